//! What a real kube-apiserver refuses at admission among the hostile objects of
//! `hostile_objects.rs` (`hostile/objects.rs`), each created through its API as any client would,
//! and the simulator refusing the same through its normal API (its backdoor stores them anyway,
//! which is how `hostile_objects.rs` plants them there; against a real cluster it plants the
//! rest through the API).

mod common;
// The list is shared with hostile_objects.rs, which uses all of it.
#[allow(dead_code)]
#[path = "hostile/objects.rs"]
mod hostile;

use std::collections::BTreeMap;

use anyhow::{Result, ensure};
use common::control_plane::{OwnControlPlane, own_control_plane};
use common::{SimProcess, client_from};
use k8s_openapi::api::core::v1::{Endpoints, Namespace, Service};
use kube::api::{DynamicObject, PostParams};
use kube::{Api, Client};
use serde_json::Value;

/// A control plane of `test`'s own, one at a time; `None` under the shared control plane.
async fn own(test: &str, apiservers: usize) -> Result<Option<OwnControlPlane>> {
    own_control_plane("real_admission", test, apiservers).await
}

/// Creates `object` through the API: `None` when it went in, the refusal (code and message)
/// otherwise.
async fn create(client: &Client, object: &Value) -> Result<Option<(u16, String)>> {
    let api = common::api_of(client, object).await?;
    let mut object = object.clone();
    // A client cannot choose a uid; the backdoor's objects carry one.
    if let Some(metadata) = object["metadata"].as_object_mut() {
        metadata.remove("uid");
    }
    let object: DynamicObject = serde_json::from_value(object)?;
    match api.create(&PostParams::default(), &object).await {
        Ok(_) => Ok(None),
        Err(kube::Error::Api(status)) => Ok(Some((status.code, status.message))),
        Err(err) => Err(err.into()),
    }
}

/// Every hostile object, its addresses in `range` (the cluster's service range), created through
/// `client`'s API. The Terminating namespace is created under a fresh name (`kube-node-lease`
/// exists on a real cluster).
async fn outcomes(client: &Client, range: &str) -> Result<BTreeMap<String, Option<(u16, String)>>> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    for name in ["default", "kube-system"] {
        let ns = serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?;
        // Present on a real cluster (409); the simulator starts without them.
        let _ = namespaces.create(&PostParams::default(), &ns).await;
    }
    let mut out = BTreeMap::new();
    for mut object in hostile::hostile(range)? {
        if object["kind"] == "Namespace" {
            object["metadata"]["name"] = "hostile-terminating".into();
        }
        out.insert(hostile::name_of(&object), create(client, &object).await?);
    }
    Ok(out)
}

/// The outcomes against the pinned list (with the addresses of `range`): exactly the listed
/// objects refused, each with its code and words.
fn judge(
    who: &str,
    range: &str,
    outcomes: &BTreeMap<String, Option<(u16, String)>>,
) -> Result<Vec<String>> {
    let refused = hostile::refused_by_a_real_apiserver(range)?;
    let mut problems = Vec::new();
    for (name, outcome) in outcomes {
        let pinned = refused.iter().find(|(refused, _, _)| refused == name);
        match (pinned, outcome) {
            (None, None) => {}
            (None, Some(refusal)) => problems.push(format!(
                "{who} refused {name}, which a real apiserver takes: {refusal:?}"
            )),
            (Some(_), None) => problems.push(format!("{who} took {name}")),
            (Some((_, code, words)), Some((got, message))) => {
                if got != code || !message.contains(words) {
                    problems.push(format!(
                        "{who} refused {name} with {got} {message:?}, not {code} ...{words}..."
                    ));
                }
            }
        }
    }
    Ok(problems)
}

/// The hostile objects created through a real kube-apiserver's API: the pinned ones are refused
/// (invalid cluster IPs, IPAddresses without an IP name or a parent, an unparseable
/// ServiceCIDR, a Lease that could never expire); the rest go in, and how they are stored is
/// what `hostile_objects.rs` meets on a real cluster. The simulator refuses exactly the same
/// through its API.
#[tokio::test(flavor = "multi_thread")]
async fn the_real_apiserver_refuses_the_pinned_hostile_objects_and_the_simulator_too() -> Result<()>
{
    let test = "the_real_apiserver_refuses_the_pinned_hostile_objects_and_the_simulator_too";
    let Some(cp) = own(test, 1).await? else {
        return Ok(());
    };
    let client = client_from(&cp.admin_kubeconfig(1)).await?;
    let range = common::service_range_of(&client).await?;
    let real = outcomes(&client, &range).await?;
    for (name, outcome) in &real {
        match outcome {
            None => println!("real kube-apiserver took {name}"),
            Some((code, message)) => {
                println!("real kube-apiserver refused {name}: {code} {message}")
            }
        }
    }
    let mut problems = judge("the real apiserver", &range, &real)?;

    // How the real apiserver stores what it takes: unknown fields dropped; a deletionTimestamp
    // in a create ignored (the namespace is Active, its finalizer kept: only a delete makes it
    // Terminating); the 10,000 addresses kept.
    let future = Api::<Service>::namespaced(client.clone(), "default")
        .get("future")
        .await?;
    let future = serde_json::to_value(&future)?;
    ensure!(
        future.pointer("/spec/futureSpecField").is_none()
            && future.pointer("/spec/ports/0/futurePortField").is_none(),
        "unknown fields kept: {future}"
    );
    let terminating = Api::<Namespace>::all(client.clone())
        .get("hostile-terminating")
        .await?;
    ensure!(
        terminating.metadata.deletion_timestamp.is_none()
            && terminating.status.and_then(|s| s.phase).as_deref() == Some("Active")
            && terminating.metadata.finalizers == Some(vec!["example.com/stuck".to_owned()]),
        "a namespace created with a deletionTimestamp: {:?}",
        terminating.metadata
    );
    let endpoints = Api::<Endpoints>::namespaced(client.clone(), "default")
        .get("kubernetes")
        .await?;
    let addresses: usize = endpoints
        .subsets
        .unwrap_or_default()
        .iter()
        .map(|s| s.addresses.as_ref().map_or(0, Vec::len))
        .sum();
    ensure!(addresses == 10_000, "{addresses} addresses stored");
    drop(cp);

    let sim = SimProcess::start(&[]).await?;
    let simulated = outcomes(&client_from(&sim.kubeconfig).await?, &sim.service_range).await?;
    problems.extend(judge("the simulator", &sim.service_range, &simulated)?);
    ensure!(problems.is_empty(), "{}", problems.join("\n"));
    Ok(())
}
