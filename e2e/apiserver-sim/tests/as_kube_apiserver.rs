//! Where the simulator was found to differ from a real kube-apiserver (1.37.2, judged by the
//! e2e suite's real control plane, `e2e/control-plane/`), pinned to what the real one answers:
//! the expected messages and shapes below are copied from its responses.
#![allow(clippy::unwrap_used)]

mod common;

use common::{api_err, create_ns, in_new_namespace, start};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Endpoints, Event as CoreEvent, Service};
use k8s_openapi::api::networking::v1::{IPAddress, ServiceCIDR};
use kube::Api;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

fn ip_address(name: &str, parent: &str) -> IPAddress {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"parentRef": {"group": "", "resource": "services", "namespace": "default", "name": parent}}
    }))
    .unwrap()
}

/// `422 Invalid` names the group-qualified kind, and the details carry the group.
#[tokio::test]
async fn invalid_names_the_group_qualified_kind() {
    let sim = start().await;
    let client = sim.client();
    create_ns(&client, "kube-system").await;
    let leases: Api<Lease> = Api::namespaced(client, "kube-system");
    let lease: Lease = serde_json::from_value(json!({
        "metadata": {"name": "zero"}, "spec": {"leaseDurationSeconds": 0}
    }))
    .unwrap();
    let e = api_err(leases.create(&PostParams::default(), &lease).await);
    assert_eq!(
        e.message,
        "Lease.coordination.k8s.io \"zero\" is invalid: spec.leaseDurationSeconds: Invalid \
         value: 0: must be greater than 0"
    );
    let details = e.details.unwrap();
    assert_eq!(
        (details.group.as_str(), details.kind.as_str()),
        ("coordination.k8s.io", "Lease")
    );
}

/// IPAddress names: strict IP parsing (no leading zeros, no IPv4-mapped IPv6), as
/// `ValidateIPAddressName`.
#[tokio::test]
async fn ip_address_names_are_parsed_strictly() {
    let sim = start().await;
    let api: Api<IPAddress> = Api::all(sim.client());
    for (name, why) in [
        ("10.096.0.9", "must not have leading 0s"),
        (
            "::ffff:10.96.0.77",
            "must not be an IPv4-mapped IPv6 address",
        ),
        (
            "2001:db8:0:0::1",
            "must be in canonical form (\"2001:db8::1\")",
        ),
        (
            "10.96.0.300",
            "must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)",
        ),
    ] {
        let e = api_err(
            api.create(&PostParams::default(), &ip_address(name, "x"))
                .await,
        );
        assert_eq!(
            e.message,
            format!(
                "IPAddress.networking.k8s.io \"{name}\" is invalid: metadata.name: Invalid \
                 value: \"{name}\": {why}"
            )
        );
    }
}

/// An IPAddress's parent is immutable (PUT and PATCH); its other fields are not. An empty
/// `group` is not serialized back, whether sent or written by the allocator.
#[tokio::test]
async fn ip_address_parent_is_immutable_and_an_empty_group_is_not_serialized() {
    let sim = start().await;
    let client = sim.client();
    create_ns(&client, "default").await;
    let api: Api<IPAddress> = Api::all(client);
    let created = api
        .create(&PostParams::default(), &ip_address("10.96.200.220", "x"))
        .await
        .unwrap();
    let parent = created.spec.as_ref().unwrap().parent_ref.clone();
    assert_eq!(
        (parent.group, parent.namespace, parent.name),
        (None, Some("default".to_owned()), "x".to_owned())
    );

    let immutable = "IPAddress.networking.k8s.io \"10.96.200.220\" is invalid: spec.parentRef: \
                     Invalid value: null: field is immutable";
    let e = api_err(
        api.replace(
            "10.96.200.220",
            &PostParams::default(),
            &ip_address("10.96.200.220", "y"),
        )
        .await,
    );
    assert_eq!((e.code, e.message.as_str()), (422, immutable));
    let e = api_err(
        api.patch(
            "10.96.200.220",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"parentRef": {"name": "z"}}})),
        )
        .await,
    );
    assert_eq!((e.code, e.message.as_str()), (422, immutable));
    // The same parent (with its empty group sent again) and a new label: accepted.
    let mut same = ip_address("10.96.200.220", "x");
    same.metadata.labels = Some([("a".to_owned(), "b".to_owned())].into());
    api.replace("10.96.200.220", &PostParams::default(), &same)
        .await
        .unwrap();
    // The same parent with its group null: kube-apiserver decodes null as "", so accepted.
    api.patch(
        "10.96.200.220",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"parentRef": {"group": null}}})),
    )
    .await
    .unwrap();
    let dynamic: Api<DynamicObject> = Api::all_with(
        api.clone().into_client(),
        &ApiResource::erase::<IPAddress>(&()),
    );
    let mut nulled = serde_json::to_value(api.get("10.96.200.220").await.unwrap()).unwrap();
    nulled["spec"]["parentRef"]["group"] = Value::Null;
    dynamic
        .replace(
            "10.96.200.220",
            &PostParams::default(),
            &serde_json::from_value(nulled).unwrap(),
        )
        .await
        .unwrap();
    // The same parent with a field kube-apiserver does not know: it drops the field when it
    // decodes, so accepted.
    let mut unknown = serde_json::to_value(api.get("10.96.200.220").await.unwrap()).unwrap();
    unknown["spec"]["parentRef"]["futureField"] = json!({"nested": true});
    dynamic
        .replace(
            "10.96.200.220",
            &PostParams::default(),
            &serde_json::from_value(unknown).unwrap(),
        )
        .await
        .unwrap();
}

/// Untyped: `k8s_openapi`'s Event cannot leave out `eventTime`.
async fn create_v1_event(
    api: &Api<DynamicObject>,
    mut event: Value,
) -> Result<DynamicObject, kube::Error> {
    event["apiVersion"] = json!("events.k8s.io/v1");
    event["kind"] = json!("Event");
    api.create(
        &PostParams::default(),
        &serde_json::from_value(event).unwrap(),
    )
    .await
}

/// `ValidateEventCreate`: events.k8s.io/v1 creates are checked strictly; core/v1 ones with the
/// legacy checks; the fields are named as core/v1 names them, except the reporting controller.
#[tokio::test]
async fn events_are_validated_on_create() {
    let sim = start().await;
    let client = sim.client();
    create_ns(&client, "default").await;
    create_ns(&client, "kube-system").await;
    let events_v1 = ApiResource::from_gvk(&GroupVersionKind::gvk("events.k8s.io", "v1", "Event"));
    let v1_system: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), "kube-system", &events_v1);
    let v1: Api<DynamicObject> = Api::namespaced_with(client.clone(), "default", &events_v1);
    let core: Api<CoreEvent> = Api::namespaced(client, "default");

    let e = api_err(
        create_v1_event(
            &v1_system,
            json!({
                "metadata": {"name": "several"}, "reason": "R", "note": "n", "type": "Weird",
                "deprecatedCount": 3, "regarding": {"kind": "Service", "name": "x"}
            }),
        )
        .await,
    );
    assert_eq!(
        e.message,
        "Event \"several\" is invalid: [involvedObject.namespace: Invalid value: \"\": does not \
         match event.namespace, eventTime: Required value, type: Invalid value: \"\": has \
         invalid value: Weird, count: Invalid value: \"\": needs to be unset]"
    );
    let details = e.details.unwrap();
    assert_eq!(
        (details.group.as_str(), details.kind.as_str()),
        ("", "Event")
    );
    let reasons: Vec<&str> = details.causes.iter().map(|c| c.reason.as_str()).collect();
    assert_eq!(
        reasons,
        [
            "FieldValueInvalid",
            "FieldValueRequired",
            "FieldValueInvalid",
            "FieldValueInvalid"
        ]
    );

    let name_format = "name part must consist of alphanumeric characters, '-', '_' or '.', and \
                       must start and end with an alphanumeric character (e.g. 'MyName',  or \
                       'my.name',  or '123-abc', regex used for validation is \
                       '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')";
    let e = api_err(
        create_v1_event(
            &v1,
            json!({
                "metadata": {"name": "unreported"}, "eventTime": "2026-11-26T04:00:00.000000Z",
                "type": "Normal", "regarding": {"kind": "Service", "name": "x", "namespace": "default"}
            }),
        )
        .await,
    );
    assert_eq!(
        e.message,
        format!(
            "Event \"unreported\" is invalid: [reportingController: Required value, \
             reportingController: Invalid value: \"\": name part must be non-empty, \
             reportingController: Invalid value: \"\": {name_format}, reportingInstance: \
             Required value, action: Required value, reason: Required value]"
        )
    );

    let e = api_err(
        create_v1_event(
            &v1,
            json!({
                "metadata": {"name": "long"}, "eventTime": "2026-11-26T04:00:00.000000Z",
                "type": "Warning", "reason": "R".repeat(129), "action": "A",
                "note": "n".repeat(1025), "reportingController": "a/b/c",
                "reportingInstance": "i", "series": {"count": 1},
                "regarding": {"kind": "Service", "name": "x", "namespace": "default"}
            }),
        )
        .await,
    );
    assert_eq!(
        e.message,
        "Event \"long\" is invalid: [reportingController: Invalid value: \"a/b/c\": a valid \
         label key must consist of alphanumeric characters, '-', '_' or '.', and must start \
         and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', \
         regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]') with an \
         optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName'), reason: Invalid \
         value: \"\": can have at most 128 characters, message: Invalid value: \"\": can have \
         at most 1024 characters, series.count: Invalid value: \"\": should be at least 2, \
         series.lastObservedTime: Required value]"
    );

    create_v1_event(
        &v1,
        json!({
            "metadata": {"name": "valid"}, "eventTime": "2026-11-26T04:00:00.000000Z",
            "type": "Warning", "reason": "R", "action": "A", "note": "n",
            "reportingController": "example.com/ctl", "reportingInstance": "i",
            "regarding": {"kind": "Service", "name": "x", "namespace": "default"}
        }),
    )
    .await
    .unwrap();

    // core/v1: without eventTime only the namespaces are compared; with it, the reporter is
    // required (named `reportingComponent` there).
    let core_event = |value: Value| -> CoreEvent { serde_json::from_value(value).unwrap() };
    let e = api_err(
        core.create(
            &PostParams::default(),
            &core_event(json!({
                "metadata": {"name": "elsewhere"}, "reason": "R", "message": "m",
                "involvedObject": {"kind": "Service", "name": "x", "namespace": "other"}
            })),
        )
        .await,
    );
    assert_eq!(
        e.message,
        "Event \"elsewhere\" is invalid: involvedObject.namespace: Invalid value: \"other\": \
         does not match event.namespace"
    );
    let e = api_err(
        core.create(
            &PostParams::default(),
            &core_event(json!({
                "metadata": {"name": "unreported"}, "reason": "R", "message": "m",
                "eventTime": "2026-11-26T04:00:00.000000Z",
                "involvedObject": {"kind": "Service", "name": "x", "namespace": "default"}
            })),
        )
        .await,
    );
    assert_eq!(
        e.message,
        format!(
            "Event \"unreported\" is invalid: [reportingComponent: Required value, \
             reportingComponent: Invalid value: \"\": name part must be non-empty, \
             reportingComponent: Invalid value: \"\": {name_format}, reportingInstance: \
             Required value, action: Required value]"
        )
    );
    core.create(
        &PostParams::default(),
        &core_event(json!({
            "metadata": {"name": "legacy"}, "reason": "R", "message": "m", "type": "Normal",
            "count": 2, "involvedObject": {"kind": "Service", "name": "x", "namespace": "default"}
        })),
    )
    .await
    .unwrap();
}

/// ValidateServiceCIDRUpdate: the CIDRs are immutable, except a single-stack ServiceCIDR gaining
/// its second family.
#[tokio::test]
async fn service_cidrs_are_immutable_but_may_become_dual_stack() {
    let sim = start().await;
    let api: Api<ServiceCIDR> = Api::all(sim.client());
    let cidr: ServiceCIDR = serde_json::from_value(json!({
        "metadata": {"name": "extra"}, "spec": {"cidrs": ["10.210.0.0/24"]}
    }))
    .unwrap();
    api.create(&PostParams::default(), &cidr).await.unwrap();
    let set = |cidrs: Value| {
        let api = api.clone();
        async move {
            api.patch(
                "extra",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"cidrs": cidrs}})),
            )
            .await
        }
    };
    let invalid = "ServiceCIDR.networking.k8s.io \"extra\" is invalid: ";
    for (cidrs, error) in [
        (
            json!(["10.211.0.0/24"]),
            "spec.cidrs[0]: Invalid value: \"10.211.0.0/24\": field is immutable",
        ),
        (
            json!(["10.210.0.0/24", "10.202.0.0/24", "fd00::/64"]),
            "spec.cidrs: Invalid value: [\"10.210.0.0/24\",\"10.202.0.0/24\",\"fd00::/64\"]: \
             field is immutable",
        ),
        (
            json!(["10.212.0.0/24", "fd00::/120"]),
            "spec.cidrs[0]: Invalid value: \"10.212.0.0/24\": field is immutable",
        ),
    ] {
        let e = api_err(set(cidrs).await);
        assert_eq!(e.message, format!("{invalid}{error}"));
    }
    set(json!(["10.210.0.0/24", "fd00::/120"])).await.unwrap();
    let e = api_err(set(json!(["10.210.0.0/24"])).await);
    assert_eq!(
        e.message,
        format!("{invalid}spec.cidrs: Invalid value: [\"10.210.0.0/24\"]: field is immutable")
    );
}

/// Ports: a Service's are checked name, port, then target port (defaulted to the port); with
/// several ports in a Service or an Endpoints subset, each needs a name.
#[tokio::test]
async fn service_and_endpoints_ports_are_checked_as_upstream() {
    let sim = start().await;
    let client = sim.client();
    let services: Api<Service> = in_new_namespace(&client, "default").await;
    let endpoints: Api<Endpoints> = Api::namespaced(client, "default");
    let service: Service = serde_json::from_value(json!({
        "metadata": {"name": "ports"},
        "spec": {"ports": [{"port": 0}, {"port": 5, "name": "a", "targetPort": 70000}]}
    }))
    .unwrap();
    let e = api_err(services.create(&PostParams::default(), &service).await);
    assert_eq!(
        e.message,
        "Service \"ports\" is invalid: [spec.ports[0].name: Required value, spec.ports[0].port: \
         Invalid value: 0: must be between 1 and 65535, inclusive, spec.ports[0].targetPort: \
         Invalid value: 0: must be between 1 and 65535, inclusive, spec.ports[1].targetPort: \
         Invalid value: 70000: must be between 1 and 65535, inclusive]"
    );
    let subset: Endpoints = serde_json::from_value(json!({
        "metadata": {"name": "ports"},
        "subsets": [{"addresses": [{"ip": "192.0.2.9"}], "ports": [{"port": 1}, {"port": 0, "name": "b"}]}]
    }))
    .unwrap();
    let e = api_err(endpoints.create(&PostParams::default(), &subset).await);
    assert_eq!(
        e.message,
        "Endpoints \"ports\" is invalid: [subsets[0].ports[0].name: Required value, \
         subsets[0].ports[1].port: Invalid value: 0: must be between 1 and 65535, inclusive]"
    );
}

/// A create drops the status the client sent, for Services and ServiceCIDRs.
#[tokio::test]
async fn create_drops_the_status_the_client_sent() {
    let sim = start().await;
    let client = sim.client();
    let services: Api<Service> = in_new_namespace(&client, "default").await;
    let service: Service = serde_json::from_value(json!({
        "metadata": {"name": "lb"},
        "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]},
        "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.50"}]}}
    }))
    .unwrap();
    let created = services
        .create(&PostParams::default(), &service)
        .await
        .unwrap();
    assert_eq!(
        serde_json::to_value(created.status).unwrap(),
        json!({"loadBalancer": {}})
    );
    let cidrs: Api<ServiceCIDR> = Api::all(client);
    let cidr: ServiceCIDR = serde_json::from_value(json!({
        "metadata": {"name": "extra"},
        "spec": {"cidrs": ["10.220.0.0/24"]},
        "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "x",
            "message": "m", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    }))
    .unwrap();
    let created = cidrs.create(&PostParams::default(), &cidr).await.unwrap();
    assert_eq!(serde_json::to_value(created.status).unwrap(), json!({}));
}
