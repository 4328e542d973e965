//! Object metadata helpers: names, uids, timestamps, validation shared by all resources.

use rand::Rng;
use serde_json::{Map, Value};

use crate::selectors::Labels;

pub fn now_rfc3339() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// Now, to the microsecond: for the request log, where the order of requests within a second
/// matters.
pub fn now_rfc3339_micros() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S%.6fZ")
        .to_string()
}

pub fn new_uid() -> String {
    let mut b: [u8; 16] = rand::rng().random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// The suffix kube-apiserver appends to `generateName` (5 chars from its consonant/digit alphabet).
pub fn generated_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut rng = rand::rng();
    (0..5)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
        .collect()
}

pub fn metadata(obj: &Value) -> Option<&Map<String, Value>> {
    obj.get("metadata").and_then(Value::as_object)
}

/// The object's `metadata`, created if absent or not an object.
pub fn metadata_mut(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj.get("metadata").is_some_and(Value::is_object) {
        obj["metadata"] = Value::Object(Map::new());
    }
    match obj.get_mut("metadata") {
        Some(Value::Object(m)) => m,
        _ => unreachable!("metadata was just set to an object"),
    }
}

pub fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    metadata(obj)
        .and_then(|m| m.get(field))
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

pub fn labels_of(obj: &Value) -> Labels {
    metadata(obj)
        .and_then(|m| m.get("labels"))
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

pub fn finalizers_of(obj: &Value) -> Vec<String> {
    metadata(obj)
        .and_then(|m| m.get("finalizers"))
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// RFC 1123 label: what namespace and Service names must be.
pub fn dns1123_label_errors(name: &str) -> Option<String> {
    let ok_chars = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    if name.len() > 63 {
        Some("must be no more than 63 characters".into())
    } else if !ok_chars {
        Some("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')".into())
    } else {
        None
    }
}

/// RFC 1123 subdomain: what most other object names must be.
pub fn dns1123_subdomain_errors(name: &str) -> Option<String> {
    if name.len() > 253 {
        return Some("must be no more than 253 characters".into());
    }
    let ok = !name.is_empty()
        && name.split('.').all(|part| {
            !part.is_empty()
                && part
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && part.starts_with(|c: char| c.is_ascii_alphanumeric())
                && part.ends_with(|c: char| c.is_ascii_alphanumeric())
        });
    if ok {
        None
    } else {
        Some("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')".into())
    }
}

/// Go's `%q` for strings, which kube-apiserver uses in `Invalid value: "x"`.
pub fn go_quote(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| format!("\"{s}\""))
}

fn qualified_name_error(key: &str) -> Option<String> {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix
        && (p.is_empty() || dns1123_subdomain_errors(p).is_some())
    {
        return Some("prefix part a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character".into());
    }
    label_value_error(name, true)
}

fn label_value_error(v: &str, required: bool) -> Option<String> {
    if v.is_empty() {
        return required.then(|| "name part must be non-empty".to_string());
    }
    if v.len() > 63 {
        return Some("must be no more than 63 characters".into());
    }
    let ok = v
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && v.starts_with(|c: char| c.is_ascii_alphanumeric())
        && v.ends_with(|c: char| c.is_ascii_alphanumeric());
    (!ok).then(|| "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')".to_string())
}

/// `metadata.labels` and `metadata.annotations` checks kube-apiserver applies to every object.
pub fn label_errors(obj: &Value) -> Vec<(String, String)> {
    let mut errs = Vec::new();
    let Some(m) = metadata(obj) else {
        return errs;
    };
    for field in ["labels", "annotations"] {
        match m.get(field) {
            None | Some(Value::Null) => {}
            Some(Value::Object(map)) => {
                for (k, v) in map {
                    if let Some(e) = qualified_name_error(k) {
                        errs.push((
                            format!("metadata.{field}"),
                            format!("Invalid value: {}: {e}", go_quote(k)),
                        ));
                    }
                    match v {
                        Value::String(v) if field == "labels" => {
                            if let Some(e) = label_value_error(v, false) {
                                errs.push((
                                    "metadata.labels".to_string(),
                                    format!("Invalid value: {}: {e}", go_quote(v)),
                                ));
                            }
                        }
                        Value::String(_) => {}
                        other => errs.push((
                            format!("metadata.{field}.{k}"),
                            format!("Invalid value: {other}: must be a string"),
                        )),
                    }
                }
            }
            Some(other) => errs.push((
                format!("metadata.{field}"),
                format!("Invalid value: {other}: must be a map of strings"),
            )),
        }
    }
    errs
}
