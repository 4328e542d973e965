//! A stand-in for one apiserver's `/readyz`: answers 200 or 500 as the test says, for the
//! endpoints loop's readiness probe (`--readyz-url` style probes of a full URL).

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Serves until dropped with the runtime; cheap to share (the flag is an `Arc`).
#[derive(Clone, Debug)]
pub struct FakeReadyz {
    ready: Arc<AtomicBool>,
    addr: SocketAddr,
}

impl FakeReadyz {
    /// Listens on a free loopback port; ready at first.
    pub async fn start() -> io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let ready = Arc::new(AtomicBool::new(true));
        let flag = ready.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let flag = flag.clone();
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let _ = stream.read(&mut buf).await;
                    let response = if flag.load(Ordering::SeqCst) {
                        "HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
                    } else {
                        "HTTP/1.1 500 Internal Server Error\r\ncontent-length: 6\r\n\
                         connection: close\r\n\r\nfailed"
                    };
                    let _ = stream.write_all(response.as_bytes()).await;
                });
            }
        });
        Ok(FakeReadyz { ready, addr })
    }

    pub fn url(&self) -> String {
        format!("http://{}/readyz", self.addr)
    }

    /// From now on, answer 200 (`true`) or 500.
    pub fn set(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }
}
