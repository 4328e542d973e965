//! Service defaults, validation and ClusterIP / NodePort allocation, modelled on kube-apiserver 1.33+
//! (`MultiCIDRServiceAllocator`: an IP is allocated exactly when its IPAddress object exists).

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use rand::Rng;
use serde_json::{Value, json};

use crate::meta::go_quote;
use crate::resources::ResIdx;
use crate::store::State;

pub type FieldErrors = Vec<(String, String)>;

/// Allocation settings (from `SimConfig`).
#[derive(Debug, Clone)]
pub struct AllocConfig {
    pub enabled: bool,
    pub ranges: Vec<IpNet>,
    pub node_ports: (u16, u16),
    pub ipaddress_idx: ResIdx,
    pub servicecidr_idx: ResIdx,
}

/// What an operation allocates and releases; applied only once the whole request is valid.
#[derive(Debug, Default)]
pub struct Plan {
    pub allocate_ips: Vec<IpAddr>,
    pub allocate_ports: Vec<u16>,
    pub release_ips: Vec<IpAddr>,
    pub release_ports: Vec<u16>,
}

fn family(ip: &IpAddr) -> &'static str {
    if ip.is_ipv4() { "IPv4" } else { "IPv6" }
}

fn net_family(n: &IpNet) -> &'static str {
    family(&n.addr())
}

fn str_field<'a>(v: &'a Value, path: &[&str]) -> Option<&'a str> {
    let mut cur = v;
    for p in path {
        cur = cur.get(*p)?;
    }
    cur.as_str()
}

fn spec_type(svc: &Value) -> String {
    str_field(svc, &["spec", "type"])
        .unwrap_or("ClusterIP")
        .to_string()
}

fn needs_node_ports(t: &str) -> bool {
    t == "NodePort" || t == "LoadBalancer"
}

fn needs_health_check(svc: &Value) -> bool {
    spec_type(svc) == "LoadBalancer"
        && str_field(svc, &["spec", "externalTrafficPolicy"]) == Some("Local")
}

/// The `clusterIPs` a Service asks for: `spec.clusterIPs`, else `[spec.clusterIP]`, else empty.
fn requested_ips(svc: &Value) -> Vec<String> {
    let from_list: Vec<String> = svc
        .pointer("/spec/clusterIPs")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .filter(|s| !s.is_empty())
                .collect()
        })
        .unwrap_or_default();
    if !from_list.is_empty() {
        return from_list;
    }
    match str_field(svc, &["spec", "clusterIP"]) {
        Some(ip) if !ip.is_empty() => vec![ip.to_string()],
        _ => Vec::new(),
    }
}

fn spec_mut(svc: &mut Value) -> &mut serde_json::Map<String, Value> {
    if !svc.get("spec").is_some_and(Value::is_object) {
        svc["spec"] = json!({});
    }
    match svc.get_mut("spec") {
        Some(Value::Object(m)) => m,
        _ => unreachable!("spec was just set to an object"),
    }
}

/// Defaults kube-apiserver applies to every Service, and validation that does not need state.
pub fn default_and_validate(svc: &mut Value) -> FieldErrors {
    let mut errs = FieldErrors::new();
    let t = spec_type(svc);
    if !["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"].contains(&t.as_str()) {
        errs.push((
            "spec.type".into(),
            format!(
                "Unsupported value: {}: supported values: \"ClusterIP\", \"ExternalName\", \"LoadBalancer\", \"NodePort\"",
                go_quote(&t)
            ),
        ));
        return errs;
    }
    let headless = requested_ips(svc).first().map(String::as_str) == Some("None");
    let spec = spec_mut(svc);
    spec.insert("type".into(), json!(t));
    spec.entry("sessionAffinity").or_insert(json!("None"));
    if t != "ExternalName" {
        spec.entry("internalTrafficPolicy")
            .or_insert(json!("Cluster"));
    } else if spec
        .get("externalName")
        .and_then(Value::as_str)
        .is_none_or(str::is_empty)
    {
        errs.push(("spec.externalName".into(), "Required value".into()));
    }
    if needs_node_ports(&t) {
        spec.entry("externalTrafficPolicy")
            .or_insert(json!("Cluster"));
    }
    let ports = spec.get_mut("ports").and_then(Value::as_array_mut);
    match ports {
        None => {
            if !headless && t != "ExternalName" {
                errs.push(("spec.ports".into(), "Required value".into()));
            }
        }
        Some(ports) => {
            if ports.is_empty() && !headless && t != "ExternalName" {
                errs.push(("spec.ports".into(), "Required value".into()));
            }
            let many = ports.len() > 1;
            let mut names = BTreeSet::new();
            for (i, p) in ports.iter_mut().enumerate() {
                let Some(p) = p.as_object_mut() else {
                    errs.push((
                        format!("spec.ports[{i}]"),
                        "Invalid value: must be an object".into(),
                    ));
                    continue;
                };
                p.entry("protocol").or_insert(json!("TCP"));
                let port = p.get("port").and_then(Value::as_i64).unwrap_or(0);
                if !p.contains_key("targetPort") {
                    p.insert("targetPort".into(), json!(port));
                }
                // validateServicePort's order: the name, the port, then the target port
                // (defaulted to the port, so a port 0 is reported twice, as upstream does).
                let name = p
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string();
                if many && name.is_empty() {
                    errs.push((format!("spec.ports[{i}].name"), "Required value".into()));
                } else if !name.is_empty() && !names.insert(name.clone()) {
                    errs.push((
                        format!("spec.ports[{i}].name"),
                        format!("Duplicate value: {}", go_quote(&name)),
                    ));
                }
                if !(1..=65535).contains(&port) {
                    errs.push((
                        format!("spec.ports[{i}].port"),
                        format!("Invalid value: {port}: must be between 1 and 65535, inclusive"),
                    ));
                }
                if let Some(target) = p.get("targetPort").and_then(Value::as_i64)
                    && !(1..=65535).contains(&target)
                {
                    errs.push((
                        format!("spec.ports[{i}].targetPort"),
                        format!("Invalid value: {target}: must be between 1 and 65535, inclusive"),
                    ));
                }
            }
        }
    }
    errs
}

impl AllocConfig {
    fn families(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        for r in &self.ranges {
            let f = net_family(r);
            if !out.contains(&f) {
                out.push(f);
            }
        }
        out
    }

    fn primary_range(&self, fam: &str) -> Option<IpNet> {
        self.ranges.iter().copied().find(|r| net_family(r) == fam)
    }

    /// Configured ranges plus the CIDRs of every ServiceCIDR object.
    fn all_ranges(&self, st: &State) -> Vec<IpNet> {
        let mut out = self.ranges.clone();
        for obj in st.objects[self.servicecidr_idx].values() {
            if let Ok(v) = obj.value()
                && let Some(cidrs) = v.pointer("/spec/cidrs").and_then(Value::as_array)
            {
                out.extend(
                    cidrs
                        .iter()
                        .filter_map(Value::as_str)
                        .filter_map(|c| c.parse::<IpNet>().ok()),
                );
            }
        }
        out
    }

    fn in_range(&self, st: &State, ip: IpAddr) -> bool {
        self.all_ranges(st).iter().any(|r| {
            r.contains(&ip)
                && ip != r.network()
                && !(ip.is_ipv4() && ip == r.broadcast() && r.prefix_len() < 31)
        })
    }

    fn ip_taken(&self, st: &State, ip: IpAddr) -> bool {
        st.contains(self.ipaddress_idx, "", &ip.to_string())
    }

    fn dynamic_ip(&self, st: &State, range: IpNet, planned: &[IpAddr]) -> Option<IpAddr> {
        let host_bits = u32::from(range.max_prefix_len() - range.prefix_len()).min(64);
        let size: u128 = 1u128 << host_bits;
        if size < 4 {
            return None;
        }
        let base = ip_to_u128(range.network());
        let max_off = if range.addr().is_ipv4() {
            size - 2
        } else {
            size - 1
        };
        // kube-apiserver hands out dynamic IPs from the upper band first, keeping the lower
        // band for static requests.
        let lower = (size / 16).clamp(16, 256).min(max_off / 2);
        let mut rng = rand::rng();
        let bands = [(lower + 1, max_off), (1, lower)];
        for (lo, hi) in bands {
            if lo > hi {
                continue;
            }
            let span = hi - lo + 1;
            let start = rng.random_range(0..span);
            for i in 0..span {
                let off = lo + (start + i) % span;
                let ip = u128_to_ip(base + off, range.addr().is_ipv4());
                if !self.ip_taken(st, ip) && !planned.contains(&ip) {
                    return Some(ip);
                }
            }
        }
        None
    }

    fn port_in_range(&self, p: i64) -> bool {
        (i64::from(self.node_ports.0)..=i64::from(self.node_ports.1)).contains(&p)
    }

    fn port_range_str(&self) -> String {
        format!("{}-{}", self.node_ports.0, self.node_ports.1)
    }

    fn dynamic_port(&self, st: &State, planned: &[u16]) -> Option<u16> {
        let (lo, hi) = self.node_ports;
        if lo > hi {
            return None;
        }
        let span = u32::from(hi - lo) + 1;
        let start = rand::rng().random_range(0..span);
        (0..span)
            .map(|i| lo + ((start + i) % span) as u16)
            .find(|p| !st.node_ports.contains(p) && !planned.contains(p))
    }
}

fn ip_to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

fn u128_to_ip(v: u128, v4: bool) -> IpAddr {
    if v4 {
        IpAddr::from(std::net::Ipv4Addr::from((v & 0xffff_ffff) as u32))
    } else {
        IpAddr::from(std::net::Ipv6Addr::from(v))
    }
}

/// A list of strings as kube-apiserver's field errors print a list value: `["a","b"]`.
fn json_literal(ips: &[String]) -> String {
    serde_json::to_string(ips).unwrap_or_default()
}

fn ips_literal(ips: &[String]) -> String {
    format!(
        "[]string{{{}}}",
        ips.iter()
            .map(|s| go_quote(s))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// Allocates ClusterIPs for a Service that has none yet (create, or leaving ExternalName).
fn allocate_cluster_ips(
    cfg: &AllocConfig,
    st: &State,
    svc: &mut Value,
    plan: &mut Plan,
    errs: &mut FieldErrors,
    dry_run: bool,
) {
    if spec_type(svc) == "ExternalName" {
        return;
    }
    let requested = requested_ips(svc);
    let configured = cfg.families();
    let primary = configured.first().copied().unwrap_or("IPv4");
    let policy = str_field(svc, &["spec", "ipFamilyPolicy"])
        .unwrap_or("SingleStack")
        .to_string();
    if requested.first().map(String::as_str) == Some("None") {
        let spec = spec_mut(svc);
        spec.insert("clusterIP".into(), json!("None"));
        spec.insert("clusterIPs".into(), json!(["None"]));
        spec.entry("ipFamilies").or_insert(json!([primary]));
        spec.entry("ipFamilyPolicy").or_insert(json!("SingleStack"));
        return;
    }
    let mut parsed: Vec<IpAddr> = Vec::new();
    for (i, s) in requested.iter().enumerate() {
        match s.parse::<IpAddr>() {
            Ok(ip) => parsed.push(ip),
            Err(_) => errs.push((
                format!("spec.clusterIPs[{i}]"),
                format!(
                    "Invalid value: {}: must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)",
                    go_quote(s)
                ),
            )),
        }
    }
    if requested.len() > 2 {
        errs.push((
            "spec.clusterIPs".into(),
            format!(
                "Invalid value: {}: may only hold up to 2 values",
                json_literal(&requested)
            ),
        ));
    }
    if !errs.is_empty() {
        return;
    }
    let mut families: Vec<&'static str> = svc
        .pointer("/spec/ipFamilies")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(|f| if f == "IPv6" { "IPv6" } else { "IPv4" })
                .collect()
        })
        .unwrap_or_default();
    if families.is_empty() {
        families = parsed.iter().map(family).collect();
    }
    let want = match policy.as_str() {
        "SingleStack" => 1,
        "PreferDualStack" => configured.len().clamp(1, 2),
        "RequireDualStack" => {
            if configured.len() < 2 {
                errs.push((
                    "spec.ipFamilyPolicy".into(),
                    "Invalid value: \"RequireDualStack\": this cluster is not configured for dual-stack services".into(),
                ));
                return;
            }
            2
        }
        other => {
            errs.push((
                "spec.ipFamilyPolicy".into(),
                format!(
                    "Unsupported value: {}: supported values: \"SingleStack\", \"PreferDualStack\", \"RequireDualStack\"",
                    go_quote(other)
                ),
            ));
            return;
        }
    };
    for f in configured.iter() {
        if families.len() >= want {
            break;
        }
        if !families.contains(f) {
            families.push(f);
        }
    }
    if families.is_empty() {
        families.push(primary);
    }
    families.truncate(want.max(parsed.len()));
    for (i, f) in families.iter().enumerate() {
        if !configured.contains(f) {
            errs.push((
                format!("spec.ipFamilies[{i}]"),
                format!(
                    "Invalid value: {}: not configured on this cluster",
                    go_quote(f)
                ),
            ));
        }
    }
    if !errs.is_empty() {
        return;
    }
    let mut out: Vec<String> = Vec::new();
    for (i, fam) in families.iter().enumerate() {
        let ip = match parsed.get(i) {
            Some(ip) => {
                if family(ip) != *fam {
                    errs.push((
                        format!("spec.clusterIPs[{i}]"),
                        format!("Invalid value: {}: expected an {fam} value as indicated by `ipFamilies[{i}]`", go_quote(&ip.to_string())),
                    ));
                    return;
                }
                if !cfg.in_range(st, *ip) {
                    let valid = cfg
                        .primary_range(fam)
                        .map(|r| r.to_string())
                        .unwrap_or_default();
                    errs.push((
                        "spec.clusterIPs".into(),
                        format!(
                            "Invalid value: {}: failed to allocate IP {ip}: the provided IP ({ip}) is not in the valid range. The range of valid IPs is {valid}",
                            ips_literal(&requested)
                        ),
                    ));
                    return;
                }
                if !dry_run && (cfg.ip_taken(st, *ip) || plan.allocate_ips.contains(ip)) {
                    errs.push((
                        "spec.clusterIPs".into(),
                        format!(
                            "Invalid value: {}: failed to allocate IP {ip}: provided IP is already allocated",
                            ips_literal(&requested)
                        ),
                    ));
                    return;
                }
                *ip
            }
            None => {
                let Some(range) = cfg.primary_range(fam) else {
                    errs.push((
                        format!("spec.ipFamilies[{i}]"),
                        format!(
                            "Invalid value: {}: not configured on this cluster",
                            go_quote(fam)
                        ),
                    ));
                    return;
                };
                match cfg.dynamic_ip(st, range, &plan.allocate_ips) {
                    Some(ip) => ip,
                    None => {
                        errs.push((
                            "spec.clusterIPs".into(),
                            format!("Internal error: failed to allocate a serviceIP: range is full ({range})"),
                        ));
                        return;
                    }
                }
            }
        };
        plan.allocate_ips.push(ip);
        out.push(ip.to_string());
    }
    let policy = if out.len() > 1 && policy == "SingleStack" {
        "RequireDualStack".to_string()
    } else {
        policy
    };
    let spec = spec_mut(svc);
    spec.insert("clusterIP".into(), json!(out[0]));
    spec.insert("clusterIPs".into(), json!(out));
    spec.insert("ipFamilies".into(), json!(families));
    spec.insert("ipFamilyPolicy".into(), json!(policy));
}

fn node_port_of(p: &Value) -> Option<i64> {
    p.get("nodePort")
        .and_then(Value::as_i64)
        .filter(|n| *n != 0)
}

/// Allocates node ports (and the health-check port) for `svc`, reusing those of `old` where the
/// request leaves them unset, as kube-apiserver's `patchAllocatedValues` does.
fn allocate_node_ports(
    cfg: &AllocConfig,
    st: &State,
    old: Option<&Value>,
    svc: &mut Value,
    plan: &mut Plan,
    errs: &mut FieldErrors,
) {
    let t = spec_type(svc);
    let old_ports: Vec<Value> = old
        .and_then(|o| o.pointer("/spec/ports"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let old_set: BTreeSet<i64> = old_ports.iter().filter_map(node_port_of).collect();
    let old_hc = old
        .and_then(|o| o.pointer("/spec/healthCheckNodePort"))
        .and_then(Value::as_i64)
        .filter(|n| *n != 0);
    let mut keep: BTreeSet<i64> = BTreeSet::new();
    if needs_node_ports(&t) {
        let ports = svc.pointer_mut("/spec/ports").and_then(Value::as_array_mut);
        if let Some(ports) = ports {
            for (i, p) in ports.iter_mut().enumerate() {
                let mut np = node_port_of(p);
                if np.is_none() {
                    let name = p.get("name").and_then(Value::as_str).unwrap_or("");
                    let port = p.get("port").and_then(Value::as_i64);
                    np = old_ports
                        .iter()
                        .find(|o| {
                            o.get("name").and_then(Value::as_str).unwrap_or("") == name
                                && o.get("port").and_then(Value::as_i64) == port
                        })
                        .and_then(node_port_of);
                }
                let value = match np {
                    Some(n) if old_set.contains(&n) => n,
                    Some(n) => {
                        if !cfg.port_in_range(n) {
                            errs.push((
                                format!("spec.ports[{i}].nodePort"),
                                format!(
                                    "Invalid value: {n}: provided port is not in the valid range. The range of valid ports is {}",
                                    cfg.port_range_str()
                                ),
                            ));
                            continue;
                        }
                        let n16 = n as u16;
                        if st.node_ports.contains(&n16) || plan.allocate_ports.contains(&n16) {
                            errs.push((
                                format!("spec.ports[{i}].nodePort"),
                                format!("Invalid value: {n}: provided port is already allocated"),
                            ));
                            continue;
                        }
                        plan.allocate_ports.push(n16);
                        n
                    }
                    None => match cfg.dynamic_port(st, &plan.allocate_ports) {
                        Some(n) => {
                            plan.allocate_ports.push(n);
                            i64::from(n)
                        }
                        None => {
                            errs.push((
                                format!("spec.ports[{i}].nodePort"),
                                "Internal error: range is full".into(),
                            ));
                            continue;
                        }
                    },
                };
                keep.insert(value);
                p["nodePort"] = json!(value);
            }
        }
    } else if let Some(ports) = svc.pointer("/spec/ports").and_then(Value::as_array) {
        for (i, p) in ports.iter().enumerate() {
            if node_port_of(p).is_some() {
                errs.push((
                    format!("spec.ports[{i}].nodePort"),
                    format!("Forbidden: may not be used when `type` is '{t}'"),
                ));
            }
        }
    }
    let requested_hc = svc
        .pointer("/spec/healthCheckNodePort")
        .and_then(Value::as_i64)
        .filter(|n| *n != 0);
    if needs_health_check(svc) {
        let hc = match requested_hc.or(old_hc) {
            Some(n) if Some(n) == old_hc => Some(n),
            Some(n) => {
                let n16 = n as u16;
                if !cfg.port_in_range(n) {
                    errs.push((
                        "spec.healthCheckNodePort".into(),
                        format!(
                            "Invalid value: {n}: provided port is not in the valid range. The range of valid ports is {}",
                            cfg.port_range_str()
                        ),
                    ));
                    None
                } else if st.node_ports.contains(&n16) || plan.allocate_ports.contains(&n16) {
                    errs.push((
                        "spec.healthCheckNodePort".into(),
                        format!("Invalid value: {n}: provided port is already allocated"),
                    ));
                    None
                } else {
                    plan.allocate_ports.push(n16);
                    Some(n)
                }
            }
            None => cfg.dynamic_port(st, &plan.allocate_ports).map(|n| {
                plan.allocate_ports.push(n);
                i64::from(n)
            }),
        };
        if let Some(hc) = hc {
            keep.insert(hc);
            spec_mut(svc).insert("healthCheckNodePort".into(), json!(hc));
        }
    } else if requested_hc.is_some() && requested_hc != old_hc {
        errs.push((
            "spec.healthCheckNodePort".into(),
            "Forbidden: may only be set when `type` is 'LoadBalancer' and `externalTrafficPolicy` is 'Local'".into(),
        ));
    } else {
        spec_mut(svc).remove("healthCheckNodePort");
    }
    for p in old_set.iter().chain(old_hc.iter()) {
        if !keep.contains(p) {
            plan.release_ports.push(*p as u16);
        }
    }
}

/// Allocation for a new Service. Returns field errors (422) if a request cannot be honoured.
/// Allocation for a create. A dry run, as kube-apiserver's dry-run allocators, checks that a
/// requested cluster IP lies in range but not whether it is taken.
pub fn on_create(
    cfg: &AllocConfig,
    st: &State,
    svc: &mut Value,
    dry_run: bool,
) -> Result<Plan, FieldErrors> {
    let mut plan = Plan::default();
    let mut errs = FieldErrors::new();
    if !cfg.enabled {
        return Ok(plan);
    }
    allocate_cluster_ips(cfg, st, svc, &mut plan, &mut errs, dry_run);
    allocate_node_ports(cfg, st, None, svc, &mut plan, &mut errs);
    if errs.is_empty() { Ok(plan) } else { Err(errs) }
}

fn has_ips(v: &Value) -> bool {
    let r = requested_ips(v);
    !r.is_empty() && r[0] != "None"
}

/// Allocation for an update: ClusterIPs are immutable once set (omitted ones are carried over),
/// node ports are carried over, reallocated or released following the new type.
pub fn on_update(
    cfg: &AllocConfig,
    st: &State,
    old: &Value,
    svc: &mut Value,
) -> Result<Plan, FieldErrors> {
    let mut plan = Plan::default();
    let mut errs = FieldErrors::new();
    if !cfg.enabled {
        return Ok(plan);
    }
    let new_type = spec_type(svc);
    let old_ips = requested_ips(old);
    if new_type == "ExternalName" {
        for ip in old_ips.iter().filter_map(|s| s.parse::<IpAddr>().ok()) {
            plan.release_ips.push(ip);
        }
        let spec = spec_mut(svc);
        for k in ["clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy"] {
            spec.remove(k);
        }
    } else if !old_ips.is_empty() {
        let new_ips = requested_ips(svc);
        if new_ips.is_empty() {
            let spec = spec_mut(svc);
            for k in ["clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy"] {
                if let Some(v) = old.pointer(&format!("/spec/{k}")) {
                    spec.insert(k.into(), v.clone());
                }
            }
        } else if new_ips[0] != old_ips[0] {
            errs.push((
                "spec.clusterIPs[0]".into(),
                format!(
                    "Invalid value: {}: may not change once set",
                    ips_literal(&new_ips)
                ),
            ));
        } else {
            // A dual-stack upgrade adds a secondary IP: allocated as on create, so a taken or
            // out-of-range one is refused as kube-apiserver refuses it.
            for (i, added) in new_ips.iter().enumerate().skip(old_ips.len()) {
                let Ok(ip) = added.parse::<IpAddr>() else {
                    continue;
                };
                let problem = if !cfg.in_range(st, ip) {
                    Some(format!("the provided IP ({ip}) is not in the valid range"))
                } else if cfg.ip_taken(st, ip) {
                    Some("provided IP is already allocated".to_owned())
                } else {
                    None
                };
                match problem {
                    Some(problem) => errs.push((
                        format!("spec.clusterIPs[{i}]"),
                        format!(
                            "Invalid value: {}: failed to allocate IP {ip}: {problem}",
                            ips_literal(&new_ips)
                        ),
                    )),
                    None => plan.allocate_ips.push(ip),
                }
            }
            let spec = spec_mut(svc);
            spec.insert("clusterIP".into(), json!(new_ips[0]));
            spec.insert("clusterIPs".into(), json!(new_ips));
            for k in ["ipFamilies", "ipFamilyPolicy"] {
                if !spec.contains_key(k)
                    && let Some(v) = old.pointer(&format!("/spec/{k}"))
                {
                    spec.insert(k.into(), v.clone());
                }
            }
        }
    } else if !has_ips(svc) || spec_type(old) == "ExternalName" {
        allocate_cluster_ips(cfg, st, svc, &mut plan, &mut errs, false);
    }
    allocate_node_ports(cfg, st, Some(old), svc, &mut plan, &mut errs);
    if errs.is_empty() { Ok(plan) } else { Err(errs) }
}

/// What deleting `old` releases: its node ports and the IPAddresses that point back to it.
pub fn on_delete(cfg: &AllocConfig, old: &Value) -> Plan {
    let mut plan = Plan::default();
    if !cfg.enabled {
        return plan;
    }
    plan.release_ips = requested_ips(old)
        .iter()
        .filter_map(|s| s.parse::<IpAddr>().ok())
        .collect();
    if let Some(ports) = old.pointer("/spec/ports").and_then(Value::as_array) {
        plan.release_ports = ports
            .iter()
            .filter_map(node_port_of)
            .map(|p| p as u16)
            .collect();
    }
    if let Some(hc) = old
        .pointer("/spec/healthCheckNodePort")
        .and_then(Value::as_i64)
        .filter(|n| *n != 0)
    {
        plan.release_ports.push(hc as u16);
    }
    plan
}

/// Writes IPAddress objects and the node-port bitmap for `plan`.
pub fn apply(
    cfg: &AllocConfig,
    st: &mut State,
    plan: &Plan,
    ns: &str,
    name: &str,
) -> Result<(), crate::errors::ApiError> {
    for ip in &plan.release_ips {
        let key = ip.to_string();
        let owned = st.get(cfg.ipaddress_idx, "", &key).is_some_and(|s| {
            s.value().ok().is_some_and(|v| {
                v.pointer("/spec/parentRef/namespace")
                    .and_then(Value::as_str)
                    == Some(ns)
                    && v.pointer("/spec/parentRef/name").and_then(Value::as_str) == Some(name)
                    && v.pointer("/spec/parentRef/resource")
                        .and_then(Value::as_str)
                        == Some("services")
            })
        });
        if owned {
            st.commit_delete(cfg.ipaddress_idx, "", &key)?;
        }
    }
    for p in &plan.release_ports {
        st.node_ports.remove(p);
    }
    for ip in &plan.allocate_ips {
        let obj = json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "IPAddress",
            "metadata": {
                "name": ip.to_string(),
                "uid": crate::meta::new_uid(),
                "creationTimestamp": crate::meta::now_rfc3339(),
                "labels": {
                    "ipaddress.kubernetes.io/ip-family": family(ip),
                    "ipaddress.kubernetes.io/managed-by": "ipallocator.k8s.io",
                },
            },
            "spec": {
                // kube-apiserver's allocator leaves `group` empty, which it does not serialize.
                "parentRef": {
                    "resource": "services",
                    "namespace": ns,
                    "name": name,
                },
            },
        });
        st.commit_put(cfg.ipaddress_idx, "", &ip.to_string(), obj)?;
    }
    for p in &plan.allocate_ports {
        st.node_ports.insert(*p);
    }
    Ok(())
}
