//! Admin HTTP server: `/livez`, `/readyz` and `/metrics`.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
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

/// Serves until `stop` fires. Requests in flight get a moment to finish.
pub async fn serve(
    listener: TcpListener,
    state: AdminState,
    stop: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(async move { stop.cancelled().await })
        .await
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
}
