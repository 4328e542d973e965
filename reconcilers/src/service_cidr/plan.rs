//! What the default ServiceCIDR needs, decided from the object as the watch has it: no I/O, no
//! clock. [`plan`] follows upstream's `syncStatus`/`sync` order:
//!
//! | the ServiceCIDR `kubernetes` | the plan |
//! | --- | --- |
//! | missing | [`Plan::Create`] it with the configured ranges |
//! | one range, our primary, and a secondary configured | [`Plan::UpgradeToDualStack`] |
//! | being deleted | [`Plan::Terminating`]: left to its finalizer |
//! | other ranges than configured | [`Plan::Inconsistent`]: reported once, never changed |
//! | as configured, `Ready` missing or Unknown | [`Plan::SetReady`] |
//! | as configured, `Ready=False` (someone else's) | [`Plan::NotReady`]: reported once |
//! | as configured and ready | [`Plan::InSync`] |

use ipnet::IpNet;
use k8s_openapi::api::networking::v1::ServiceCIDR;

/// What the existing object needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    Create,
    /// Single-stack object whose range is our primary: add the secondary.
    UpgradeToDualStack,
    /// Terminating: leave it to its finalizer.
    Terminating,
    /// `spec.cidrs` differ from the configuration in a way we must not change.
    Inconsistent {
        actual: Vec<String>,
    },
    /// Matches; `Ready` is missing or Unknown.
    SetReady,
    /// Matches but `Ready=False` (set by someone else): report it.
    NotReady {
        reason: String,
        message: String,
    },
    InSync,
}

fn same_cidrs(actual: &[String], desired: &[IpNet]) -> bool {
    actual.len() == desired.len()
        && actual
            .iter()
            .zip(desired)
            .all(|(a, d)| a.parse::<IpNet>().is_ok_and(|a| a == *d))
}

/// Decides what to do with the current object (pure).
pub fn plan(current: Option<&ServiceCIDR>, desired: &[IpNet]) -> Plan {
    let Some(current) = current else {
        return Plan::Create;
    };
    let actual: Vec<String> = current
        .spec
        .as_ref()
        .and_then(|spec| spec.cidrs.clone())
        .unwrap_or_default();
    if desired.len() == 2 && actual.len() == 1 && same_cidrs(&actual, &desired[..1]) {
        return Plan::UpgradeToDualStack;
    }
    if current.metadata.deletion_timestamp.is_some() {
        return Plan::Terminating;
    }
    if !same_cidrs(&actual, desired) {
        return Plan::Inconsistent { actual };
    }
    let ready = current
        .status
        .as_ref()
        .and_then(|status| status.conditions.as_ref())
        .and_then(|conditions| conditions.iter().find(|c| c.type_ == "Ready"));
    match ready {
        Some(c) if c.status == "True" => Plan::InSync,
        Some(c) if c.status == "False" => Plan::NotReady {
            reason: c.reason.clone(),
            message: c.message.clone(),
        },
        _ => Plan::SetReady,
    }
}

/// Whether a `Ready=False` condition's reason can be its event's, as upstream publishes it:
/// events.k8s.io/v1 refuses an empty reason or one over 128 bytes, and one a condition's own
/// validation would refuse (`^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$`) reads as no reason.
pub(super) fn is_event_reason(reason: &str) -> bool {
    let inner = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | ',' | ':');
    reason.len() <= 128
        && reason.starts_with(|c: char| c.is_ascii_alphabetic())
        && reason.ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
        && reason.chars().all(inner)
}

/// The Ready condition of `current` in words, as a repair's log line says what it was.
pub(super) fn ready_words(current: Option<&ServiceCIDR>) -> String {
    let ready = current
        .and_then(|cidr| cidr.status.as_ref())
        .and_then(|status| status.conditions.as_ref())
        .and_then(|conditions| conditions.iter().find(|c| c.type_ == "Ready"));
    match ready {
        Some(c) => format!("condition Ready={}", c.status),
        None => "no Ready condition".to_owned(),
    }
}

/// Go's `%v` of a `[]string`.
pub(super) fn go_list(items: &[String]) -> String {
    format!("[{}]", items.join(" "))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use k8s_openapi::api::networking::v1::ServiceCIDRSpec;
    use k8s_openapi::api::networking::v1::ServiceCIDRStatus;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|n| n.parse().unwrap()).collect()
    }

    fn object(cidrs: &[&str], ready: Option<&str>) -> ServiceCIDR {
        ServiceCIDR {
            metadata: ObjectMeta {
                name: Some("kubernetes".into()),
                ..ObjectMeta::default()
            },
            spec: Some(ServiceCIDRSpec {
                cidrs: Some(cidrs.iter().map(|c| (*c).to_owned()).collect()),
            }),
            status: ready.map(|status| ServiceCIDRStatus {
                conditions: Some(vec![Condition {
                    type_: "Ready".into(),
                    status: status.into(),
                    reason: "Because".into(),
                    message: "it is so".into(),
                    last_transition_time: Time(jiff::Timestamp::UNIX_EPOCH),
                    observed_generation: None,
                }]),
            }),
        }
    }

    #[test]
    fn plans_follow_upstream() {
        let dual = nets(&["10.96.0.0/12", "fd00::/108"]);
        assert_eq!(plan(None, &dual), Plan::Create);
        assert_eq!(
            plan(Some(&object(&["10.96.0.0/12"], None)), &dual),
            Plan::UpgradeToDualStack
        );
        assert_eq!(
            plan(Some(&object(&["10.0.0.0/24"], None)), &dual),
            Plan::Inconsistent {
                actual: vec!["10.0.0.0/24".into()]
            }
        );
        assert_eq!(
            plan(
                Some(&object(&["10.96.0.0/12", "fd00::/108"], None)),
                &nets(&["10.96.0.0/12"])
            ),
            Plan::Inconsistent {
                actual: vec!["10.96.0.0/12".into(), "fd00::/108".into()]
            },
            "never shrinks dual-stack back to single-stack"
        );
        let matching = ["10.96.0.0/12", "fd00::/108"];
        assert_eq!(plan(Some(&object(&matching, None)), &dual), Plan::SetReady);
        assert_eq!(
            plan(Some(&object(&matching, Some("Unknown"))), &dual),
            Plan::SetReady
        );
        assert_eq!(
            plan(Some(&object(&matching, Some("True"))), &dual),
            Plan::InSync
        );
        assert_eq!(
            plan(Some(&object(&matching, Some("False"))), &dual),
            Plan::NotReady {
                reason: "Because".into(),
                message: "it is so".into()
            }
        );
        let mut terminating = object(&matching, None);
        terminating.metadata.deletion_timestamp = Some(Time(jiff::Timestamp::UNIX_EPOCH));
        assert_eq!(plan(Some(&terminating), &dual), Plan::Terminating);
    }

    #[test]
    fn a_condition_reason_is_an_event_reason_when_events_take_it() {
        for good in ["Because", "A", "Not_Ready:2,x_", &"R".repeat(128)] {
            assert!(is_event_reason(good), "{good}");
        }
        for bad in [
            "",
            &"R".repeat(129),
            "not ready",
            "1Ready",
            "Ready:",
            "Ready\n",
            "Bereit\u{e4}",
        ] {
            assert!(!is_event_reason(bad), "{bad:?}");
        }
    }

    #[test]
    fn go_formatting_of_lists() {
        assert_eq!(go_list(&["a".into(), "b".into()]), "[a b]");
    }
}
