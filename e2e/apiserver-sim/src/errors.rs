//! Kubernetes `Status` errors as kube-apiserver writes them.

use serde_json::{Value, json};

use crate::resources::ResourceDef;

/// An API error, rendered as a `metav1.Status` body.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    pub details: Option<Value>,
    /// Sent as a `Retry-After` header and in `details.retryAfterSeconds`.
    pub retry_after: Option<u32>,
}

impl ApiError {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
            details: None,
            retry_after: None,
        }
    }

    fn details_for(res: &ResourceDef, name: &str) -> Value {
        let mut d = json!({"name": name, "kind": res.plural});
        if !res.group.is_empty() {
            d["group"] = json!(res.group);
        }
        d
    }

    pub fn not_found(res: &ResourceDef, name: &str) -> Self {
        Self {
            details: Some(Self::details_for(res, name)),
            ..Self::new(
                404,
                "NotFound",
                format!("{} \"{}\" not found", res.qualified(), name),
            )
        }
    }

    pub fn already_exists(res: &ResourceDef, name: &str) -> Self {
        Self {
            details: Some(Self::details_for(res, name)),
            ..Self::new(
                409,
                "AlreadyExists",
                format!("{} \"{}\" already exists", res.qualified(), name),
            )
        }
    }

    pub fn conflict(res: &ResourceDef, name: &str, why: &str) -> Self {
        Self {
            details: Some(Self::details_for(res, name)),
            ..Self::new(
                409,
                "Conflict",
                format!(
                    "Operation cannot be fulfilled on {} \"{}\": {}",
                    res.qualified(),
                    name,
                    why
                ),
            )
        }
    }

    pub fn stale(res: &ResourceDef, name: &str) -> Self {
        Self::conflict(
            res,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    pub fn forbidden(res: &ResourceDef, name: &str, why: &str) -> Self {
        Self {
            details: Some(Self::details_for(res, name)),
            ..Self::new(
                403,
                "Forbidden",
                format!("{} \"{}\" is forbidden: {}", res.qualified(), name, why),
            )
        }
    }

    /// 422 Invalid with one cause per field error: `(field, message)`. The message names the
    /// group-qualified kind, as kube-apiserver's `NewInvalid` does (`Lease.coordination.k8s.io
    /// "x" is invalid: ...`; core kinds, and Events of either API, unqualified).
    pub fn invalid(res: &ResourceDef, name: &str, causes: &[(String, String)]) -> Self {
        let msgs: Vec<String> = causes.iter().map(|(f, m)| format!("{f}: {m}")).collect();
        let kind = if res.group.is_empty() {
            res.kind.to_string()
        } else {
            format!("{}.{}", res.kind, res.group)
        };
        let message = if msgs.len() == 1 {
            format!("{kind} \"{name}\" is invalid: {}", msgs[0])
        } else {
            format!("{kind} \"{name}\" is invalid: [{}]", msgs.join(", "))
        };
        let mut details = json!({
            "name": name,
            "kind": res.kind,
            "causes": causes.iter().map(|(f, m)| json!({
                "reason": cause_reason(m),
                "message": m,
                "field": f,
            })).collect::<Vec<_>>(),
        });
        if !res.group.is_empty() {
            details["group"] = json!(res.group);
        }
        Self {
            details: Some(details),
            ..Self::new(422, "Invalid", message)
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self::new(405, "MethodNotAllowed", message)
    }

    pub fn gone(message: impl Into<String>) -> Self {
        Self::new(410, "Expired", message)
    }

    pub fn unsupported_media(content_type: &str) -> Self {
        Self::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, application/strategic-merge-patch+json; got {content_type:?}"
            ),
        )
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "InternalError", message)
    }

    /// The error kube-apiserver sends for a code it produces under load or failure.
    pub fn for_code(code: u16, retry_after: Option<u32>) -> Self {
        let (reason, message) = match code {
            429 => (
                "TooManyRequests",
                "Too many requests, please try again later.",
            ),
            409 => (
                "Conflict",
                "Operation cannot be fulfilled: injected conflict",
            ),
            503 => (
                "ServiceUnavailable",
                "The server is currently unable to handle the request",
            ),
            504 => (
                "Timeout",
                "The server was unable to return a response in the time allotted",
            ),
            410 => ("Expired", "injected: resource expired"),
            404 => ("NotFound", "injected: not found"),
            403 => ("Forbidden", "injected: forbidden"),
            401 => ("Unauthorized", "Unauthorized"),
            _ => ("InternalError", "Internal error occurred: injected fault"),
        };
        let mut e = Self::new(code, reason, message);
        if let Some(secs) = retry_after {
            e.retry_after = Some(secs);
            e.details = Some(json!({"retryAfterSeconds": secs}));
        }
        e
    }

    pub fn to_status(&self) -> Value {
        let mut s = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(d) = &self.details {
            s["details"] = d.clone();
        }
        s
    }
}

fn cause_reason(message: &str) -> &'static str {
    if message.starts_with("Required value") {
        "FieldValueRequired"
    } else if message.starts_with("Duplicate value") {
        "FieldValueDuplicate"
    } else if message.starts_with("Unsupported value") {
        "FieldValueNotSupported"
    } else if message.starts_with("Forbidden") {
        "FieldValueForbidden"
    } else {
        "FieldValueInvalid"
    }
}
