//! The write and read operations behind the REST handlers, the backdoor and the namespace
//! lifecycle. Every operation takes the global lock once, so each is atomic.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use bytes::Bytes;
use serde_json::{Map, Value, json};
use tokio::sync::watch;

use crate::convert;
use crate::errors::ApiError;
use crate::faults::Faults;
use crate::meta::{
    dns1123_label_errors, dns1123_subdomain_errors, finalizers_of, generated_suffix, go_quote,
    meta_str, metadata, metadata_mut, new_uid, now_rfc3339,
};
use crate::resources::{self, RESOURCES, ResIdx};
use crate::services::{self, AllocConfig};
use crate::ssa;
use crate::store::State;

/// State shared by the server, the handle and background tasks.
#[derive(Debug)]
pub struct Shared {
    state: RwLock<State>,
    /// Publishes the latest resourceVersion; watchers wake on change.
    pub rv_tx: watch::Sender<u64>,
    pub alloc: AllocConfig,
    pub namespace_finalize_delay: Duration,
    pub bookmark_interval: Duration,
    pub ready: AtomicBool,
    /// Emulates the NamespaceLifecycle admission plugin's immortal namespaces.
    pub protect_system_namespaces: AtomicBool,
    /// Whether `networking.k8s.io/v1` is served (Kubernetes 1.33+); 404 otherwise.
    pub serve_networking_v1: AtomicBool,
    pub faults: Faults,
    pub ns_idx: ResIdx,
    pub svc_idx: ResIdx,
}

/// How a PATCH body is to be interpreted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchKind {
    Merge,
    Json,
    StrategicMerge,
    Apply,
}

/// Namespaces kube-apiserver's NamespaceLifecycle admission plugin refuses to delete.
pub const IMMORTAL_NAMESPACES: [&str; 3] = ["default", "kube-system", "kube-public"];

/// Per-request write settings.
#[derive(Debug, Clone, Copy, Default)]
pub struct WriteOptions<'a> {
    pub dry_run: bool,
    /// The `fieldManager` query parameter.
    pub field_manager: Option<&'a str>,
    /// Who a non-apply write is attributed to (fieldManager, else the User-Agent's product).
    pub updater: &'a str,
    /// The `force` query parameter (server-side apply).
    pub force: bool,
}

/// Outcome of a write: the object bytes and whether it was newly created (201 vs 200).
#[derive(Debug)]
pub struct Written {
    pub json: Bytes,
    pub created: bool,
}

/// Index of a core-group resource; the table always contains the ones asked for here.
fn idx(plural: &str) -> ResIdx {
    RESOURCES
        .iter()
        .position(|r| r.group.is_empty() && r.plural == plural)
        .unwrap_or(0)
}

impl Shared {
    pub fn new(
        alloc_enabled: bool,
        ranges: Vec<ipnet::IpNet>,
        node_ports: (u16, u16),
        window: usize,
        namespace_finalize_delay: Duration,
        bookmark_interval: Duration,
    ) -> Self {
        let (rv_tx, _) = watch::channel(1);
        let ipaddress_idx = resources::find("networking.k8s.io", "v1", "ipaddresses").unwrap_or(0);
        let servicecidr_idx =
            resources::find("networking.k8s.io", "v1", "servicecidrs").unwrap_or(0);
        Self {
            state: RwLock::new(State::new(window)),
            rv_tx,
            alloc: AllocConfig {
                enabled: alloc_enabled,
                ranges,
                node_ports,
                ipaddress_idx,
                servicecidr_idx,
            },
            namespace_finalize_delay,
            // tokio's interval panics on zero.
            bookmark_interval: bookmark_interval.max(Duration::from_millis(1)),
            ready: AtomicBool::new(true),
            protect_system_namespaces: AtomicBool::new(false),
            serve_networking_v1: AtomicBool::new(true),
            faults: Faults::default(),
            ns_idx: idx("namespaces"),
            svc_idx: idx("services"),
        }
    }

    /// The global lock, for writing. A panic while holding it cannot leave a half-written
    /// object (writes are single inserts), so a poisoned lock is still usable.
    pub fn lock(&self) -> RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    /// The global lock, for reading: concurrent LISTs, GETs and watch catch-ups are served in
    /// parallel, as kube-apiserver serves them from its watch cache.
    pub fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn publish(&self, st: &State) {
        self.rv_tx.send_replace(st.rv);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    pub fn current_rv(&self) -> u64 {
        self.read().rv
    }

    pub fn get(&self, res: ResIdx, ns: &str, name: &str) -> Result<Bytes, ApiError> {
        self.read()
            .get(res, ns, name)
            .map(|s| s.json.clone())
            .ok_or_else(|| ApiError::not_found(&RESOURCES[res], name))
    }

    /// Checks body apiVersion/kind and URL/body namespace and name agreement; fills them in.
    fn normalize_body(
        &self,
        res: ResIdx,
        ns: &str,
        url_name: Option<&str>,
        body: &mut Value,
    ) -> Result<(), ApiError> {
        let def = &RESOURCES[res];
        let Some(root) = body.as_object_mut() else {
            return Err(ApiError::bad_request(
                "the body of the request must be a JSON object",
            ));
        };
        let api_version = def.api_version();
        if let Some(av) = root.get("apiVersion").and_then(Value::as_str)
            && !av.is_empty()
            && av != api_version
        {
            return Err(ApiError::bad_request(format!(
                "the API version in the data ({av}) does not match the expected API version ({api_version})"
            )));
        }
        if let Some(k) = root.get("kind").and_then(Value::as_str)
            && !k.is_empty()
            && k != def.kind
        {
            return Err(ApiError::bad_request(format!(
                "the kind in the data ({k}) does not match the expected kind ({})",
                def.kind
            )));
        }
        root.insert("apiVersion".into(), json!(api_version));
        root.insert("kind".into(), json!(def.kind));
        let m = metadata_mut(body);
        if def.namespaced {
            match m.get("namespace").and_then(Value::as_str) {
                Some(n) if !n.is_empty() && n != ns => {
                    return Err(ApiError::bad_request(
                        "the namespace of the provided object does not match the namespace sent on the request",
                    ));
                }
                _ => {
                    m.insert("namespace".into(), json!(ns));
                }
            }
        } else {
            m.remove("namespace");
        }
        if let Some(url_name) = url_name {
            match m.get("name").and_then(Value::as_str) {
                Some(n) if !n.is_empty() && n != url_name => {
                    return Err(ApiError::bad_request(format!(
                        "the name of the object ({n}) does not match the name on the URL ({url_name})"
                    )));
                }
                _ => {
                    m.insert("name".into(), json!(url_name));
                }
            }
        }
        Ok(())
    }

    fn validate(&self, res: ResIdx, name: &str, obj: &mut Value) -> Vec<(String, String)> {
        let def = &RESOURCES[res];
        let mut errs = Vec::new();
        let name_err = match (def.group, def.plural) {
            ("", "namespaces") | ("", "services") => dns1123_label_errors(name),
            ("networking.k8s.io", "ipaddresses") => ip_address_name_error(name),
            _ => dns1123_subdomain_errors(name),
        };
        if let Some(e) = name_err {
            errs.push((
                "metadata.name".into(),
                format!("Invalid value: {}: {e}", go_quote(name)),
            ));
        }
        errs.extend(crate::meta::label_errors(obj));
        match (def.group, def.plural) {
            ("", "services") => errs.extend(services::default_and_validate(obj)),
            ("networking.k8s.io", "ipaddresses") => {
                // Empty optional strings are not serialized by kube-apiserver: a `group: ""`
                // sent for a core parent comes back without `group`.
                if let Some(parent) = obj
                    .pointer_mut("/spec/parentRef")
                    .and_then(Value::as_object_mut)
                {
                    for f in ["group", "namespace"] {
                        if parent.get(f).and_then(Value::as_str) == Some("") {
                            parent.remove(f);
                        }
                    }
                }
                if obj.pointer("/spec/parentRef").is_none_or(Value::is_null) {
                    errs.push(("spec.parentRef".into(), "Required value".into()));
                } else {
                    for f in ["resource", "name"] {
                        if obj
                            .pointer(&format!("/spec/parentRef/{f}"))
                            .and_then(Value::as_str)
                            .is_none_or(str::is_empty)
                        {
                            errs.push((format!("spec.parentRef.{f}"), "Required value".into()));
                        }
                    }
                }
            }
            // kube-apiserver's ValidateLeaseSpec: a Lease that could never expire (or never
            // be held) is refused.
            ("coordination.k8s.io", "leases") => {
                if let Some(seconds) = obj
                    .pointer("/spec/leaseDurationSeconds")
                    .and_then(Value::as_i64)
                    && seconds <= 0
                {
                    errs.push((
                        "spec.leaseDurationSeconds".into(),
                        format!("Invalid value: {seconds}: must be greater than 0"),
                    ));
                }
                if let Some(count) = obj
                    .pointer("/spec/leaseTransitions")
                    .and_then(Value::as_i64)
                    && count < 0
                {
                    errs.push((
                        "spec.leaseTransitions".into(),
                        format!("Invalid value: {count}: must be greater than or equal to 0"),
                    ));
                }
            }
            ("networking.k8s.io", "servicecidrs") => {
                let cidrs = obj.pointer("/spec/cidrs").and_then(Value::as_array);
                match cidrs {
                    None => errs.push(("spec.cidrs".into(), "Required value".into())),
                    Some(c) if c.is_empty() => {
                        errs.push(("spec.cidrs".into(), "Required value".into()))
                    }
                    Some(c) => {
                        for (i, v) in c.iter().enumerate() {
                            let s = v.as_str().unwrap_or("");
                            if s.parse::<ipnet::IpNet>().is_err() {
                                errs.push((
                                    format!("spec.cidrs[{i}]"),
                                    format!(
                                        "Invalid value: {}: must be a valid CIDR value, (e.g. 10.9.8.0/24 or 2001:db8::/64)",
                                        go_quote(s)
                                    ),
                                ));
                            }
                        }
                    }
                }
            }
            ("", "secrets") => errs.extend(default_and_validate_secret(obj)),
            ("", "endpoints") => {
                let subsets = obj.get("subsets").and_then(Value::as_array);
                for (i, subset) in subsets.into_iter().flatten().enumerate() {
                    for list in ["addresses", "notReadyAddresses"] {
                        let addrs = subset.get(list).and_then(Value::as_array);
                        for (j, a) in addrs.into_iter().flatten().enumerate() {
                            let ip = a.get("ip").and_then(Value::as_str).unwrap_or("");
                            let field = format!("subsets[{i}].{list}[{j}].ip");
                            match ip.parse::<std::net::IpAddr>() {
                                Ok(parsed) => {
                                    if let Some(why) = endpoint_ip_error(parsed) {
                                        errs.push((field, format!("Invalid value: {}: {why}", go_quote(ip))));
                                    }
                                }
                                Err(_) => errs.push((
                                    field,
                                    format!("Invalid value: {}: must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)", go_quote(ip)),
                                )),
                            }
                        }
                    }
                    let ports = subset.get("ports").and_then(Value::as_array);
                    // validateEndpointPort: with several ports each needs its name.
                    let many = ports.is_some_and(|p| p.len() > 1);
                    for (j, p) in ports.into_iter().flatten().enumerate() {
                        if many
                            && p.get("name")
                                .and_then(Value::as_str)
                                .is_none_or(str::is_empty)
                        {
                            errs.push((
                                format!("subsets[{i}].ports[{j}].name"),
                                "Required value".into(),
                            ));
                        }
                        let port = p.get("port").and_then(Value::as_i64).unwrap_or(0);
                        if !(1..=65535).contains(&port) {
                            errs.push((
                                format!("subsets[{i}].ports[{j}].port"),
                                format!(
                                    "Invalid value: {port}: must be between 1 and 65535, inclusive"
                                ),
                            ));
                        }
                    }
                }
            }
            ("discovery.k8s.io", "endpointslices") => {
                let at = obj.get("addressType").and_then(Value::as_str);
                if let Some(family @ ("IPv4" | "IPv6")) = at {
                    let eps = obj.get("endpoints").and_then(Value::as_array);
                    for (i, ep) in eps.into_iter().flatten().enumerate() {
                        let addrs = ep.get("addresses").and_then(Value::as_array);
                        for (j, a) in addrs.into_iter().flatten().enumerate() {
                            let text = a.as_str().unwrap_or("");
                            let field = format!("endpoints[{i}].addresses[{j}]");
                            match text.parse::<std::net::IpAddr>() {
                                Ok(ip) if (family == "IPv4") == ip.is_ipv4() => {
                                    if let Some(why) = endpoint_ip_error(ip) {
                                        errs.push((
                                            field,
                                            format!("Invalid value: {}: {why}", go_quote(text)),
                                        ));
                                    }
                                }
                                _ => errs.push((
                                    field,
                                    format!(
                                        "Invalid value: {}: must be a valid {family} address",
                                        go_quote(text)
                                    ),
                                )),
                            }
                        }
                    }
                }
                match at {
                    None => errs.push(("addressType".into(), "Required value".into())),
                    Some("IPv4" | "IPv6" | "FQDN") => {}
                    Some(o) => errs.push((
                        "addressType".into(),
                        format!(
                            "Unsupported value: {}: supported values: \"FQDN\", \"IPv4\", \"IPv6\"",
                            go_quote(o)
                        ),
                    )),
                }
            }
            _ => {}
        }
        errs
    }

    fn check_namespace(
        &self,
        st: &State,
        res: ResIdx,
        ns: &str,
        name: &str,
    ) -> Result<(), ApiError> {
        if !RESOURCES[res].namespaced {
            return Ok(());
        }
        let Some(nsobj) = st.get(self.ns_idx, "", ns) else {
            let mut e = ApiError::not_found(&RESOURCES[self.ns_idx], ns);
            e.details = Some(json!({"name": ns, "kind": "namespaces"}));
            return Err(e);
        };
        let terminating = nsobj.value().ok().is_some_and(|v| {
            meta_str(&v, "deletionTimestamp").is_some()
                || v.pointer("/status/phase").and_then(Value::as_str) == Some("Terminating")
        });
        if terminating {
            let mut e = ApiError::forbidden(
                &RESOURCES[res],
                name,
                &format!(
                    "unable to create new content in namespace {ns} because it is being terminated"
                ),
            );
            if let Some(d) = e.details.as_mut() {
                d["causes"] = json!([{
                    "reason": "NamespaceTerminating",
                    "message": format!("namespace {ns} is being terminated"),
                    "field": "metadata.namespace",
                }]);
            }
            return Err(e);
        }
        Ok(())
    }

    /// POST: create a new object.
    pub fn create(
        &self,
        res: ResIdx,
        ns: &str,
        mut body: Value,
        dry_run: bool,
    ) -> Result<Bytes, ApiError> {
        self.normalize_body(res, ns, None, &mut body)?;
        // events.k8s.io/v1 is stored as core/v1 Events; which API created one decides its checks.
        let events_v1 = convert::is_converted(res);
        let mut body = convert::to_storage(res, body);
        let res = convert::storage_idx(res);
        let def = &RESOURCES[res];
        let name = match meta_str(&body, "name") {
            Some(n) => n.to_string(),
            None => match meta_str(&body, "generateName") {
                Some(prefix) => format!("{prefix}{}", generated_suffix()),
                None => {
                    return Err(ApiError::invalid(
                        def,
                        "",
                        &[(
                            "metadata.name".into(),
                            "Required value: name or generateName is required".into(),
                        )],
                    ));
                }
            },
        };
        if meta_str(&body, "resourceVersion").is_some() {
            return Err(ApiError::internal(
                "resourceVersion should not be set on objects to be created",
            ));
        }
        {
            let m = metadata_mut(&mut body);
            m.insert("name".into(), json!(name));
            m.insert("uid".into(), json!(new_uid()));
            m.insert("creationTimestamp".into(), json!(now_rfc3339()));
            m.remove("deletionTimestamp");
            m.remove("deletionGracePeriodSeconds");
            m.remove("generation");
            m.remove("managedFields");
        }
        if res == self.ns_idx {
            prepare_namespace(&mut body, &name);
        }
        // kube-apiserver's PrepareForCreate: the status a client sends is dropped (a
        // Service's empty status still shows its `loadBalancer`).
        match (def.group, def.plural) {
            ("", "services") => body["status"] = json!({"loadBalancer": {}}),
            ("networking.k8s.io", "servicecidrs") => body["status"] = json!({}),
            _ => {}
        }
        let mut errs = self.validate(res, &name, &mut body);
        if (def.group, def.plural) == ("", "events") {
            errs.extend(crate::events::create_errors(&body, ns, events_v1));
        }
        if !errs.is_empty() {
            return Err(ApiError::invalid(def, &name, &errs));
        }
        let mut st = self.lock();
        self.check_namespace(&st, res, ns, &name)?;
        if st.contains(res, ns, &name) {
            return Err(ApiError::already_exists(def, &name));
        }
        let plan = if res == self.svc_idx {
            services::on_create(&self.alloc, &st, &mut body, dry_run)
                .map_err(|errs| ApiError::invalid(def, &name, &errs))?
        } else {
            services::Plan::default()
        };
        if dry_run {
            return serde_json::to_vec(&body)
                .map(Bytes::from)
                .map_err(|e| ApiError::internal(e.to_string()));
        }
        services::apply(&self.alloc, &mut st, &plan, ns, &name)?;
        let out = st.commit_put(res, ns, &name, body)?;
        self.publish(&st);
        Ok(out)
    }

    /// PUT on the object or its `status` subresource.
    pub fn update(
        &self,
        res: ResIdx,
        ns: &str,
        name: &str,
        status: bool,
        mut body: Value,
        opts: WriteOptions<'_>,
    ) -> Result<Written, ApiError> {
        self.normalize_body(res, ns, Some(name), &mut body)?;
        let body = convert::to_storage(res, body);
        let res = convert::storage_idx(res);
        let mut st = self.lock();
        let before = st.get(res, ns, name).cloned();
        let w = self.update_locked(&mut st, res, ns, name, status, body, opts.dry_run)?;
        if !opts.dry_run {
            track_update(&mut st, res, ns, name, before.as_ref(), opts.updater);
        }
        self.publish(&st);
        Ok(w)
    }

    #[allow(clippy::too_many_arguments)]
    fn update_locked(
        &self,
        st: &mut State,
        res: ResIdx,
        ns: &str,
        name: &str,
        status: bool,
        mut body: Value,
        dry_run: bool,
    ) -> Result<Written, ApiError> {
        let def = &RESOURCES[res];
        let Some(existing) = st.get(res, ns, name).cloned() else {
            return Err(ApiError::not_found(def, name));
        };
        let old = existing.value()?;
        if let Some(rv) = meta_str(&body, "resourceVersion")
            && rv != existing.rv.to_string()
        {
            return Err(ApiError::stale(def, name));
        }
        // Fields the server owns: carried over whatever the client sent.
        {
            let old_meta = metadata(&old).cloned().unwrap_or_default();
            let m = metadata_mut(&mut body);
            for k in [
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
            ] {
                match old_meta.get(k) {
                    Some(v) => m.insert(k.into(), v.clone()),
                    None => m.remove(k),
                };
            }
            m.remove("resourceVersion");
        }
        if status {
            let mut merged = old.clone();
            match body.get("status") {
                Some(s) => merged["status"] = s.clone(),
                None => {
                    if let Some(o) = merged.as_object_mut() {
                        o.remove("status");
                    }
                }
            }
            body = merged;
        } else if def.has_status {
            match old.get("status") {
                Some(s) => body["status"] = s.clone(),
                None => {
                    if let Some(o) = body.as_object_mut() {
                        o.remove("status");
                    }
                }
            }
        }
        if res == self.ns_idx {
            prepare_namespace_update(&old, &mut body, name);
        }
        let mut errs = self.validate(res, name, &mut body);
        // kube-apiserver's ValidateIPAddressUpdate: the parent of an IP is fixed (the repair
        // loops delete and recreate an IPAddress to change it). Its message has `null` for the
        // value.
        if (def.group, def.plural) == ("networking.k8s.io", "ipaddresses")
            && parent_ref(&old) != parent_ref(&body)
        {
            errs.push((
                "spec.parentRef".into(),
                "Invalid value: null: field is immutable".into(),
            ));
        }
        if (def.group, def.plural) == ("networking.k8s.io", "servicecidrs") && !status {
            errs.extend(service_cidr_update_errors(&old, &body));
        }
        if !errs.is_empty() {
            return Err(ApiError::invalid(def, name, &errs));
        }
        let plan = if res == self.svc_idx && !status {
            services::on_update(&self.alloc, st, &old, &mut body)
                .map_err(|errs| ApiError::invalid(def, name, &errs))?
        } else {
            services::Plan::default()
        };
        // A write that changes nothing keeps the resourceVersion and emits no event, as in
        // kube-apiserver.
        let mut candidate = body.clone();
        metadata_mut(&mut candidate)
            .insert("resourceVersion".into(), json!(existing.rv.to_string()));
        let unchanged = serde_json::to_vec(&candidate)
            .map(|b| b == existing.json.as_ref())
            .unwrap_or(false);
        if unchanged || dry_run {
            let json = if unchanged {
                existing.json.clone()
            } else {
                Bytes::from(
                    serde_json::to_vec(&candidate)
                        .map_err(|e| ApiError::internal(e.to_string()))?,
                )
            };
            return Ok(Written {
                json,
                created: false,
            });
        }
        services::apply(&self.alloc, st, &plan, ns, name)?;
        let deleting = meta_str(&body, "deletionTimestamp").is_some();
        // A namespace also waits for the namespace controller (spec.finalizers), which empties
        // spec.finalizers once the contents are gone.
        let finalized = deleting
            && finalizers_of(&body).is_empty()
            && (res != self.ns_idx
                || body
                    .pointer("/spec/finalizers")
                    .and_then(Value::as_array)
                    .is_none_or(Vec::is_empty));
        let json = st.commit_put(res, ns, name, body)?;
        if finalized {
            return self.finish_delete(st, res, ns, name).map(|j| Written {
                json: j.unwrap_or(json),
                created: false,
            });
        }
        Ok(Written {
            json,
            created: false,
        })
    }

    /// PUT that creates when the resource allows it (`AllowCreateOnUpdate`).
    pub fn create_or_update(
        &self,
        res: ResIdx,
        ns: &str,
        name: &str,
        status: bool,
        body: Value,
        opts: WriteOptions<'_>,
    ) -> Result<Written, ApiError> {
        let def = &RESOURCES[res];
        let dry_run = opts.dry_run;
        let exists = self.read().contains(convert::storage_idx(res), ns, name);
        if !exists && def.create_on_update && !status {
            let mut body = body;
            self.normalize_body(res, ns, Some(name), &mut body)?;
            if let Some(m) = body.get_mut("metadata").and_then(Value::as_object_mut) {
                m.remove("resourceVersion");
            }
            return match self.create(res, ns, body, dry_run) {
                Ok(json) => Ok(Written {
                    json,
                    created: true,
                }),
                Err(e) if e.code == 409 => Err(ApiError::stale(def, name)),
                Err(e) => Err(e),
            };
        }
        self.update(res, ns, name, status, body, opts)
    }

    /// PATCH: applied to the stored object under the lock, then validated as an update.
    #[allow(clippy::too_many_arguments)]
    pub fn patch(
        &self,
        res: ResIdx,
        ns: &str,
        name: &str,
        status: bool,
        kind: PatchKind,
        patch: &[u8],
        opts: WriteOptions<'_>,
    ) -> Result<Written, ApiError> {
        let def = &RESOURCES[res];
        let dry_run = opts.dry_run;
        let applier = match (kind, opts.field_manager) {
            (PatchKind::Apply, None) => {
                return Err(ApiError::new(
                    422,
                    "Invalid",
                    "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch",
                ));
            }
            (PatchKind::Apply, Some(m)) => Some(m),
            _ => None,
        };
        let patch_value: Value = match kind {
            PatchKind::Apply => serde_saphyr::from_slice(patch)
                .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?,
            _ => serde_json::from_slice(patch)
                .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?,
        };
        let mut st = self.lock();
        let existing = st.get(convert::storage_idx(res), ns, name).cloned();
        let Some(existing) = existing else {
            drop(st);
            if let Some(applier) = applier
                && !status
            {
                let mut body = patch_value.clone();
                self.normalize_body(res, ns, Some(name), &mut body)?;
                let json = self.create(res, ns, body, dry_run)?;
                if !dry_run {
                    let owners = ssa::after_apply(None, applier, &patch_value);
                    self.lock()
                        .set_owners(convert::storage_idx(res), ns, name, owners);
                }
                return Ok(Written {
                    json,
                    created: true,
                });
            }
            return Err(ApiError::not_found(def, name));
        };
        let mut doc = convert::from_storage(res, existing.value()?);
        if let Some(applier) = applier
            && !opts.force
        {
            ssa::check_conflicts(
                def,
                name,
                applier,
                existing.owners.as_deref(),
                &doc,
                &patch_value,
            )?;
        }
        match kind {
            PatchKind::Json => {
                let p: json_patch::Patch = serde_json::from_value(patch_value.clone())
                    .map_err(|e| ApiError::bad_request(format!("error decoding patch: {e}")))?;
                json_patch::patch(&mut doc, &p).map_err(|e| {
                    ApiError::new(
                        422,
                        "Invalid",
                        format!(
                            "the server rejected our request due to an error in our request: {e}"
                        ),
                    )
                })?;
            }
            PatchKind::Merge | PatchKind::StrategicMerge | PatchKind::Apply => {
                if !patch_value.is_object() {
                    return Err(ApiError::bad_request("patch body must be a JSON object"));
                }
                json_patch::merge(&mut doc, &patch_value);
            }
        }
        self.normalize_body(res, ns, Some(name), &mut doc)?;
        if kind == PatchKind::Apply
            && let Some(m) = doc.get_mut("metadata").and_then(Value::as_object_mut)
        {
            // Server-side apply is not optimistic unless the applied config carries a version.
            if patch_value.pointer("/metadata/resourceVersion").is_none() {
                m.insert("resourceVersion".into(), json!(existing.rv.to_string()));
            }
        }
        let doc = convert::to_storage(res, doc);
        let res = convert::storage_idx(res);
        let w = self.update_locked(&mut st, res, ns, name, status, doc, dry_run)?;
        if !dry_run {
            match applier {
                Some(applier) => {
                    let owners =
                        ssa::after_apply(existing.owners.as_deref(), applier, &patch_value);
                    st.set_owners(res, ns, name, owners);
                }
                None => track_update(&mut st, res, ns, name, Some(&existing), opts.updater),
            }
        }
        self.publish(&st);
        Ok(w)
    }

    /// DELETE with optional preconditions. Namespaces go Terminating; objects with finalizers
    /// get a deletionTimestamp; everything else disappears at once.
    pub fn delete(
        self: &Arc<Self>,
        res: ResIdx,
        ns: &str,
        name: &str,
        options: Option<&Value>,
        dry_run: bool,
    ) -> Result<Bytes, ApiError> {
        let res = convert::storage_idx(res);
        let def = &RESOURCES[res];
        if res == self.ns_idx
            && IMMORTAL_NAMESPACES.contains(&name)
            && self.protect_system_namespaces.load(Ordering::SeqCst)
        {
            return Err(ApiError::forbidden(
                def,
                name,
                "this namespace may not be deleted",
            ));
        }
        // DeleteOptions can carry dryRun in the body as well as in the query.
        let dry_run = dry_run
            || options
                .and_then(|o| o.get("dryRun"))
                .and_then(Value::as_array)
                .is_some_and(|a| a.iter().any(|v| v == "All"));
        let mut st = self.lock();
        let Some(existing) = st.get(res, ns, name).cloned() else {
            return Err(ApiError::not_found(def, name));
        };
        let mut obj = existing.value()?;
        if let Some(pre) = options.and_then(|o| o.get("preconditions")) {
            let uid = meta_str(&obj, "uid").unwrap_or("").to_string();
            if let Some(want) = pre.get("uid").and_then(Value::as_str)
                && want != uid
            {
                return Err(ApiError::conflict(
                    def,
                    name,
                    &format!(
                        "Precondition failed: UID in precondition: {want}, UID in object meta: {uid}"
                    ),
                ));
            }
            if let Some(want) = pre.get("resourceVersion").and_then(Value::as_str)
                && want != existing.rv.to_string()
            {
                return Err(ApiError::conflict(
                    def,
                    name,
                    &format!(
                        "Precondition failed: ResourceVersion in precondition: {want}, ResourceVersion in object meta: {}",
                        existing.rv
                    ),
                ));
            }
        }
        if dry_run {
            return Ok(existing.json);
        }
        let already_deleting = meta_str(&obj, "deletionTimestamp").is_some();
        if res == self.ns_idx {
            if already_deleting {
                return Ok(existing.json);
            }
            metadata_mut(&mut obj).insert("deletionTimestamp".into(), json!(now_rfc3339()));
            obj["status"] = json!({"phase": "Terminating"});
            let json = st.commit_put(res, ns, name, obj)?;
            self.publish(&st);
            drop(st);
            self.schedule_namespace_finalize(name.to_string());
            return Ok(json);
        }
        if !finalizers_of(&obj).is_empty() {
            if already_deleting {
                return Ok(existing.json);
            }
            let m = metadata_mut(&mut obj);
            m.insert("deletionTimestamp".into(), json!(now_rfc3339()));
            m.insert("deletionGracePeriodSeconds".into(), json!(0));
            let json = st.commit_put(res, ns, name, obj)?;
            self.publish(&st);
            return Ok(json);
        }
        let out = self.finish_delete(&mut st, res, ns, name)?;
        self.publish(&st);
        out.ok_or_else(|| ApiError::not_found(def, name))
    }

    /// Removes an object for good, releasing what a Service held.
    fn finish_delete(
        &self,
        st: &mut State,
        res: ResIdx,
        ns: &str,
        name: &str,
    ) -> Result<Option<Bytes>, ApiError> {
        if res == self.svc_idx
            && let Some(old) = st.get(res, ns, name).cloned()
        {
            let plan = services::on_delete(&self.alloc, &old.value()?);
            services::apply(&self.alloc, st, &plan, ns, name)?;
        }
        st.commit_delete(res, ns, name)
    }

    /// What the namespace controller does: after a delay, delete everything in the namespace,
    /// then the namespace itself (unless metadata.finalizers hold it).
    fn schedule_namespace_finalize(self: &Arc<Self>, ns: String) {
        let shared = Arc::clone(self);
        let delay = self.namespace_finalize_delay;
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            if let Err(e) = shared.finalize_namespace(&ns) {
                tracing::warn!(namespace = %ns, error = %e.message, "namespace finalization failed");
            }
        });
    }

    fn finalize_namespace(&self, ns: &str) -> Result<(), ApiError> {
        let mut st = self.lock();
        let Some(nsobj) = st.get(self.ns_idx, "", ns).cloned() else {
            return Ok(());
        };
        let v = nsobj.value()?;
        if meta_str(&v, "deletionTimestamp").is_none() {
            return Ok(());
        }
        for (res, def) in RESOURCES.iter().enumerate() {
            if !def.namespaced {
                continue;
            }
            let names: Vec<String> = st.objects[res]
                .range((ns.to_string(), String::new())..)
                .take_while(|((n, _), _)| n == ns)
                .map(|((_, name), _)| name.clone())
                .collect();
            for name in names {
                self.finish_delete(&mut st, res, ns, &name)?;
            }
        }
        if finalizers_of(&v).is_empty() {
            st.commit_delete(self.ns_idx, "", ns)?;
        } else {
            let mut v = v;
            v["spec"]["finalizers"] = json!([]);
            st.commit_put(self.ns_idx, "", ns, v)?;
        }
        self.publish(&st);
        Ok(())
    }

    /// Backdoor write: stores the object as given (filling only uid and creationTimestamp when
    /// absent), bypassing validation, allocation and namespace checks, but with a new
    /// resourceVersion and a watch event.
    pub fn backdoor_put(&self, obj: Value) -> Result<Bytes, ApiError> {
        let av = obj.get("apiVersion").and_then(Value::as_str).unwrap_or("");
        let kind = obj.get("kind").and_then(Value::as_str).unwrap_or("");
        let res = resources::find_by_kind(av, kind).ok_or_else(|| {
            ApiError::bad_request(format!(
                "backdoor: no served resource has apiVersion {av:?} and kind {kind:?}"
            ))
        })?;
        let mut obj = convert::to_storage(res, obj);
        let res = convert::storage_idx(res);
        let name = meta_str(&obj, "name")
            .ok_or_else(|| ApiError::bad_request("backdoor: metadata.name is required"))?
            .to_string();
        let ns = if RESOURCES[res].namespaced {
            meta_str(&obj, "namespace")
                .ok_or_else(|| {
                    ApiError::bad_request(
                        "backdoor: metadata.namespace is required for a namespaced resource",
                    )
                })?
                .to_string()
        } else {
            String::new()
        };
        let mut st = self.lock();
        let existing = st.get(res, &ns, &name).and_then(|s| s.value().ok());
        let m: &mut Map<String, Value> = metadata_mut(&mut obj);
        for k in ["uid", "creationTimestamp"] {
            if m.get(k).and_then(Value::as_str).is_none_or(str::is_empty) {
                let carried = existing
                    .as_ref()
                    .and_then(|e| meta_str(e, k))
                    .map(str::to_string);
                let v =
                    carried.unwrap_or_else(|| if k == "uid" { new_uid() } else { now_rfc3339() });
                m.insert(k.into(), json!(v));
            }
        }
        let out = st.commit_put(res, &ns, &name, obj)?;
        self.publish(&st);
        Ok(out)
    }

    /// Backdoor delete: removes the object with a DELETED event, releasing nothing.
    pub fn backdoor_delete(
        &self,
        res: ResIdx,
        ns: &str,
        name: &str,
    ) -> Result<Option<Bytes>, ApiError> {
        let mut st = self.lock();
        let out = st.commit_delete(res, ns, name)?;
        self.publish(&st);
        Ok(out)
    }

    /// Deletes an object no watch hears of ([`State::remove_unlogged`]).
    pub fn backdoor_delete_unseen(&self, res: ResIdx, ns: &str, name: &str) -> Option<Bytes> {
        let mut st = self.lock();
        let out = st.remove_unlogged(res, ns, name);
        self.publish(&st);
        out
    }

    /// Creates namespaces at startup (`SimConfig::seed_namespaces`).
    /// Creates the ServiceCIDR `kubernetes` from the service ranges, as kube-apiserver 1.33+
    /// does at start (its default ServiceCIDR controller); an existing one is kept.
    pub fn seed_default_service_cidr(&self, ranges: &[ipnet::IpNet]) -> Result<(), ApiError> {
        let Some(res) = resources::find("networking.k8s.io", "v1", "servicecidrs") else {
            return Ok(());
        };
        let cidrs: Vec<String> = ranges.iter().map(ToString::to_string).collect();
        let body = json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "ServiceCIDR",
            "metadata": {"name": "kubernetes"},
            "spec": {"cidrs": cidrs},
        });
        match self.create(res, "", body, false) {
            Ok(_) => Ok(()),
            Err(e) if e.code == 409 => Ok(()),
            Err(e) => Err(e),
        }
    }

    pub fn seed_namespace(&self, name: &str) -> Result<(), ApiError> {
        let body = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}});
        match self.create(self.ns_idx, "", body, false) {
            Ok(_) => Ok(()),
            Err(e) if e.code == 409 => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// kube-apiserver's `ValidateEndpointIP`: addresses no endpoint may have.
fn endpoint_ip_error(ip: std::net::IpAddr) -> Option<&'static str> {
    use std::net::IpAddr;
    if ip.is_unspecified() {
        return Some("may not be unspecified (0.0.0.0, ::)");
    }
    if ip.is_loopback() {
        return Some("may not be in the loopback range (127.0.0.0/8, ::1/128)");
    }
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            if o[0] == 169 && o[1] == 254 {
                Some("may not be in the link-local range (169.254.0.0/16, fe80::/10)")
            } else if o[0] == 224 && o[1] == 0 && o[2] == 0 {
                Some("may not be in the link-local multicast range (224.0.0.0/24, ff02::/10)")
            } else {
                None
            }
        }
        IpAddr::V6(v6) => {
            let seg = v6.segments();
            if seg[0] & 0xffc0 == 0xfe80 {
                Some("may not be in the link-local range (169.254.0.0/16, fe80::/10)")
            } else if seg[0] & 0xffcf == 0xff02 {
                Some("may not be in the link-local multicast range (224.0.0.0/24, ff02::/10)")
            } else {
                None
            }
        }
    }
}

/// Moves ownership of the fields a non-apply write changed to `updater`, for objects whose
/// ownership is tracked.
fn track_update(
    st: &mut State,
    res: ResIdx,
    ns: &str,
    name: &str,
    before: Option<&crate::store::Stored>,
    updater: &str,
) {
    let Some(before) = before else { return };
    let Some(owners) = before.owners.as_deref() else {
        return;
    };
    let Some(after) = st.get(res, ns, name) else {
        return;
    };
    if after.rv == before.rv {
        return;
    }
    if let (Ok(old), Ok(new)) = (before.value(), after.value()) {
        let owners = ssa::after_update(owners, updater, &old, &new);
        st.set_owners(res, ns, name, owners);
    }
}

fn prepare_namespace(body: &mut Value, name: &str) {
    let m = metadata_mut(body);
    let labels = m.entry("labels").or_insert_with(|| json!({}));
    if !labels.is_object() {
        *labels = json!({});
    }
    labels["kubernetes.io/metadata.name"] = json!(name);
    body["spec"] = json!({"finalizers": ["kubernetes"]});
    body["status"] = json!({"phase": "Active"});
}

fn prepare_namespace_update(old: &Value, body: &mut Value, name: &str) {
    let m = metadata_mut(body);
    let labels = m.entry("labels").or_insert_with(|| json!({}));
    if !labels.is_object() {
        *labels = json!({});
    }
    labels["kubernetes.io/metadata.name"] = json!(name);
    // spec.finalizers only change through /finalize, which is not served.
    match old.get("spec") {
        Some(s) => body["spec"] = s.clone(),
        None => {
            if let Some(o) = body.as_object_mut() {
                o.remove("spec");
            }
        }
    }
}

/// kube-apiserver's checks of an IPAddress name (`ValidateIPAddressName` with strict IP parsing):
/// a valid IP, without leading zeros (Go's legacy parser reads `10.096.0.1`, the strict one
/// refuses it), not IPv4-mapped IPv6, in canonical form.
fn ip_address_name_error(name: &str) -> Option<String> {
    match name.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V6(v6)) if v6.to_ipv4_mapped().is_some() => {
            Some("must not be an IPv4-mapped IPv6 address".to_string())
        }
        Ok(ip) if ip.to_string() == name => None,
        Ok(ip) => Some(format!("must be in canonical form (\"{ip}\")")),
        Err(_) if is_ipv4_with_leading_zeros(name) => Some("must not have leading 0s".to_string()),
        Err(_) => Some("must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)".to_string()),
    }
}

/// Four dot-separated decimal numbers up to 255, which Go's `ParseIPSloppy` accepts with leading
/// zeros.
fn is_ipv4_with_leading_zeros(name: &str) -> bool {
    let parts: Vec<&str> = name.split('.').collect();
    parts.len() == 4
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.bytes().all(|b| b.is_ascii_digit())
                && p.trim_start_matches('0').len() <= 3
                && p.parse::<u32>().is_ok_and(|n| n <= 255)
        })
}

/// An IPAddress's `spec.parentRef` as kube-apiserver compares it: its four fields only (it drops
/// unknown ones when it decodes), without empty or null `group` and `namespace`, which it does
/// not tell from absent ones (it decodes all three to "").
fn parent_ref(obj: &Value) -> Option<Value> {
    let mut parent = obj.pointer("/spec/parentRef")?.clone();
    if let Some(fields) = parent.as_object_mut() {
        fields.retain(|k, v| {
            ["group", "resource", "namespace", "name"].contains(&k.as_str())
                && !v.is_null()
                && v.as_str() != Some("")
        });
    }
    Some(parent)
}

/// kube-apiserver's ValidateServiceCIDRUpdate: the CIDRs are immutable, except that a
/// single-stack ServiceCIDR may gain a second CIDR (to become dual-stack).
fn service_cidr_update_errors(old: &Value, new: &Value) -> Vec<(String, String)> {
    let cidrs = |obj: &Value| -> Vec<Value> {
        obj.pointer("/spec/cidrs")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let (old, new) = (cidrs(old), cidrs(new));
    let immutable = |field: String, value: &Value| {
        (field, format!("Invalid value: {value}: field is immutable"))
    };
    match (old.len(), new.len()) {
        (o, n) if o == n => (0..o)
            .filter(|i| old[*i] != new[*i])
            .map(|i| immutable(format!("spec.cidrs[{i}]"), &new[i]))
            .collect(),
        (1, 2) if old[0] != new[0] => vec![immutable("spec.cidrs[0]".into(), &new[0])],
        (1, 2) => Vec::new(),
        _ => vec![immutable("spec.cidrs".into(), &Value::Array(new))],
    }
}

/// kube-apiserver's Secret handling on write: `stringData` is folded into `data` (base64) and
/// never stored, `type` defaults to `Opaque`, and keys and values are checked as
/// `ValidateSecret` and the JSON decoder would (values must be base64).
fn default_and_validate_secret(obj: &mut Value) -> Vec<(String, String)> {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut errs = Vec::new();
    let Some(root) = obj.as_object_mut() else {
        return errs;
    };
    if let Some(Value::Object(string_data)) = root.remove("stringData") {
        let data = root
            .entry("data")
            .or_insert_with(|| Value::Object(Map::new()));
        if !data.is_object() {
            *data = Value::Object(Map::new());
        }
        if let Some(data) = data.as_object_mut() {
            for (k, v) in string_data {
                let text = v.as_str().unwrap_or_default();
                data.insert(k, json!(b64.encode(text)));
            }
        }
    }
    if root
        .get("type")
        .and_then(Value::as_str)
        .is_none_or(str::is_empty)
    {
        root.insert("type".into(), json!("Opaque"));
    }
    for (k, v) in root
        .get("data")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
    {
        let key_ok = !k.is_empty()
            && k.len() <= 253
            && k.bytes()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
            && k != "."
            && k != ".."
            && !k.starts_with("..");
        if !key_ok {
            errs.push((
                format!("data[{k}]"),
                format!(
                    "Invalid value: {}: a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or 'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')",
                    go_quote(k)
                ),
            ));
        }
        if !v.is_null() && v.as_str().is_none_or(|s| b64.decode(s).is_err()) {
            errs.push((
                format!("data[{k}]"),
                "Invalid value: must be a base64-encoded string".into(),
            ));
        }
    }
    errs
}
