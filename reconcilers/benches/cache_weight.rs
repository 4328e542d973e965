//! What one Service costs a cache, measured, against what the cache budget counts for it
//! (`reconcilers::budget`): a whole decoded object (a `WatchCache` of whole objects) and a
//! projected record (the repairs' Service cache). Resident memory before and after decoding 50,000 Services of
//! about 500 bytes of JSON each.
//!
//! `cargo bench -p bootstrap-reconcilers --bench cache_weight`

use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use reconcilers::budget::object_weight;
use reconcilers::service_cache::record::{ServiceObject, ServiceRecord};
use reconcilers::watch_cache::Cached;

const OBJECTS: usize = 50_000;

fn resident_bytes() -> usize {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|statm| statm.split_whitespace().nth(1)?.parse::<usize>().ok())
        .map_or(0, |pages| pages * 4096)
}

fn service(i: usize) -> String {
    serde_json::json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {
            "name": format!("web-{i:08}"), "namespace": "default",
            "uid": format!("6e0d1a52-0000-4000-8000-{i:012}"), "resourceVersion": format!("{i}"),
            "creationTimestamp": "2026-11-29T00:00:00Z",
        },
        "spec": {
            "type": "ClusterIP", "clusterIP": "10.96.1.2", "clusterIPs": ["10.96.1.2"],
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
            "selector": {"app": "web"}, "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack",
            "sessionAffinity": "None", "internalTrafficPolicy": "Cluster",
        },
        "status": {"loadBalancer": {}},
    })
    .to_string()
}

fn main() {
    let json: Vec<String> = (0..OBJECTS).map(service).collect();
    let json_bytes = json.iter().map(String::len).sum::<usize>() / OBJECTS;

    let before = resident_bytes();
    let records: Vec<ServiceRecord> = json
        .iter()
        .filter_map(|text| serde_json::from_str::<ServiceObject>(text).ok())
        .map(|object| ServiceRecord::from(&object))
        .collect();
    let record = resident_bytes().saturating_sub(before) / OBJECTS;

    let before = resident_bytes();
    let objects: Vec<Arc<Service>> = json
        .iter()
        .filter_map(|text| serde_json::from_str(text).ok().map(Arc::new))
        .collect();
    let whole = resident_bytes().saturating_sub(before) / OBJECTS;
    let counted = objects.iter().map(|o| object_weight(&**o)).sum::<usize>() / OBJECTS;

    // Both kept until here: memory one phase freed would be reused by the next.
    drop((records, objects));
    let counted_record = json
        .iter()
        .filter_map(|text| serde_json::from_str::<ServiceObject>(text).ok())
        .map(|object| ServiceRecord::weight(&object))
        .sum::<usize>()
        / OBJECTS;
    println!("{OBJECTS} Services of {json_bytes} bytes of JSON each:");
    println!(
        "  decoded whole (Arc<Service>): {whole} bytes each resident; the budget counts {counted}"
    );
    println!(
        "  projected record (ServiceRecord, in a Vec): {record} bytes each resident; the budget \
         counts {counted_record}"
    );
}
