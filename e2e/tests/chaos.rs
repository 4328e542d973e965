//! Chaos, short mode: one and three replicas of the real binary against the simulator while it
//! fails 30 % of requests (500, 503 and 429 with Retry-After), drops connections, cuts watches,
//! answers watches `410 Gone` and delays answers, and while the harness breaks what every loop
//! keeps (namespaces, the `kubernetes` Service, Endpoints and EndpointSlice, IPAddresses, orphan
//! IPAddresses, node port duplicates), SIGKILLs replicas and, with three, cuts the leader off.
//! Then the faults stop and the invariants are checked:
//!
//! - no replica exits on its own or panics, and `/healthz` answers 200 throughout;
//! - within 5 s of the faults stopping every loop has converged (the objects, then `check`);
//! - no wrong write: the only IPAddresses a replica deletes are the orphans the harness made, no
//!   replica deletes a namespace, a Service or the Endpoints, and no Service but `kubernetes`
//!   is ever changed;
//! - at most one writer at a time: writes of leader-only objects never come from two live
//!   replicas within the same second;
//! - the `kubernetes` Endpoints are never emptied.
//!
//! `BOOTSTRAP_CHAOS_SEED` replays a run; `BOOTSTRAP_CHAOS_SECS` sets its length (default 20).

mod common;

use anyhow::Result;
use common::chaos::chaos;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_survive_faults_and_breakage_and_converge() -> Result<()> {
    chaos(3).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_survives_faults_and_breakage_and_converges() -> Result<()> {
    chaos(1).await
}
