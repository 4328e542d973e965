//! Fault injection, the request log, the backdoor and the `/sim` admin API.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use apiserver_sim::{FaultKind, FaultRule, SimConfig, Trigger, Verb};
use common::{api_err, client_without_retry, fast_config, in_new_namespace, start, start_with};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use kube::Api;
use kube::api::{ListParams, PostParams, WatchEvent, WatchParams};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn cm(name: &str) -> ConfigMap {
    serde_json::from_value(json!({"metadata": {"name": name}})).unwrap()
}

#[tokio::test]
async fn error_faults_parse_as_api_errors() {
    let sim = start().await;
    let client = client_without_retry(&sim, "fault-test/1").await;
    let api: Api<ConfigMap> = in_new_namespace(&client, "f").await;
    let cases = [
        (500, "InternalError"),
        (503, "ServiceUnavailable"),
        (429, "TooManyRequests"),
        (409, "Conflict"),
    ];
    for (code, reason) in cases {
        sim.faults().inject(FaultRule::next(
            Some(Verb::List),
            Some("configmaps"),
            1,
            FaultKind::Error {
                code,
                retry_after_seconds: (code == 429).then_some(1),
            },
        ));
        let e = api_err(api.list(&ListParams::default()).await);
        assert_eq!((e.code, e.reason.as_str()), (code, reason));
        // Spent after one request.
        api.list(&ListParams::default()).await.unwrap();
    }
    // Only the matching verb and resource are affected.
    sim.faults().inject(FaultRule::next(
        Some(Verb::Create),
        Some("services"),
        2,
        FaultKind::Error {
            code: 500,
            retry_after_seconds: None,
        },
    ));
    api.create(&PostParams::default(), &cm("unaffected"))
        .await
        .unwrap();
    assert_eq!(sim.faults().rules().len(), 1);
    sim.faults().clear();
    assert!(sim.faults().rules().is_empty());
    // Probability 1 always fires, probability 0 never.
    sim.faults().inject(FaultRule::probability(
        None,
        Some("configmaps"),
        1.0,
        FaultKind::Error {
            code: 503,
            retry_after_seconds: None,
        },
    ));
    for _ in 0..3 {
        assert_eq!(api_err(api.get("unaffected").await).code, 503);
    }
    sim.faults().clear();
    sim.faults().inject(FaultRule::probability(
        None,
        None,
        0.0,
        FaultKind::Error {
            code: 503,
            retry_after_seconds: None,
        },
    ));
    for _ in 0..3 {
        api.get("unaffected").await.unwrap();
    }
    sim.faults().clear();

    // kube's default client retries a 503 by itself: the caller sees success, the log shows both.
    sim.clear_requests();
    sim.faults().inject(FaultRule::next(
        Some(Verb::Get),
        None,
        1,
        FaultKind::Error {
            code: 503,
            retry_after_seconds: None,
        },
    ));
    let retrying: Api<ConfigMap> = Api::namespaced(sim.client(), "f");
    retrying.get("unaffected").await.unwrap();
    let statuses: Vec<u16> = sim.requests().iter().map(|r| r.status).collect();
    assert_eq!(statuses, vec![503, 200]);
    sim.shutdown().await;
}

/// Raw HTTP/1.1 on a plain-HTTP simulator, to see headers kube::Error does not carry.
async fn raw_get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(
        format!(
            "GET {path} HTTP/1.1\r\nHost: x\r\nUser-Agent: raw-test/1\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

#[tokio::test]
async fn too_many_requests_carries_retry_after() {
    let sim = start_with(SimConfig {
        plain_http: true,
        ..fast_config()
    })
    .await;
    assert!(sim.base_url().starts_with("http://"));
    sim.faults().inject(FaultRule::next(
        None,
        Some("namespaces"),
        1,
        FaultKind::Error {
            code: 429,
            retry_after_seconds: Some(7),
        },
    ));
    let resp = raw_get(sim.addr(), "/api/v1/namespaces").await;
    assert!(resp.starts_with("HTTP/1.1 429"), "{resp}");
    assert!(
        resp.to_ascii_lowercase().contains("retry-after: 7"),
        "{resp}"
    );
    assert!(resp.contains("\"retryAfterSeconds\":7"), "{resp}");
    let records = sim.requests();
    let last = records.last().unwrap();
    assert_eq!(
        (last.verb.as_str(), last.resource.as_str(), last.status),
        ("list", "namespaces", 429)
    );
    assert_eq!(last.user_agent, "raw-test/1");
    sim.shutdown().await;
}

#[tokio::test]
async fn latency_and_dropped_connection() {
    let sim = start().await;
    let client = sim.client();
    let api: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    sim.faults().inject(FaultRule::next(
        Some(Verb::List),
        None,
        1,
        FaultKind::Latency { millis: 300 },
    ));
    let t = Instant::now();
    api.list(&ListParams::default()).await.unwrap();
    assert!(t.elapsed() >= Duration::from_millis(300), "latency applied");

    sim.faults().inject(FaultRule::next(
        Some(Verb::List),
        None,
        1,
        FaultKind::DropConnection,
    ));
    match api.list(&ListParams::default()).await {
        Err(kube::Error::Api(s)) => panic!("a dropped connection is not an API status: {s:?}"),
        Err(_) => {}
        Ok(_) => panic!("the request should fail when the connection drops"),
    }
    // The next request gets a fresh connection and works.
    api.list(&ListParams::default()).await.unwrap();
    let dropped = sim.requests().iter().filter(|r| r.status == 0).count();
    assert_eq!(dropped, 1);
    sim.shutdown().await;
}

#[tokio::test]
async fn watch_faults() {
    let sim = start().await;
    let client = sim.client();
    let api: Api<ConfigMap> = in_new_namespace(&client, "f").await;
    for i in 0..5 {
        api.create(&PostParams::default(), &cm(&format!("c{i}")))
            .await
            .unwrap();
    }
    // Cut after N events: the stream ends after 2 of the 5 initial events.
    sim.faults().inject(FaultRule::next(
        Some(Verb::Watch),
        Some("configmaps"),
        1,
        FaultKind::CutWatchAfterEvents { events: 2 },
    ));
    let events: Vec<_> = tokio::time::timeout(
        Duration::from_secs(20),
        api.watch(&WatchParams::default(), "0")
            .await
            .unwrap()
            .collect::<Vec<_>>(),
    )
    .await
    .expect("stream ends");
    assert_eq!(events.len(), 2);

    // Cut after T: an idle watch ends.
    sim.faults().inject(FaultRule::next(
        Some(Verb::Watch),
        None,
        1,
        FaultKind::CutWatchAfter { millis: 300 },
    ));
    let rv = sim.resource_version().to_string();
    let t = Instant::now();
    let events: Vec<_> = tokio::time::timeout(
        Duration::from_secs(20),
        api.watch(&WatchParams::default().disable_bookmarks(), &rv)
            .await
            .unwrap()
            .collect::<Vec<_>>(),
    )
    .await
    .expect("stream ends");
    assert!(events.is_empty());
    assert!(t.elapsed() >= Duration::from_millis(300));

    // 410 on the next watch, even from a current resourceVersion.
    sim.faults().inject(FaultRule::next(
        Some(Verb::Watch),
        None,
        1,
        FaultKind::WatchGone,
    ));
    let mut s = api
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    match s.next().await.unwrap().unwrap() {
        WatchEvent::Error(e) => assert_eq!((e.code, e.reason.as_str()), (410, "Expired")),
        _ => panic!("expected 410"),
    }
    // Watch-only faults never fire on other verbs.
    sim.faults()
        .inject(FaultRule::next(None, None, 1, FaultKind::WatchGone));
    api.list(&ListParams::default()).await.unwrap();
    assert_eq!(sim.faults().rules().len(), 1);
    sim.shutdown().await;
}

#[tokio::test]
async fn request_log_records_every_request() {
    let sim = start().await;
    let client = client_without_retry(&sim, "log-test/2").await;
    let api: Api<ConfigMap> = in_new_namespace(&client, "f").await;
    api.create(&PostParams::default(), &cm("one"))
        .await
        .unwrap();
    let _ = api.get("missing").await;
    let log = sim.requests();
    let create = log
        .iter()
        .find(|r| r.verb == "create" && r.resource == "configmaps")
        .unwrap();
    assert_eq!(
        (
            create.namespace.as_str(),
            create.name.as_str(),
            create.status
        ),
        ("f", "", 201)
    );
    assert_eq!(create.user_agent, "log-test/2");
    assert!(!create.time.is_empty());
    let get = log.iter().find(|r| r.verb == "get").unwrap();
    assert_eq!((get.name.as_str(), get.status), ("missing", 404));
    assert_eq!(sim.request_count("create", "namespaces"), 1);
    sim.clear_requests();
    assert!(sim.requests().is_empty());
    sim.shutdown().await;
}

#[tokio::test]
async fn backdoor_builds_broken_state_visible_to_watchers() {
    let sim = start().await;
    let client = sim.client();
    let svcs: Api<Service> = in_new_namespace(&client, "f").await;
    let rv = sim.resource_version().to_string();
    let mut stream = svcs
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();

    // An out-of-range ClusterIP and no IPAddress: what a bad restore leaves behind.
    let stored = sim
        .backdoor()
        .put(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "broken", "namespace": "f"},
            "spec": {"clusterIP": "192.0.2.77", "clusterIPs": ["192.0.2.77"], "ports": [{"port": 80}]}
        }))
        .unwrap();
    assert!(stored["metadata"]["uid"].is_string());
    let ev = tokio::time::timeout(Duration::from_secs(20), stream.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    match ev {
        WatchEvent::Added(s) => {
            assert_eq!(s.spec.unwrap().cluster_ip.as_deref(), Some("192.0.2.77"))
        }
        _ => panic!("expected ADDED"),
    }
    assert!(
        common::ip_addresses(&client).await.is_empty(),
        "backdoor allocates nothing"
    );

    // Backdoor into a namespace that does not exist, bypassing validation.
    sim.backdoor()
        .put(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "Not_Valid", "namespace": "ghost"}}))
        .unwrap();
    assert!(
        sim.backdoor()
            .get("configmaps", "ghost", "Not_Valid")
            .unwrap()
            .is_some()
    );

    // Backdoor delete: watchers see DELETED, nothing is released.
    let created = svcs
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": "ok"}, "spec": {"ports": [{"port": 80}]}}),
            )
            .unwrap(),
        )
        .await
        .unwrap();
    let ip = created.spec.unwrap().cluster_ip.unwrap();
    sim.backdoor()
        .delete("services", "f", "ok")
        .unwrap()
        .unwrap();
    let mut kinds = Vec::new();
    while kinds.len() < 2 {
        match tokio::time::timeout(Duration::from_secs(20), stream.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap()
        {
            WatchEvent::Added(_) => kinds.push("ADDED"),
            WatchEvent::Deleted(_) => kinds.push("DELETED"),
            _ => {}
        }
    }
    assert_eq!(kinds, vec!["ADDED", "DELETED"]);
    assert!(
        sim.backdoor()
            .get("ipaddresses", "", &ip)
            .unwrap()
            .is_some(),
        "leaked IPAddress stays"
    );
    assert_eq!(sim.backdoor().list("services").unwrap().len(), 1);
    assert!(
        sim.backdoor()
            .put(json!({"apiVersion": "v1", "kind": "Nope", "metadata": {"name": "x"}}))
            .is_err()
    );
    assert!(sim.backdoor().delete("nope", "", "x").is_err());
    sim.shutdown().await;
}

async fn admin(
    client: &kube::Client,
    method: &str,
    path: &str,
    body: serde_json::Value,
) -> serde_json::Value {
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&body).unwrap())
        .unwrap();
    serde_json::from_str(&client.request_text(req).await.unwrap()).unwrap()
}

#[tokio::test]
async fn admin_http_api() {
    let sim = start().await;
    let client = sim.client();
    let api: Api<ConfigMap> = in_new_namespace(&client, "f").await;

    // Faults.
    let rules = admin(
        &client,
        "POST",
        "/sim/faults",
        json!({
            "verb": "get", "resource": "configmaps",
            "fault": {"type": "error", "code": 500},
            "trigger": {"next": 1}
        }),
    )
    .await;
    assert_eq!(rules.as_array().unwrap().len(), 1);
    assert_eq!(sim.faults().rules()[0].trigger, Trigger::Next(1));
    assert_eq!(api_err(api.get("x").await).code, 500);
    admin(
        &client,
        "POST",
        "/sim/faults",
        json!({"fault": {"type": "latency", "millis": 1}, "trigger": {"probability": 0.5}}),
    )
    .await;
    assert_eq!(
        admin(&client, "DELETE", "/sim/faults", json!(null)).await,
        json!([])
    );
    assert!(sim.faults().rules().is_empty());

    // Backdoor.
    admin(&client, "PUT", "/sim/backdoor", json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "bd", "namespace": "f"}})).await;
    assert!(api.get("bd").await.is_ok());
    let got = admin(&client, "GET", "/sim/backdoor/configmaps/f/bd", json!(null)).await;
    assert_eq!(got["metadata"]["name"], "bd");
    admin(
        &client,
        "DELETE",
        "/sim/backdoor/configmaps/f/bd",
        json!(null),
    )
    .await;
    assert_eq!(api_err(api.get("bd").await).code, 404);

    // Request log.
    let log = admin(&client, "GET", "/sim/requests", json!(null)).await;
    let entries = log.as_array().unwrap();
    assert!(
        entries
            .iter()
            .any(|e| e["verb"] == "get" && e["resource"] == "configmaps" && e["status"] == 500)
    );
    assert!(
        entries
            .iter()
            .all(|e| !e["path"].as_str().unwrap().starts_with("/sim")),
        "admin calls are not logged"
    );
    admin(&client, "DELETE", "/sim/requests", json!(null)).await;
    assert!(sim.requests().is_empty());

    // Open watches per resource.
    let watches = admin(&client, "GET", "/sim/watches", json!(null)).await;
    assert_eq!(watches["services"], 0);
    assert_eq!(watches["leases.coordination.k8s.io"], 0);

    // Readiness.
    assert_eq!(
        admin(&client, "PUT", "/sim/ready", json!({"ready": false})).await,
        json!({"ready": false})
    );
    let readyz = client
        .request_text(hyper::Request::get("/readyz").body(Vec::new()).unwrap())
        .await;
    assert!(readyz.is_err());
    admin(&client, "PUT", "/sim/ready", json!({"ready": true})).await;
    assert_eq!(
        admin(&client, "GET", "/sim/ready", json!(null)).await,
        json!({"ready": true})
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn flooding_faults_serve_valid_new_objects_without_end() {
    let sim = start().await;
    let client = client_without_retry(&sim, "flood-test/1").await;
    let api: Api<Service> = Api::namespaced(client, "team");
    let every = |verb: Verb, fault: FaultKind| {
        FaultRule::probability(Some(verb), Some("services"), 1.0, fault)
    };

    // Each page is small and valid, and every continue request gets another page, with new
    // names and a token again.
    sim.faults()
        .inject(every(Verb::List, FaultKind::EndlessPages));
    let mut names = std::collections::BTreeSet::new();
    let mut params = ListParams::default().limit(5);
    for _ in 0..20 {
        let page = api.list(&params).await.unwrap();
        assert!((1..=5).contains(&page.items.len()), "{}", page.items.len());
        for service in &page.items {
            assert_eq!(service.metadata.namespace.as_deref(), Some("team"));
            assert!(service.spec.as_ref().unwrap().cluster_ip.is_some());
            assert!(names.insert(service.metadata.name.clone().unwrap()));
        }
        let token = page.metadata.continue_.clone().unwrap_or_default();
        assert!(!token.is_empty());
        params = params.continue_token(&token);
    }
    // List-only: a watch is served as usual (nothing to stream in an empty namespace).
    let rv = sim.resource_version().to_string();
    let quiet = tokio::time::timeout(
        Duration::from_millis(300),
        api.watch(&WatchParams::default().disable_bookmarks(), &rv)
            .await
            .unwrap()
            .boxed()
            .next(),
    )
    .await;
    assert!(quiet.is_err(), "{quiet:?}");
    sim.faults().clear();

    // A watch streams ADDED events of new Services, each with a clusterIP of the range.
    sim.faults()
        .inject(every(Verb::Watch, FaultKind::EndlessNewObjects));
    let range: ipnet::IpNet = "10.96.0.0/12".parse().unwrap();
    let mut stream = api
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    let mut seen = std::collections::BTreeSet::new();
    while seen.len() < 5_000 {
        match stream.next().await.unwrap().unwrap() {
            WatchEvent::Added(service) => {
                let ip: std::net::IpAddr = service
                    .spec
                    .and_then(|spec| spec.cluster_ip)
                    .unwrap()
                    .parse()
                    .unwrap();
                assert!(range.contains(&ip), "{ip}");
                assert!(seen.insert(service.metadata.name.unwrap()));
            }
            other => panic!("expected ADDED, got {other:?}"),
        }
    }
    // Watch-only: a list is served as usual.
    assert!(
        api.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    sim.shutdown().await;
}
