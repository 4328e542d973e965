//! Which tenant keeps the etcd keys that two tenant Secrets claim.
//!
//! Two tenants on one etcd must not have prefixes one of which contains the other (equal
//! included): one would rewrite the other's bitmaps, or write into its resources' key space.
//! One etcd is what etcd says it is: the cluster ID in the header of its answers, learned by a
//! read made before the tenant starts ([`crate::tenants`]), never the spelling of a URL (a
//! host name, `127.1`, a zero-padded port all reach the same etcd as its plain address). When
//! claims overlap, one tenant is refused, and which one must not be up to the Secrets' writers:
//! a Secret's age says nothing about who held the keys first, so an old Secret edited to name a
//! running tenant's prefix would displace it.
//!
//! So a tenant started with a claim records it in a Lease of the controller's own namespace
//! (`<lease name>-etcd-claim-<Secret uid>`, labelled [`RECORD_LABEL`], its annotations the
//! tenant's `namespace/name`, the etcd's cluster ID and the prefix), where no tenant Secret's
//! writer can write. A record belongs to the tenant it names, whatever the uid of its Secret:
//! a Secret deleted and created again under the same name finds its claim still held. The
//! decision, made by [`conflicts`] from every Secret and every record, so that every replica
//! decides alike:
//!
//! | claims                                     | keeps the keys                                |
//! |--------------------------------------------|-----------------------------------------------|
//! | one recorded, others not                   | the recorded one, even while its Secret is    |
//! |                                            | gone or claims other keys (see below)         |
//! | several recorded                           | the one recorded first (the record's          |
//! |                                            | creation, stamped by the API server)          |
//! | none recorded                              | the older Secret, then the first by name      |
//! | records not listed yet                     | none is started; running tenants go on        |
//! | a claim whose etcd is still being asked    | none overlapping its prefix is started        |
//!
//! A record outlives a change of its Secret that leaves the claim alone (a rotated certificate,
//! a re-created Secret), and is replaced when its tenant starts with another claim. A record no
//! Secret makes any more is kept for [`CLAIM_GRACE`] after the manager first sees it so, and
//! holds its keys meanwhile (a Secret refused for them stays refused); then it is deleted, by
//! compare-and-swap.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;

use crate::config::TENANT_CONFIG_ANNOTATION;

/// The label of every claim record, whatever its group.
pub const RECORD_LABEL: &str = "bootstrap-controller.io/etcd-claim";
const TENANT_ANNOTATION: &str = "bootstrap-controller.io/tenant";
const SERVERS_ANNOTATION: &str = "bootstrap-controller.io/etcd-servers";
const CLUSTER_ANNOTATION: &str = "bootstrap-controller.io/etcd-cluster-id";
const PREFIX_ANNOTATION: &str = "bootstrap-controller.io/etcd-prefix";

/// How long a claim outlives its Secret (deleted, or edited to claim other keys): long enough
/// for a Secret deleted and created again by hand or by a tool's recreate to find its keys
/// still its own.
pub const CLAIM_GRACE: Duration = Duration::from_secs(10 * 60);

/// The etcd keys a tenant writes: the etcd (its cluster ID) and the prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdClaim {
    /// etcd's cluster ID; 0 (which etcd never reports) in a record that carries none: such a
    /// record names no etcd and holds nothing, and its tenant, once running, writes its claim
    /// over it.
    pub cluster: u64,
    pub prefix: String,
}

/// Whether one prefix contains the other (equal included).
fn prefixes_overlap(a: &str, b: &str) -> bool {
    // Allocation-free: every sync compares every pair of claims.
    let within = |a: &str, b: &str| {
        b.strip_prefix(a)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
    };
    within(a, b) || within(b, a)
}

impl EtcdClaim {
    /// Whether the two are on one etcd and one prefix contains the other (equal included).
    pub fn overlaps(&self, other: &EtcdClaim) -> bool {
        self.cluster != 0
            && self.cluster == other.cluster
            && prefixes_overlap(&self.prefix, &other.prefix)
    }
}

/// A claim as recorded: whose it is (the Secret's `namespace/name`), and since when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// The record's own name, for its replacement or deletion.
    pub name: String,
    pub resource_version: Option<String>,
    /// The Secret, `namespace/name`.
    pub tenant: String,
    pub claim: EtcdClaim,
    pub created: Option<Timestamp>,
}

/// The name of the record of the Secret with this uid, for the replicas' group `group`.
pub fn record_name(group: &str, uid: &str) -> String {
    format!("{group}-etcd-claim-{uid}")
}

/// Whether a Lease named `name` is a record of `group`.
pub fn is_record_name(group: &str, name: &str) -> bool {
    name.strip_prefix(group)
        .and_then(|rest| rest.strip_prefix("-etcd-claim-"))
        .is_some_and(|uid| !uid.is_empty())
}

/// The record of `tenant`'s claim, to create or (with the old record's resourceVersion)
/// replace; `servers` are the tenant's URLs, for people reading it.
pub fn record(
    group: &str,
    uid: &str,
    tenant: &str,
    claim: &EtcdClaim,
    servers: &[String],
    resource_version: Option<String>,
) -> Lease {
    let servers = serde_json::to_string(servers).unwrap_or_default();
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
                (
                    CLUSTER_ANNOTATION.to_owned(),
                    format!("{:016x}", claim.cluster),
                ),
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

/// The record a Lease holds, if it is a record of `group` (other Leases with the label, of
/// another group or written by hand without the annotations, are not records).
pub fn parse(group: &str, lease: &Lease) -> Option<Record> {
    let name = lease.metadata.name.clone()?;
    if !is_record_name(group, &name) {
        return None;
    }
    let annotations = lease.metadata.annotations.as_ref()?;
    let cluster = match annotations.get(CLUSTER_ANNOTATION) {
        Some(id) => u64::from_str_radix(id, 16).ok()?,
        None => 0,
    };
    let tenant = annotations.get(TENANT_ANNOTATION)?.clone();
    Some(Record {
        name,
        resource_version: lease.metadata.resource_version.clone(),
        tenant,
        claim: EtcdClaim {
            cluster,
            prefix: annotations.get(PREFIX_ANNOTATION)?.clone(),
        },
        created: lease.metadata.creation_timestamp.as_ref().map(|t| t.0),
    })
}

/// What is known of the etcd keys a tenant Secret claims.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claimed {
    /// Its etcd answered: this is the claim.
    Known(EtcdClaim),
    /// Its etcd is being asked for the first time: the claim may be on any etcd.
    Asking { prefix: String },
    /// Its etcd could not be asked: it cannot start, and claims nothing new (it keeps a record
    /// it has, not knowing better).
    Unknown,
}

/// One tenant Secret that claims etcd keys.
#[derive(Clone, Debug)]
pub struct Candidate<'a> {
    /// `namespace/name`.
    pub key: &'a str,
    /// The Secret's creation.
    pub created: Option<Timestamp>,
    pub claim: Claimed,
}

/// What [`conflicts`] decided.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Decision {
    /// Tenants refused, with why.
    pub refused: HashMap<String, String>,
    /// Tenants not to be started yet: the records are not known, or a claim that may overlap
    /// theirs is still being asked about.
    pub undecided: Vec<String>,
}

/// Whether a record is still made by a Secret: its tenant's Secret exists and claims what it
/// says, or cannot tell (its etcd not asked yet, or not answering).
pub fn still_claimed(record: &Record, candidates: &[Candidate<'_>]) -> bool {
    candidates.iter().any(|c| {
        c.key == record.tenant
            && match &c.claim {
                Claimed::Known(claim) => *claim == record.claim,
                Claimed::Asking { .. } | Claimed::Unknown => true,
            }
    })
}

/// The records no Secret makes any more, in two lists: those first seen so now (`unclaimed`
/// holds when each record was first seen so, and is kept up to date here), and those seen so
/// for [`CLAIM_GRACE`] or longer, to delete. A record claimed again is forgotten in `unclaimed`,
/// so its grace starts afresh if it is given up again.
pub fn unclaimed<'r>(
    records: &'r [Record],
    candidates: &[Candidate<'_>],
    unclaimed: &mut HashMap<String, Instant>,
    now: Instant,
) -> (Vec<&'r Record>, Vec<&'r Record>) {
    let (mut newly, mut expired) = (Vec::new(), Vec::new());
    for record in records {
        if still_claimed(record, candidates) {
            unclaimed.remove(&record.name);
            continue;
        }
        let since = *unclaimed.entry(record.name.clone()).or_insert_with(|| {
            newly.push(record);
            now
        });
        if now.saturating_duration_since(since) >= CLAIM_GRACE {
            expired.push(record);
        }
    }
    unclaimed.retain(|name, _| records.iter().any(|record| &record.name == name));
    (newly, expired)
}

/// Which candidates are refused because another keeps the keys they claim (see the module's
/// table). `records` is `None` until the records have been listed.
pub fn conflicts(candidates: &[Candidate<'_>], records: Option<&[Record]>) -> Decision {
    let Some(records) = records else {
        return Decision {
            refused: HashMap::new(),
            undecided: candidates.iter().map(|c| c.key.to_owned()).collect(),
        };
    };
    // Records first, by their creation, then name: one overlapping an earlier one of another
    // tenant holds nothing.
    let mut ordered: Vec<&Record> = records.iter().collect();
    ordered.sort_by(|a, b| (a.created, &a.name).cmp(&(b.created, &b.name)));
    let mut holders: Vec<&Record> = Vec::new();
    for record in ordered {
        if !holders
            .iter()
            .any(|h| h.tenant != record.tenant && h.claim.overlaps(&record.claim))
        {
            holders.push(record);
        }
    }
    let mut refused = HashMap::new();
    let mut undecided = Vec::new();
    let asking: Vec<(&str, &str)> = candidates
        .iter()
        .filter_map(|c| match &c.claim {
            Claimed::Asking { prefix } => Some((c.key, prefix.as_str())),
            _ => None,
        })
        .collect();
    // With whether it waits for a claim being asked about.
    let mut unrecorded: Vec<(&Candidate<'_>, &EtcdClaim, bool)> = Vec::new();
    for candidate in candidates {
        let claim = match &candidate.claim {
            Claimed::Known(claim) => claim,
            Claimed::Asking { .. } => {
                undecided.push(candidate.key.to_owned());
                continue;
            }
            Claimed::Unknown => continue,
        };
        if let Some(holder) = holders
            .iter()
            .find(|h| h.tenant != candidate.key && h.claim.overlaps(claim))
        {
            refused.insert(
                candidate.key.to_owned(),
                refusal(claim, &holder.tenant, &holder.claim, Some(holder.created)),
            );
            continue;
        }
        let held = holders
            .iter()
            .any(|h| h.tenant == candidate.key && h.claim == *claim);
        if held {
            continue;
        }
        let waits = asking
            .iter()
            .any(|(key, prefix)| *key != candidate.key && prefixes_overlap(prefix, &claim.prefix));
        unrecorded.push((candidate, claim, waits));
    }
    // Claims never recorded: the older Secret first, then the first by name. One that waits
    // still comes in its turn: a younger claim it overlaps waits with it, since which of the
    // two keeps the keys depends on it.
    unrecorded.sort_by(|(a, ..), (b, ..)| (a.created, a.key).cmp(&(b.created, b.key)));
    let mut kept: Vec<(&Candidate<'_>, &EtcdClaim, bool)> = Vec::new();
    for (candidate, claim, waits) in unrecorded {
        match kept.iter().find(|(_, k, _)| claim.overlaps(k)) {
            Some((_, _, true)) => undecided.push(candidate.key.to_owned()),
            Some((keeper, kept_claim, false)) => {
                refused.insert(
                    candidate.key.to_owned(),
                    refusal(claim, keeper.key, kept_claim, None),
                );
            }
            None => {
                if waits {
                    undecided.push(candidate.key.to_owned());
                }
                kept.push((candidate, claim, waits));
            }
        }
    }
    Decision { refused, undecided }
}

/// Why a claim is refused: the keys it overlaps, and who keeps them (`since`: the holder's
/// record's creation, for a recorded claim).
fn refusal(
    claim: &EtcdClaim,
    keeper: &str,
    kept: &EtcdClaim,
    since: Option<Option<Timestamp>>,
) -> String {
    let by = match since {
        Some(Some(created)) => format!("the tenant {keeper}, which has held them since {created}"),
        Some(None) => format!("the tenant {keeper}, which holds them"),
        None => format!("the older tenant {keeper}"),
    };
    format!(
        "{TENANT_CONFIG_ANNOTATION}: etcdPrefix {:?} overlaps {:?} of {by} on the same etcd \
         (cluster ID {:016x}, however its URL is written): two tenants' keys must not contain \
         each other (give each tenant its own prefix)",
        claim.prefix, kept.prefix, claim.cluster
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const ETCD: u64 = 0x8e9e_05c5_2164_694d;

    fn claim(cluster: u64, prefix: &str) -> EtcdClaim {
        EtcdClaim {
            cluster,
            prefix: prefix.to_owned(),
        }
    }

    fn at(seconds: i64) -> Option<Timestamp> {
        Some(Timestamp::from_second(1_800_000_000 + seconds).expect("a valid time"))
    }

    fn candidate<'a>(key: &'a str, created: i64, prefix: &str) -> Candidate<'a> {
        Candidate {
            key,
            created: at(created),
            claim: Claimed::Known(claim(ETCD, prefix)),
        }
    }

    fn recorded(uid: &str, tenant: &str, prefix: &str, created: i64) -> Record {
        let lease = Lease {
            metadata: ObjectMeta {
                creation_timestamp: at(created)
                    .map(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time),
                ..record(
                    "bc",
                    uid,
                    tenant,
                    &claim(ETCD, prefix),
                    &["https://192.0.2.9:2379".to_owned()],
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
        let record = recorded("u-1", "t/x", "/tenants/a", 5);
        assert_eq!(record.tenant, "t/x");
        assert_eq!(record.claim, claim(ETCD, "/tenants/a"));
        assert_eq!(record.name, "bc-etcd-claim-u-1");
        assert_eq!(record.resource_version.as_deref(), Some("7"));
        let lease = super::record("bc", "u-1", "t/x", &record.claim, &[], None);
        assert_eq!(parse("other", &lease), None);
        assert_eq!(parse("b", &lease), None);
        let mut unannotated = lease.clone();
        unannotated.metadata.annotations = None;
        assert_eq!(parse("bc", &unannotated), None);
        // A record without a cluster ID is one (so its tenant can write over it), but names no
        // etcd: it holds nothing, and no Secret still makes its claim.
        let mut no_cluster = lease;
        if let Some(annotations) = no_cluster.metadata.annotations.as_mut() {
            annotations.remove(CLUSTER_ANNOTATION);
        }
        let legacy = parse("bc", &no_cluster).expect("a record");
        assert_eq!(legacy.claim.cluster, 0);
        assert!(!legacy.claim.overlaps(&legacy.claim));
        let candidates = [candidate("t/x", 1, "/tenants/a")];
        assert!(!still_claimed(&legacy, &candidates));
        assert_eq!(conflicts(&candidates, Some(&[legacy])), Decision::default());
    }

    #[test]
    fn claims_overlap_on_one_etcd_when_one_prefix_contains_the_other() {
        let a = claim(ETCD, "/tenants/a");
        for (other, overlaps) in [
            (claim(ETCD, "/tenants/a"), true),
            (claim(ETCD, "/tenants"), true),
            (claim(ETCD, "/tenants/a/services"), true),
            (claim(ETCD, "/tenants/ab"), false),
            (claim(ETCD, "/tenants/b"), false),
            (claim(ETCD + 1, "/tenants/a"), false),
        ] {
            assert_eq!(a.overlaps(&other), overlaps, "{other:?}");
            assert_eq!(other.overlaps(&a), overlaps, "{other:?}");
        }
    }

    #[test]
    fn without_records_the_older_secret_keeps_the_keys() {
        let candidates = [
            candidate("t/aa-young", 10, "/tenants/a/b"),
            candidate("t/zz-old", 1, "/tenants/a"),
            candidate("t/apart", 20, "/tenants/c"),
        ];
        let decision = conflicts(&candidates, Some(&[]));
        assert_eq!(decision.refused.len(), 1, "{decision:?}");
        let why = &decision.refused["t/aa-young"];
        assert!(why.contains("older tenant t/zz-old"), "{why}");
        assert!(why.contains("8e9e05c52164694d"), "{why}");
        assert!(decision.undecided.is_empty());
    }

    #[test]
    fn the_same_prefix_on_two_etcds_is_no_conflict() {
        let mut other = candidate("t/b", 2, "/tenants/a");
        other.claim = Claimed::Known(claim(ETCD + 1, "/tenants/a"));
        let candidates = [candidate("t/a", 1, "/tenants/a"), other];
        assert_eq!(conflicts(&candidates, Some(&[])), Decision::default());
    }

    #[test]
    fn an_old_secret_edited_to_claim_a_recorded_prefix_is_refused() {
        // zz-old's record is of its former prefix: it holds nothing under /tenants/a.
        let records = [
            recorded("u-young", "t/aa-young", "/tenants/a", 30),
            recorded("u-old", "t/zz-old", "/tenants/b", 2),
        ];
        let candidates = [
            candidate("t/aa-young", 10, "/tenants/a"),
            candidate("t/zz-old", 1, "/tenants/a"),
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
        let records = [
            recorded("u-1", "t/one", "/tenants/a", 50),
            recorded("u-2", "t/two", "/tenants/a/x", 40),
        ];
        let candidates = [
            candidate("t/one", 1, "/tenants/a"),
            candidate("t/two", 2, "/tenants/a/x"),
        ];
        let decision = conflicts(&candidates, Some(&records));
        assert_eq!(
            decision.refused.keys().collect::<Vec<_>>(),
            vec!["t/one"],
            "{decision:?}"
        );
    }

    #[test]
    fn a_claim_outlives_its_secret_and_a_refused_one_never_takes_it_over() {
        // t/holder's record was written under the uid of a Secret since deleted.
        let records = [recorded("u-gone", "t/holder", "/tenants/a", 5)];
        // Its Secret gone: the older, refused Secret stays refused while the record lasts.
        let refused_one = [candidate("t/refused", 1, "/tenants/a")];
        let decision = conflicts(&refused_one, Some(&records));
        assert!(
            decision.refused["t/refused"].contains("t/holder, which has held them since"),
            "{decision:?}"
        );
        assert!(!still_claimed(&records[0], &refused_one));
        // Created again under its name (another uid, a later creation): it holds its keys.
        let back = [
            candidate("t/refused", 1, "/tenants/a"),
            candidate("t/holder", 900, "/tenants/a"),
        ];
        let decision = conflicts(&back, Some(&records));
        assert_eq!(
            decision.refused.keys().collect::<Vec<_>>(),
            vec!["t/refused"],
            "{decision:?}"
        );
        assert!(still_claimed(&records[0], &back));
        // Back with other keys: the record is no longer its claim (its grace runs out), but
        // holds the old keys meanwhile.
        let moved = [
            candidate("t/refused", 1, "/tenants/a"),
            candidate("t/holder", 900, "/tenants/z"),
        ];
        assert!(!still_claimed(&records[0], &moved));
        assert!(
            conflicts(&moved, Some(&records))
                .refused
                .contains_key("t/refused")
        );
    }

    #[test]
    fn a_record_no_secret_makes_is_deleted_only_after_the_grace() {
        let records = [
            recorded("u-1", "t/gone", "/tenants/a", 1),
            recorded("u-2", "t/here", "/tenants/b", 1),
        ];
        let here = [candidate("t/here", 1, "/tenants/b")];
        let mut seen = HashMap::from([("bc-etcd-claim-u-forgotten".to_owned(), Instant::now())]);
        let start = Instant::now();
        let (newly, expired) = unclaimed(&records, &here, &mut seen, start);
        assert_eq!(newly, vec![&records[0]]);
        assert!(expired.is_empty());
        assert_eq!(seen.keys().collect::<Vec<_>>(), vec!["bc-etcd-claim-u-1"]);
        let almost = start + CLAIM_GRACE - Duration::from_secs(1);
        assert_eq!(
            unclaimed(&records, &here, &mut seen, almost),
            (vec![], vec![])
        );
        let (newly, expired) = unclaimed(&records, &here, &mut seen, start + CLAIM_GRACE);
        assert!(newly.is_empty());
        assert_eq!(expired, vec![&records[0]]);
        // Its Secret back before the end: its grace starts afresh when it is given up again.
        let back = [
            candidate("t/here", 1, "/tenants/b"),
            candidate("t/gone", 9, "/tenants/a"),
        ];
        assert_eq!(
            unclaimed(&records, &back, &mut seen, almost),
            (vec![], vec![])
        );
        assert!(seen.is_empty());
        let later = start + CLAIM_GRACE * 2;
        let (newly, expired) = unclaimed(&records, &here, &mut seen, later);
        assert_eq!((newly.len(), expired.len()), (1, 0));
    }

    #[test]
    fn a_claim_whose_etcd_is_being_asked_holds_up_the_prefixes_it_may_overlap() {
        let asking = |key, prefix: &str| Candidate {
            claim: Claimed::Asking {
                prefix: prefix.to_owned(),
            },
            ..candidate(key, 1, prefix)
        };
        let mut unknown = candidate("t/unknown", 0, "/tenants/c");
        unknown.claim = Claimed::Unknown;
        let records = [recorded("u-r", "t/recorded", "/tenants/q", 1)];
        let candidates = [
            asking("t/asking", "/tenants/a/b/c"),
            asking("t/asking-q", "/tenants/q/z"),
            unknown,
            candidate("t/new", 2, "/tenants/a/b"),
            // Younger than t/new, which it overlaps, but not t/asking: it waits with t/new.
            candidate("t/newer", 3, "/tenants/a/b/x"),
            candidate("t/recorded", 4, "/tenants/q"),
            candidate("t/apart", 3, "/tenants/b"),
            candidate("t/c", 5, "/tenants/c"),
        ];
        let decision = conflicts(&candidates, Some(&records));
        let mut undecided = decision.undecided.clone();
        undecided.sort();
        // The recorded claim keeps its keys whatever the one being asked turns out to be; an
        // etcd that does not answer holds up nothing.
        assert_eq!(
            undecided,
            vec!["t/asking", "t/asking-q", "t/new", "t/newer"],
            "{decision:?}"
        );
        assert!(decision.refused.is_empty(), "{decision:?}");
    }

    #[test]
    fn until_the_records_are_listed_no_claim_is_decided() {
        let candidates = [
            candidate("t/a", 1, "/tenants/a"),
            candidate("t/c", 3, "/tenants/c"),
        ];
        let decision = conflicts(&candidates, None);
        assert!(decision.refused.is_empty());
        let mut undecided = decision.undecided;
        undecided.sort();
        assert_eq!(undecided, vec!["t/a", "t/c"]);
    }
}
