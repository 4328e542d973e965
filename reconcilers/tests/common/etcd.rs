//! A real etcd for the etcd-mode tests: Debian's `etcd-server` binary, started on free loopback
//! ports with a temporary data directory, optionally with TLS and client certificates.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use reconcilers::legacy_alloc::etcd::{EtcdConfig, EtcdStore};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("a free port")
}

fn etcd_binary() -> PathBuf {
    for dir in std::env::var("PATH").unwrap_or_default().split(':') {
        let candidate = Path::new(dir).join("etcd");
        if candidate.is_file() {
            return candidate;
        }
    }
    panic!(
        "the etcd binary is not on PATH: these tests need a real etcd (Debian: apt-get install etcd-server)"
    );
}

/// TLS material for an etcd that requires client certificates.
pub struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    pub fn generate() -> Self {
        use rcgen::{
            BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
            SanType,
        };
        let dir = tempfile::tempdir().unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_cert = ca_params.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        let leaf = |name: &str, usage: ExtendedKeyUsagePurpose| {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
            params
                .subject_alt_names
                .push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
            params.extended_key_usages = vec![usage];
            let cert = params.signed_by(&key, &issuer).unwrap();
            std::fs::write(dir.path().join(format!("{name}.crt")), cert.pem()).unwrap();
            std::fs::write(dir.path().join(format!("{name}.key")), key.serialize_pem()).unwrap();
        };
        leaf("server", ExtendedKeyUsagePurpose::ServerAuth);
        leaf("client", ExtendedKeyUsagePurpose::ClientAuth);
        // A second client certificate of the same CA: the first one renewed.
        leaf("renewed", ExtendedKeyUsagePurpose::ClientAuth);
        std::fs::write(dir.path().join("ca.crt"), ca_cert.pem()).unwrap();
        Pki { dir }
    }

    /// A file of this PKI: `ca.crt`, `server.crt`/`.key`, `client.crt`/`.key`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

/// A real etcd on loopback; killed on drop.
pub struct Etcd {
    child: Option<Child>,
    data: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    tls: Option<Pki>,
}

impl Etcd {
    pub async fn start(tls: Option<Pki>) -> Self {
        let mut etcd = Etcd {
            child: None,
            data: tempfile::tempdir().unwrap(),
            client_port: free_port(),
            peer_port: free_port(),
            tls,
        };
        etcd.spawn().await;
        etcd
    }

    /// The PKI the server uses and trusts, when it serves TLS.
    pub fn pki(&self) -> Option<&Pki> {
        self.tls.as_ref()
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    pub async fn spawn(&mut self) {
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut command = Command::new(etcd_binary());
        command
            .arg("--name=test")
            .arg(format!(
                "--data-dir={}",
                self.data.path().join("data").display()
            ))
            .arg(format!("--listen-client-urls={}", self.url()))
            .arg(format!("--advertise-client-urls={}", self.url()))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=test={peer}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(pki) = &self.tls {
            command
                .arg(format!("--cert-file={}", pki.path("server.crt").display()))
                .arg(format!("--key-file={}", pki.path("server.key").display()))
                .arg(format!(
                    "--trusted-ca-file={}",
                    pki.path("ca.crt").display()
                ))
                .arg("--client-cert-auth");
        }
        self.child = Some(command.spawn().expect("etcd starts"));
        let store = EtcdStore::new(self.config());
        super::eventually("etcd answers", || async {
            store.get("/probe").await.is_ok()
        })
        .await;
    }

    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn config(&self) -> EtcdConfig {
        EtcdConfig {
            servers: vec![self.url()],
            ca_file: self.tls.as_ref().map(|pki| pki.path("ca.crt")),
            cert_file: self.tls.as_ref().map(|pki| pki.path("client.crt")),
            key_file: self.tls.as_ref().map(|pki| pki.path("client.key")),
            ..EtcdConfig::default()
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Etcd {
    /// Requests etcd has answered on its KV service so far (Range, Put, DeleteRange, Txn,
    /// Compact, every result), from its own metrics. Plain-HTTP etcd only.
    pub async fn kv_requests(&self) -> u64 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", self.client_port))
            .await
            .unwrap();
        stream
            .write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            .await
            .unwrap();
        let mut body = String::new();
        stream.read_to_string(&mut body).await.unwrap();
        body.lines()
            .filter(|line| {
                line.starts_with("grpc_server_handled_total{")
                    && line.contains("grpc_service=\"etcdserverpb.KV\"")
            })
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    }
}
