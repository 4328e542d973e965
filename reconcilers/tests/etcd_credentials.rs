//! The etcd client certificate renewed on disk (kubeadm yearly, cert-manager often) is used from
//! the next call on, without a restart: against a real etcd that requires client certificates.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;

use common::etcd::{Etcd, Pki};
use reconcilers::legacy_alloc::etcd::EtcdStore;

/// Puts `from`'s certificate and key `which` (`client`, `renewed`) in `to` as a renewal or a
/// Secret volume does: written aside, then renamed over the old files.
fn install(from: &Pki, which: &str, to: &Path) {
    for extension in ["crt", "key"] {
        let staged = to.join(format!(".client.{extension}.new"));
        std::fs::copy(from.path(&format!("{which}.{extension}")), &staged).unwrap();
        std::fs::rename(&staged, to.join(format!("client.{extension}"))).unwrap();
    }
}

#[tokio::test]
async fn a_renewed_client_certificate_is_used_without_a_restart() {
    let etcd = Etcd::start(Some(Pki::generate())).await;
    let trusted = etcd.pki().unwrap();
    // A client certificate from a CA the server does not trust.
    let foreign = Pki::generate();
    let dir = tempfile::tempdir().unwrap();
    install(&foreign, "client", dir.path());
    let mut config = etcd.config();
    config.cert_file = Some(dir.path().join("client.crt"));
    config.key_file = Some(dir.path().join("client.key"));
    let store = EtcdStore::new(config);

    // Started with a certificate the server refuses: calls fail until it is replaced.
    assert!(store.get("/k").await.is_err());
    install(trusted, "client", dir.path());
    assert!(
        store
            .compare_and_swap("/k", None, b"1".to_vec())
            .await
            .unwrap()
    );
    assert_eq!(store.get("/k").await.unwrap().unwrap().value, b"1");

    // The files now hold a certificate the server refuses: the working connection made with
    // the old ones is given up for one made with the new files, so the call fails.
    install(&foreign, "client", dir.path());
    assert!(store.get("/k").await.is_err());
    assert!(store.get("/k").await.is_err(), "and keeps failing");

    // Renewed by the trusted CA: calls succeed again, on the same store.
    install(trusted, "renewed", dir.path());
    assert_eq!(store.get("/k").await.unwrap().unwrap().value, b"1");
}
