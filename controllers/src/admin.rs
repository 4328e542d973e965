//! Admin HTTP server: `/livez`, `/readyz` and `/metrics`.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::health::Health;
use crate::metrics::{OPENMETRICS_CONTENT_TYPE, encode_merged};

#[derive(Clone)]
pub struct AdminState {
    pub health: Health,
    pub registry: Arc<Registry>,
    /// Management mode's tenants: their readiness lines and metrics registries.
    pub tenants: Option<crate::tenants::Directory>,
    /// Once cancelled, `/readyz` fails so traffic and rollouts move on while loops stop.
    pub shutting_down: CancellationToken,
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/livez", get(livez))
        .route("/healthz", get(livez))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// What one peer may hold of the server. The port is unauthenticated and, by default, open to
/// every pod, so what a client can make the process keep is bounded: its connections, and how
/// long it may take to send a request's headers.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionLimits {
    /// Open connections per peer address; one more closes that peer's oldest, so a client
    /// that holds connections open loses them, not the newest request of another (the
    /// kubelet's probes, Prometheus).
    pub per_peer: usize,
    /// Open connections in all; one more closes the oldest of the peer holding the most.
    pub total: usize,
    /// A request's headers must arrive within this, or the connection is closed (also an idle
    /// HTTP/1 connection waiting for its next request).
    pub header_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            per_peer: 16,
            total: 256,
            header_timeout: Duration::from_secs(5),
        }
    }
}

/// How long requests in flight may finish after `stop`.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// Serves until `stop` fires, within [`ConnectionLimits::default`]. Requests in flight get a
/// moment to finish.
pub async fn serve(
    listener: TcpListener,
    state: AdminState,
    stop: CancellationToken,
) -> std::io::Result<()> {
    serve_within(listener, state, stop, ConnectionLimits::default()).await;
    Ok(())
}

/// [`serve`] within `limits`.
pub async fn serve_within(
    listener: TcpListener,
    state: AdminState,
    stop: CancellationToken,
    limits: ConnectionLimits,
) {
    let service = TowerToHyperService::new(router(state));
    // HTTP/1 only: probes and scrapes speak it, and its header timeout runs from the first byte.
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let open: Arc<Mutex<Open>> = Arc::default();
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                // Out of file descriptors, most likely: give the open connections time to end.
                tracing::debug!(error = %err, "admin server cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let admitted = Admitted::new(&open, peer.ip(), &limits);
        let (builder, service, stop) = (builder.clone(), service.clone(), stop.clone());
        connections.spawn(async move {
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            tokio::select! {
                ended = connection.as_mut() => {
                    if let Err(err) = ended {
                        tracing::debug!(error = %err, "admin server connection ended");
                    }
                    return;
                }
                () = admitted.evicted.cancelled() => {
                    tracing::debug!(%peer, "admin server connection closed for a newer one");
                    return;
                }
                () = stop.cancelled() => connection.as_mut().graceful_shutdown(),
            }
            let _ = tokio::time::timeout(SHUTDOWN_GRACE, connection).await;
        });
        // Reap the ended connections' tasks as they go.
        while connections.try_join_next().is_some() {}
    }
    while connections.join_next().await.is_some() {}
}

/// The open connections, oldest first, each with its peer and what closes it.
#[derive(Default)]
struct Open {
    next: u64,
    by_age: BTreeMap<u64, (IpAddr, CancellationToken)>,
}

impl Open {
    /// The oldest connection of the peer that holds the most (the older one's on a tie): the
    /// server full, the party filling it pays, not a peer with one request.
    fn oldest_of_the_largest(&self) -> Option<u64> {
        let mut held: BTreeMap<IpAddr, (usize, u64)> = BTreeMap::new();
        for (id, (peer, _)) in &self.by_age {
            held.entry(*peer).or_insert((0, *id)).0 += 1;
        }
        let largest = held.values().map(|(count, _)| *count).max()?;
        (held.values())
            .filter(|(count, _)| *count == largest)
            .map(|(_, oldest)| *oldest)
            .min()
    }
}

/// One admitted connection, counted against its peer and the total until dropped.
struct Admitted {
    open: Arc<Mutex<Open>>,
    id: u64,
    /// Cancelled when a newer connection takes its place.
    evicted: CancellationToken,
}

impl Admitted {
    /// Admits a connection of `peer`, closing the peer's oldest when it holds its limit, else
    /// the oldest of all when the server holds its total.
    fn new(open: &Arc<Mutex<Open>>, peer: IpAddr, limits: &ConnectionLimits) -> Self {
        let mut state = open.lock().unwrap_or_else(|poison| poison.into_inner());
        let of_peer: Vec<u64> = (state.by_age.iter())
            .filter(|(_, (from, _))| *from == peer)
            .map(|(id, _)| *id)
            .collect();
        let oldest = match of_peer.first() {
            Some(id) if of_peer.len() >= limits.per_peer => Some(*id),
            _ if state.by_age.len() >= limits.total => state.oldest_of_the_largest(),
            _ => None,
        };
        if let Some((_, evicted)) = oldest.and_then(|id| state.by_age.remove(&id)) {
            evicted.cancel();
        }
        let id = state.next;
        state.next += 1;
        let evicted = CancellationToken::new();
        state.by_age.insert(id, (peer, evicted.clone()));
        Admitted {
            open: open.clone(),
            id,
            evicted,
        }
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut state = self
            .open
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        state.by_age.remove(&self.id);
    }
}

/// The process is alive as long as it answers: loops that fail are retried, never fatal, so a
/// restart would not help them.
async fn livez() -> &'static str {
    "ok"
}

async fn readyz(State(state): State<AdminState>) -> Response {
    let readiness = state.health.readiness();
    let mut body = String::new();
    let mut ready = readiness.ready;
    if state.shutting_down.is_cancelled() {
        body.push_str("[-]shutdown failed: shutting down\n");
        ready = false;
    }
    for line in &readiness.lines {
        body.push_str(line);
        body.push('\n');
    }
    if readiness.lines.is_empty() && state.tenants.is_none() {
        body.push_str("[+]loops ok (no loop enabled)\n");
    }
    // Informational: a failing tenant does not make this process unready (a restart would not
    // heal it, and would interrupt every other tenant).
    if let Some(tenants) = &state.tenants {
        for line in tenants.readyz_lines() {
            body.push_str(&line);
            body.push('\n');
        }
    }
    if ready {
        body.push_str("readyz check passed\n");
        (StatusCode::OK, body).into_response()
    } else {
        body.push_str("readyz check failed\n");
        (StatusCode::SERVICE_UNAVAILABLE, body).into_response()
    }
}

async fn metrics(State(state): State<AdminState>) -> Response {
    // The process's own metrics (memory, CPU, build) beside the runtime's and the tenants'.
    let mut more = vec![crate::metrics::process_registry()];
    if let Some(tenants) = &state.tenants {
        more.extend(tenants.registries());
    }
    let encoded = encode_merged(&state.registry, &more);
    match encoded {
        Ok(text) => ([(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)], text).into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "encoding metrics failed\n",
        )
            .into_response(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::metrics::{RunnerMetrics, new_registry};

    async fn get_text(addr: std::net::SocketAddr, path: &str) -> (u16, String, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        let (head, body) = response.split_once("\r\n\r\n").unwrap();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        let content_type = head
            .lines()
            .find_map(|line| {
                line.to_ascii_lowercase()
                    .strip_prefix("content-type: ")
                    .map(str::to_owned)
            })
            .unwrap_or_default();
        (status, content_type, body.to_owned())
    }

    #[tokio::test]
    async fn serves_livez_readyz_and_openmetrics() {
        let mut registry = new_registry();
        let metrics = RunnerMetrics::register(&mut registry);
        metrics.init_loop(
            "system-namespaces",
            std::time::Duration::from_secs(60),
            true,
        );
        let state = AdminState {
            health: Health::default(),
            registry: Arc::new(registry),
            tenants: None,
            shutting_down: CancellationToken::new(),
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let server = tokio::spawn(serve(listener, state.clone(), stop.clone()));

        let (status, _, body) = get_text(addr, "/livez").await;
        assert_eq!((status, body.as_str()), (200, "ok"));

        let (status, content_type, body) = get_text(addr, "/metrics").await;
        assert_eq!(status, 200);
        assert_eq!(
            content_type,
            "application/openmetrics-text; version=1.0.0; charset=utf-8"
        );
        assert!(
            body.contains(
                "bootstrap_loop_passes_total{loop=\"system-namespaces\",result=\"success\"} 0"
            ),
            "{body}"
        );
        assert!(body.ends_with("# EOF\n"), "{body}");

        let (status, _, body) = get_text(addr, "/readyz").await;
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("readyz check passed"), "{body}");

        state.shutting_down.cancel();
        let (status, _, body) = get_text(addr, "/readyz").await;
        assert_eq!(status, 503, "{body}");
        assert!(body.contains("[-]shutdown failed"), "{body}");

        stop.cancel();
        server.await.unwrap().unwrap();
    }

    fn quiet_state() -> AdminState {
        AdminState {
            health: Health::default(),
            registry: Arc::new(new_registry()),
            tenants: None,
            shutting_down: CancellationToken::new(),
        }
    }

    /// Whether the server closed `stream` (rather than leaving it open) within 10 s.
    async fn closed(stream: &mut tokio::net::TcpStream) -> bool {
        use tokio::io::AsyncReadExt;
        let mut buffer = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buffer)).await;
        matches!(read, Ok(Ok(0)) | Ok(Err(_)))
    }

    /// Whether `stream` is still open: nothing to read, and no end, for a moment.
    async fn still_open(stream: &mut tokio::net::TcpStream) -> bool {
        use tokio::io::AsyncReadExt;
        let mut buffer = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_millis(300), stream.read(&mut buffer));
        read.await.is_err()
    }

    #[tokio::test]
    async fn a_client_that_sends_nothing_is_closed_after_the_header_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let limits = ConnectionLimits {
            header_timeout: Duration::from_millis(200),
            ..ConnectionLimits::default()
        };
        let server = tokio::spawn(serve_within(listener, quiet_state(), stop.clone(), limits));
        let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
        assert!(closed(&mut silent).await, "an idle connection is not kept");
        stop.cancel();
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_peer_over_its_connections_loses_its_oldest_and_no_newcomer_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let limits = ConnectionLimits {
            per_peer: 3,
            total: 4,
            // Longer than the test: only the limits close a connection here.
            header_timeout: Duration::from_secs(60),
        };
        let server = tokio::spawn(serve_within(listener, quiet_state(), stop.clone(), limits));
        let from = |source: &'static str| async move {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
            socket.connect(addr).await.unwrap()
        };
        let served = |mut stream: tokio::net::TcpStream| async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            stream
                .write_all(b"GET /livez HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
                .await
                .unwrap();
            let mut response = String::new();
            stream.read_to_string(&mut response).await.unwrap();
            response.starts_with("HTTP/1.1 200")
        };
        // The oldest of all, alone from its peer.
        let mut lone = from("127.0.0.4").await;
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(from("127.0.0.1").await);
        }
        // Accepted in order: a fourth of the same peer is served, and the peer's oldest closed.
        assert!(served(from("127.0.0.1").await).await);
        assert!(closed(&mut held[0]).await, "the peer's oldest is closed");
        // The server full, a newcomer closes the oldest of the peer holding the most: held[1],
        // not the lone connection, which is older.
        let _other = from("127.0.0.2").await;
        assert!(served(from("127.0.0.3").await).await);
        assert!(
            closed(&mut held[1]).await,
            "the largest peer's oldest is closed"
        );
        assert!(
            still_open(&mut lone).await,
            "a peer with one connection keeps it"
        );
        stop.cancel();
        server.await.unwrap();
    }
}
