//! Helpers shared by the integration tests.
#![allow(dead_code, clippy::unwrap_used)]

use std::future::Future;
use std::time::Duration;

use apiserver_sim::{Sim, SimConfig};
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::api::PostParams;

/// A config with short delays so tests stay fast.
pub fn fast_config() -> SimConfig {
    SimConfig {
        namespace_finalize_delay: Duration::from_millis(200),
        bookmark_interval: Duration::from_millis(200),
        ..SimConfig::default()
    }
}

pub async fn start() -> Sim {
    Sim::start(fast_config()).await.expect("simulator starts")
}

pub async fn start_with(config: SimConfig) -> Sim {
    Sim::start(config).await.expect("simulator starts")
}

pub async fn create_ns(client: &kube::Client, name: &str) {
    let api: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name}
    }))
    .unwrap();
    api.create(&PostParams::default(), &ns).await.unwrap();
}

/// Polls `check` until it returns true; fails after 20 s.
pub async fn eventually<F, Fut>(what: &str, check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    if let Err(err) = test_support::eventually(what, Duration::from_secs(20), check).await {
        panic!("{err}");
    }
}

/// The `kube::Error::Api` inside a result, or a panic naming what was expected.
pub fn api_err<T: std::fmt::Debug>(r: Result<T, kube::Error>) -> kube::core::Status {
    match r {
        Err(kube::Error::Api(e)) => *e,
        other => panic!("expected kube::Error::Api, got {other:?}"),
    }
}

/// Creates namespace `namespace`; the API of `K` objects in it.
pub async fn in_new_namespace<K>(client: &kube::Client, namespace: &str) -> Api<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    create_ns(client, namespace).await;
    Api::namespaced(client.clone(), namespace)
}

/// Every IPAddress object the API lists.
pub async fn ip_addresses(
    client: &kube::Client,
) -> Vec<k8s_openapi::api::networking::v1::IPAddress> {
    Api::all(client.clone())
        .list(&kube::api::ListParams::default())
        .await
        .unwrap()
        .items
}

/// The API error's message must hold `words`; the message is shown when it does not.
pub fn says(status: &kube::core::Status, words: &str) {
    assert!(status.message.contains(words), "{}", status.message);
}

/// A client without kube's built-in retry of 429/503/504, so injected errors reach the caller,
/// sending `user_agent` as its User-Agent.
pub async fn client_without_retry(sim: &Sim, user_agent: &str) -> kube::Client {
    let mut cfg = sim.kube_config().await.unwrap();
    cfg.default_retry = false;
    cfg.headers.push((
        hyper::header::USER_AGENT,
        hyper::header::HeaderValue::from_str(user_agent).unwrap(),
    ));
    kube::Client::try_from(cfg).unwrap()
}
