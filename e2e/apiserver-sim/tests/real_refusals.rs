//! What a real kube-apiserver refuses that the simulator once accepted through its normal API
//! (found by `e2e/tests/real_admission.rs` against a real control plane), refused the same way:
//! the same field, the same words. The backdoor still stores them.
#![allow(clippy::unwrap_used)]

mod common;

use common::{api_err, create_ns, says, start};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Service;
use kube::Api;
use kube::api::PostParams;
use serde_json::json;

#[tokio::test]
async fn a_lease_that_could_never_expire_is_refused() {
    let sim = start().await;
    let client = sim.client();
    create_ns(&client, "kube-system").await;
    let leases: Api<Lease> = Api::namespaced(client, "kube-system");
    let lease = |name: &str, spec: serde_json::Value| -> Lease {
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap()
    };
    for (seconds, name) in [(-5, "negative"), (0, "zero")] {
        let e = api_err(
            leases
                .create(
                    &PostParams::default(),
                    &lease(
                        name,
                        json!({"holderIdentity": "x", "leaseDurationSeconds": seconds}),
                    ),
                )
                .await,
        );
        assert_eq!((e.code, e.reason.as_str()), (422, "Invalid"), "{seconds}");
        says(
            &e,
            &format!("spec.leaseDurationSeconds: Invalid value: {seconds}: must be greater than 0"),
        );
    }
    let e = api_err(
        leases
            .create(
                &PostParams::default(),
                &lease("transitions", json!({"leaseTransitions": -1})),
            )
            .await,
    );
    says(
        &e,
        "spec.leaseTransitions: Invalid value: -1: must be greater than or equal to 0",
    );
    // An update is judged the same way.
    let mut ok = leases
        .create(
            &PostParams::default(),
            &lease("ok", json!({"leaseDurationSeconds": 15})),
        )
        .await
        .unwrap();
    ok.spec.as_mut().unwrap().lease_duration_seconds = Some(-1);
    let e = api_err(leases.replace("ok", &PostParams::default(), &ok).await);
    assert_eq!(e.code, 422, "{}", e.message);
    // The backdoor stores what the API refuses.
    sim.backdoor()
        .put(
            json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": "everlasting", "namespace": "kube-system"},
                    "spec": {"leaseDurationSeconds": -5}}),
        )
        .unwrap();
}

#[tokio::test]
async fn more_than_two_cluster_ips_are_refused_as_kube_apiserver_says() {
    let sim = start().await;
    let client = sim.client();
    create_ns(&client, "default").await;
    let services: Api<Service> = Api::namespaced(client, "default");
    let service: Service = serde_json::from_value(json!({
        "metadata": {"name": "junk-ips"},
        "spec": {"clusterIP": "10.96.0.50", "clusterIPs": ["10.96.0.50", "zzz", "::1::"],
                 "ports": [{"port": 80}]}
    }))
    .unwrap();
    let e = api_err(services.create(&PostParams::default(), &service).await);
    assert_eq!(e.code, 422);
    // kube-apiserver 1.37's message, field by field.
    for part in [
        r#"spec.clusterIPs[1]: Invalid value: "zzz": must be a valid IP address"#,
        r#"spec.clusterIPs[2]: Invalid value: "::1::": must be a valid IP address"#,
        r#"spec.clusterIPs: Invalid value: ["10.96.0.50","zzz","::1::"]: may only hold up to 2 values"#,
    ] {
        assert!(e.message.contains(part), "{part} not in {}", e.message);
    }
}
