//! End to end: tenants sharing one etcd are kept apart by etcd's own auth. A real etcd (TLS,
//! client-certificate auth, auth enabled) holds two tenants' keys under `/tenant-a` and
//! `/tenant-b`; each tenant's user (its client certificate's CN) may read and write only its
//! prefix. The controller runs in management mode against simulated tenant clusters whose
//! Secrets carry the etcd client certificates in their data keys. A Secret aimed at the other
//! tenant's prefix (with the server spelled another way) gets etcd's refusal already when its
//! etcd is asked who it is, and never writes.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use apiserver_sim::{Fleet, FleetConfig, TENANT_LABEL, kubeconfig_secret};
use common::{CONVERGE, ControllerProcess, eventually, free_port};
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

const NAMESPACE: &str = "tenants";

/// A CA and the certificates the test needs, as PEM files in a directory.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn generate(clients: &[&str]) -> Result<Pki> {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
            KeyPair, SanType,
        };
        let dir = tempfile::tempdir()?;
        let ca_key = KeyPair::generate()?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "tenant etcd CA");
        let ca = ca_params.self_signed(&ca_key)?;
        std::fs::write(dir.path().join("ca.crt"), ca.pem())?;
        let issuer = Issuer::new(ca_params, ca_key);
        let leaf = |name: &str, server: bool| -> Result<()> {
            let key = KeyPair::generate()?;
            let mut params = CertificateParams::new(vec!["localhost".to_owned()])?;
            params
                .subject_alt_names
                .push(SanType::IpAddress("127.0.0.1".parse()?));
            params.distinguished_name.push(DnType::CommonName, name);
            params.extended_key_usages = if server {
                vec![
                    ExtendedKeyUsagePurpose::ServerAuth,
                    ExtendedKeyUsagePurpose::ClientAuth,
                ]
            } else {
                vec![ExtendedKeyUsagePurpose::ClientAuth]
            };
            let cert = params.signed_by(&key, &issuer)?;
            std::fs::write(dir.path().join(format!("{name}.crt")), cert.pem())?;
            std::fs::write(dir.path().join(format!("{name}.key")), key.serialize_pem())?;
            Ok(())
        };
        leaf("server", true)?;
        for client in clients {
            leaf(client, false)?;
        }
        Ok(Pki { dir })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn read(&self, name: &str) -> Result<Vec<u8>> {
        Ok(std::fs::read(self.path(name))?)
    }
}

/// Debian's etcd with TLS and client-certificate auth, on free loopback ports.
struct Etcd {
    child: Child,
    _data: tempfile::TempDir,
    port: u16,
}

impl Etcd {
    async fn start(pki: &Pki) -> Result<Etcd> {
        let data = tempfile::tempdir()?;
        let port = free_port()?.port();
        let peer = format!("http://127.0.0.1:{}", free_port()?.port());
        let url = format!("https://127.0.0.1:{port}");
        let child = Command::new("etcd")
            .arg("--name=auth")
            .arg(format!("--data-dir={}", data.path().join("data").display()))
            .arg(format!("--listen-client-urls={url}"))
            .arg(format!("--advertise-client-urls={url}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=auth={peer}"))
            .arg(format!("--cert-file={}", pki.path("server.crt").display()))
            .arg(format!("--key-file={}", pki.path("server.key").display()))
            .arg(format!(
                "--trusted-ca-file={}",
                pki.path("ca.crt").display()
            ))
            .arg("--client-cert-auth")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting etcd (Debian: apt-get install etcd-server)")?;
        let etcd = Etcd {
            child,
            _data: data,
            port,
        };
        eventually("etcd answers", CONVERGE, || async {
            Ok(etcd
                .ctl(pki, "root", &["endpoint", "health"])
                .is_ok()
                .then_some(()))
        })
        .await?;
        Ok(etcd)
    }

    fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// `etcdctl` as `user` (its client certificate); its output, or why it failed.
    fn ctl(&self, pki: &Pki, user: &str, args: &[&str]) -> Result<String> {
        let output = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", self.url()))
            .arg(format!("--cacert={}", pki.path("ca.crt").display()))
            .arg(format!(
                "--cert={}",
                pki.path(&format!("{user}.crt")).display()
            ))
            .arg(format!(
                "--key={}",
                pki.path(&format!("{user}.key")).display()
            ))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .context("running etcdctl (Debian: apt-get install etcd-client)")?;
        if !output.status.success() {
            bail!(
                "etcdctl {args:?} as {user}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// Users `root`, and one per tenant whose role reaches only `/<tenant>/`; then auth on.
    fn enable_auth(&self, pki: &Pki, tenants: &[&str]) -> Result<()> {
        self.ctl(pki, "root", &["user", "add", "root", "--no-password"])?;
        self.ctl(pki, "root", &["user", "grant-role", "root", "root"])?;
        for tenant in tenants {
            self.ctl(pki, "root", &["role", "add", tenant])?;
            self.ctl(
                pki,
                "root",
                &[
                    "role",
                    "grant-permission",
                    tenant,
                    "readwrite",
                    &format!("/{tenant}/"),
                    "--prefix=true",
                ],
            )?;
            self.ctl(pki, "root", &["user", "add", tenant, "--no-password"])?;
            self.ctl(pki, "root", &["user", "grant-role", tenant, tenant])?;
        }
        self.ctl(pki, "root", &["auth", "enable"])?;
        Ok(())
    }

    /// The key's mod revision (0: absent), read as root.
    fn mod_revision(&self, pki: &Pki, key: &str) -> Result<u64> {
        let out = self.ctl(pki, "root", &["get", key, "-w", "json"])?;
        let value: serde_json::Value = serde_json::from_str(&out)?;
        Ok(value["kvs"][0]["mod_revision"].as_u64().unwrap_or(0))
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A tenant Secret: tenant `i`'s kubeconfig, the fragment, and the etcd client certificate of
/// `user`.
fn tenant_secret(
    fleet: &Fleet,
    i: usize,
    name: &str,
    pki: &Pki,
    user: &str,
    fragment: &str,
) -> Result<Secret> {
    use base64::Engine;
    let encode = |bytes: Vec<u8>| base64::engine::general_purpose::STANDARD.encode(bytes);
    let kubeconfig = fleet.tenant_kubeconfig(i).context("tenant")?;
    let mut secret = kubeconfig_secret(NAMESPACE, name, &kubeconfig);
    secret["metadata"]["annotations"] = json!({ "bootstrap-controller.io/config": fragment });
    secret["data"]["etcd-ca.crt"] = json!(encode(pki.read("ca.crt")?));
    secret["data"]["etcd-client.crt"] = json!(encode(pki.read(&format!("{user}.crt"))?));
    secret["data"]["etcd-client.key"] = json!(encode(pki.read(&format!("{user}.key"))?));
    Ok(serde_json::from_value(secret)?)
}

fn fragment(server: &str, prefix: &str) -> String {
    format!(
        "etcdServers: {server}\netcdPrefix: {prefix}\nloops:\n  nodePortRepair:\n    interval: 5s\n"
    )
}

/// The `/readyz?verbose` line of a tenant.
async fn tenant_line(controller: &ControllerProcess, name: &str) -> Result<String> {
    let (_, body) = controller.admin_get("/readyz?verbose").await?;
    Ok(body
        .lines()
        .find(|l| l.contains(&format!("tenant {NAMESPACE}/{name}-kubeconfig ")))
        .unwrap_or_default()
        .to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_aimed_at_another_tenants_etcd_prefix_gets_etcds_refusal_not_a_write() -> Result<()>
{
    let pki = Pki::generate(&["root", "tenant-a", "tenant-b"])?;
    let etcd = Etcd::start(&pki).await?;
    etcd.enable_auth(&pki, &["tenant-a", "tenant-b"])?;
    // etcd itself: tenant-b's certificate cannot touch tenant-a's keys.
    let denied = etcd.ctl(&pki, "tenant-b", &["put", "/tenant-a/x", "y"]);
    ensure!(
        denied
            .as_ref()
            .is_err_and(|e| e.to_string().contains("permission denied")),
        "{denied:?}"
    );

    let fleet = Fleet::start(FleetConfig {
        tenants: 2,
        write_secrets: false,
        ..FleetConfig::default()
    })
    .await?;
    let secrets: Api<Secret> = Api::namespaced(fleet.management().client(), NAMESPACE);
    for (index, tenant) in ["tenant-a", "tenant-b"].into_iter().enumerate() {
        let fragment = fragment(&etcd.url(), &format!("/{tenant}"));
        let secret = tenant_secret(&fleet, index, tenant, &pki, tenant, &fragment)?;
        secrets.create(&PostParams::default(), &secret).await?;
    }
    let selector = format!("{TENANT_LABEL}=true");
    let mut controller = ControllerProcess::start(
        fleet.management().kubeconfig_path(),
        &[
            "--tenants-secret-selector",
            &selector,
            "--tenants-namespace",
            NAMESPACE,
            "--service-cluster-ip-range",
            "10.96.0.0/12",
            "--leader-elect=false",
            // localhost may resolve to ::1 as well.
            "--tenants-etcd-allowed-cidrs",
            "127.0.0.0/8,::1/128",
        ],
    )?;
    controller.wait_ready().await?;
    // Each tenant's NodePort repair creates its own bitmap under its own prefix, with its own
    // credentials.
    let key_a = "/tenant-a/ranges/servicenodeports";
    let key_b = "/tenant-b/ranges/servicenodeports";
    eventually("both bitmaps written", CONVERGE, || async {
        Ok(
            (etcd.mod_revision(&pki, key_a)? > 0 && etcd.mod_revision(&pki, key_b)? > 0)
                .then_some(()),
        )
    })
    .await?;
    for name in ["tenant-a", "tenant-b"] {
        eventually(&format!("{name} ok"), CONVERGE, || async {
            Ok(tenant_line(&controller, name)
                .await?
                .starts_with("[+]")
                .then_some(()))
        })
        .await?;
    }
    let a_before = etcd.mod_revision(&pki, key_a)?;

    // tenant-b's Secret now names tenant-a's prefix, on the same etcd spelled another way.
    let aimed = fragment(&format!("https://localhost:{}", etcd.port), "/tenant-a");
    secrets
        .patch(
            "tenant-b-kubeconfig",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {
                "bootstrap-controller.io/config": aimed
            }}})),
        )
        .await?;
    let line = eventually("tenant-b refused by etcd", CONVERGE, || async {
        let line = tenant_line(&controller, "tenant-b").await?;
        Ok((line.starts_with("[-]") && line.contains("permission denied")).then_some(line))
    })
    .await?;
    println!("tenant-b aimed at /tenant-a: {line}");
    // Passes of both tenants went on for a while: nothing was written to tenant-a's key but
    // by tenant-a (which has nothing to change).
    tokio::time::sleep(Duration::from_secs(6)).await;
    ensure!(
        etcd.mod_revision(&pki, key_a)? == a_before,
        "tenant-a's bitmap was written"
    );
    let line = tenant_line(&controller, "tenant-a").await?;
    ensure!(line.starts_with("[+]"), "{line}");
    secrets
        .delete("tenant-b-kubeconfig", &DeleteParams::default())
        .await?;
    drop(controller);
    fleet.shutdown().await;
    Ok(())
}
