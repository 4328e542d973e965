//! Chaos, short mode: one and three replicas of the real binary against the simulator while it
//! fails 30 % of requests (500, 503 and 429 with Retry-After), drops connections, cuts watches,
//! answers watches `410 Gone` and delays answers, and while the harness breaks what every loop
//! keeps (namespaces, the `kubernetes` Service, Endpoints and EndpointSlice, IPAddresses, orphan
//! IPAddresses, node port duplicates), SIGKILLs replicas and, with three, cuts the leader off.
//! Then the faults stop and the invariants are checked:
//!
//! - every fault happened: each kind of refusal (500, 503, 429, a dropped connection) reached a
//!   controller, a watch was answered `410 Gone`, replicas were killed (and sent nothing after),
//!   and with three the leader was cut off (its requests dropped);
//! - no replica exits on its own or panics, and `/healthz` answers 200 throughout;
//! - once the faults stop every loop converges (the objects, then `check`; the time it took is
//!   printed, not bounded);
//! - no wrong write: the only IPAddresses a replica deletes are the orphans the harness made, no
//!   replica deletes a namespace, a Service or the Endpoints, and no Service but `kubernetes`
//!   is ever changed;
//! - at most one writer at a time: writes of leader-only objects never come from two live
//!   replicas within the same second;
//! - the `kubernetes` Endpoints and EndpointSlice are never emptied (observed, not missing, while
//!   the chaos runs; the tests below feed the checker emptied objects).
//!
//! `BOOTSTRAP_CHAOS_SEED` replays a run; `BOOTSTRAP_CHAOS_SECS` sets its length (default 20).

mod common;

use anyhow::Result;
use common::chaos::{NeverEmptied, chaos, endpoints_emptied, slice_emptied};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_survive_faults_and_breakage_and_converge() -> Result<()> {
    chaos(3).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_survives_faults_and_breakage_and_converges() -> Result<()> {
    chaos(1).await
}

/// Every shape of an emptied Endpoints counts, the one a replace with `subsets: None` writes (no
/// key at all) first.
#[test]
fn the_invariant_counts_every_emptied_endpoints() {
    let meta = json!({"name": "kubernetes", "namespace": "default"});
    let ports = json!([{"name": "https", "port": 443, "protocol": "TCP"}]);
    for emptied in [
        json!({"metadata": meta}),
        json!({"metadata": meta, "subsets": null}),
        json!({"metadata": meta, "subsets": []}),
        json!({"metadata": meta, "subsets": [{"ports": ports}]}),
        json!({"metadata": meta, "subsets": [{"addresses": [], "ports": ports}]}),
        json!({"metadata": meta, "subsets": [{"notReadyAddresses": [{"ip": "10.0.0.1"}], "ports": ports}]}),
    ] {
        assert!(endpoints_emptied(&emptied), "not counted: {emptied}");
    }
    let listed =
        json!({"metadata": meta, "subsets": [{"addresses": [{"ip": "10.0.0.1"}], "ports": ports}]});
    assert!(!endpoints_emptied(&listed));
}

#[test]
fn the_invariant_counts_every_emptied_slice() {
    let meta = json!({"name": "kubernetes", "namespace": "default"});
    for emptied in [
        json!({"metadata": meta, "addressType": "IPv4"}),
        json!({"metadata": meta, "addressType": "IPv4", "endpoints": null}),
        json!({"metadata": meta, "addressType": "IPv4", "endpoints": []}),
        json!({"metadata": meta, "addressType": "IPv4",
               "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": false}}]}),
        json!({"metadata": meta, "addressType": "IPv4", "endpoints": [{"addresses": []}]}),
    ] {
        assert!(slice_emptied(&emptied), "not counted: {emptied}");
    }
    let listed = json!({"metadata": meta, "addressType": "IPv4",
                        "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": true}}]});
    assert!(!slice_emptied(&listed));
}

/// The checker as the run uses it: one emptied observation among good ones fails the run, and so
/// does a run that observed nothing.
#[test]
fn the_invariant_fails_on_one_emptied_observation_and_on_none_at_all() {
    let endpoints =
        json!({"subsets": [{"addresses": [{"ip": "10.0.0.1"}], "ports": [{"port": 443}]}]});
    let slice = json!({"endpoints": [{"addresses": ["10.0.0.1"]}]});
    let emptied = json!({"metadata": {"name": "kubernetes"}});

    let mut good = NeverEmptied::default();
    good.observe(Some(&endpoints), Some(&slice));
    good.observe(None, None);
    assert!(good.check().is_ok(), "{good:?}");

    let mut bad = NeverEmptied::default();
    bad.observe(Some(&endpoints), Some(&slice));
    bad.observe(Some(&emptied), Some(&slice));
    bad.observe(Some(&endpoints), Some(&slice));
    let err = bad.check().expect_err("an emptied Endpoints passed");
    assert!(err.to_string().contains("seen emptied 1 time"), "{err}");

    let mut bad_slice = NeverEmptied::default();
    bad_slice.observe(Some(&endpoints), Some(&json!({"endpoints": []})));
    assert!(
        bad_slice.check().is_err(),
        "an emptied EndpointSlice passed"
    );

    let mut blind = NeverEmptied::default();
    blind.observe(None, None);
    assert!(blind.check().is_err(), "a run that observed nothing passed");
}
