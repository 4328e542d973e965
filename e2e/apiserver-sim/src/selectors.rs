//! Label and field selectors, parsed the way kube-apiserver parses them.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::errors::ApiError;

pub type Labels = BTreeMap<String, String>;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    Eq(String),
    NotEq(String),
    In(Vec<String>),
    NotIn(Vec<String>),
    Exists,
    NotExists,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Requirement {
    key: String,
    op: Op,
}

/// A parsed label selector; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector {
    reqs: Vec<Requirement>,
}

impl LabelSelector {
    pub fn parse(input: &str) -> Result<Self, ApiError> {
        let mut reqs = Vec::new();
        for part in split_top_level(input) {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            reqs.push(parse_requirement(part).ok_or_else(|| {
                ApiError::bad_request(format!(
                    "unable to parse requirement: found '{part}', expected: key, !key, key=value, key!=value, key in (v1,v2), key notin (v1,v2)"
                ))
            })?);
        }
        Ok(Self { reqs })
    }

    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    pub fn matches(&self, labels: &Labels) -> bool {
        self.reqs.iter().all(|r| {
            let v = labels.get(&r.key);
            match &r.op {
                Op::Eq(x) => v == Some(x),
                Op::NotEq(x) => v != Some(x),
                Op::In(xs) => v.is_some_and(|v| xs.contains(v)),
                Op::NotIn(xs) => v.is_none_or(|v| !xs.contains(v)),
                Op::Exists => v.is_some(),
                Op::NotExists => v.is_none(),
            }
        })
    }
}

fn split_top_level(input: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in input.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&input[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&input[start..]);
    out
}

fn valid_key(k: &str) -> bool {
    !k.is_empty()
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

fn parse_set(s: &str) -> Option<Vec<String>> {
    let s = s.trim();
    let inner = s.strip_prefix('(')?.strip_suffix(')')?;
    Some(
        inner
            .split(',')
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
            .collect(),
    )
}

fn parse_requirement(part: &str) -> Option<Requirement> {
    if let Some(key) = part.strip_prefix('!') {
        let key = key.trim();
        return valid_key(key).then(|| Requirement {
            key: key.to_string(),
            op: Op::NotExists,
        });
    }
    if let Some((k, v)) = part.split_once("!=") {
        return Some(Requirement {
            key: checked(k)?,
            op: Op::NotEq(v.trim().to_string()),
        });
    }
    if let Some((k, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
        return Some(Requirement {
            key: checked(k)?,
            op: Op::Eq(v.trim().to_string()),
        });
    }
    let mut words = part.splitn(2, char::is_whitespace);
    let key = words.next()?.trim();
    let rest = words.next().map(str::trim).unwrap_or("");
    if rest.is_empty() {
        return valid_key(key).then(|| Requirement {
            key: key.to_string(),
            op: Op::Exists,
        });
    }
    if let Some(set) = rest.strip_prefix("notin") {
        return Some(Requirement {
            key: checked(key)?,
            op: Op::NotIn(parse_set(set)?),
        });
    }
    if let Some(set) = rest.strip_prefix("in") {
        return Some(Requirement {
            key: checked(key)?,
            op: Op::In(parse_set(set)?),
        });
    }
    None
}

fn checked(k: &str) -> Option<String> {
    let k = k.trim();
    valid_key(k).then(|| k.to_string())
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct FieldReq {
    path: String,
    value: String,
    equal: bool,
}

/// A parsed field selector. `metadata.name` and `metadata.namespace` are answered from the index;
/// any other dotted path is looked up in the object's JSON (string, number or bool leaves).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector {
    reqs: Vec<FieldReq>,
}

impl FieldSelector {
    pub fn parse(input: &str) -> Result<Self, ApiError> {
        let mut reqs = Vec::new();
        for part in input.split(',') {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            let (path, value, equal) = if let Some((k, v)) = part.split_once("!=") {
                (k, v, false)
            } else if let Some((k, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
                (k, v, true)
            } else {
                return Err(ApiError::bad_request(format!(
                    "invalid field selector: '{part}': expected field=value or field!=value"
                )));
            };
            reqs.push(FieldReq {
                path: path.trim().to_string(),
                value: value.trim().to_string(),
                equal,
            });
        }
        Ok(Self { reqs })
    }

    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// Matches using index fields; `object` is parsed lazily only for other paths.
    pub fn matches(&self, ns: &str, name: &str, object: impl FnOnce() -> Option<Value>) -> bool {
        let mut parsed: Option<Option<Value>> = None;
        let mut object = Some(object);
        for r in &self.reqs {
            let actual: Option<String> = match r.path.as_str() {
                "metadata.name" => Some(name.to_string()),
                "metadata.namespace" => Some(ns.to_string()),
                path => {
                    if parsed.is_none() {
                        parsed = Some(object.take().and_then(|f| f()));
                    }
                    parsed
                        .as_ref()
                        .and_then(|o| o.as_ref())
                        .and_then(|o| lookup(o, path))
                }
            };
            let actual = actual.unwrap_or_default();
            if (actual == r.value) != r.equal {
                return false;
            }
        }
        true
    }
}

fn lookup(v: &Value, path: &str) -> Option<String> {
    let mut cur = v;
    for seg in path.split('.') {
        cur = cur.get(seg)?;
    }
    match cur {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn label_selector_operators() {
        let l = labels(&[("app", "web"), ("tier", "front")]);
        let m = |s: &str| LabelSelector::parse(s).unwrap().matches(&l);
        assert!(m("app=web"));
        assert!(m("app==web"));
        assert!(!m("app=db"));
        assert!(m("app!=db"));
        assert!(!m("app!=web"));
        assert!(m("app in (web, db)"));
        assert!(!m("app in (db)"));
        assert!(m("app notin (db)"));
        assert!(m("missing notin (db)"));
        assert!(m("tier"));
        assert!(!m("missing"));
        assert!(m("!missing"));
        assert!(!m("!app"));
        assert!(m("app in (web,db),tier=front,!x"));
        assert!(m(""));
        assert!(LabelSelector::parse("app in web").is_err());
        assert!(LabelSelector::parse("a b c").is_err());
    }

    #[test]
    fn field_selector_paths() {
        let f = FieldSelector::parse("metadata.name=a,metadata.namespace!=kube-system").unwrap();
        assert!(f.matches("default", "a", || None));
        assert!(!f.matches("kube-system", "a", || None));
        assert!(!f.matches("default", "b", || None));
        let f = FieldSelector::parse("spec.type=NodePort").unwrap();
        let obj = serde_json::json!({"spec": {"type": "NodePort"}});
        assert!(f.matches("d", "n", || Some(obj.clone())));
        assert!(FieldSelector::parse("nonsense").is_err());
    }
}
