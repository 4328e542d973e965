//! Which tenant keeps the etcd keys that two tenant Secrets claim.
//!
//! Two tenants on one etcd server must not have prefixes one of which contains the other (equal
//! included): one would rewrite the other's bitmaps, or write into its resources' key space. When
//! claims overlap, one tenant is refused, and which one must not be up to the Secrets' writers:
//! a Secret's age says nothing about who held the keys first, so an old Secret edited to name a
//! running tenant's prefix would displace it.
//!
//! So a tenant started with a claim records it in a Lease of the controller's own namespace
//! (`<lease name>-etcd-claim-<Secret uid>`, labelled [`RECORD_LABEL`], its annotations the
//! servers and prefix), where no tenant Secret's writer can write. The decision, made by
//! [`conflicts`] from every Secret and every record, so that every replica decides alike:
//!
//! | claims                                  | keeps the keys                                   |
//! |-----------------------------------------|--------------------------------------------------|
//! | one recorded (the Secret still claims   | the recorded one                                 |
//! | what its record says), others not       |                                                  |
//! | several recorded                        | the one recorded first (the record's creation,   |
//! |                                         | stamped by the API server)                       |
//! | none recorded                           | the older Secret, then the first by name         |
//! | overlapping, records not listed yet     | none is started; running tenants go on           |
//!
//! A record outlives a change of its Secret that leaves the claim alone (a rotated certificate),
//! and is replaced when its tenant starts with another claim. Records whose Secret is gone or
//! claims nothing any more are deleted, each by compare-and-swap.

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;

use crate::config::TENANT_CONFIG_ANNOTATION;

/// The label of every claim record, whatever its group.
pub const RECORD_LABEL: &str = "bootstrap-controller.io/etcd-claim";
const TENANT_ANNOTATION: &str = "bootstrap-controller.io/tenant";
const SERVERS_ANNOTATION: &str = "bootstrap-controller.io/etcd-servers";
const PREFIX_ANNOTATION: &str = "bootstrap-controller.io/etcd-prefix";

/// The etcd keys a tenant writes: its servers and prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdClaim {
    pub servers: Vec<String>,
    pub prefix: String,
}

impl EtcdClaim {
    /// Whether the two share a server and one prefix contains the other (equal included).
    pub fn overlaps(&self, other: &EtcdClaim) -> bool {
        // Allocation-free: every sync compares every pair of claims.
        let within = |a: &str, b: &str| {
            b.strip_prefix(a)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
        };
        self.servers.iter().any(|s| other.servers.contains(s))
            && (within(&self.prefix, &other.prefix) || within(&other.prefix, &self.prefix))
    }
}

/// A claim as recorded: whose it is (the Secret's uid), and since when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// The record's own name, for its replacement or deletion.
    pub name: String,
    pub resource_version: Option<String>,
    /// The Secret, `namespace/name`, when the record was written (for messages only).
    pub tenant: String,
    pub claim: EtcdClaim,
    pub created: Option<Timestamp>,
}

/// The name of the record of the Secret with this uid, for the replicas' group `group`.
pub fn record_name(group: &str, uid: &str) -> String {
    format!("{group}-etcd-claim-{uid}")
}

/// The Secret uid whose record of `group` is named `name`.
pub fn uid_of<'a>(group: &str, name: &'a str) -> Option<&'a str> {
    name.strip_prefix(group)?.strip_prefix("-etcd-claim-")
}

/// The record of `tenant`'s claim, to create or (with the old record's resourceVersion) replace.
pub fn record(
    group: &str,
    uid: &str,
    tenant: &str,
    claim: &EtcdClaim,
    resource_version: Option<String>,
) -> Lease {
    let servers = serde_json::to_string(&claim.servers).unwrap_or_default();
    Lease {
        metadata: ObjectMeta {
            name: Some(record_name(group, uid)),
            labels: Some(BTreeMap::from([(
                RECORD_LABEL.to_owned(),
                "true".to_owned(),
            )])),
            annotations: Some(BTreeMap::from([
                (TENANT_ANNOTATION.to_owned(), tenant.to_owned()),
                (SERVERS_ANNOTATION.to_owned(), servers),
                (PREFIX_ANNOTATION.to_owned(), claim.prefix.clone()),
            ])),
            resource_version,
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(tenant.to_owned()),
            ..LeaseSpec::default()
        }),
    }
}

/// The Secret uid and record a Lease holds, if it is a record of `group` (other Leases with the
/// label, of another group or written by hand without the annotations, are not records).
pub fn parse(group: &str, lease: &Lease) -> Option<(String, Record)> {
    let name = lease.metadata.name.clone()?;
    let uid = uid_of(group, &name)?.to_owned();
    let annotations = lease.metadata.annotations.as_ref()?;
    let servers: Vec<String> = serde_json::from_str(annotations.get(SERVERS_ANNOTATION)?).ok()?;
    let record = Record {
        name,
        resource_version: lease.metadata.resource_version.clone(),
        tenant: annotations
            .get(TENANT_ANNOTATION)
            .cloned()
            .unwrap_or_default(),
        claim: EtcdClaim {
            servers,
            prefix: annotations.get(PREFIX_ANNOTATION)?.clone(),
        },
        created: lease.metadata.creation_timestamp.as_ref().map(|t| t.0),
    };
    Some((uid, record))
}

/// One tenant Secret that claims etcd keys.
#[derive(Clone, Debug)]
pub struct Candidate<'a> {
    /// `namespace/name`.
    pub key: &'a str,
    pub uid: &'a str,
    /// The Secret's creation.
    pub created: Option<Timestamp>,
    pub claim: EtcdClaim,
}

/// What [`conflicts`] decided.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Decision {
    /// Tenants refused, with why.
    pub refused: HashMap<String, String>,
    /// Tenants whose claim overlaps another while the records are not known: neither is
    /// started until they are.
    pub undecided: Vec<String>,
}

/// Which candidates are refused because another keeps the keys they claim (see the module's
/// table). `records` is `None` until the records have been listed.
pub fn conflicts(
    candidates: &[Candidate<'_>],
    records: Option<&BTreeMap<String, Record>>,
) -> Decision {
    let overlapping: Vec<&Candidate<'_>> = candidates
        .iter()
        .filter(|c| {
            candidates
                .iter()
                .any(|other| other.key != c.key && c.claim.overlaps(&other.claim))
        })
        .collect();
    let Some(records) = records else {
        return Decision {
            refused: HashMap::new(),
            undecided: overlapping.iter().map(|c| c.key.to_owned()).collect(),
        };
    };
    let held = |c: &Candidate<'_>| records.get(c.uid).filter(|r| r.claim == c.claim);
    let mut ordered = overlapping;
    // Recorded claims first, by the record's creation; then the Secrets' creation; then name.
    ordered.sort_by_key(|c| match held(c) {
        Some(record) => (0, record.created, c.key),
        None => (1, c.created, c.key),
    });
    let mut refused = HashMap::new();
    let mut kept: Vec<&Candidate<'_>> = Vec::new();
    for candidate in ordered {
        match kept.iter().find(|k| candidate.claim.overlaps(&k.claim)) {
            Some(keeper) => {
                let since = match held(keeper).and_then(|r| r.created) {
                    Some(created) => format!(
                        "the tenant {}, which has held them since {created}",
                        keeper.key
                    ),
                    None => format!("the older tenant {}", keeper.key),
                };
                refused.insert(
                    candidate.key.to_owned(),
                    format!(
                        "{TENANT_CONFIG_ANNOTATION}: etcdPrefix {:?} overlaps {:?} of {since} on \
                         the same etcd server: two tenants' keys must not contain each other \
                         (give each tenant its own prefix)",
                        candidate.claim.prefix, keeper.claim.prefix
                    ),
                );
            }
            None => kept.push(candidate),
        }
    }
    Decision {
        refused,
        undecided: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(server: &str, prefix: &str) -> EtcdClaim {
        EtcdClaim {
            servers: vec![server.to_owned()],
            prefix: prefix.to_owned(),
        }
    }

    fn at(seconds: i64) -> Option<Timestamp> {
        Some(Timestamp::from_second(1_800_000_000 + seconds).expect("a valid time"))
    }

    fn candidate<'a>(key: &'a str, uid: &'a str, created: i64, prefix: &str) -> Candidate<'a> {
        Candidate {
            key,
            uid,
            created: at(created),
            claim: claim("https://192.0.2.9:2379", prefix),
        }
    }

    fn recorded(uid: &str, prefix: &str, created: i64) -> (String, Record) {
        let lease = Lease {
            metadata: ObjectMeta {
                creation_timestamp: at(created)
                    .map(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time),
                ..record(
                    "bc",
                    uid,
                    "tenants/someone",
                    &claim("https://192.0.2.9:2379", prefix),
                    Some("7".to_owned()),
                )
                .metadata
            },
            spec: None,
        };
        parse("bc", &lease).expect("a record of group bc")
    }

    #[test]
    fn a_record_reads_back_as_written_and_only_for_its_group() {
        let (uid, record) = recorded("u-1", "/tenants/a", 5);
        assert_eq!(uid, "u-1");
        assert_eq!(record.claim, claim("https://192.0.2.9:2379", "/tenants/a"));
        assert_eq!(record.name, "bc-etcd-claim-u-1");
        assert_eq!(record.resource_version.as_deref(), Some("7"));
        let lease = super::record("bc", "u-1", "t/x", &record.claim, None);
        assert_eq!(parse("other", &lease), None);
        let mut unannotated = lease;
        unannotated.metadata.annotations = None;
        assert_eq!(parse("bc", &unannotated), None);
    }

    #[test]
    fn without_records_the_older_secret_keeps_the_keys() {
        let candidates = [
            candidate("t/aa-young", "u-young", 10, "/tenants/a/b"),
            candidate("t/zz-old", "u-old", 1, "/tenants/a"),
            candidate("t/apart", "u-apart", 20, "/tenants/c"),
        ];
        let decision = conflicts(&candidates, Some(&BTreeMap::new()));
        assert_eq!(decision.refused.len(), 1);
        assert!(decision.refused["t/aa-young"].contains("older tenant t/zz-old"));
    }

    #[test]
    fn an_old_secret_edited_to_claim_a_recorded_prefix_is_refused() {
        // zz-old's record is of its former prefix: it holds nothing under /tenants/a.
        let records = BTreeMap::from([
            recorded("u-young", "/tenants/a", 30),
            recorded("u-old", "/tenants/b", 2),
        ]);
        let candidates = [
            candidate("t/aa-young", "u-young", 10, "/tenants/a"),
            candidate("t/zz-old", "u-old", 1, "/tenants/a"),
        ];
        let decision = conflicts(&candidates, Some(&records));
        assert_eq!(decision.refused.len(), 1, "{decision:?}");
        let why = &decision.refused["t/zz-old"];
        assert!(
            why.contains("t/aa-young, which has held them since"),
            "{why}"
        );
    }

    #[test]
    fn of_two_recorded_claims_the_first_recorded_keeps_the_keys() {
        let records = BTreeMap::from([
            recorded("u-1", "/tenants/a", 50),
            recorded("u-2", "/tenants/a/x", 40),
        ]);
        let candidates = [
            candidate("t/one", "u-1", 1, "/tenants/a"),
            candidate("t/two", "u-2", 2, "/tenants/a/x"),
        ];
        let decision = conflicts(&candidates, Some(&records));
        assert_eq!(
            decision.refused.keys().collect::<Vec<_>>(),
            vec!["t/one"],
            "{decision:?}"
        );
    }

    #[test]
    fn overlapping_claims_wait_for_the_records_and_others_do_not() {
        let candidates = [
            candidate("t/a", "u-a", 1, "/tenants/a"),
            candidate("t/b", "u-b", 2, "/tenants/a"),
            candidate("t/c", "u-c", 3, "/tenants/c"),
        ];
        let decision = conflicts(&candidates, None);
        assert!(decision.refused.is_empty());
        let mut undecided = decision.undecided;
        undecided.sort();
        assert_eq!(undecided, vec!["t/a", "t/b"]);
    }

    #[test]
    fn etcd_claims_overlap_on_a_shared_server_when_one_prefix_contains_the_other() {
        let servers = |list: &[&str], prefix: &str| EtcdClaim {
            servers: list.iter().map(|s| (*s).to_owned()).collect(),
            prefix: prefix.to_owned(),
        };
        let a = servers(&["https://192.0.2.1:2379"], "/tenants/a");
        for (other, overlaps) in [
            (servers(&["https://192.0.2.1:2379"], "/tenants/a"), true),
            (servers(&["https://192.0.2.1:2379"], "/tenants"), true),
            (
                servers(&["https://192.0.2.1:2379"], "/tenants/a/services"),
                true,
            ),
            (
                servers(
                    &["https://192.0.2.2:2379", "https://192.0.2.1:2379"],
                    "/tenants/a",
                ),
                true,
            ),
            (servers(&["https://192.0.2.1:2379"], "/tenants/ab"), false),
            (servers(&["https://192.0.2.1:2379"], "/tenants/b"), false),
            (servers(&["https://192.0.2.2:2379"], "/tenants/a"), false),
        ] {
            assert_eq!(a.overlaps(&other), overlaps, "{other:?}");
            assert_eq!(other.overlaps(&a), overlaps, "{other:?}");
        }
    }
}
