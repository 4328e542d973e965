//! `events.k8s.io/v1` Events are served from the core/v1 Event storage, as in kube-apiserver,
//! so `kubectl get events` shows what a controller wrote through either API.

use serde_json::{Map, Value};

use crate::resources::{self, RESOURCES, ResIdx};

/// (events.k8s.io/v1 field, core/v1 field) pairs that differ only in name.
const RENAMES: [(&str, &str); 7] = [
    ("regarding", "involvedObject"),
    ("note", "message"),
    ("reportingController", "reportingComponent"),
    ("deprecatedSource", "source"),
    ("deprecatedFirstTimestamp", "firstTimestamp"),
    ("deprecatedLastTimestamp", "lastTimestamp"),
    ("deprecatedCount", "count"),
];

fn events_v1() -> Option<ResIdx> {
    resources::find("events.k8s.io", "v1", "events")
}

fn core_events() -> Option<ResIdx> {
    resources::find("", "v1", "events")
}

/// Where objects of `res` are stored.
pub fn storage_idx(res: ResIdx) -> ResIdx {
    match (events_v1(), core_events()) {
        (Some(v1), Some(core)) if res == v1 => core,
        _ => res,
    }
}

/// Whether `res` is served by converting another resource's storage.
pub fn is_converted(res: ResIdx) -> bool {
    storage_idx(res) != res
}

fn rename(obj: Value, from_v1: bool, api_version: &str, kind: &str) -> Value {
    let Value::Object(mut m) = obj else {
        return obj;
    };
    let mut out = Map::new();
    for (v1, core) in RENAMES {
        let (from, to) = if from_v1 { (v1, core) } else { (core, v1) };
        if let Some(v) = m.remove(from) {
            out.insert(to.to_string(), v);
        }
    }
    for (k, v) in m {
        out.entry(k).or_insert(v);
    }
    out.insert("apiVersion".into(), Value::String(api_version.into()));
    out.insert("kind".into(), Value::String(kind.into()));
    Value::Object(out)
}

/// An object of `res` as the API shows it → its stored form.
pub fn to_storage(res: ResIdx, obj: Value) -> Value {
    if !is_converted(res) {
        return obj;
    }
    let core = &RESOURCES[storage_idx(res)];
    rename(obj, true, &core.api_version(), core.kind)
}

/// A stored object → how `res` shows it.
pub fn from_storage(res: ResIdx, obj: Value) -> Value {
    if !is_converted(res) {
        return obj;
    }
    let def = &RESOURCES[res];
    rename(obj, false, &def.api_version(), def.kind)
}

/// Stored JSON bytes → `res`'s JSON bytes (unchanged for unconverted resources).
pub fn bytes_from_storage(res: ResIdx, json: &[u8]) -> Vec<u8> {
    if !is_converted(res) {
        return json.to_vec();
    }
    serde_json::from_slice::<Value>(json)
        .ok()
        .and_then(|v| serde_json::to_vec(&from_storage(res, v)).ok())
        .unwrap_or_else(|| json.to_vec())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn events_round_trip_between_groups() {
        let v1 = events_v1().unwrap();
        let ev = json!({
            "apiVersion": "events.k8s.io/v1", "kind": "Event",
            "metadata": {"name": "x.1", "namespace": "d"},
            "regarding": {"kind": "Service", "name": "kubernetes"},
            "note": "hello", "reason": "R", "type": "Normal", "action": "A",
            "reportingController": "c", "reportingInstance": "i",
            "eventTime": "2026-01-01T00:00:00.000000Z",
        });
        let core = to_storage(v1, ev.clone());
        assert_eq!(core["apiVersion"], "v1");
        assert_eq!(core["message"], "hello");
        assert_eq!(core["involvedObject"]["name"], "kubernetes");
        assert_eq!(core["reportingComponent"], "c");
        assert_eq!(from_storage(v1, core), ev);
        assert!(!is_converted(core_events().unwrap()));
    }
}
