//! What a pass of the `kubernetes-service` loop does, decided from the Service as the watch has
//! it: no I/O, no clock. The cases, as [`plan`] tells them apart:
//!
//! | the Service | the plan |
//! | --- | --- |
//! | missing, and no range known (no `serviceClusterIPRange`, no `kubernetes` ServiceCIDR) | [`Plan::MissingUnknownRange`]: reported, not created (its ClusterIP cannot be chosen) |
//! | missing | [`Plan::Create`] the [`desired_service`] |
//! | ports, type, selector, sessionAffinity or its two labels differ | one update to the [`repaired_service`]; with `repair: off` reported only |
//! | clusterIP not the first IP of the primary range (immutable) | reported once; with `recreateOnClusterIPMismatch`, deleted (by uid and resourceVersion) once no other Service or IPAddress holds the IP (a live list) and a dry-run create shows the API takes it, and created |
//! | as desired | nothing |
//!
//! Both kinds of drift at once give both steps, the update first.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;

use super::section::{RepairPolicy, Section, cluster_ips, ports, service_type};
use crate::section::Settings;

/// What one pass does about the Service.
#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    /// The Service is missing and its ClusterIP cannot be chosen: why.
    MissingUnknownRange(String),
    /// The Service is missing: create this one.
    Create(Box<Service>),
    /// The Service exists.
    Existing {
        existing: Box<Service>,
        /// Drift of the repairable fields, and the update that repairs it when the policy does.
        drift: Vec<ServiceDrift>,
        repaired: Option<Box<Service>>,
        /// The clusterIP mismatch, if there is one, and whether to delete and recreate for it.
        mismatch: Option<ServiceDrift>,
        recreate: bool,
    },
}

/// The plan for `existing` under `section` and `settings` (whose `service_ranges` are the ranges
/// in effect: configured or read from the cluster). `unknown_range` says why no Service range is
/// known, if none is (the ClusterIP is then neither chosen nor judged).
pub fn plan(
    section: &Section,
    settings: &Settings,
    existing: Option<Service>,
    unknown_range: Option<String>,
) -> Plan {
    let Some(existing) = existing else {
        return match unknown_range {
            Some(why) => Plan::MissingUnknownRange(why),
            None => Plan::Create(Box::new(desired_service(section, settings, None))),
        };
    };
    let (drift, immutable): (Vec<_>, Vec<_>) = service_drift(section, settings, &existing)
        .into_iter()
        .partition(ServiceDrift::repairable);
    let repaired = (!drift.is_empty() && section.repair == RepairPolicy::Repair)
        .then(|| Box::new(repaired_service(section, settings, &existing)));
    Plan::Existing {
        existing: Box::new(existing),
        drift,
        repaired,
        mismatch: immutable.into_iter().next(),
        recreate: section.recreate_on_cluster_ip_mismatch,
    }
}

pub const PROVIDER_LABEL: (&str, &str) = ("provider", "kubernetes");
pub const COMPONENT_LABEL: (&str, &str) = ("component", "apiserver");

/// The Service to create when none exists, or anew in place of `existing` (for its clusterIP),
/// keeping its type, node port and targetPort where the settings leave them unset.
pub fn desired_service(
    section: &Section,
    settings: &Settings,
    existing: Option<&Service>,
) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(section.name.clone()),
            namespace: Some(section.namespace.clone()),
            labels: Some(BTreeMap::from([
                (PROVIDER_LABEL.0.to_owned(), PROVIDER_LABEL.1.to_owned()),
                (COMPONENT_LABEL.0.to_owned(), COMPONENT_LABEL.1.to_owned()),
            ])),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            ports: Some(ports(section, settings, existing)),
            selector: None,
            // As upstream: clusterIP and SingleStack, clusterIPs and ipFamilies left to the API.
            cluster_ip: cluster_ips(settings).first().map(ToString::to_string),
            ip_family_policy: Some("SingleStack".to_owned()),
            session_affinity: Some("None".to_owned()),
            type_: Some(service_type(settings, existing).0.to_owned()),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// One way an existing Service differs from the desired one.
#[derive(Clone, Debug, PartialEq)]
pub enum ServiceDrift {
    Ports {
        found: Vec<ServicePort>,
    },
    Type {
        found: Option<String>,
    },
    Selector {
        found: BTreeMap<String, String>,
    },
    SessionAffinity {
        found: String,
    },
    Label {
        key: &'static str,
        found: Option<String>,
    },
    /// Immutable: reported, never repaired in place.
    ClusterIp {
        found: Vec<String>,
        want: Vec<String>,
    },
}

impl ServiceDrift {
    pub fn kind(&self) -> &'static str {
        match self {
            ServiceDrift::Ports { .. } => "service_ports",
            ServiceDrift::Type { .. } => "service_type",
            ServiceDrift::Selector { .. } => "service_selector",
            ServiceDrift::SessionAffinity { .. } => "service_session_affinity",
            ServiceDrift::Label { .. } => "service_labels",
            ServiceDrift::ClusterIp { .. } => "service_cluster_ip",
        }
    }

    pub fn repairable(&self) -> bool {
        !matches!(self, ServiceDrift::ClusterIp { .. })
    }
}

impl fmt::Display for ServiceDrift {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServiceDrift::Ports { found } => write!(
                f,
                "ports are [{}]",
                found
                    .iter()
                    .map(describe_port)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            ServiceDrift::Type { found } => {
                write!(f, "type is {}", found.as_deref().unwrap_or("unset"))
            }
            ServiceDrift::Selector { found } => write!(f, "has selector {found:?}, want none"),
            ServiceDrift::SessionAffinity { found } => {
                write!(f, "sessionAffinity is {found}, want None")
            }
            ServiceDrift::Label { key, found } => write!(
                f,
                "label {key} is {}",
                found
                    .as_deref()
                    .map_or("missing".to_owned(), |v| format!("{v:?}"))
            ),
            ServiceDrift::ClusterIp { found, want } => write!(
                f,
                "clusterIPs are [{}], want [{}] (immutable)",
                found.join(", "),
                want.join(", ")
            ),
        }
    }
}

fn describe_port(port: &ServicePort) -> String {
    let target = match &port.target_port {
        Some(IntOrString::Int(n)) => n.to_string(),
        Some(IntOrString::String(s)) => s.clone(),
        None => "-".to_owned(),
    };
    let node = port
        .node_port
        .map(|n| format!(" nodePort {n}"))
        .unwrap_or_default();
    format!(
        "{} {}/{}->{}{}",
        port.name.as_deref().unwrap_or(""),
        port.protocol.as_deref().unwrap_or(""),
        port.port,
        target,
        node
    )
}

/// Every difference between `existing` and the desired Service.
pub fn service_drift(
    section: &Section,
    settings: &Settings,
    existing: &Service,
) -> Vec<ServiceDrift> {
    let mut drift = Vec::new();
    let spec = existing.spec.clone().unwrap_or_default();

    let found_ports = spec.ports.clone().unwrap_or_default();
    if found_ports != ports(section, settings, Some(existing)) {
        drift.push(ServiceDrift::Ports { found: found_ports });
    }
    // The API defaults an unset type to ClusterIP.
    let found_type = spec.type_.clone().unwrap_or_else(|| "ClusterIP".to_owned());
    if found_type != service_type(settings, Some(existing)).0 {
        drift.push(ServiceDrift::Type {
            found: spec.type_.clone(),
        });
    }
    if let Some(selector) = spec.selector.as_ref().filter(|s| !s.is_empty()) {
        drift.push(ServiceDrift::Selector {
            found: selector.clone(),
        });
    }
    if let Some(affinity) = spec
        .session_affinity
        .as_ref()
        .filter(|a| a.as_str() != "None")
    {
        drift.push(ServiceDrift::SessionAffinity {
            found: affinity.clone(),
        });
    }
    for (key, value) in [PROVIDER_LABEL, COMPONENT_LABEL] {
        let found = existing.labels().get(key);
        if found.map(String::as_str) != Some(value) {
            drift.push(ServiceDrift::Label {
                key,
                found: found.cloned(),
            });
        }
    }

    let want_ips = cluster_ips(settings);
    let want: Vec<String> = want_ips.iter().map(ToString::to_string).collect();
    let found_ips: Vec<String> = match (&spec.cluster_ips, &spec.cluster_ip) {
        (Some(ips), _) if !ips.is_empty() => ips.clone(),
        (_, Some(ip)) => vec![ip.clone()],
        _ => Vec::new(),
    };
    // Only the primary IP is judged: a Service made dual-stack by someone else has a secondary
    // IP that is not ours to judge.
    let primary_ok =
        found_ips.first().and_then(|s| s.parse::<IpAddr>().ok()) == want_ips.first().copied();
    // No range known (not configured, not told by the cluster): nothing to judge the IP by.
    if !want.is_empty() && !primary_ok {
        drift.push(ServiceDrift::ClusterIp {
            found: found_ips,
            want,
        });
    }
    drift
}

/// `existing` with every repairable field set to the desired value; everything else (clusterIPs,
/// ipFamilies, foreign labels and annotations, resourceVersion) kept.
pub fn repaired_service(section: &Section, settings: &Settings, existing: &Service) -> Service {
    let mut repaired = existing.clone();
    repaired.metadata.managed_fields = None;
    let labels = repaired.metadata.labels.get_or_insert_with(BTreeMap::new);
    for (key, value) in [PROVIDER_LABEL, COMPONENT_LABEL] {
        labels.insert(key.to_owned(), value.to_owned());
    }
    let spec = repaired.spec.get_or_insert_with(ServiceSpec::default);
    spec.ports = Some(ports(section, settings, Some(existing)));
    spec.selector = None;
    spec.session_affinity = Some("None".to_owned());
    spec.session_affinity_config = None;
    let want_type = service_type(settings, Some(existing)).0;
    if spec.type_.as_deref().unwrap_or("ClusterIP") != want_type {
        spec.type_ = Some(want_type.to_owned());
        // Fields the API only allows on NodePort/LoadBalancer/ExternalName Services.
        if want_type == "ClusterIP" {
            spec.external_traffic_policy = None;
            spec.health_check_node_port = None;
            spec.allocate_load_balancer_node_ports = None;
            spec.load_balancer_class = None;
            spec.load_balancer_ip = None;
            spec.load_balancer_source_ranges = None;
        }
        if want_type == "NodePort" {
            spec.allocate_load_balancer_node_ports = None;
            spec.load_balancer_class = None;
            spec.load_balancer_ip = None;
            spec.load_balancer_source_ranges = None;
            spec.health_check_node_port = None;
        }
        spec.external_name = None;
    }
    repaired
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// One IPv4 range, the default ports, no node port.
    fn settings() -> Settings {
        Settings {
            service_ranges: vec!["10.96.0.0/12".parse().unwrap()],
            ..crate::section::test_settings()
        }
    }

    fn section() -> Section {
        Section::default()
    }

    #[test]
    fn desired_service_matches_upstream_shape() {
        let json = serde_json::to_value(desired_service(&section(), &settings(), None)).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {
                    "name": "kubernetes",
                    "namespace": "default",
                    "labels": {"component": "apiserver", "provider": "kubernetes"}
                },
                "spec": {
                    "clusterIP": "10.96.0.1",
                    "ipFamilyPolicy": "SingleStack",
                    "ports": [{"name": "https", "port": 443, "protocol": "TCP", "targetPort": 6443}],
                    "sessionAffinity": "None",
                    "type": "ClusterIP"
                }
            })
        );
    }

    #[test]
    fn two_ranges_and_node_port_give_a_single_stack_node_port_service() {
        let settings = Settings {
            service_ranges: vec![
                "10.96.0.0/12".parse().unwrap(),
                "fd00::/108".parse().unwrap(),
            ],
            kubernetes_service_node_port: Some(30443),
            secure_port: Some(6444),
            ..settings()
        };
        let section = Section {
            port: 8443,
            ..section()
        };
        let spec = desired_service(&section, &settings, None).spec.unwrap();
        assert_eq!(spec.ip_family_policy.as_deref(), Some("SingleStack"));
        assert_eq!(spec.cluster_ip.as_deref(), Some("10.96.0.1"));
        assert_eq!(
            spec.cluster_ips, None,
            "left to the API's defaulting, as upstream"
        );
        assert_eq!(spec.type_.as_deref(), Some("NodePort"));
        let port = &spec.ports.unwrap()[0];
        assert_eq!((port.port, port.node_port), (8443, Some(30443)));
        assert_eq!(port.target_port, Some(IntOrString::Int(6444)));
    }

    fn existing() -> Service {
        let mut s = desired_service(&section(), &settings(), None);
        // What the API adds on create.
        s.metadata.resource_version = Some("5".into());
        s.metadata.uid = Some("u".into());
        let spec = s.spec.as_mut().unwrap();
        spec.cluster_ips = Some(vec!["10.96.0.1".into()]);
        spec.ip_families = Some(vec!["IPv4".into()]);
        spec.internal_traffic_policy = Some("Cluster".into());
        s
    }

    #[test]
    fn freshly_created_service_has_no_drift() {
        assert!(service_drift(&section(), &settings(), &existing()).is_empty());
        let mut unset = existing();
        unset.spec.as_mut().unwrap().type_ = None;
        unset.spec.as_mut().unwrap().session_affinity = None;
        unset.spec.as_mut().unwrap().selector = Some(BTreeMap::new());
        assert!(
            service_drift(&section(), &settings(), &unset).is_empty(),
            "API defaults are not drift"
        );
    }

    #[test]
    fn every_repairable_drift_is_found_and_repaired() {
        let mut s = existing();
        s.metadata.labels = Some(BTreeMap::from([
            ("provider".into(), "someone".into()),
            ("team".into(), "x".into()),
        ]));
        let spec = s.spec.as_mut().unwrap();
        spec.ports.as_mut().unwrap()[0].target_port = Some(IntOrString::Int(1));
        spec.type_ = Some("NodePort".into());
        spec.external_traffic_policy = Some("Cluster".into());
        spec.selector = Some(BTreeMap::from([("app".into(), "x".into())]));
        spec.session_affinity = Some("ClientIP".into());
        // A configured securePort and node port (0: ClusterIP) are repaired; without them the
        // targetPort, type and node port are kept (below).
        let settings = Settings {
            secure_port: Some(6443),
            kubernetes_service_node_port: Some(0),
            ..settings()
        };
        let kinds: Vec<_> = service_drift(&section(), &settings, &s)
            .iter()
            .map(ServiceDrift::kind)
            .collect();
        assert_eq!(
            kinds,
            vec![
                "service_ports",
                "service_type",
                "service_selector",
                "service_session_affinity",
                "service_labels",
                "service_labels"
            ]
        );
        let repaired = repaired_service(&section(), &settings, &s);
        assert!(service_drift(&section(), &settings, &repaired).is_empty());
        assert_eq!(
            repaired.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].target_port,
            Some(IntOrString::Int(6443))
        );
        assert_eq!(repaired.metadata.resource_version.as_deref(), Some("5"));
        assert_eq!(repaired.labels().get("team").map(String::as_str), Some("x"));
        let spec = repaired.spec.unwrap();
        assert_eq!(
            spec.external_traffic_policy, None,
            "ClusterIP Services may not carry it"
        );
        assert_eq!(
            spec.cluster_ips,
            Some(vec!["10.96.0.1".to_owned()]),
            "clusterIPs untouched"
        );
    }

    #[test]
    fn without_a_secure_port_the_services_target_port_is_kept() {
        // A managed control plane's Service targets 443; a default must not rewrite it to 6443.
        let mut s = existing();
        s.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].target_port =
            Some(IntOrString::Int(443));
        assert_eq!(settings().secure_port, None);
        assert!(service_drift(&section(), &settings(), &s).is_empty());
        // The port itself is still repaired, keeping the targetPort.
        s.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].port = 8443;
        let repaired = repaired_service(&section(), &settings(), &s);
        let port = &repaired.spec.unwrap().ports.unwrap()[0];
        assert_eq!(
            (port.port, port.target_port.clone()),
            (443, Some(IntOrString::Int(443)))
        );
        // Created, it gets kube-apiserver's default.
        let created = desired_service(&section(), &settings(), None).spec.unwrap();
        assert_eq!(
            created.ports.unwrap()[0].target_port,
            Some(IntOrString::Int(6443))
        );
    }

    #[test]
    fn without_a_node_port_the_services_type_and_node_port_are_kept() {
        // kube-apiserver run with --kubernetes-service-node-port=30443 made it NodePort.
        let mut s = existing();
        let spec = s.spec.as_mut().unwrap();
        spec.type_ = Some("NodePort".into());
        spec.ports.as_mut().unwrap()[0].node_port = Some(30443);
        assert_eq!(settings().kubernetes_service_node_port, None);
        assert!(service_drift(&section(), &settings(), &s).is_empty());
        // The port itself is still repaired, keeping the type and node port.
        s.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].port = 8443;
        let spec = repaired_service(&section(), &settings(), &s).spec.unwrap();
        assert_eq!(spec.type_.as_deref(), Some("NodePort"));
        let port = &spec.ports.unwrap()[0];
        assert_eq!((port.port, port.node_port), (443, Some(30443)));
        // Created, it is ClusterIP; 0 asks for ClusterIP, which repairs the NodePort one.
        let created = desired_service(&section(), &settings(), None).spec.unwrap();
        assert_eq!(created.type_.as_deref(), Some("ClusterIP"));
        let cluster_ip = Settings {
            kubernetes_service_node_port: Some(0),
            ..settings()
        };
        let kinds: Vec<_> = service_drift(&section(), &cluster_ip, &s)
            .iter()
            .map(ServiceDrift::kind)
            .collect();
        assert_eq!(kinds, ["service_ports", "service_type"]);
        let spec = repaired_service(&section(), &cluster_ip, &s).spec.unwrap();
        assert_eq!(spec.type_.as_deref(), Some("ClusterIP"));
        assert_eq!(spec.ports.unwrap()[0].node_port, None);
    }

    #[test]
    fn switching_to_node_port_sets_the_node_port() {
        let c = Settings {
            kubernetes_service_node_port: Some(30443),
            ..settings()
        };
        let drift = service_drift(&section(), &c, &existing());
        assert_eq!(
            drift.iter().map(ServiceDrift::kind).collect::<Vec<_>>(),
            vec!["service_ports", "service_type"]
        );
        let repaired = repaired_service(&section(), &c, &existing());
        assert!(service_drift(&section(), &c, &repaired).is_empty());
    }

    #[test]
    fn cluster_ip_mismatch_is_reported_not_repaired() {
        let mut s = existing();
        s.spec.as_mut().unwrap().cluster_ip = Some("10.96.0.10".into());
        s.spec.as_mut().unwrap().cluster_ips = Some(vec!["10.96.0.10".into()]);
        let drift = service_drift(&section(), &settings(), &s);
        assert_eq!(drift.len(), 1);
        assert!(!drift[0].repairable());
        assert_eq!(
            drift[0].to_string(),
            "clusterIPs are [10.96.0.10], want [10.96.0.1] (immutable)"
        );
        let repaired = repaired_service(&section(), &settings(), &s);
        assert_eq!(
            repaired.spec.unwrap().cluster_ip.as_deref(),
            Some("10.96.0.10")
        );
    }

    #[test]
    fn a_secondary_cluster_ip_is_not_ours_to_judge() {
        let dual = Settings {
            service_ranges: vec![
                "10.96.0.0/12".parse().unwrap(),
                "fd00::/108".parse().unwrap(),
            ],
            ..settings()
        };
        // Made dual-stack by someone else, with any secondary IP: only the primary is checked.
        let mut dual_by_hand = existing();
        dual_by_hand.spec.as_mut().unwrap().cluster_ips =
            Some(vec!["10.96.0.1".into(), "fd00::77".into()]);
        assert!(service_drift(&section(), &dual, &dual_by_hand).is_empty());
    }

    #[test]
    fn a_single_stack_service_is_never_upgraded_to_dual_stack() {
        let dual = Settings {
            service_ranges: vec![
                "10.96.0.0/12".parse().unwrap(),
                "fd00::/108".parse().unwrap(),
            ],
            ..settings()
        };
        let single = existing();
        assert!(service_drift(&section(), &dual, &single).is_empty());
        let spec = repaired_service(&section(), &dual, &single).spec.unwrap();
        assert_eq!(spec.ip_family_policy.as_deref(), Some("SingleStack"));
        assert_eq!(spec.cluster_ips, Some(vec!["10.96.0.1".to_owned()]));
    }

    /// One test per row of the module's table.
    #[test]
    fn the_plan_has_one_case_per_row_of_the_table() {
        let why = "no serviceClusterIPRange and no kubernetes ServiceCIDR".to_owned();
        assert_eq!(
            plan(&section(), &settings(), None, Some(why.clone())),
            Plan::MissingUnknownRange(why)
        );
        assert_eq!(
            plan(&section(), &settings(), None, None),
            Plan::Create(Box::new(desired_service(&section(), &settings(), None)))
        );
        let as_desired = plan(&section(), &settings(), Some(existing()), None);
        assert!(
            matches!(&as_desired, Plan::Existing { drift, repaired: None, mismatch: None, .. } if drift.is_empty()),
            "{as_desired:?}"
        );

        let mut drifted = existing();
        drifted.spec.as_mut().unwrap().session_affinity = Some("ClientIP".into());
        drifted.spec.as_mut().unwrap().cluster_ip = Some("10.96.0.9".into());
        drifted.spec.as_mut().unwrap().cluster_ips = Some(vec!["10.96.0.9".into()]);
        let Plan::Existing {
            drift,
            repaired,
            mismatch,
            recreate,
            ..
        } = plan(&section(), &settings(), Some(drifted.clone()), None)
        else {
            panic!("an existing Service");
        };
        assert_eq!(drift.len(), 1, "{drift:?}");
        assert_eq!(
            repaired,
            Some(Box::new(repaired_service(
                &section(),
                &settings(),
                &drifted
            )))
        );
        assert!(matches!(mismatch, Some(ServiceDrift::ClusterIp { .. })));
        assert!(!recreate, "recreating is opted into, never the default");

        let reporting = Section {
            repair: RepairPolicy::Off,
            recreate_on_cluster_ip_mismatch: true,
            ..section()
        };
        let Plan::Existing {
            drift,
            repaired,
            recreate,
            ..
        } = plan(&reporting, &settings(), Some(drifted), None)
        else {
            panic!("an existing Service");
        };
        assert_eq!(drift.len(), 1);
        assert_eq!(repaired, None, "repair: off writes nothing");
        assert!(recreate);
    }
}
