//! CRUD, metadata, errors, patches, selectors, pagination and namespaces through kube-rs.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;

use common::{api_err, create_ns, eventually, in_new_namespace, says, start};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Service};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use serde_json::json;

fn cm(name: &str, labels: &[(&str, &str)]) -> ConfigMap {
    serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "labels": labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>(),
        },
        "data": {"k": "v"},
    }))
    .unwrap()
}

#[tokio::test]
async fn crud_roundtrip_and_metadata() {
    let sim = start().await;
    let client = sim.client();
    let api: Api<ConfigMap> = in_new_namespace(&client, "app").await;
    let created = api
        .create(&PostParams::default(), &cm("one", &[]))
        .await
        .unwrap();
    let meta = &created.metadata;
    assert_eq!(meta.namespace.as_deref(), Some("app"));
    assert!(meta.uid.as_ref().is_some_and(|u| u.len() == 36));
    assert!(meta.creation_timestamp.is_some());
    let rv1: u64 = meta.resource_version.as_ref().unwrap().parse().unwrap();

    let got = api.get("one").await.unwrap();
    assert_eq!(got.metadata.uid, created.metadata.uid);
    assert_eq!(got.data.unwrap()["k"], "v");

    // PUT without resourceVersion is unconditional; the global version increases.
    let mut upd = cm("one", &[("a", "b")]);
    upd.metadata.resource_version = None;
    let replaced = api
        .replace("one", &PostParams::default(), &upd)
        .await
        .unwrap();
    let rv2: u64 = replaced
        .metadata
        .resource_version
        .as_ref()
        .unwrap()
        .parse()
        .unwrap();
    assert!(rv2 > rv1);
    assert_eq!(
        replaced.metadata.uid, created.metadata.uid,
        "uid survives updates"
    );

    // PUT with a stale resourceVersion is a 409 Conflict.
    let mut stale = cm("one", &[]);
    stale.metadata.resource_version = Some(rv1.to_string());
    let e = api_err(api.replace("one", &PostParams::default(), &stale).await);
    assert_eq!((e.code, e.reason.as_str()), (409, "Conflict"));
    says(&e, "the object has been modified");

    // PUT with the current resourceVersion works.
    let mut fresh = cm("one", &[("c", "d")]);
    fresh.metadata.resource_version = Some(rv2.to_string());
    api.replace("one", &PostParams::default(), &fresh)
        .await
        .unwrap();

    // A no-op update keeps the resourceVersion.
    let current = api.get("one").await.unwrap();
    let again = api
        .replace("one", &PostParams::default(), &current)
        .await
        .unwrap();
    assert_eq!(
        again.metadata.resource_version,
        current.metadata.resource_version
    );

    let list = api.list(&ListParams::default()).await.unwrap();
    assert_eq!(list.items.len(), 1);
    let list_rv: u64 = list.metadata.resource_version.unwrap().parse().unwrap();
    assert!(list_rv >= rv2);

    api.delete("one", &DeleteParams::default()).await.unwrap();
    let e = api_err(api.get("one").await);
    assert_eq!((e.code, e.reason.as_str()), (404, "NotFound"));
    assert_eq!(e.message, "configmaps \"one\" not found");
    let d = e.details.unwrap();
    assert_eq!((d.name.as_str(), d.kind.as_str()), ("one", "configmaps"));
    sim.shutdown().await;
}

#[tokio::test]
async fn generate_name_and_namespace_label() {
    let sim = start().await;
    let client = sim.client();
    let ns_api: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace =
        serde_json::from_value(json!({"metadata": {"generateName": "gen-"}})).unwrap();
    let created = ns_api.create(&PostParams::default(), &ns).await.unwrap();
    let name = created.metadata.name.clone().unwrap();
    assert!(name.starts_with("gen-") && name.len() == 9, "{name}");
    assert_eq!(
        created.metadata.labels.unwrap()["kubernetes.io/metadata.name"],
        name
    );
    assert_eq!(created.status.unwrap().phase.as_deref(), Some("Active"));
    assert_eq!(
        created.spec.unwrap().finalizers.unwrap(),
        vec!["kubernetes"]
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn error_statuses() {
    let sim = start().await;
    let client = sim.client();
    let api: Api<ConfigMap> = in_new_namespace(&client, "app").await;
    api.create(&PostParams::default(), &cm("dup", &[]))
        .await
        .unwrap();

    let e = api_err(api.create(&PostParams::default(), &cm("dup", &[])).await);
    assert_eq!((e.code, e.reason.as_str()), (409, "AlreadyExists"));
    assert_eq!(e.message, "configmaps \"dup\" already exists");

    let e = api_err(
        api.create(&PostParams::default(), &cm("Bad_Name", &[]))
            .await,
    );
    assert_eq!((e.code, e.reason.as_str()), (422, "Invalid"));
    let d = e.details.unwrap();
    assert_eq!(d.kind, "ConfigMap");
    assert_eq!(d.causes[0].field, "metadata.name");

    let e = api_err(api.create(&PostParams::default(), &cm("", &[])).await);
    assert_eq!((e.code, e.reason.as_str()), (422, "Invalid"));
    says(&e, "name or generateName is required");

    // Service without ports: missing required field.
    let svc_api: Api<Service> = Api::namespaced(client.clone(), "app");
    let svc: Service =
        serde_json::from_value(json!({"metadata": {"name": "noports"}, "spec": {}})).unwrap();
    let e = api_err(svc_api.create(&PostParams::default(), &svc).await);
    assert_eq!((e.code, e.reason.as_str()), (422, "Invalid"));
    says(&e, "spec.ports: Required value");

    // Namespaced create in a missing namespace: 404 for the namespace.
    let missing: Api<ConfigMap> = Api::namespaced(client.clone(), "nowhere");
    let e = api_err(missing.create(&PostParams::default(), &cm("x", &[])).await);
    assert_eq!((e.code, e.reason.as_str()), (404, "NotFound"));
    assert_eq!(e.message, "namespaces \"nowhere\" not found");
    assert_eq!(e.details.unwrap().kind, "namespaces");

    // Update and patch of a missing object.
    let e = api_err(
        api.replace("ghost", &PostParams::default(), &cm("ghost", &[]))
            .await,
    );
    assert_eq!(e.code, 404);
    let e = api_err(
        api.patch(
            "ghost",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {}})),
        )
        .await,
    );
    assert_eq!(e.code, 404);
    let e = api_err(api.delete("ghost", &DeleteParams::default()).await);
    assert_eq!(e.code, 404);

    // Body/URL name mismatch.
    let e = api_err(
        api.replace("dup", &PostParams::default(), &cm("other", &[]))
            .await,
    );
    assert_eq!((e.code, e.reason.as_str()), (400, "BadRequest"));
    sim.shutdown().await;
}

#[tokio::test]
async fn namespace_termination_removes_contents() {
    let sim = start().await;
    let client = sim.client();
    let api: Api<ConfigMap> = in_new_namespace(&client, "doomed").await;
    api.create(&PostParams::default(), &cm("a", &[]))
        .await
        .unwrap();
    let svc_api: Api<Service> = Api::namespaced(client.clone(), "doomed");
    let svc: Service = serde_json::from_value(
        json!({"metadata": {"name": "s"}, "spec": {"ports": [{"port": 80}]}}),
    )
    .unwrap();
    let svc = svc_api.create(&PostParams::default(), &svc).await.unwrap();
    let ip = svc.spec.unwrap().cluster_ip.unwrap();
    assert!(
        sim.backdoor()
            .get("ipaddresses", "", &ip)
            .unwrap()
            .is_some()
    );

    let ns_api: Api<Namespace> = Api::all(client.clone());
    let deleted = ns_api
        .delete("doomed", &DeleteParams::default())
        .await
        .unwrap();
    let ns = deleted
        .left()
        .expect("namespace returned while terminating");
    assert!(ns.metadata.deletion_timestamp.is_some());
    assert_eq!(ns.status.unwrap().phase.as_deref(), Some("Terminating"));

    // While terminating: creates are forbidden with 403.
    let e = api_err(api.create(&PostParams::default(), &cm("late", &[])).await);
    assert_eq!((e.code, e.reason.as_str()), (403, "Forbidden"));
    says(&e, "because it is being terminated");

    eventually("namespace gone", || async {
        matches!(ns_api.get("doomed").await, Err(kube::Error::Api(e)) if e.code == 404)
    })
    .await;
    assert!(
        sim.backdoor()
            .get("configmaps", "doomed", "a")
            .unwrap()
            .is_none()
    );
    assert!(
        sim.backdoor()
            .get("services", "doomed", "s")
            .unwrap()
            .is_none()
    );
    assert!(
        sim.backdoor()
            .get("ipaddresses", "", &ip)
            .unwrap()
            .is_none(),
        "the Service's IP is released with the namespace"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn patch_types() {
    let sim = start().await;
    let client = sim.client();
    let api: Api<ConfigMap> = in_new_namespace(&client, "app").await;
    api.create(&PostParams::default(), &cm("p", &[("keep", "1")]))
        .await
        .unwrap();
    let pp = PatchParams::default();

    let merged = api
        .patch(
            "p",
            &pp,
            &Patch::Merge(
                json!({"metadata": {"labels": {"m": "1"}}, "data": {"k": null, "n": "2"}}),
            ),
        )
        .await
        .unwrap();
    let labels = merged.metadata.labels.clone().unwrap();
    assert_eq!((labels["keep"].as_str(), labels["m"].as_str()), ("1", "1"));
    let data = merged.data.clone().unwrap();
    assert!(!data.contains_key("k"));
    assert_eq!(data["n"], "2");

    let jp: json_patch::Patch = serde_json::from_value(json!([
        {"op": "add", "path": "/data/j", "value": "3"},
        {"op": "remove", "path": "/metadata/labels/keep"},
    ]))
    .unwrap();
    let patched = api.patch("p", &pp, &Patch::<()>::Json(jp)).await.unwrap();
    assert_eq!(patched.data.unwrap()["j"], "3");
    assert!(!patched.metadata.labels.unwrap().contains_key("keep"));

    let sm = api
        .patch("p", &pp, &Patch::Strategic(json!({"data": {"s": "4"}})))
        .await
        .unwrap();
    assert_eq!(sm.data.unwrap()["s"], "4");

    // A patch carrying a stale resourceVersion is a conflict.
    let e = api_err(
        api.patch(
            "p",
            &pp,
            &Patch::Merge(json!({"metadata": {"resourceVersion": "1"}, "data": {"x": "y"}})),
        )
        .await,
    );
    assert_eq!((e.code, e.reason.as_str()), (409, "Conflict"));

    // Server-side apply creates and then updates.
    let apply = PatchParams::apply("test").force();
    let applied = api
        .patch("applied", &apply, &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "applied"}, "data": {"a": "1"}})))
        .await
        .unwrap();
    assert_eq!(applied.data.unwrap()["a"], "1");
    sim.shutdown().await;
}

#[tokio::test]
async fn delete_preconditions() {
    let sim = start().await;
    let client = sim.client();
    let api: Api<ConfigMap> = in_new_namespace(&client, "app").await;
    let c = api
        .create(&PostParams::default(), &cm("pre", &[]))
        .await
        .unwrap();
    let stale = DeleteParams {
        preconditions: Some(Preconditions {
            resource_version: Some("1".into()),
            uid: None,
        }),
        ..DeleteParams::default()
    };
    let e = api_err(api.delete("pre", &stale).await);
    assert_eq!((e.code, e.reason.as_str()), (409, "Conflict"));
    says(&e, "Precondition failed");
    let wrong_uid = DeleteParams {
        preconditions: Some(Preconditions {
            resource_version: None,
            uid: Some("00000000-0000-0000-0000-000000000000".into()),
        }),
        ..DeleteParams::default()
    };
    assert_eq!(api_err(api.delete("pre", &wrong_uid).await).code, 409);
    let right = DeleteParams {
        preconditions: Some(Preconditions {
            resource_version: c.metadata.resource_version.clone(),
            uid: c.metadata.uid.clone(),
        }),
        ..DeleteParams::default()
    };
    api.delete("pre", &right).await.unwrap();
    assert_eq!(api_err(api.get("pre").await).code, 404);
    sim.shutdown().await;
}

#[tokio::test]
async fn finalizers_hold_deletion() {
    let sim = start().await;
    let client = sim.client();
    let api: Api<ConfigMap> = in_new_namespace(&client, "app").await;
    let mut c = cm("fin", &[]);
    c.metadata.finalizers = Some(vec!["example.com/hold".into()]);
    api.create(&PostParams::default(), &c).await.unwrap();
    api.delete("fin", &DeleteParams::default()).await.unwrap();
    let held = api.get("fin").await.unwrap();
    assert!(held.metadata.deletion_timestamp.is_some());
    api.patch(
        "fin",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    assert_eq!(api_err(api.get("fin").await).code, 404);
    sim.shutdown().await;
}

#[tokio::test]
async fn selectors_and_pagination() {
    let sim = start().await;
    let client = sim.client();
    create_ns(&client, "a").await;
    create_ns(&client, "b").await;
    for ns in ["a", "b"] {
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
        for i in 0..12 {
            let tier = if i % 3 == 0 { "front" } else { "back" };
            let mut labels = vec![("tier", tier)];
            if i % 2 == 0 {
                labels.push(("even", "yes"));
            }
            api.create(&PostParams::default(), &cm(&format!("cm-{i:02}"), &labels))
                .await
                .unwrap();
        }
    }
    let all: Api<ConfigMap> = Api::all(client.clone());
    let names = |l: kube::core::ObjectList<ConfigMap>| -> Vec<String> {
        l.items
            .into_iter()
            .map(|c| {
                format!(
                    "{}/{}",
                    c.metadata.namespace.unwrap(),
                    c.metadata.name.unwrap()
                )
            })
            .collect()
    };
    let count = |sel: &'static str| {
        let all = all.clone();
        async move {
            all.list(&ListParams::default().labels(sel))
                .await
                .unwrap()
                .items
                .len()
        }
    };
    assert_eq!(count("tier=front").await, 8);
    assert_eq!(count("tier!=front").await, 16);
    assert_eq!(count("tier in (front,back)").await, 24);
    assert_eq!(count("tier notin (front)").await, 16);
    assert_eq!(count("even").await, 12);
    assert_eq!(count("!even").await, 12);
    assert_eq!(count("even,tier=front").await, 4);

    let by_name = all
        .list(&ListParams::default().fields("metadata.name=cm-03"))
        .await
        .unwrap();
    assert_eq!(names(by_name), vec!["a/cm-03", "b/cm-03"]);
    let by_ns = all
        .list(&ListParams::default().fields("metadata.namespace=b,metadata.name!=cm-00"))
        .await
        .unwrap();
    assert_eq!(by_ns.items.len(), 11);

    // limit/continue across namespaces, stable order, no duplicates.
    let mut seen = Vec::new();
    let mut params = ListParams::default().limit(5);
    let mut pages = 0;
    let mut first_rv = None;
    loop {
        let page = all.list(&params).await.unwrap();
        pages += 1;
        let rv = page.metadata.resource_version.clone();
        if first_rv.is_none() {
            first_rv = rv.clone();
        }
        // 24 objects in pages of 5: 19, 14, 9, 4 left after the first four; none on the last.
        let expected_remaining = (pages < 5).then(|| 24 - 5 * pages);
        assert_eq!(
            page.metadata.remaining_item_count, expected_remaining,
            "remainingItemCount on page {pages}"
        );
        assert_eq!(
            rv, first_rv,
            "every page reports the first page's resourceVersion"
        );
        let cont = page.metadata.continue_.clone();
        seen.extend(names(page));
        match cont {
            Some(c) if !c.is_empty() => params = ListParams::default().limit(5).continue_token(&c),
            _ => break,
        }
    }
    assert_eq!(pages, 5);
    assert_eq!(seen.len(), 24);
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), 24);
    // Namespaced list only sees its namespace, and counts only what is left of it.
    let a: Api<ConfigMap> = Api::namespaced(client.clone(), "a");
    assert_eq!(
        a.list(&ListParams::default()).await.unwrap().items.len(),
        12
    );
    let first = a.list(&ListParams::default().limit(5)).await.unwrap();
    assert_eq!(first.metadata.remaining_item_count, Some(7));
    let second = a
        .list(
            &ListParams::default()
                .limit(5)
                .continue_token(first.metadata.continue_.as_deref().unwrap()),
        )
        .await
        .unwrap();
    assert_eq!(second.metadata.remaining_item_count, Some(2));
    // Selective lists carry no count, as kube-apiserver's.
    let selective = all
        .list(&ListParams::default().labels("even").limit(5))
        .await
        .unwrap();
    assert!(selective.metadata.continue_.is_some());
    assert_eq!(selective.metadata.remaining_item_count, None);
    sim.shutdown().await;
}

#[tokio::test]
async fn other_resources_roundtrip_typed() {
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    use k8s_openapi::api::events::v1::Event as EventV1;
    use k8s_openapi::api::networking::v1::ServiceCIDR;
    let sim = start().await;
    let client = sim.client();
    let leases: Api<Lease> = in_new_namespace(&client, "kube-system").await;
    let lease: Lease = serde_json::from_value(json!({
        "metadata": {"name": "leader"},
        "spec": {"holderIdentity": "me", "leaseDurationSeconds": 15}
    }))
    .unwrap();
    let l = leases.create(&PostParams::default(), &lease).await.unwrap();
    assert_eq!(l.spec.unwrap().holder_identity.as_deref(), Some("me"));

    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "kube-system");
    let es: EndpointSlice = serde_json::from_value(json!({
        "metadata": {"name": "kubernetes", "labels": {"kubernetes.io/service-name": "kubernetes"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["192.0.2.1"]}],
        "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}]
    }))
    .unwrap();
    slices.create(&PostParams::default(), &es).await.unwrap();
    assert_eq!(
        slices
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        1
    );

    let events: Api<EventV1> = Api::namespaced(client.clone(), "kube-system");
    let ev: EventV1 = serde_json::from_value(json!({
        "metadata": {"generateName": "x."},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "reason": "Test", "action": "Testing", "type": "Normal",
        "reportingController": "test", "reportingInstance": "test-1",
        "note": "hello"
    }))
    .unwrap();
    events.create(&PostParams::default(), &ev).await.unwrap();
    assert_eq!(
        events
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        1
    );

    // ServiceCIDR and its status subresource.
    let cidrs: Api<ServiceCIDR> = Api::all(client.clone());
    let sc: ServiceCIDR = serde_json::from_value(json!({
        "metadata": {"name": "kubernetes"}, "spec": {"cidrs": ["10.96.0.0/12"]}
    }))
    .unwrap();
    cidrs.create(&PostParams::default(), &sc).await.unwrap();
    let status = json!({"status": {"conditions": [{
        "type": "Ready", "status": "True", "reason": "", "message": "Kubernetes default Service CIDR is ready",
        "lastTransitionTime": "2026-01-01T00:00:00Z"
    }]}});
    let with_status = cidrs
        .patch_status("kubernetes", &PatchParams::default(), &Patch::Merge(status))
        .await
        .unwrap();
    assert_eq!(
        with_status.status.unwrap().conditions.unwrap()[0].type_,
        "Ready"
    );
    // A main-resource write cannot change status.
    let cleared = cidrs
        .patch(
            "kubernetes",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": null, "metadata": {"labels": {"x": "y"}}})),
        )
        .await
        .unwrap();
    assert!(cleared.status.unwrap().conditions.is_some());
    let bad: ServiceCIDR =
        serde_json::from_value(json!({"metadata": {"name": "bad"}, "spec": {"cidrs": ["nope"]}}))
            .unwrap();
    assert_eq!(
        api_err(cidrs.create(&PostParams::default(), &bad).await).code,
        422
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn discovery_version_and_health() {
    let sim = start().await;
    let client = sim.client();
    let v = client.apiserver_version().await.unwrap();
    assert_eq!(v.major, "1");
    let discovery = kube::discovery::Discovery::new(client.clone())
        .run()
        .await
        .unwrap();
    let mut found = Vec::new();
    for group in discovery.groups() {
        for (ar, _caps) in group.recommended_resources() {
            found.push(format!("{}/{}", ar.group, ar.plural));
        }
    }
    for want in [
        "/namespaces",
        "/services",
        "/endpoints",
        "/events",
        "/configmaps",
        "coordination.k8s.io/leases",
        "discovery.k8s.io/endpointslices",
        "networking.k8s.io/ipaddresses",
        "networking.k8s.io/servicecidrs",
        "events.k8s.io/events",
    ] {
        assert!(
            found.iter().any(|f| f == want),
            "{want} missing from {found:?}"
        );
    }
    let get = |p: &'static str| {
        let client = client.clone();
        async move {
            let req = hyper::Request::get(p).body(Vec::new()).unwrap();
            client.request_text(req).await
        }
    };
    assert_eq!(get("/livez").await.unwrap(), "ok");
    assert_eq!(get("/healthz").await.unwrap(), "ok");
    assert_eq!(get("/readyz").await.unwrap(), "ok");
    sim.set_ready(false);
    assert!(get("/readyz").await.is_err(), "readyz fails when not ready");
    sim.set_ready(true);
    assert_eq!(get("/readyz").await.unwrap(), "ok");
    sim.shutdown().await;
}

/// Sends each `(method, path, content type, body, status)` with `raw`: the status must be the
/// one answered.
async fn answers(client: &kube::Client, requests: &[(&str, &str, &str, &str, u16)]) {
    for &(method, path, content_type, body, want) in requests {
        let (code, msg) = raw(client, method, path, content_type, body).await;
        assert_eq!(code, want, "{method} {path} {content_type} {body:?}: {msg}");
    }
}

async fn raw(
    client: &kube::Client,
    method: &str,
    path: &str,
    ct: &str,
    body: &str,
) -> (u16, String) {
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", ct)
        .body(body.as_bytes().to_vec())
        .unwrap();
    match client.request_text(req).await {
        Ok(text) => (200, text),
        Err(kube::Error::Api(s)) => (s.code, s.message),
        Err(e) => panic!("transport error (the server must answer, not crash): {e}"),
    }
}

#[tokio::test]
async fn hostile_requests_get_clear_errors() {
    let sim = start().await;
    let client = sim.client();
    create_ns(&client, "h").await;
    let j = "application/json";
    let configmaps = "/api/v1/namespaces/h/configmaps";
    answers(
        &client,
        &[
            ("GET", "/api/v1/namespaces?limit=abc", j, "", 400),
            (
                "GET",
                "/api/v1/namespaces?labelSelector=a%20b%20c",
                j,
                "",
                400,
            ),
            (
                "GET",
                "/api/v1/namespaces?fieldSelector=nonsense",
                j,
                "",
                400,
            ),
            ("GET", "/api/v1/namespaces?continue=%25%25", j, "", 400),
            ("POST", configmaps, j, "{not json", 400),
            ("POST", configmaps, j, "[1,2]", 400),
            (
                "POST",
                configmaps,
                j,
                r#"{"kind":"Secret","metadata":{"name":"x"}}"#,
                400,
            ),
            ("POST", configmaps, "application/yaml", "a: b", 415),
            ("GET", "/api/v1/nothing", j, "", 404),
            ("GET", "/apis/nope.io/v1", j, "", 404),
            ("POST", "/api/v1/services", j, "{}", 405),
            ("GET", "/api/v1/namespaces/h/configmaps/x/bogus", j, "", 404),
        ],
    )
    .await;
    raw(
        &client,
        "POST",
        configmaps,
        j,
        r#"{"metadata":{"name":"p"}}"#,
    )
    .await;
    answers(
        &client,
        &[
            (
                "PATCH",
                "/api/v1/namespaces/h/configmaps/p",
                "text/plain",
                "{}",
                415,
            ),
            (
                "PATCH",
                "/api/v1/namespaces/h/configmaps/p",
                "application/merge-patch+json",
                "[]",
                400,
            ),
        ],
    )
    .await;
    let (code, _) = raw(
        &client,
        "PATCH",
        "/api/v1/namespaces/h/configmaps/p",
        "application/json-patch+json",
        r#"[{"op":"test","path":"/data/x","value":"1"}]"#,
    )
    .await;
    assert_eq!(code, 422);
    // Absurd numbers are clamped, not fatal (the fault ends the stream so the body completes).
    sim.faults().inject(apiserver_sim::FaultRule::next(
        Some(apiserver_sim::Verb::Watch),
        None,
        1,
        apiserver_sim::FaultKind::CutWatchAfter { millis: 200 },
    ));
    let (code, _) = raw(
        &client,
        "GET",
        "/api/v1/namespaces/h/configmaps?watch=1&timeoutSeconds=18446744073709551615&resourceVersion=1&allowWatchBookmarks=true",
        j,
        "",
    )
    .await;
    assert_eq!(code, 200);

    // Hostile stored objects (through the backdoor) do not break later API calls.
    sim.backdoor()
        .put(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "weird", "namespace": "h", "labels": "not-a-map"},
            "spec": {"type": 5, "clusterIPs": [1, null], "ports": [{"nodePort": "x"}, "junk"], "healthCheckNodePort": 99999}
        }))
        .unwrap();
    let svc: Api<Service> = Api::namespaced(client.clone(), "h");
    let (code, _) = raw(&client, "GET", "/api/v1/namespaces/h/services", j, "").await;
    assert_eq!(code, 200);
    let (code, _) = raw(
        &client,
        "PATCH",
        "/api/v1/namespaces/h/services/weird",
        "application/merge-patch+json",
        r#"{"metadata":{"annotations":{"a":"b"}}}"#,
    )
    .await;
    assert!(code == 200 || code == 422, "{code}");
    let (code, _) = raw(
        &client,
        "DELETE",
        "/api/v1/namespaces/h/services/weird",
        j,
        "",
    )
    .await;
    assert_eq!(code, 200);
    assert!(svc.get_opt("weird").await.unwrap().is_none());
    assert!(
        sim.backdoor()
            .get("services", "h", "weird")
            .unwrap()
            .is_none()
    );
    sim.shutdown().await;
}

/// Server-side apply conflicts: what leader-election libraries use for mutual exclusion.
#[tokio::test]
async fn apply_conflicts_between_field_managers() {
    let sim = start().await;
    let client = sim.client();
    let leases: Api<Lease> = in_new_namespace(&client, "kube-system").await;
    let lease = |holder: &str| {
        Patch::Apply(json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "lock"},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15}
        }))
    };
    let apply = |holder: &str| {
        let (leases, lease) = (leases.clone(), lease(holder));
        let manager = format!("candidate-{holder}");
        async move {
            leases
                .patch("lock", &PatchParams::apply(&manager), &lease)
                .await
        }
    };
    let created = apply("a").await.unwrap();
    assert_eq!(created.spec.unwrap().holder_identity.as_deref(), Some("a"));
    // The same manager may change its own fields; another manager may re-apply equal values.
    apply("a").await.unwrap();
    let e = api_err(apply("b").await);
    assert_eq!((e.code, e.reason.as_str()), (409, "Conflict"));
    assert!(
        e.message.contains("conflict with \"candidate-a\"")
            && e.message.contains(".spec.holderIdentity"),
        "{}",
        e.message
    );
    assert_eq!(
        leases
            .get("lock")
            .await
            .unwrap()
            .spec
            .unwrap()
            .holder_identity
            .as_deref(),
        Some("a")
    );
    // force takes the field over.
    leases
        .patch(
            "lock",
            &PatchParams::apply("candidate-b").force(),
            &lease("b"),
        )
        .await
        .unwrap();
    let e = api_err(apply("a").await);
    says(&e, "conflict with \"candidate-b\"");
    // A non-apply write moves ownership to its field manager.
    let pp = PatchParams {
        field_manager: Some("renewer".into()),
        ..PatchParams::default()
    };
    leases
        .patch(
            "lock",
            &pp,
            &Patch::Strategic(json!({"spec": {"holderIdentity": "c"}})),
        )
        .await
        .unwrap();
    let e = api_err(apply("b").await);
    says(&e, "conflict with \"renewer\"");
    // Apply without a field manager is rejected as upstream does.
    let req = hyper::Request::builder()
        .method("PATCH")
        .uri("/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/lock")
        .header("content-type", "application/apply-patch+yaml")
        .body(b"spec: {holderIdentity: z}".to_vec())
        .unwrap();
    match client.request_text(req).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 422);
            says(&s, "fieldManager: Required value");
        }
        other => panic!("expected 422, got {other:?}"),
    }
    sim.shutdown().await;
}

/// kube-apiserver rejects endpoints no client could reach (loopback, link-local, unspecified).
#[tokio::test]
async fn endpoint_addresses_are_validated() {
    use k8s_openapi::api::core::v1::Endpoints;
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    let sim = start().await;
    let client = sim.client();
    let eps: Api<Endpoints> = in_new_namespace(&client, "default").await;
    let ep = |ip: &str| -> Endpoints {
        serde_json::from_value(json!({
            "metadata": {"name": "kubernetes"},
            "subsets": [{"addresses": [{"ip": ip}], "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}]}]
        }))
        .unwrap()
    };
    for bad in ["127.0.0.1", "169.254.1.1", "0.0.0.0", "::1", "not-an-ip"] {
        let e = api_err(eps.create(&PostParams::default(), &ep(bad)).await);
        assert_eq!((e.code, e.reason.as_str()), (422, "Invalid"), "{bad}");
        says(&e, "subsets[0].addresses[0].ip");
    }
    let e = api_err(eps.create(&PostParams::default(), &ep("127.0.0.1")).await);
    says(&e, "may not be in the loopback range");
    eps.create(&PostParams::default(), &ep("192.0.2.10"))
        .await
        .unwrap();

    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    let slice = |name: &str, ip: &str| -> EndpointSlice {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [ip]}],
            "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}]
        }))
        .unwrap()
    };
    let e = api_err(
        slices
            .create(&PostParams::default(), &slice("a", "127.0.0.1"))
            .await,
    );
    says(&e, "endpoints[0].addresses[0]");
    let e = api_err(
        slices
            .create(&PostParams::default(), &slice("b", "2001:db8::1"))
            .await,
    );
    says(&e, "must be a valid IPv4 address");
    slices
        .create(&PostParams::default(), &slice("c", "192.0.2.10"))
        .await
        .unwrap();
    sim.shutdown().await;
}

#[tokio::test]
async fn labels_and_annotations_are_validated() {
    let sim = start().await;
    let client = sim.client();
    let api: Api<ConfigMap> = in_new_namespace(&client, "l").await;
    let e = api_err(
        api.create(&PostParams::default(), &cm("a", &[("bad key!", "v")]))
            .await,
    );
    assert_eq!((e.code, e.reason.as_str()), (422, "Invalid"));
    says(&e, "metadata.labels");
    let e = api_err(
        api.create(&PostParams::default(), &cm("b", &[("k", "bad value!")]))
            .await,
    );
    says(&e, "a valid label must be");
    let long = "x".repeat(64);
    let e = api_err(
        api.create(&PostParams::default(), &cm("c", &[("k", long.as_str())]))
            .await,
    );
    says(&e, "no more than 63");
    api.create(
        &PostParams::default(),
        &cm("ok", &[("app.kubernetes.io/name", "web"), ("empty", "")]),
    )
    .await
    .unwrap();
    // Dry-run delete (in the DeleteOptions body) deletes nothing.
    api.delete(
        "ok",
        &DeleteParams {
            dry_run: true,
            ..DeleteParams::default()
        },
    )
    .await
    .unwrap();
    assert!(api.get_opt("ok").await.unwrap().is_some());
    sim.shutdown().await;
}

#[tokio::test]
async fn system_namespaces_can_be_protected_like_namespace_lifecycle() {
    let sim = common::start_with(apiserver_sim::SimConfig {
        protect_system_namespaces: true,
        seed_namespaces: vec![
            "default".into(),
            "kube-public".into(),
            "kube-node-lease".into(),
        ],
        ..common::fast_config()
    })
    .await;
    let nss: Api<Namespace> = Api::all(sim.client());
    let e = api_err(nss.delete("kube-public", &DeleteParams::default()).await);
    assert_eq!((e.code, e.reason.as_str()), (403, "Forbidden"));
    assert_eq!(
        e.message,
        "namespaces \"kube-public\" is forbidden: this namespace may not be deleted"
    );
    assert_eq!(
        api_err(nss.delete("default", &DeleteParams::default()).await).code,
        403
    );
    // kube-node-lease is not immortal upstream either.
    nss.delete("kube-node-lease", &DeleteParams::default())
        .await
        .unwrap();
    // The backdoor still can (an etcd restore or a disabled admission plugin).
    sim.backdoor()
        .delete("namespaces", "", "kube-public")
        .unwrap()
        .unwrap();
    sim.shutdown().await;
}

/// Optimistic concurrency under contention: every successful read-modify-write is counted
/// exactly once; the losers get 409 Conflict and retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_updates_never_lose_a_write() {
    let sim = start().await;
    let client = sim.client();
    let api: Api<ConfigMap> = in_new_namespace(&client, "c").await;
    let mut counter = cm("counter", &[]);
    counter.data = Some(BTreeMap::from([("n".to_string(), "0".to_string())]));
    api.create(&PostParams::default(), &counter).await.unwrap();
    let workers = 8;
    let per_worker = 10;
    let mut tasks = Vec::new();
    for _ in 0..workers {
        let api = api.clone();
        tasks.push(tokio::spawn(async move {
            let mut conflicts = 0;
            let mut done = 0;
            while done < per_worker {
                let mut cur = api.get("counter").await.unwrap();
                let n: u64 = cur.data.as_ref().unwrap()["n"].parse().unwrap();
                cur.data
                    .as_mut()
                    .unwrap()
                    .insert("n".into(), (n + 1).to_string());
                match api.replace("counter", &PostParams::default(), &cur).await {
                    Ok(_) => done += 1,
                    Err(kube::Error::Api(e)) if e.code == 409 => conflicts += 1,
                    Err(e) => panic!("unexpected error: {e}"),
                }
            }
            conflicts
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let n: u64 = api.get("counter").await.unwrap().data.unwrap()["n"]
        .parse()
        .unwrap();
    assert_eq!(n, workers * per_worker);
    sim.shutdown().await;
}

/// events.k8s.io/v1 and core/v1 Events are one store, as in kube-apiserver.
#[tokio::test]
async fn events_are_shared_between_the_two_apis() {
    use futures::StreamExt;
    use k8s_openapi::api::core::v1::Event as CoreEvent;
    use k8s_openapi::api::events::v1::Event as EventV1;
    use kube::api::{WatchEvent, WatchParams};
    let sim = start().await;
    let client = sim.client();
    let v1: Api<EventV1> = in_new_namespace(&client, "default").await;
    let core: Api<CoreEvent> = Api::namespaced(client.clone(), "default");
    let rv = sim.resource_version().to_string();
    let mut core_watch = core
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    let mut v1_watch = v1
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    let ev: EventV1 = serde_json::from_value(json!({
        "metadata": {"name": "kubernetes.1"},
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "regarding": {"kind": "Service", "namespace": "default", "name": "kubernetes"},
        "reason": "ClusterIPNotAllocated", "action": "ClusterIPAllocation", "type": "Warning",
        "note": "Cluster IP [IPv4]: 10.96.0.1 is not allocated; repairing",
        "reportingController": "ipallocator-repair-controller", "reportingInstance": "x"
    }))
    .unwrap();
    let created = v1.create(&PostParams::default(), &ev).await.unwrap();
    assert_eq!(created.note.as_deref(), ev.note.as_deref());
    let as_core = core.get("kubernetes.1").await.unwrap();
    assert_eq!(as_core.message.as_deref(), ev.note.as_deref());
    assert_eq!(as_core.involved_object.name.as_deref(), Some("kubernetes"));
    assert_eq!(
        as_core.reporting_component.as_deref(),
        Some("ipallocator-repair-controller")
    );
    match tokio::time::timeout(std::time::Duration::from_secs(20), core_watch.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
    {
        WatchEvent::Added(e) => assert_eq!(e.reason.as_deref(), Some("ClusterIPNotAllocated")),
        other => panic!("expected ADDED, got {other:?}"),
    }
    match tokio::time::timeout(std::time::Duration::from_secs(20), v1_watch.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
    {
        WatchEvent::Added(e) => assert_eq!(e.note.as_deref(), ev.note.as_deref()),
        other => panic!("expected ADDED, got {other:?}"),
    }
    // A merge patch through events.k8s.io (what kube-runtime's Recorder sends for a series).
    let patched = v1
        .patch(
            "kubernetes.1",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"series": {"count": 2, "lastObservedTime": "2026-01-01T00:01:00.000000Z"}}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(patched.series.unwrap().count, 2);
    assert_eq!(
        core.get("kubernetes.1")
            .await
            .unwrap()
            .series
            .unwrap()
            .count,
        Some(2)
    );
    assert_eq!(
        v1.list(&ListParams::default()).await.unwrap().items.len(),
        1
    );
    let e = api_err(v1.get("missing").await);
    assert_eq!(e.message, "events.events.k8s.io \"missing\" not found");
    v1.delete("kubernetes.1", &DeleteParams::default())
        .await
        .unwrap();
    assert!(core.get_opt("kubernetes.1").await.unwrap().is_none());
    sim.shutdown().await;
}

#[tokio::test]
async fn namespace_with_metadata_finalizers_goes_once_they_are_removed() {
    let sim = start().await;
    let client = sim.client();
    let nss: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({
        "metadata": {"name": "held", "finalizers": ["example.com/hold"]}
    }))
    .unwrap();
    nss.create(&PostParams::default(), &ns).await.unwrap();
    create_ns(&client, "other").await;
    nss.delete("held", &DeleteParams::default()).await.unwrap();
    // Wait until the namespace controller's part is done (spec.finalizers emptied).
    eventually("contents finalized", || async {
        nss.get("held")
            .await
            .unwrap()
            .spec
            .and_then(|s| s.finalizers)
            .is_none_or(|f| f.is_empty())
    })
    .await;
    assert!(
        nss.get_opt("held").await.unwrap().is_some(),
        "held by metadata.finalizers"
    );
    nss.patch(
        "held",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    assert!(nss.get_opt("held").await.unwrap().is_none());
    assert!(nss.get_opt("other").await.unwrap().is_some());
    sim.shutdown().await;
}

/// LIST bodies arrive as kube-apiserver (1.33+, streaming collection encoding, Go's `net/http`)
/// sends them: no Content-Length, in chunks of at most 2 KiB, in JSON and in protobuf alike.
#[tokio::test]
async fn lists_are_streamed_in_small_chunks_without_a_length() {
    use http_body_util::BodyExt;
    let sim = start().await;
    let client = sim.client();
    let cms: Api<ConfigMap> = in_new_namespace(&client, "chunks").await;
    for i in 0..40 {
        let cm = ConfigMap {
            metadata: kube::api::ObjectMeta {
                name: Some(format!("cm-{i}")),
                ..Default::default()
            },
            data: Some(BTreeMap::from([("filler".to_string(), "x".repeat(300))])),
            ..Default::default()
        };
        cms.create(&PostParams::default(), &cm).await.unwrap();
    }
    let svcs: Api<Service> = Api::namespaced(client.clone(), "chunks");
    for i in 0..40 {
        let svc: Service = serde_json::from_value(json!({
            "metadata": {"name": format!("svc-{i}")},
            "spec": {"ports": [{"port": 80}]}
        }))
        .unwrap();
        svcs.create(&PostParams::default(), &svc).await.unwrap();
    }
    for (path, accept, items) in [
        (
            "/api/v1/namespaces/chunks/configmaps",
            "application/json",
            40,
        ),
        (
            "/api/v1/namespaces/chunks/services",
            "application/vnd.kubernetes.protobuf",
            40,
        ),
    ] {
        let req = hyper::Request::builder()
            .uri(path)
            .header("accept", accept)
            .body(kube::client::Body::empty())
            .unwrap();
        let response = client.send(req).await.unwrap();
        assert_eq!(response.status(), 200, "{path}");
        assert!(
            response.headers().get("content-length").is_none(),
            "{path}: a streamed LIST announces no length"
        );
        let mut body = response.into_body();
        let (mut frames, mut received) = (0, Vec::new());
        while let Some(frame) = body.frame().await {
            let data = frame.unwrap().into_data().unwrap();
            assert!(
                data.len() <= 2048,
                "{path}: a frame of {} bytes",
                data.len()
            );
            frames += 1;
            received.extend_from_slice(&data);
        }
        assert!(
            received.len() > 2 * 2048,
            "{path}: {} bytes",
            received.len()
        );
        assert!(
            frames >= received.len().div_ceil(2048),
            "{path}: {frames} frames"
        );
        if accept == "application/json" {
            let list: serde_json::Value = serde_json::from_slice(&received).unwrap();
            assert_eq!(list["items"].as_array().map(Vec::len), Some(items));
        } else {
            // The envelope's magic; the repair's tests decode these bodies in full.
            assert_eq!(&received[..4], b"k8s\0");
        }
    }
    sim.shutdown().await;
}
