//! A stand-in for one apiserver's `/readyz`: answers 200 or 500 as the test says, for the
//! endpoints loop's readiness probe (`--readyz-url` style probes of a full URL).

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Serves until dropped with the runtime; cheap to share (the flag is an `Arc`).
#[derive(Clone, Debug)]
pub struct FakeReadyz {
    ready: Arc<AtomicBool>,
    /// Probes still to fail before `ready` decides again.
    failing: Arc<AtomicU32>,
    /// Probes answered so far.
    probes: Arc<AtomicU32>,
    addr: SocketAddr,
}

impl FakeReadyz {
    /// Listens on a free loopback port; ready at first.
    pub async fn start() -> io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let ready = Arc::new(AtomicBool::new(true));
        let failing = Arc::new(AtomicU32::new(0));
        let probes = Arc::new(AtomicU32::new(0));
        let (flag, fail, count) = (ready.clone(), failing.clone(), probes.clone());
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let (flag, fail, count) = (flag.clone(), fail.clone(), count.clone());
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let _ = stream.read(&mut buf).await;
                    count.fetch_add(1, Ordering::SeqCst);
                    let forced = fail
                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                        .is_ok();
                    let response = if !forced && flag.load(Ordering::SeqCst) {
                        "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
                    } else {
                        "HTTP/1.1 500 Internal Server Error\r\ncontent-length: 6\r\n\
                         connection: close\r\n\r\nfailed"
                    };
                    let _ = stream.write_all(response.as_bytes()).await;
                });
            }
        });
        Ok(FakeReadyz {
            ready,
            failing,
            probes,
            addr,
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}/readyz", self.addr)
    }

    /// From now on, answer 200 (`true`) or 500.
    pub fn set(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    /// The next `n` probes answer 500, whatever [`FakeReadyz::set`] says.
    pub fn fail_next(&self, n: u32) {
        self.failing.store(n, Ordering::SeqCst);
    }

    /// Probes still to fail from [`FakeReadyz::fail_next`].
    pub fn failing(&self) -> u32 {
        self.failing.load(Ordering::SeqCst)
    }

    /// Probes answered so far.
    pub fn probes(&self) -> u32 {
        self.probes.load(Ordering::SeqCst)
    }
}
