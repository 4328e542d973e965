//! Server-side printing (`Accept: application/json;as=Table;g=meta.k8s.io;v=v1`), so `kubectl get`
//! shows kube-apiserver's usual columns during demos.

use serde_json::{Value, json};

use crate::resources::ResourceDef;

fn human_age(created: Option<&str>) -> String {
    let Some(ts) = created.and_then(|c| c.parse::<jiff::Timestamp>().ok()) else {
        return "<unknown>".into();
    };
    let secs = (jiff::Timestamp::now().as_second() - ts.as_second()).max(0);
    let (m, h, d) = (secs / 60, secs / 3600, secs / 86_400);
    if secs < 120 {
        format!("{secs}s")
    } else if m < 10 {
        format!("{m}m{}s", secs % 60)
    } else if m < 180 {
        format!("{m}m")
    } else if h < 8 {
        format!("{h}h{}m", m % 60)
    } else if h < 48 {
        format!("{h}h")
    } else if d < 8 {
        format!("{d}d{}h", h % 24)
    } else {
        format!("{d}d")
    }
}

fn s(v: &Value, ptr: &str) -> String {
    match v.pointer(ptr) {
        Some(Value::String(x)) => x.clone(),
        Some(Value::Number(n)) => n.to_string(),
        _ => String::new(),
    }
}

fn or_none(x: String) -> String {
    if x.is_empty() { "<none>".into() } else { x }
}

fn ports(v: &Value) -> String {
    let Some(ports) = v.pointer("/spec/ports").and_then(Value::as_array) else {
        return "<none>".into();
    };
    let parts: Vec<String> = ports
        .iter()
        .map(|p| {
            let proto = s(p, "/protocol");
            let proto = if proto.is_empty() {
                "TCP".to_string()
            } else {
                proto
            };
            match p.get("nodePort").and_then(Value::as_i64) {
                Some(np) => format!("{}:{np}/{proto}", s(p, "/port")),
                None => format!("{}/{proto}", s(p, "/port")),
            }
        })
        .collect();
    or_none(parts.join(","))
}

fn columns_and_cells(def: &ResourceDef, o: &Value) -> (Vec<&'static str>, Vec<String>) {
    let name = s(o, "/metadata/name");
    let age = human_age(
        o.pointer("/metadata/creationTimestamp")
            .and_then(Value::as_str),
    );
    match (def.group, def.plural) {
        ("", "namespaces") => (
            vec!["Name", "Status", "Age"],
            vec![name, s(o, "/status/phase"), age],
        ),
        ("", "services") => {
            let external = o
                .pointer("/spec/externalIPs")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .unwrap_or_default();
            let external = if external.is_empty() && s(o, "/spec/type") == "LoadBalancer" {
                "<pending>".to_string()
            } else {
                or_none(external)
            };
            (
                vec![
                    "Name",
                    "Type",
                    "Cluster-IP",
                    "External-IP",
                    "Port(s)",
                    "Age",
                ],
                vec![
                    name,
                    s(o, "/spec/type"),
                    or_none(s(o, "/spec/clusterIP")),
                    external,
                    ports(o),
                    age,
                ],
            )
        }
        ("", "endpoints") => {
            let mut eps = Vec::new();
            for subset in o
                .get("subsets")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                for a in subset
                    .get("addresses")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    for p in subset
                        .get("ports")
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                    {
                        eps.push(format!("{}:{}", s(a, "/ip"), s(p, "/port")));
                    }
                }
            }
            (
                vec!["Name", "Endpoints", "Age"],
                vec![name, or_none(eps.join(",")), age],
            )
        }
        ("", "configmaps") => {
            let n = o
                .get("data")
                .and_then(Value::as_object)
                .map_or(0, |m| m.len())
                + o.get("binaryData")
                    .and_then(Value::as_object)
                    .map_or(0, |m| m.len());
            (vec!["Name", "Data", "Age"], vec![name, n.to_string(), age])
        }
        ("", "secrets") => {
            let n = o
                .get("data")
                .and_then(Value::as_object)
                .map_or(0, |m| m.len());
            (
                vec!["Name", "Type", "Data", "Age"],
                vec![name, s(o, "/type"), n.to_string(), age],
            )
        }
        ("coordination.k8s.io", "leases") => (
            vec!["Name", "Holder", "Age"],
            vec![name, s(o, "/spec/holderIdentity"), age],
        ),
        ("discovery.k8s.io", "endpointslices") => {
            let ports: Vec<String> = o
                .get("ports")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .map(|p| s(p, "/port"))
                .collect();
            let addrs: Vec<String> = o
                .get("endpoints")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .flat_map(|e| {
                    e.get("addresses")
                        .and_then(Value::as_array)
                        .cloned()
                        .unwrap_or_default()
                })
                .filter_map(|a| a.as_str().map(str::to_string))
                .collect();
            (
                vec!["Name", "AddressType", "Ports", "Endpoints", "Age"],
                vec![
                    name,
                    s(o, "/addressType"),
                    or_none(ports.join(",")),
                    or_none(addrs.join(",")),
                    age,
                ],
            )
        }
        ("networking.k8s.io", "ipaddresses") => {
            let parent = format!(
                "{}/{}/{}",
                s(o, "/spec/parentRef/resource"),
                s(o, "/spec/parentRef/namespace"),
                s(o, "/spec/parentRef/name")
            );
            (vec!["Name", "ParentRef"], vec![name, parent])
        }
        ("networking.k8s.io", "servicecidrs") => {
            let cidrs = o
                .pointer("/spec/cidrs")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .unwrap_or_default();
            (vec!["Name", "CIDRs", "Age"], vec![name, cidrs, age])
        }
        ("", "events") | ("events.k8s.io", "events") => {
            let core = def.group.is_empty();
            let (object, message, last) = if core {
                ("/involvedObject", "/message", "/lastTimestamp")
            } else {
                ("/regarding", "/note", "/deprecatedLastTimestamp")
            };
            let seen = [
                last,
                "/series/lastObservedTime",
                "/eventTime",
                "/metadata/creationTimestamp",
            ]
            .iter()
            .find_map(|p| {
                o.pointer(p)
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty())
            })
            .map(str::to_string);
            let object = format!(
                "{}/{}",
                s(o, &format!("{object}/kind")).to_lowercase(),
                s(o, &format!("{object}/name"))
            );
            (
                vec!["Last Seen", "Type", "Reason", "Object", "Message"],
                vec![
                    human_age(seen.as_deref()),
                    s(o, "/type"),
                    s(o, "/reason"),
                    object,
                    s(o, message),
                ],
            )
        }
        _ => (vec!["Name", "Age"], vec![name, age]),
    }
}

fn column_definitions(cols: &[&str]) -> Value {
    Value::Array(
        cols.iter()
            .map(|c| {
                json!({
                    "name": c,
                    "type": "string",
                    "format": if *c == "Name" { "name" } else { "" },
                    "description": "",
                    "priority": 0,
                })
            })
            .collect(),
    )
}

/// A `meta.k8s.io/v1` Table of `objects`, with `list_meta` as its metadata.
pub fn table(def: &ResourceDef, objects: &[Value], list_meta: Value) -> Value {
    let mut cols = None;
    let rows: Vec<Value> = objects
        .iter()
        .map(|o| {
            let (c, cells) = columns_and_cells(def, o);
            cols.get_or_insert(c);
            json!({
                "cells": cells,
                "object": {
                    "kind": "PartialObjectMetadata",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": o.get("metadata").cloned().unwrap_or(json!({})),
                },
            })
        })
        .collect();
    let cols = cols.unwrap_or_else(|| columns_and_cells(def, &json!({})).0);
    json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": list_meta,
        "columnDefinitions": column_definitions(&cols),
        "rows": rows,
    })
}

/// Whether the client asked for server-side printing.
pub fn wants_table(accept: &str) -> bool {
    accept
        .split(',')
        .next()
        .is_some_and(|first| first.contains("as=Table"))
}
