//! The demo's scenarios for the `kubernetes` Service, the default ServiceCIDR and the ClusterIP
//! repair: each breaks one thing through the API, as a person or a broken tool would, and waits
//! for the loop that owns it to put it back.

use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::networking::v1::{IPAddress, ServiceCIDR};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};

use crate::{DemoEnv, REPAIR_TIMEOUT, millis};

/// Polls `probe` every 10 ms until it gives a value, or fails naming `what`.
async fn until<T, F>(what: &str, mut probe: impl FnMut() -> F) -> Result<(T, Duration), String>
where
    F: std::future::Future<Output = Result<Option<T>, String>>,
{
    let started = Instant::now();
    loop {
        if let Some(value) = probe().await? {
            return Ok((value, started.elapsed()));
        }
        if started.elapsed() > REPAIR_TIMEOUT {
            return Err(format!(
                "{what}: not seen within {}s",
                REPAIR_TIMEOUT.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Sets the `kubernetes` Service's port to 8443 and waits for the loop to put back its own.
pub fn kubernetes_service_port<'a>(env: &'a DemoEnv<'a>) -> BoxFuture<'a, Result<String, String>> {
    Box::pin(async move {
        let section = &env.config.loops.kubernetes_service;
        if !section.enabled {
            return Ok("skipped: the kubernetes-service loop is disabled".to_owned());
        }
        let api: Api<Service> = Api::namespaced(env.client.clone(), &section.namespace);
        let port_of = |service: &Service| {
            service
                .spec
                .as_ref()
                .and_then(|spec| spec.ports.as_ref())
                .and_then(|ports| ports.first())
                .map(|port| port.port)
        };
        let before = api
            .get(&section.name)
            .await
            .map_err(|err| format!("cannot read Service {}: {err}", section.name))?;
        let wanted = port_of(&before);
        // Only the port changes: the targetPort stays what the Service has.
        let target_port = before
            .spec
            .as_ref()
            .and_then(|spec| spec.ports.as_ref())
            .and_then(|ports| ports.first())
            .and_then(|port| port.target_port.clone());
        let patch = serde_json::json!({"spec": {"ports": [
            {"name": "https", "port": 8443, "protocol": "TCP", "targetPort": target_port}
        ]}});
        api.patch(
            &section.name,
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .map_err(|err| format!("cannot patch Service {}: {err}", section.name))?;
        println!(
            "  changed the port of Service {}/{} from {} to 8443",
            section.namespace,
            section.name,
            wanted.map_or_else(|| "none".to_owned(), |p| p.to_string())
        );
        let (port, took) = until("the port repaired", || async {
            let service = api
                .get(&section.name)
                .await
                .map_err(|err| format!("cannot read Service {}: {err}", section.name))?;
            Ok(port_of(&service).filter(|port| Some(*port) == wanted))
        })
        .await?;
        println!(
            "  +{}  port {port} restored by the controller",
            millis(took)
        );
        Ok(format!("port restored after {}", millis(took)))
    })
}

/// Shows the default ServiceCIDR the service-cidr loop keeps (the ClusterIP repair waits for it).
pub fn default_service_cidr<'a>(env: &'a DemoEnv<'a>) -> BoxFuture<'a, Result<String, String>> {
    Box::pin(async move {
        if !env.config.loops.service_cidr.enabled {
            return Ok("skipped: the service-cidr loop is disabled".to_owned());
        }
        let api: Api<ServiceCIDR> = Api::all(env.client.clone());
        let (cidrs, took) = until("the default ServiceCIDR", || async {
            let cidr = api
                .get_opt("kubernetes")
                .await
                .map_err(|err| format!("cannot read ServiceCIDR kubernetes: {err}"))?;
            Ok(cidr.and_then(|cidr| cidr.spec?.cidrs))
        })
        .await?;
        println!(
            "  ServiceCIDR kubernetes holds {} (the ranges the controller was given), seen after {}",
            cidrs.join(", "),
            millis(took)
        );
        Ok(format!("ServiceCIDR kubernetes holds {}", cidrs.join(", ")))
    })
}

/// Creates a Service, deletes the IPAddress that backs its cluster IP, and waits for the
/// ClusterIP repair to recreate it (upstream's `ClusterIPNotAllocated`).
pub fn ip_address_deleted<'a>(env: &'a DemoEnv<'a>) -> BoxFuture<'a, Result<String, String>> {
    Box::pin(async move {
        if !env.config.loops.cluster_ip_repair.enabled {
            return Ok("skipped: the clusterip-repair loop is disabled".to_owned());
        }
        let services: Api<Service> = Api::namespaced(env.client.clone(), "default");
        let service = Service {
            metadata: ObjectMeta {
                name: Some("demo-web".to_owned()),
                ..ObjectMeta::default()
            },
            spec: Some(ServiceSpec {
                ports: Some(vec![ServicePort {
                    port: 80,
                    ..ServicePort::default()
                }]),
                ..ServiceSpec::default()
            }),
            ..Service::default()
        };
        let created = services
            .create(&PostParams::default(), &service)
            .await
            .map_err(|err| format!("cannot create Service demo-web: {err}"))?;
        let ip = created
            .spec
            .and_then(|spec| spec.cluster_ip)
            .ok_or("the API gave Service demo-web no cluster IP")?;
        let addresses: Api<IPAddress> = Api::all(env.client.clone());
        let before = addresses
            .get(&ip)
            .await
            .map_err(|err| format!("cannot read IPAddress {ip}: {err}"))?;
        addresses
            .delete(&ip, &DeleteParams::default())
            .await
            .map_err(|err| format!("cannot delete IPAddress {ip}: {err}"))?;
        println!(
            "  created Service default/demo-web (cluster IP {ip}) and deleted its IPAddress {ip}"
        );
        let (_, took) = until("the IPAddress recreated", || async {
            let now = addresses
                .get_opt(&ip)
                .await
                .map_err(|err| format!("cannot read IPAddress {ip}: {err}"))?;
            Ok(now.filter(|now| now.metadata.uid != before.metadata.uid))
        })
        .await?;
        println!(
            "  +{}  IPAddress {ip} recreated by the controller for default/demo-web (event ClusterIPNotAllocated)",
            millis(took)
        );
        Ok(format!("IPAddress recreated after {}", millis(took)))
    })
}
