//! The resource table: every served resource is one line of [`RESOURCES`].

/// Static description of one served resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResourceDef {
    /// API group; empty for the core group.
    pub group: &'static str,
    pub version: &'static str,
    /// Lower-case plural used in URLs (`services`).
    pub plural: &'static str,
    pub kind: &'static str,
    pub namespaced: bool,
    /// Whether a `/status` subresource exists (main-resource writes then keep the stored status).
    pub has_status: bool,
    /// Whether PUT on a missing object creates it (kube-apiserver's `AllowCreateOnUpdate`).
    pub create_on_update: bool,
    pub short_names: &'static [&'static str],
    pub singular: &'static str,
}

impl ResourceDef {
    /// `apiVersion` as written in objects: `v1` or `group/version`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_string()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `plural` or `plural.group`, the form kube-apiserver uses in error messages.
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }
}

#[allow(clippy::too_many_arguments)]
const fn def(
    group: &'static str,
    plural: &'static str,
    singular: &'static str,
    kind: &'static str,
    namespaced: bool,
    has_status: bool,
    create_on_update: bool,
    short_names: &'static [&'static str],
) -> ResourceDef {
    ResourceDef {
        group,
        version: "v1",
        plural,
        kind,
        namespaced,
        has_status,
        create_on_update,
        short_names,
        singular,
    }
}

/// Every resource the simulator serves. Adding a resource is adding a line here.
/// Columns: group, plural, singular, kind, namespaced, has /status, create-on-PUT, short names.
#[rustfmt::skip]
pub const RESOURCES: &[ResourceDef] = &[
    def("", "namespaces", "namespace", "Namespace", false, true, false, &["ns"]),
    def("", "services", "service", "Service", true, true, false, &["svc"]),
    def("", "endpoints", "endpoints", "Endpoints", true, false, true, &["ep"]),
    def("", "events", "event", "Event", true, false, true, &["ev"]),
    def("", "configmaps", "configmap", "ConfigMap", true, false, false, &["cm"]),
    def("", "secrets", "secret", "Secret", true, false, false, &[]),
    def("coordination.k8s.io", "leases", "lease", "Lease", true, false, false, &[]),
    def("discovery.k8s.io", "endpointslices", "endpointslice", "EndpointSlice", true, false, false, &[]),
    def("networking.k8s.io", "ipaddresses", "ipaddress", "IPAddress", false, false, false, &["ip"]),
    def("networking.k8s.io", "servicecidrs", "servicecidr", "ServiceCIDR", false, true, false, &[]),
    def("events.k8s.io", "events", "event", "Event", true, false, true, &["ev"]),
];

/// Index of a resource in [`RESOURCES`].
pub type ResIdx = usize;

pub fn find(group: &str, version: &str, plural: &str) -> Option<ResIdx> {
    RESOURCES
        .iter()
        .position(|r| r.group == group && r.version == version && r.plural == plural)
}

/// Resolves a resource by its plural name, accepting `plural` (core group first) or `plural.group`.
pub fn find_by_name(name: &str) -> Option<ResIdx> {
    if let Some(i) = RESOURCES.iter().position(|r| r.qualified() == name) {
        return Some(i);
    }
    RESOURCES.iter().position(|r| r.plural == name)
}

/// Resolves a resource from an object's `apiVersion` and `kind`.
pub fn find_by_kind(api_version: &str, kind: &str) -> Option<ResIdx> {
    RESOURCES
        .iter()
        .position(|r| r.api_version() == api_version && r.kind == kind)
}

/// Groups in discovery order (core group excluded).
pub fn groups() -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::new();
    for r in RESOURCES {
        if !r.group.is_empty() && !out.contains(&r.group) {
            out.push(r.group);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_has_the_resources_the_simulator_special_cases() {
        for (g, p) in [
            ("", "namespaces"),
            ("", "services"),
            ("networking.k8s.io", "ipaddresses"),
            ("networking.k8s.io", "servicecidrs"),
        ] {
            assert!(find(g, "v1", p).is_some(), "{g}/{p}");
        }
        assert_eq!(find_by_name("events"), find("", "v1", "events"));
        assert_eq!(
            find_by_name("events.events.k8s.io"),
            find("events.k8s.io", "v1", "events")
        );
        assert_eq!(
            find_by_kind("coordination.k8s.io/v1", "Lease"),
            find("coordination.k8s.io", "v1", "leases")
        );
        assert_eq!(groups().len(), 4);
    }
}
