//! The etcd-claim records ([`crate::etcd_claims`]) as the manager keeps them: which tenants are
//! refused, or wait, for their etcd keys, and the records of the tenants running here.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, DeleteParams, PostParams, Preconditions};
use reconcilers::lease;
use tracing::{debug, info, warn};

use super::etcd::EtcdState;
use super::{Manager, Spec};
use crate::etcd_claims::{self, CLAIM_GRACE, Candidate, Record};

/// How long a record write or deletion may take, and how soon one that failed is tried again.
pub(super) const RECORD_TIMEOUT: Duration = Duration::from_secs(10);
pub(super) const RECORD_RETRY: Duration = Duration::from_secs(30);

/// Every Secret that claims etcd keys, with what is known of its claim.
fn candidates<'a>(
    etcds: &'a HashMap<String, (Spec, EtcdState)>,
    secrets: &'a BTreeMap<String, Spec>,
) -> Vec<Candidate<'a>> {
    secrets
        .iter()
        .filter_map(|(key, spec)| {
            let (_, state) = etcds.get(key)?;
            Some(Candidate {
                key,
                created: spec.created,
                claim: state.claimed()?,
            })
        })
        .collect()
}

impl Manager {
    /// Which tenants are refused, or wait, because their etcd keys overlap another's
    /// ([`etcd_claims::conflicts`]). Decided from every Secret and record, so every replica
    /// decides alike.
    pub(super) fn etcd_conflicts(
        &mut self,
        secrets: &BTreeMap<String, Spec>,
    ) -> etcd_claims::Decision {
        self.ask_etcds(secrets);
        let records: Option<Vec<Record>> = self
            .records
            .complete
            .as_ref()
            .map(|r| r.values().cloned().collect());
        etcd_claims::conflicts(&candidates(&self.etcds, secrets), records.as_deref())
    }

    /// Keeps the etcd-claim records: the claim of every tenant running here recorded as it is
    /// now, and the records that no Secret makes any more deleted once [`CLAIM_GRACE`] has
    /// passed since this replica first saw them so. Each write runs in a task of its own,
    /// bounded by [`RECORD_TIMEOUT`]; one that fails is tried again after [`RECORD_RETRY`]
    /// (the manager syncs on a timer too). Deletions carry the record's resourceVersion, so a
    /// record rewritten meanwhile (by another replica) stays.
    pub(super) fn keep_records(&mut self, secrets: &BTreeMap<String, Spec>) {
        let Some(records) = &self.records.complete else {
            return;
        };
        let now = Instant::now();
        self.recording
            .retain(|_, at| now.duration_since(*at) < RECORD_RETRY);
        let group = &self.settings.election.lease_name;
        let api: Api<Lease> =
            Api::namespaced(self.client.clone(), &self.settings.election.lease_namespace);
        let mut writes = Vec::new();
        for (key, running) in &self.running {
            let Some((_, EtcdState::Known(asked))) = self.etcds.get(key) else {
                continue;
            };
            let uid = &running.spec.uid;
            let recorded = records
                .values()
                .any(|record| &record.tenant == key && record.claim == asked.claim);
            if uid.is_empty() || recorded {
                continue;
            }
            let name = etcd_claims::record_name(group, uid);
            let version = records
                .get(&name)
                .and_then(|record| record.resource_version.clone());
            let lease = etcd_claims::record(group, uid, key, &asked.claim, &asked.servers, version);
            writes.push((name, lease));
        }
        let deletions = expired_records(records, &self.etcds, secrets, &mut self.unclaimed, now);
        for (name, lease) in writes {
            // Under way or failed lately: its time is kept, not renewed, so that it comes due.
            if self.recording.contains_key(&name) {
                continue;
            }
            self.recording.insert(name.clone(), now);
            let (api, errors) = (api.clone(), self.record_errors.clone());
            tokio::spawn(async move {
                let params = PostParams {
                    field_manager: Some("bootstrap-controller".to_owned()),
                    ..PostParams::default()
                };
                // With the old record's resourceVersion a replacement, else a creation: both
                // fail rather than overwrite a record another replica wrote meanwhile.
                let write = async {
                    if lease.metadata.resource_version.is_some() {
                        api.replace(&name, &params, &lease).await.map(drop)
                    } else {
                        api.create(&params, &lease).await.map(drop)
                    }
                };
                let result = tokio::time::timeout(RECORD_TIMEOUT, write).await;
                report_record(&errors, &name, "write", result);
            });
        }
        for (name, version) in deletions {
            // Under way or failed lately: its time is kept, not renewed, so that it comes due.
            if self.recording.contains_key(&name) {
                continue;
            }
            self.recording.insert(name.clone(), now);
            let (api, errors) = (api.clone(), self.record_errors.clone());
            tokio::spawn(async move {
                let params = DeleteParams {
                    preconditions: Some(Preconditions {
                        resource_version: version,
                        uid: None,
                    }),
                    ..DeleteParams::default()
                };
                let delete = async { api.delete(&name, &params).await.map(drop) };
                let result = tokio::time::timeout(RECORD_TIMEOUT, delete).await;
                report_record(&errors, &name, "delete", result);
            });
        }
    }
}

/// The records no Secret has made for [`CLAIM_GRACE`], to delete (name and resourceVersion);
/// those that became unclaimed are logged. A Secret shed for the Secrets' budget is held without
/// its annotation, so what it claims is not known: its records are kept, neither counted
/// unclaimed nor deleted.
fn expired_records(
    records: &BTreeMap<String, Record>,
    etcds: &HashMap<String, (Spec, EtcdState)>,
    secrets: &BTreeMap<String, Spec>,
    unclaimed: &mut HashMap<String, Instant>,
    now: Instant,
) -> Vec<(String, Option<String>)> {
    let candidates = candidates(etcds, secrets);
    let shed = |record: &Record| {
        secrets
            .get(&record.tenant)
            .is_some_and(|s| s.shed.is_some())
    };
    let listed: Vec<Record> = records
        .values()
        .filter(|record| !shed(record))
        .cloned()
        .collect();
    let (newly, expired) = etcd_claims::unclaimed(&listed, &candidates, unclaimed, now);
    for record in newly {
        info!(
            record = %record.name,
            tenant = %record.tenant,
            "no tenant Secret makes this etcd claim any more; it holds its keys for {} s, then it is deleted",
            CLAIM_GRACE.as_secs()
        );
    }
    expired
        .into_iter()
        .map(|record| (record.name.clone(), record.resource_version.clone()))
        .collect()
}

/// The last failure of each record's write or deletion, by record name, until it succeeds.
pub(super) type RecordErrors = Mutex<HashMap<String, String>>;

/// Logs how a record's write or deletion ended: a conflict or a record already gone is a race
/// with another replica, settled on the next try; another error is warned about once for its
/// record until that record's write succeeds or fails otherwise.
fn report_record(
    errors: &RecordErrors,
    name: &str,
    what: &str,
    result: Result<Result<(), kube::Error>, tokio::time::error::Elapsed>,
) {
    let message = match result {
        Ok(Ok(())) => {
            debug!(record = %name, "etcd-claim record {what} done");
            errors
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(name);
            return;
        }
        Ok(Err(err))
            if lease::is_conflict(&err)
                || (lease::status_code(&err) == Some(404) && what == "delete") =>
        {
            debug!(record = %name, error = %err, "etcd-claim record {what} raced another writer; tried again later");
            errors
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(name);
            return;
        }
        Ok(Err(err)) => err.to_string(),
        Err(_) => format!("no answer within {} s", RECORD_TIMEOUT.as_secs()),
    };
    let mut last = errors.lock().unwrap_or_else(|p| p.into_inner());
    if last.get(name) != Some(&message) {
        warn!(record = %name, error = %message, "cannot {what} an etcd-claim record; tried again in {} s (the same failure again is logged at debug level)", RECORD_RETRY.as_secs());
        last.insert(name.to_owned(), message);
    } else {
        debug!(record = %name, error = %message, "cannot {what} an etcd-claim record, again");
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::test_log::Captured;

    fn refused(record: &str) -> Result<Result<(), kube::Error>, tokio::time::error::Elapsed> {
        let status =
            kube::core::Status::failure(&format!("leases \"{record}\" is forbidden"), "Forbidden")
                .with_code(403)
                .boxed();
        Ok(Err(kube::Error::Api(status)))
    }

    /// Two records refused in turn are each warned about once, not at every retry; a record
    /// whose write then succeeds is warned about again when it fails again.
    #[test]
    fn each_records_failure_is_warned_about_once_until_it_succeeds() {
        let captured = Captured::default();
        let _guard = tracing::subscriber::set_default(captured.subscriber(tracing::Level::WARN));
        let errors = RecordErrors::default();
        for _ in 0..5 {
            report_record(&errors, "a", "write", refused("a"));
            report_record(&errors, "b", "write", refused("b"));
        }
        let warnings = || {
            captured
                .text()
                .lines()
                .filter(|line| line.contains(" WARN "))
                .count()
        };
        assert_eq!(warnings(), 2);
        report_record(&errors, "a", "write", Ok(Ok(())));
        report_record(&errors, "a", "write", refused("a"));
        assert_eq!(warnings(), 3);
        assert_eq!(errors.lock().unwrap().len(), 2);
    }
}
