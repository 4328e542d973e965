//! A small model of server-side apply field ownership: enough for apply conflicts (409 when an
//! apply without `force` changes a field another manager set), which leader-election libraries
//! rely on for mutual exclusion. Lists are atomic; fields an applier stops sending are kept.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::errors::ApiError;
use crate::resources::ResourceDef;
use crate::store::Owners;

/// Server-owned or identity fields that never take part in ownership.
fn ignored(path: &str) -> bool {
    matches!(
        path,
        ".apiVersion"
            | ".kind"
            | ".metadata.name"
            | ".metadata.namespace"
            | ".metadata.uid"
            | ".metadata.resourceVersion"
            | ".metadata.creationTimestamp"
            | ".metadata.generation"
            | ".metadata.deletionTimestamp"
            | ".metadata.deletionGracePeriodSeconds"
    ) || path.starts_with(".metadata.managedFields")
        || path.starts_with(".status")
}

/// Leaf fields of `v` (objects are descended, everything else is a leaf).
pub fn leaves(v: &Value) -> BTreeMap<String, Value> {
    fn walk(v: &Value, path: String, out: &mut BTreeMap<String, Value>) {
        match v {
            Value::Object(m) if !m.is_empty() => {
                for (k, child) in m {
                    walk(child, format!("{path}.{k}"), out);
                }
            }
            other => {
                if !path.is_empty() && !ignored(&path) {
                    out.insert(path, other.clone());
                }
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(v, String::new(), &mut out);
    out
}

/// 409 if applying `patch` as `manager` would change a field someone else owns.
pub fn check_conflicts(
    def: &ResourceDef,
    name: &str,
    manager: &str,
    owners: Option<&Owners>,
    current: &Value,
    patch: &Value,
) -> Result<(), ApiError> {
    let Some(owners) = owners else {
        return Ok(());
    };
    let now = leaves(current);
    let mut conflicts: Vec<(String, String)> = Vec::new();
    for (path, want) in leaves(patch) {
        if want.is_null() {
            continue;
        }
        let Some(owner) = owners.get(&path) else {
            continue;
        };
        if owner != manager && now.get(&path).is_some_and(|have| *have != want) {
            conflicts.push((owner.clone(), path));
        }
    }
    if conflicts.is_empty() {
        return Ok(());
    }
    let api_version = def.api_version();
    let parts: Vec<String> = conflicts
        .iter()
        .map(|(owner, path)| format!("conflict with \"{owner}\" using {api_version}: {path}"))
        .collect();
    let n = conflicts.len();
    let mut e = ApiError::conflict(def, name, "");
    e.message = format!(
        "Apply failed with {n} conflict{}: {}",
        if n == 1 { "" } else { "s" },
        parts.join("; ")
    );
    if let Some(d) = e.details.as_mut() {
        d["causes"] = Value::Array(
            conflicts
                .iter()
                .map(|(owner, path)| {
                    serde_json::json!({
                        "reason": "FieldManagerConflict",
                        "message": format!("conflict with \"{owner}\" using {api_version}"),
                        "field": path,
                    })
                })
                .collect(),
        );
    }
    Err(e)
}

/// Ownership after `manager` applied `patch`.
pub fn after_apply(owners: Option<&Owners>, manager: &str, patch: &Value) -> Owners {
    let mut out = owners.cloned().unwrap_or_default();
    for (path, v) in leaves(patch) {
        if v.is_null() {
            out.remove(&path);
        } else {
            out.insert(path, manager.to_string());
        }
    }
    out
}

/// Ownership after a non-apply write by `manager` changed `old` into `new`.
pub fn after_update(owners: &Owners, manager: &str, old: &Value, new: &Value) -> Owners {
    let before = leaves(old);
    let after = leaves(new);
    let mut out = owners.clone();
    for (path, v) in &after {
        if before.get(path) != Some(v) {
            out.insert(path.clone(), manager.to_string());
        }
    }
    out.retain(|path, _| after.contains_key(path));
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::resources::RESOURCES;
    use serde_json::json;

    #[test]
    fn apply_conflicts_only_on_changed_foreign_fields() {
        let def = &RESOURCES[0];
        let cur = json!({"spec": {"holder": "a", "n": 1}, "metadata": {"name": "x"}});
        let owners = after_apply(None, "a", &json!({"spec": {"holder": "a", "n": 1}}));
        // Same value: no conflict. Different value from another manager: conflict.
        check_conflicts(
            def,
            "x",
            "b",
            Some(&owners),
            &cur,
            &json!({"spec": {"holder": "a"}}),
        )
        .unwrap();
        let e = check_conflicts(
            def,
            "x",
            "b",
            Some(&owners),
            &cur,
            &json!({"spec": {"holder": "b"}}),
        )
        .unwrap_err();
        assert_eq!((e.code, e.reason), (409, "Conflict"));
        assert!(e.message.contains("conflict with \"a\""), "{}", e.message);
        assert!(e.message.contains(".spec.holder"), "{}", e.message);
        // The owner itself may change it.
        check_conflicts(
            def,
            "x",
            "a",
            Some(&owners),
            &cur,
            &json!({"spec": {"holder": "z"}}),
        )
        .unwrap();
        // An update by "c" takes over the fields it changed.
        let new = json!({"spec": {"holder": "c", "n": 1}});
        let o2 = after_update(&owners, "c", &cur, &new);
        assert_eq!(o2[".spec.holder"], "c");
        assert_eq!(o2[".spec.n"], "a");
    }
}
