//! kube-apiserver's validation of a new Event (`ValidateEventCreate`), on the stored core/v1
//! form, so field names are core/v1's (`message`, `count`, `source`) whichever API was used, as
//! kube-apiserver reports them. Every create passes the legacy checks; one through
//! `events.k8s.io/v1` also the strict ones.

use serde_json::Value;

use crate::meta::{go_quote, meta_str};

/// Upstream's `ReportingInstanceLengthLimit`, `ActionLengthLimit` and `ReasonLengthLimit`.
const SHORT_LIMIT: usize = 128;
/// Upstream's `NoteLengthLimit`.
const NOTE_LIMIT: usize = 1024;

fn text<'a>(event: &'a Value, path: &str) -> &'a str {
    event.pointer(path).and_then(Value::as_str).unwrap_or("")
}

/// A time field counts as set when it holds a non-empty value (Go's zero time is "unset").
fn is_set(event: &Value, path: &str) -> bool {
    match event.pointer(path) {
        None | Some(Value::Null) => false,
        Some(Value::String(s)) => !s.is_empty(),
        Some(_) => true,
    }
}

/// `(field, message)` per error, in kube-apiserver's order. `events_v1`: created through
/// `events.k8s.io/v1`; `namespace`: the request's.
pub fn create_errors(event: &Value, namespace: &str, events_v1: bool) -> Vec<(String, String)> {
    let mut errs = Vec::new();
    let involved_ns = text(event, "/involvedObject/namespace");
    let mismatch = || {
        (
            "involvedObject.namespace".to_string(),
            format!(
                "Invalid value: {}: does not match event.namespace",
                go_quote(involved_ns)
            ),
        )
    };
    let namespace = meta_str(event, "namespace").unwrap_or(namespace);
    let invalid =
        |field: &str, why: String| (field.to_string(), format!("Invalid value: \"\": {why}"));
    let required = |field: &str| (field.to_string(), "Required value".to_string());

    // legacyValidateEvent
    if !is_set(event, "/eventTime") {
        if involved_ns.is_empty() {
            if !namespace.is_empty() && namespace != "default" {
                errs.push(mismatch());
            }
        } else if namespace != involved_ns {
            errs.push(mismatch());
        }
    } else {
        if involved_ns.is_empty() && namespace != "default" && namespace != "kube-system" {
            errs.push(mismatch());
        }
        let controller_field = if events_v1 {
            "reportingController"
        } else {
            "reportingComponent"
        };
        let controller = text(event, "/reportingComponent");
        if controller.is_empty() {
            errs.push(required(controller_field));
        }
        for why in qualified_name_errors(controller) {
            errs.push((
                controller_field.to_string(),
                format!("Invalid value: {}: {why}", go_quote(controller)),
            ));
        }
        for (field, limit) in [
            ("reportingInstance", SHORT_LIMIT),
            ("action", SHORT_LIMIT),
            ("reason", SHORT_LIMIT),
        ] {
            let value = text(event, &format!("/{field}"));
            if value.is_empty() {
                errs.push(required(field));
            }
            if value.len() > limit {
                errs.push(invalid(
                    field,
                    format!("can have at most {limit} characters"),
                ));
            }
        }
        if text(event, "/message").len() > NOTE_LIMIT {
            errs.push(invalid(
                "message",
                format!("can have at most {NOTE_LIMIT} characters"),
            ));
        }
    }
    if !events_v1 {
        return errs;
    }

    // The strict checks of events.k8s.io/v1 (metadata is checked for every object elsewhere).
    if event.get("series").is_some_and(|s| !s.is_null()) {
        if event
            .pointer("/series/count")
            .and_then(Value::as_i64)
            .unwrap_or(0)
            < 2
        {
            errs.push(invalid("series.count", "should be at least 2".into()));
        }
        if !is_set(event, "/series/lastObservedTime") {
            errs.push(required("series.lastObservedTime"));
        }
    }
    if !is_set(event, "/eventTime") {
        errs.push(required("eventTime"));
    }
    let kind = text(event, "/type");
    if kind != "Normal" && kind != "Warning" {
        errs.push(invalid("type", format!("has invalid value: {kind}")));
    }
    for field in ["firstTimestamp", "lastTimestamp"] {
        if is_set(event, &format!("/{field}")) {
            errs.push(invalid(field, "needs to be unset".into()));
        }
    }
    if event.get("count").and_then(Value::as_i64).unwrap_or(0) != 0 {
        errs.push(invalid("count", "needs to be unset".into()));
    }
    if !text(event, "/source/component").is_empty() || !text(event, "/source/host").is_empty() {
        errs.push(invalid("source", "needs to be unset".into()));
    }
    errs
}

/// apimachinery's `IsQualifiedName`: `[prefix/]name`, the prefix a DNS subdomain, the name up to
/// 63 alphanumerics, `-`, `_` and `.`, starting and ending alphanumeric.
fn qualified_name_errors(value: &str) -> Vec<String> {
    const NAME_FORMAT: &str = "name part must consist of alphanumeric characters, '-', '_' or \
        '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or \
        'my.name',  or '123-abc', regex used for validation is \
        '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')";
    let mut errs = Vec::new();
    let parts: Vec<&str> = value.split('/').collect();
    let name = match parts.as_slice() {
        [name] => *name,
        [prefix, name] => {
            if prefix.is_empty() {
                errs.push("prefix part must be non-empty".to_string());
            } else if let Some(why) = crate::meta::dns1123_subdomain_errors(prefix) {
                errs.push(format!("prefix part {why}"));
            }
            *name
        }
        _ => {
            errs.push(
                "a valid label key must consist of alphanumeric characters, '-', '_' or '.', and \
                 must start and end with an alphanumeric character (e.g. 'MyName',  or \
                 'my.name',  or '123-abc', regex used for validation is \
                 '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]') with an optional DNS subdomain \
                 prefix and '/' (e.g. 'example.com/MyName')"
                    .to_string(),
            );
            return errs;
        }
    };
    if name.is_empty() {
        errs.push("name part must be non-empty".to_string());
    } else if name.len() > 63 {
        errs.push("name part must be no more than 63 characters".to_string());
    }
    let ok = name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !ok {
        errs.push(NAME_FORMAT.to_string());
    }
    errs
}
