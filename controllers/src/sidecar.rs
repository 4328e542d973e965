//! `sidecar manifest`: the sidecar's static pod for one control-plane node, generated from that
//! node's kube-apiserver static pod manifest.
//!
//! The documented examples, `deploy/sidecar/bootstrap-controller.yaml` and
//! `bootstrap-controller-etcd.yaml`, are the templates: compiled in, with the values that come
//! from kube-apiserver's flags replaced line by line. Generating from kubeadm's default manifest
//! gives the examples back byte for byte (a test checks it), so the two cannot drift.
//!
//! The kube-apiserver manifest is untrusted input: bounded in size, parsed into the few fields
//! read, and every value checked before it is written into YAML.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Read;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use serde::Deserialize;

use crate::config::{format_cidrs, parse_service_cidrs};
use reconcilers::alloc::PortRange;
// Why no manifest was generated: the field (a kube-apiserver flag, a manifest field or one of
// this command's options) and what to do.
use reconcilers::legacy_alloc::etcd::DEFAULT_PREFIX as DEFAULT_ETCD_PREFIX;
use reconcilers::section::ConfigError;

/// The sidecar's static pod, with kubeadm's defaults: the template of [`generate`].
pub const TEMPLATE: &str = include_str!("../../deploy/sidecar/bootstrap-controller.yaml");
/// The same with etcd mode (`--etcd`).
pub const TEMPLATE_ETCD: &str = include_str!("../../deploy/sidecar/bootstrap-controller-etcd.yaml");

/// The largest kube-apiserver manifest read: kubeadm's is about 4 KiB.
pub const MAX_MANIFEST_BYTES: u64 = 1024 * 1024;

/// kubeadm's path of kube-apiserver's static pod manifest.
pub const KUBEADM_MANIFEST: &str = "/etc/kubernetes/manifests/kube-apiserver.yaml";

/// The image the examples name: this version's release.
pub const DEFAULT_IMAGE: &str = concat!(
    "ghcr.io/bootstrap-controller/bootstrap-controller:",
    env!("CARGO_PKG_VERSION")
);

// kube-apiserver's defaults for the flags read (DefaultServiceNodePortRange in
// pkg/kubeapiserver/options/options.go, the secure serving port and the endpoint reconciler in
// pkg/controlplane/apiserver/options).
const DEFAULT_NODE_PORT_RANGE: &str = "30000-32767";
const DEFAULT_SECURE_PORT: u16 = 6443;
const DEFAULT_RECONCILER: &str = "lease";

// What the etcd template names for kubeadm's local etcd.
const TEMPLATE_ETCD_CAFILE: &str = "/etc/kubernetes/pki/etcd/ca.crt";
const TEMPLATE_ETCD_CERTFILE: &str = "/etc/kubernetes/pki/apiserver-etcd-client.crt";
const TEMPLATE_ETCD_KEYFILE: &str = "/etc/kubernetes/pki/apiserver-etcd-client.key";

/// The flags of kube-apiserver that are read; each takes a value.
const READ_FLAGS: &[&str] = &[
    "service-cluster-ip-range",
    "service-node-port-range",
    "secure-port",
    "advertise-address",
    "endpoint-reconciler-type",
    "etcd-servers",
    "etcd-cafile",
    "etcd-certfile",
    "etcd-keyfile",
    "etcd-prefix",
];

/// `sidecar manifest`'s options.
#[derive(Debug, Clone, Args)]
pub struct ManifestArgs {
    /// kube-apiserver's static pod manifest on this node, or `-` for stdin (e.g. when running
    /// from the image: `... sidecar manifest --kube-apiserver-manifest - <FILE`). At most 1 MiB.
    #[arg(long, value_name = "FILE", default_value = KUBEADM_MANIFEST)]
    pub kube_apiserver_manifest: PathBuf,
    /// The name of kube-apiserver's container in that manifest.
    #[arg(long, value_name = "NAME", default_value = "kube-apiserver")]
    pub container: String,
    /// The sidecar's image.
    #[arg(long, value_name = "IMAGE", default_value = DEFAULT_IMAGE)]
    pub image: String,
    /// The sidecar's imagePullPolicy (`never` for an image loaded into the node's runtime).
    #[arg(long, value_name = "POLICY", default_value = "if-not-present")]
    pub image_pull_policy: PullPolicy,
    /// Generate the etcd-mode manifest (deploy/sidecar/bootstrap-controller-etcd.yaml): the
    /// legacy allocation bitmaps read with kube-apiserver's own --etcd-servers, --etcd-cafile,
    /// --etcd-certfile, --etcd-keyfile and --etcd-prefix.
    #[arg(long)]
    pub etcd: bool,
    /// Write the manifest to FILE (through a hidden temporary file in the same directory,
    /// renamed over it, so the kubelet never reads half of it) instead of stdout.
    #[arg(long, short = 'o', value_name = "FILE")]
    pub output: Option<PathBuf>,
}

/// The container's imagePullPolicy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PullPolicy {
    Always,
    IfNotPresent,
    Never,
}

impl PullPolicy {
    fn as_str(self) -> &'static str {
        match self {
            Self::Always => "Always",
            Self::IfNotPresent => "IfNotPresent",
            Self::Never => "Never",
        }
    }
}

// The minimal shape of a static pod: everything else in it is ignored.
#[derive(Debug, Deserialize)]
struct StaticPod {
    kind: Option<String>,
    spec: Option<PodSpec>,
}

#[derive(Debug, Deserialize)]
struct PodSpec {
    #[serde(default)]
    containers: Vec<Container>,
}

#[derive(Debug, Deserialize)]
struct Container {
    name: Option<String>,
    #[serde(default)]
    command: Vec<String>,
    #[serde(default)]
    args: Vec<String>,
}

/// The kube-apiserver flags the sidecar needs, as kube-apiserver's manifest gives them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ApiserverFlags {
    values: BTreeMap<&'static str, String>,
}

impl ApiserverFlags {
    /// The value of `--NAME`, if the manifest sets it.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str)
    }

    /// `--endpoint-reconciler-type`, or kube-apiserver's default.
    pub fn endpoint_reconciler_type(&self) -> &str {
        self.get("endpoint-reconciler-type")
            .unwrap_or(DEFAULT_RECONCILER)
    }
}

/// Reads at most [`MAX_MANIFEST_BYTES`] from `path` (`-`: stdin).
pub fn read_manifest(path: &Path) -> Result<String, ConfigError> {
    let field = "--kube-apiserver-manifest";
    let mut bytes = Vec::new();
    let limit = MAX_MANIFEST_BYTES + 1;
    let read = if path == Path::new("-") {
        std::io::stdin().lock().take(limit).read_to_end(&mut bytes)
    } else {
        std::fs::File::open(path).and_then(|file| file.take(limit).read_to_end(&mut bytes))
    };
    let shown = if path == Path::new("-") {
        "stdin".to_owned()
    } else {
        path.display().to_string()
    };
    read.map_err(|err| {
        ConfigError::new(
            field,
            format!(
                "cannot read {shown}: {err} (kubeadm's is {KUBEADM_MANIFEST}, readable by root \
                 only: run as root, or pass it on stdin with `--kube-apiserver-manifest -`)"
            ),
        )
    })?;
    if bytes.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(ConfigError::new(
            field,
            format!(
                "{shown} is larger than 1 MiB, which no static pod manifest is: point it at \
                 kube-apiserver's (kubeadm's is {KUBEADM_MANIFEST})"
            ),
        ));
    }
    String::from_utf8(bytes).map_err(|_| {
        ConfigError::new(
            field,
            format!("{shown} is not UTF-8 text: point it at kube-apiserver's static pod manifest"),
        )
    })
}

/// The flags of the container `container` in the static pod manifest `text`: its `command`
/// then its `args`, as the kubelet joins them.
pub fn parse_manifest(text: &str, container: &str) -> Result<ApiserverFlags, ConfigError> {
    let mut failed_path = None;
    let parsed: Result<StaticPod, _> =
        serde_saphyr::with_deserializer_from_str(text, |deserializer| {
            serde_path_to_error::deserialize(deserializer).map_err(|err| {
                failed_path = Some(err.path().to_string());
                err.into_inner()
            })
        });
    let pod = parsed.map_err(|err| {
        let field = failed_path
            .filter(|path| path != ".")
            .unwrap_or_else(|| "(manifest)".to_owned());
        let message = err.to_string();
        let first = message.lines().next().unwrap_or("invalid YAML").trim();
        ConfigError::new(
            field,
            format!("{first} (expected kube-apiserver's static pod manifest, a Pod in YAML)"),
        )
    })?;
    if let Some(kind) = pod.kind.as_deref().filter(|kind| *kind != "Pod") {
        return Err(ConfigError::new(
            "kind",
            format!(
                "is {kind:?}, not Pod: point --kube-apiserver-manifest at kube-apiserver's static pod manifest"
            ),
        ));
    }
    let containers = pod.spec.map(|spec| spec.containers).unwrap_or_default();
    let mut named = containers
        .iter()
        .filter(|c| c.name.as_deref() == Some(container));
    let Some(found) = named.next() else {
        let names: Vec<&str> = containers
            .iter()
            .filter_map(|c| c.name.as_deref())
            .collect();
        return Err(ConfigError::new(
            "spec.containers",
            format!(
                "no container named {container:?} (found: {}): point --kube-apiserver-manifest \
                 at kube-apiserver's static pod manifest, or name its container with --container",
                if names.is_empty() {
                    "none".to_owned()
                } else {
                    names.join(", ")
                }
            ),
        ));
    };
    if named.next().is_some() {
        return Err(ConfigError::new(
            "spec.containers",
            format!(
                "two containers are named {container:?}, which Kubernetes refuses: fix the manifest"
            ),
        ));
    }
    parse_flags(found.command.iter().chain(&found.args).map(String::as_str))
}

/// kube-apiserver's flags among `words` (pflag's forms `--name=value` and `--name value`).
fn parse_flags<'a>(words: impl Iterator<Item = &'a str>) -> Result<ApiserverFlags, ConfigError> {
    let mut flags = ApiserverFlags::default();
    let mut words = words.peekable();
    while let Some(word) = words.next() {
        let Some(flag) = word.strip_prefix("--") else {
            continue;
        };
        let (name, inline) = match flag.split_once('=') {
            Some((name, value)) => (name, Some(value)),
            None => (flag, None),
        };
        let Some(name) = READ_FLAGS.iter().copied().find(|read| *read == name) else {
            continue;
        };
        let value = match inline {
            Some(value) => value.to_owned(),
            None => words.next().map(str::to_owned).ok_or_else(|| {
                ConfigError::new(
                    format!("--{name}"),
                    "is kube-apiserver's last argument, with no value: give it one \
                     (--{name}=VALUE)",
                )
            })?,
        };
        let value = value.trim().to_owned();
        if let Some(earlier) = flags.values.get(name)
            && *earlier != value
        {
            return Err(ConfigError::new(
                format!("--{name}"),
                format!(
                    "kube-apiserver's manifest gives it twice, {earlier:?} and {value:?}: keep \
                     the one kube-apiserver should use (it takes the last) and remove the other"
                ),
            ));
        }
        flags.values.insert(name, value);
    }
    Ok(flags)
}

/// What goes into the sidecar's manifest, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Values {
    pub service_cluster_ip_range: String,
    pub service_node_port_range: String,
    pub secure_port: u16,
    /// `$(HOST_IP)` (the node's address, as the kubelet reports it) when kube-apiserver has no
    /// --advertise-address.
    pub advertise_address: String,
    pub etcd: Option<EtcdValues>,
}

/// kube-apiserver's etcd client settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdValues {
    pub servers: String,
    pub ca_file: String,
    pub cert_file: String,
    pub key_file: String,
    pub prefix: String,
}

/// Checks the flags' values and picks kube-apiserver's defaults for those not given.
pub fn values(flags: &ApiserverFlags, etcd: bool) -> Result<Values, ConfigError> {
    let range = flags.get("service-cluster-ip-range").ok_or_else(|| {
        ConfigError::new(
            "--service-cluster-ip-range",
            "kube-apiserver's manifest does not set it, and the sidecar needs the range \
             kube-apiserver allocates from (unset, kube-apiserver falls back to the deprecated \
             10.0.0.0/24): set it in kube-apiserver's manifest (kubeadm sets it from \
             networking.serviceSubnet)",
        )
    })?;
    let service_cluster_ip_range = parse_service_cidrs(range)
        .map(|cidrs| format_cidrs(&cidrs))
        .map_err(|err| {
            ConfigError::new(
                "--service-cluster-ip-range",
                format!("kube-apiserver's value {range:?}: {err}"),
            )
        })?;
    let service_node_port_range = match flags.get("service-node-port-range") {
        None => DEFAULT_NODE_PORT_RANGE.to_owned(),
        Some(text) => node_port_range(text)?,
    };
    let secure_port = match flags.get("secure-port") {
        None => DEFAULT_SECURE_PORT,
        Some(text) => text
            .parse::<u16>()
            .ok()
            .filter(|port| *port > 0)
            .ok_or_else(|| {
                ConfigError::new(
                    "--secure-port",
                    format!(
                        "kube-apiserver's value {text:?} is not a port of 1-65535 (0 turns \
                         kube-apiserver's HTTPS off, and the sidecar has nothing to advertise): \
                         fix it in kube-apiserver's manifest"
                    ),
                )
            })?,
    };
    let advertise_address = match flags.get("advertise-address") {
        None => "$(HOST_IP)".to_owned(),
        Some(text) => text
            .parse::<IpAddr>()
            .map(|ip| ip.to_string())
            .map_err(|_| {
                ConfigError::new(
                    "--advertise-address",
                    format!(
                        "kube-apiserver's value {text:?} is not an IP address: fix it in \
                         kube-apiserver's manifest"
                    ),
                )
            })?,
    };
    if let Some(kind) = flags.get("endpoint-reconciler-type")
        && !["lease", "master-count", "none"].contains(&kind)
    {
        return Err(ConfigError::new(
            "--endpoint-reconciler-type",
            format!(
                "kube-apiserver's value {kind:?} is none of lease, master-count, none: fix it \
                 in kube-apiserver's manifest (none, beside the sidecar)"
            ),
        ));
    }
    let etcd = etcd.then(|| etcd_values(flags)).transpose()?;
    Ok(Values {
        service_cluster_ip_range,
        service_node_port_range,
        secure_port,
        advertise_address,
        etcd,
    })
}

/// kube-apiserver's port range forms (utilnet.PortRange.Set: `BASE-LAST`, `BASE+OFFSET`, or
/// one port) as the `BASE-LAST` the controller takes.
fn node_port_range(text: &str) -> Result<String, ConfigError> {
    PortRange::parse_any_form(text)
        .map(|range| range.to_string())
        .map_err(|err| {
            ConfigError::new(
                "--service-node-port-range",
                format!(
                    "kube-apiserver's value: {err} (or BASE+OFFSET, or one port); fix it in \
                     kube-apiserver's manifest"
                ),
            )
        })
}

fn etcd_values(flags: &ApiserverFlags) -> Result<EtcdValues, ConfigError> {
    let required = |name: &str| {
        flags.get(name).ok_or_else(|| {
            ConfigError::new(
                format!("--{name}"),
                "kube-apiserver's manifest does not set it, and --etcd reads the legacy \
                 allocation bitmaps with kube-apiserver's own etcd client settings: leave --etcd \
                 out, or set it in kube-apiserver's manifest",
            )
        })
    };
    let servers = required("etcd-servers")?;
    let mut checked = Vec::new();
    for server in servers.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let valid = server.parse::<http::Uri>().is_ok_and(|uri| {
            matches!(uri.scheme_str(), Some("http" | "https")) && uri.authority().is_some()
        }) && yaml_safe(server);
        if !valid {
            return Err(ConfigError::new(
                "--etcd-servers",
                format!(
                    "kube-apiserver's value has {server:?}, not an etcd URL (expected e.g. \
                     https://127.0.0.1:2379): fix it in kube-apiserver's manifest"
                ),
            ));
        }
        checked.push(server);
    }
    let path = |name: &str| -> Result<String, ConfigError> {
        let path = required(name)?;
        if path.starts_with('/') && yaml_safe(path) {
            Ok(path.to_owned())
        } else {
            Err(ConfigError::new(
                format!("--{name}"),
                format!(
                    "kube-apiserver's value {path:?} is not an absolute path without spaces, \
                     quotes or backslashes, which the sidecar's hostPath mounts need: give \
                     kube-apiserver such a path"
                ),
            ))
        }
    };
    let prefix = flags.get("etcd-prefix").unwrap_or(DEFAULT_ETCD_PREFIX);
    if !prefix.starts_with('/') || !yaml_safe(prefix) {
        return Err(ConfigError::new(
            "--etcd-prefix",
            format!(
                "kube-apiserver's value {prefix:?} is not a key prefix such as /registry: fix \
                 it in kube-apiserver's manifest"
            ),
        ));
    }
    Ok(EtcdValues {
        servers: checked.join(","),
        ca_file: path("etcd-cafile")?,
        cert_file: path("etcd-certfile")?,
        key_file: path("etcd-keyfile")?,
        prefix: prefix.to_owned(),
    })
}

/// A value that can stand in a double-quoted or plain YAML scalar unchanged: printable ASCII
/// with no space, quote or backslash.
fn yaml_safe(text: &str) -> bool {
    !text.is_empty()
        && text
            .bytes()
            .all(|b| b.is_ascii_graphic() && !matches!(b, b'"' | b'\'' | b'\\'))
}

/// The sidecar's manifest for `values`, with `image` and `pull_policy`.
pub fn generate(
    values: &Values,
    image: &str,
    pull_policy: PullPolicy,
) -> Result<String, ConfigError> {
    if !yaml_safe(image) {
        return Err(ConfigError::new(
            "--image",
            format!("{image:?} is not an image reference (expected e.g. {DEFAULT_IMAGE})"),
        ));
    }
    let mut edits = vec![
        Edit::key("image", image.to_owned()),
        Edit::key("imagePullPolicy", pull_policy.as_str().to_owned()),
        Edit::env(
            "BOOTSTRAP_SERVICE_CLUSTER_IP_RANGE",
            &values.service_cluster_ip_range,
        ),
        Edit::env(
            "BOOTSTRAP_SERVICE_NODE_PORT_RANGE",
            &values.service_node_port_range,
        ),
        Edit::env("BOOTSTRAP_SECURE_PORT", &values.secure_port.to_string()),
        Edit::env("BOOTSTRAP_ADVERTISE_ADDRESS", &values.advertise_address),
    ];
    let template = match &values.etcd {
        None => TEMPLATE,
        Some(etcd) => {
            edits.push(Edit::env("BOOTSTRAP_ETCD_SERVERS", &etcd.servers));
            edits.push(Edit::path(TEMPLATE_ETCD_CAFILE, &etcd.ca_file));
            edits.push(Edit::path(TEMPLATE_ETCD_CERTFILE, &etcd.cert_file));
            edits.push(Edit::path(TEMPLATE_ETCD_KEYFILE, &etcd.key_file));
            if etcd.prefix != DEFAULT_ETCD_PREFIX {
                edits.push(Edit::insert_env_after(
                    "BOOTSTRAP_ETCD_KEYFILE",
                    "BOOTSTRAP_ETCD_PREFIX",
                    &etcd.prefix,
                ));
            }
            TEMPLATE_ETCD
        }
    };
    apply(template, &mut edits)
}

/// One change to the template, and how many lines it changed.
struct Edit {
    kind: EditKind,
    hits: usize,
}

enum EditKind {
    /// The line `KEY: ...` (the container's image, imagePullPolicy).
    Key { key: &'static str, value: String },
    /// The `value:` line after `- name: NAME`.
    Env { name: &'static str, value: String },
    /// Every `path:`, `mountPath:` and `value:` naming the file `from`.
    Path { from: &'static str, to: String },
    /// A new variable after the `value:` line of `- name: AFTER`.
    InsertEnv {
        after: &'static str,
        name: &'static str,
        value: String,
    },
}

impl Edit {
    fn new(kind: EditKind) -> Self {
        Self { kind, hits: 0 }
    }
    fn key(key: &'static str, value: String) -> Self {
        Self::new(EditKind::Key { key, value })
    }
    fn env(name: &'static str, value: &str) -> Self {
        Self::new(EditKind::Env {
            name,
            value: value.to_owned(),
        })
    }
    fn path(from: &'static str, to: &str) -> Self {
        Self::new(EditKind::Path {
            from,
            to: to.to_owned(),
        })
    }
    fn insert_env_after(after: &'static str, name: &'static str, value: &str) -> Self {
        Self::new(EditKind::InsertEnv {
            after,
            name,
            value: value.to_owned(),
        })
    }
    fn describe(&self) -> String {
        match &self.kind {
            EditKind::Key { key, .. } => format!("the line {key}:"),
            EditKind::Env { name, .. } => format!("the value of {name}"),
            EditKind::Path { from, .. } => format!("the path {from}"),
            EditKind::InsertEnv { after, .. } => format!("the value of {after}"),
        }
    }
}

/// Applies every edit in one pass over the lines (a replaced value is never matched again);
/// each must change a line, the keys and variables exactly one.
fn apply(template: &str, edits: &mut [Edit]) -> Result<String, ConfigError> {
    let mut out = String::with_capacity(template.len() + 256);
    let mut env_name: Option<&str> = None;
    for line in template.split_inclusive('\n') {
        let body = line.trim_end_matches('\n');
        let indent = &body[..body.len() - body.trim_start().len()];
        let content = body.trim_start();
        let mut replaced = None;
        let mut insert_after = None;
        for edit in edits.iter_mut() {
            let new = match &edit.kind {
                EditKind::Key { key, value } => content
                    .strip_prefix(key)
                    .and_then(|rest| rest.strip_prefix(": "))
                    .map(|_| format!("{indent}{key}: {value}")),
                EditKind::Env { name, value } => (env_name == Some(name)
                    && content.starts_with("value: "))
                .then(|| format!("{indent}value: \"{value}\"")),
                EditKind::Path { from, to } => ["path: ", "mountPath: "]
                    .iter()
                    .find(|key| content.strip_prefix(**key) == Some(from))
                    .map(|key| format!("{indent}{key}{to}"))
                    .or_else(|| {
                        (content.strip_prefix("value: ") == Some(&format!("\"{from}\"")))
                            .then(|| format!("{indent}value: \"{to}\""))
                    }),
                EditKind::InsertEnv { after, name, value } => {
                    if env_name == Some(after) && content.starts_with("value: ") {
                        let item = indent.strip_suffix("  ").unwrap_or(indent);
                        insert_after = Some(format!(
                            "{item}- name: {name}\n{indent}value: \"{value}\"\n"
                        ));
                        edit.hits += 1;
                    }
                    None
                }
            };
            if new.is_some() {
                edit.hits += 1;
                replaced = new;
            }
        }
        match replaced {
            Some(new) => {
                out.push_str(&new);
                if line.ends_with('\n') {
                    out.push('\n');
                }
            }
            None => out.push_str(line),
        }
        if let Some(extra) = insert_after {
            out.push_str(&extra);
        }
        env_name = content.strip_prefix("- name: ");
    }
    for edit in edits.iter() {
        let once = !matches!(edit.kind, EditKind::Path { .. });
        if edit.hits == 0 || (once && edit.hits > 1) {
            return Err(ConfigError::new(
                "(template)",
                format!(
                    "{} was found {} times in the built-in sidecar manifest: this binary is \
                     broken, report it",
                    edit.describe(),
                    edit.hits
                ),
            ));
        }
    }
    Ok(out)
}

/// What stderr says about kube-apiserver's endpoint reconciler: the sidecar and kube-apiserver
/// both write the `kubernetes` endpoints unless it is `none`.
pub fn reconciler_advice(flags: &ApiserverFlags, manifest: &Path) -> String {
    let kind = flags.endpoint_reconciler_type();
    if kind == "none" {
        return "kube-apiserver runs with --endpoint-reconciler-type=none: the sidecar alone \
                keeps the `kubernetes` endpoints.\n"
            .to_owned();
    }
    let given = flags.get("endpoint-reconciler-type").is_some();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "warning: kube-apiserver runs with --endpoint-reconciler-type={kind}{}: its own \
         reconciler keeps rewriting the `kubernetes` endpoints and undoes the sidecar's \
         readiness gating. Set it to none.",
        if given { "" } else { " (its default)" }
    );
    out.push_str(
        "With kubeadm, in the ClusterConfiguration (the file given to `kubeadm init --config`, \
         and the kube-system/kubeadm-config ConfigMap that `kubeadm join` and `kubeadm upgrade` \
         read), kubeadm.k8s.io/v1beta4:\n\
         \x20 apiServer:\n\
         \x20   extraArgs:\n\
         \x20     - name: endpoint-reconciler-type\n\
         \x20       value: none\n\
         (kubeadm.k8s.io/v1beta3's apiServer.extraArgs is a map: `endpoint-reconciler-type: \
         none`.)\n",
    );
    let shown = if manifest == Path::new("-") {
        "kube-apiserver's static pod manifest".to_owned()
    } else {
        manifest.display().to_string()
    };
    if given {
        let _ = writeln!(
            out,
            "On this node now (or without kubeadm): in {shown}, change \
             `--endpoint-reconciler-type={kind}` to `--endpoint-reconciler-type=none`; the \
             kubelet restarts kube-apiserver."
        );
    } else {
        let _ = writeln!(
            out,
            "On this node now (or without kubeadm): in {shown}, add the line \
             `- --endpoint-reconciler-type=none` to the kube-apiserver container's command; the \
             kubelet restarts kube-apiserver."
        );
    }
    out
}

/// What stderr says was read, so that a person can compare it with the cluster.
pub fn summary(values: &Values, flags: &ApiserverFlags) -> String {
    let from = |name: &str| {
        if flags.get(name).is_some() {
            ""
        } else {
            " (kube-apiserver's default)"
        }
    };
    let mut out = format!(
        "service range {}, node ports {}{}, secure port {}{}, advertise address {}",
        values.service_cluster_ip_range,
        values.service_node_port_range,
        from("service-node-port-range"),
        values.secure_port,
        from("secure-port"),
        values.advertise_address,
    );
    if flags.get("advertise-address").is_none() {
        out.push_str(" (no --advertise-address: the node's address as the kubelet reports it)");
    }
    if let Some(etcd) = &values.etcd {
        let _ = write!(out, ", etcd {} under {}", etcd.servers, etcd.prefix);
    }
    out
}

/// Writes `text` to `path` through `.NAME.tmp` in the same directory, renamed over it: the
/// kubelet ignores hidden files in its manifest directory and never sees half a manifest.
pub fn write_atomically(path: &Path, text: &str) -> Result<(), ConfigError> {
    let field = "--output";
    let name = path
        .file_name()
        .ok_or_else(|| ConfigError::new(field, format!("{} names no file", path.display())))?;
    let mut hidden = std::ffi::OsString::from(".");
    hidden.push(name);
    hidden.push(".tmp");
    let temporary = path.with_file_name(hidden);
    let written = std::fs::write(&temporary, text).and_then(|()| std::fs::rename(&temporary, path));
    written.map_err(|err| {
        let _ = std::fs::remove_file(&temporary);
        ConfigError::new(
            field,
            format!(
                "cannot write {}: {err} (check the directory exists and is writable)",
                path.display()
            ),
        )
    })
}

/// `sidecar manifest`: the manifest (stdout or --output), then what was read and the endpoint
/// reconciler's advice on stderr.
pub fn run_manifest(args: &ManifestArgs) -> Result<(String, String), ConfigError> {
    let text = read_manifest(&args.kube_apiserver_manifest)?;
    let flags = parse_manifest(&text, &args.container)?;
    let values = values(&flags, args.etcd)?;
    let manifest = generate(&values, &args.image, args.image_pull_policy)?;
    let shown = if args.kube_apiserver_manifest == Path::new("-") {
        "stdin".to_owned()
    } else {
        args.kube_apiserver_manifest.display().to_string()
    };
    let mut notes = format!("from {shown}: {}\n", summary(&values, &flags));
    notes.push_str(&reconciler_advice(&flags, &args.kube_apiserver_manifest));
    Ok((manifest, notes))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
