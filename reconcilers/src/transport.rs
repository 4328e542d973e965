//! An HTTP/1.1 transport for large LIST responses that reads each response on the task that
//! consumes its body.
//!
//! kube's client (hyper-util's pooled client) runs every connection in a task of its own and
//! hands the body to the reader through a channel that holds one frame. kube-apiserver streams a
//! LIST page in chunks of 2 KiB (Go's `net/http` buffer), so a page of 2,000 Services in protobuf
//! is about 650 hand-overs between two tasks. Each is a wake-up, often of the other worker
//! thread, and then the frame's buffer is released on another core than the one that cut it.
//! Here the body polls its own connection: the frames are cut and consumed on one task, with no
//! hand-over.
//!
//! Below TLS, reads go through a buffer of [`READ_BUFFER`] bytes ([`BufferedTcp`]): rustls
//! reads 4 – 16 KiB at a time, one system call each.
//!
//! Everything else comes from kube's [`Config`]: the TLS setup
//! (`rustls_https_connector_with_connector`), the cluster URL, the retry of 429/503/504 answers
//! (`default_retry`), authentication (with token refresh) and the extra headers (impersonation)
//! are the layers kube's own client is built from. A configuration this transport does not
//! cover (a proxy, an exec plugin) gets no client here, and the caller keeps kube's.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body as _, Frame, SizeHint};
use hyper::client::conn::http1;
use kube::client::{Body, ConfigExt};
use kube::{Client, Config};
use tower::{BoxError, ServiceBuilder, ServiceExt as _};

type Connector = hyper_rustls::HttpsConnector<BufferedConnector>;
type Stream = hyper_rustls::MaybeHttpsStream<BufferedTcp>;
type Connection = http1::Connection<Stream, Body>;
type Sender = http1::SendRequest<Body>;

/// At most this many connections are kept between requests (the repair lists three collections
/// at once, each with one page in flight ahead).
const MAX_IDLE: usize = 8;
/// A connection unused for longer is not reused: servers and load balancers close idle ones.
const MAX_IDLE_FOR: Duration = Duration::from_secs(60);

/// Why a request over this transport failed.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("connecting to {authority}: {source}")]
    Connect {
        authority: String,
        #[source]
        source: BoxError,
    },
    #[error("connecting to {authority}: no connection within {timeout:?}")]
    ConnectTimeout {
        authority: String,
        timeout: Duration,
    },
    #[error("no data from the server for {0:?}")]
    ReadTimeout(Duration),
    #[error("the request has no scheme and host: {0}")]
    NotAbsolute(http::Uri),
    #[error("the connection closed before the response was complete")]
    Closed,
    #[error(transparent)]
    Http(#[from] hyper::Error),
}

/// A [`Client`] whose requests go through this transport, built from `config` as kube builds its
/// own; `None` when `config` needs something only kube's client does: a proxy, or an exec
/// plugin (its client certificates expire, and kube's client tracks that).
pub fn in_task_client(config: &Config) -> Result<Option<Client>, kube::Error> {
    if config.proxy_url.is_some() || config.auth_info.exec.is_some() {
        return Ok(None);
    }
    let transport = InTaskTransport {
        shared: Arc::new(Shared {
            connector: config.rustls_https_connector_with_connector(BufferedConnector::new())?,
            idle: Mutex::new(Vec::new()),
            connect_timeout: config.connect_timeout,
            read_timeout: config.read_timeout,
        }),
    };
    // The layers in kube's order (`ClientBuilder::try_from`), its tracing layer aside: that one
    // reads the clock twice per frame.
    let retry = config
        .default_retry
        .then(|| tower::retry::RetryLayer::new(kube::client::retry::RetryPolicy::server_retry()));
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(retry)
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(transport);
    Ok(Some(Client::new(service, config.default_namespace.clone())))
}

/// The transport as a tower service: absolute request URIs in (kube's base URI layer makes them
/// so), responses whose bodies drive their connections out.
#[derive(Clone)]
pub struct InTaskTransport {
    shared: Arc<Shared>,
}

struct Shared {
    connector: Connector,
    idle: Mutex<Vec<Idle>>,
    connect_timeout: Option<Duration>,
    read_timeout: Option<Duration>,
}

/// A connection between requests.
struct Idle {
    authority: http::uri::Authority,
    sender: Sender,
    connection: Connection,
    since: tokio::time::Instant,
}

impl tower::Service<Request<Body>> for InTaskTransport {
    type Response = Response<InTaskBody>;
    type Error = TransportError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        Box::pin(Arc::clone(&self.shared).send(request))
    }
}

impl Shared {
    async fn send(
        self: Arc<Self>,
        request: Request<Body>,
    ) -> Result<Response<InTaskBody>, TransportError> {
        let (mut parts, body) = request.into_parts();
        let authority = parts
            .uri
            .authority()
            .cloned()
            .filter(|_| parts.uri.scheme().is_some())
            .ok_or_else(|| TransportError::NotAbsolute(parts.uri.clone()))?;
        let target = parts.uri.clone();
        // Over a connection of its own, a request names only the path (origin form) and the host
        // goes in a header: hyper's connection sends the URI as given.
        parts.uri = target
            .path_and_query()
            .cloned()
            .map_or_else(|| http::Uri::from_static("/"), http::Uri::from);
        if !parts.headers.contains_key(http::header::HOST)
            && let Ok(host) = http::HeaderValue::from_str(authority.as_str())
        {
            parts.headers.insert(http::header::HOST, host);
        }
        // A GET or HEAD without a body may go again on a fresh connection when a reused one
        // turns out closed by the server before it answered (idle connections are closed at
        // will); any other request might have been acted on.
        let resendable = matches!(parts.method, http::Method::GET | http::Method::HEAD)
            && body.size_hint().exact() == Some(0);
        let mut body = Some(body);
        loop {
            let (mut sender, mut connection, reused) = match self.take_idle(&authority) {
                Some(idle) => (idle.sender, idle.connection, true),
                None => {
                    let (sender, connection) = self.connect(&target, &authority).await?;
                    (sender, connection, false)
                }
            };
            let ready = std::future::poll_fn(|cx| {
                if Pin::new(&mut connection).poll(cx).is_ready() {
                    return Poll::Ready(false);
                }
                sender.poll_ready(cx).map(|ready| ready.is_ok())
            })
            .await;
            if !ready {
                // Nothing was sent on it: any request may go on another connection.
                if reused {
                    continue;
                }
                return Err(TransportError::Closed);
            }
            let this_body = match body.take() {
                Some(body) => body,
                None => Body::empty(),
            };
            let mut request = Request::new(this_body);
            *request.method_mut() = parts.method.clone();
            *request.uri_mut() = parts.uri.clone();
            *request.version_mut() = parts.version;
            *request.headers_mut() = parts.headers.clone();
            let mut response = std::pin::pin!(sender.send_request(request));
            let head = async {
                std::future::poll_fn(|cx| {
                    if let Poll::Ready(response) = response.as_mut().poll(cx) {
                        return Poll::Ready(Some(response));
                    }
                    match Pin::new(&mut connection).poll(cx) {
                        Poll::Ready(_) => Poll::Ready(None),
                        Poll::Pending => Poll::Pending,
                    }
                })
                .await
            };
            let head = match self.read_timeout {
                Some(timeout) => tokio::time::timeout(timeout, head)
                    .await
                    .map_err(|_| TransportError::ReadTimeout(timeout))?,
                None => head.await,
            };
            // The connection ended first: the response future now holds why.
            let head = match head {
                Some(head) => head,
                None => response.as_mut().await,
            };
            match head {
                Ok(head) => {
                    // What kube's client logs through its tracing layer, once per request.
                    tracing::debug!(
                        method = %parts.method,
                        path = %parts.uri,
                        status = head.status().as_u16(),
                        reused,
                        "HTTP response (LIST transport)"
                    );
                    let shared = Arc::clone(&self);
                    return Ok(head.map(|incoming| InTaskBody {
                        incoming,
                        connection: Some(Driven {
                            authority,
                            sender,
                            connection,
                        }),
                        shared,
                        read_timer: None,
                        progressed: false,
                    }));
                }
                Err(err)
                    if reused
                        && resendable
                        && (err.is_canceled() || err.is_incomplete_message()) =>
                {
                    tracing::debug!(error = %err, "a reused connection was closed; sending again on a new one");
                    continue;
                }
                Err(err) => return Err(err.into()),
            }
        }
    }

    fn take_idle(&self, authority: &http::uri::Authority) -> Option<Idle> {
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = tokio::time::Instant::now();
        idle.retain(|conn| {
            now.duration_since(conn.since) < MAX_IDLE_FOR && !conn.sender.is_closed()
        });
        let at = idle.iter().rposition(|conn| conn.authority == *authority)?;
        Some(idle.swap_remove(at))
    }

    fn put_idle(&self, driven: Driven) {
        if driven.sender.is_closed() {
            return;
        }
        let mut idle = self
            .idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if idle.len() < MAX_IDLE {
            idle.push(Idle {
                authority: driven.authority,
                sender: driven.sender,
                connection: driven.connection,
                since: tokio::time::Instant::now(),
            });
        }
    }

    async fn connect(
        &self,
        target: &http::Uri,
        authority: &http::uri::Authority,
    ) -> Result<(Sender, Connection), TransportError> {
        let connect = async {
            let stream = self
                .connector
                .clone()
                .oneshot(target.clone())
                .await
                .map_err(|source| TransportError::Connect {
                    authority: authority.to_string(),
                    source,
                })?;
            Ok::<_, TransportError>(http1::handshake(stream).await?)
        };
        match self.connect_timeout {
            Some(timeout) => tokio::time::timeout(timeout, connect).await.map_err(|_| {
                TransportError::ConnectTimeout {
                    authority: authority.to_string(),
                    timeout,
                }
            })?,
            None => connect.await,
        }
    }
}

/// The connection a response came on, driven by its body.
struct Driven {
    authority: http::uri::Authority,
    sender: Sender,
    connection: Connection,
}

/// A response body that reads its connection itself; the connection goes back to the pool when
/// the body has been read to its end.
pub struct InTaskBody {
    incoming: hyper::body::Incoming,
    /// `None` once the connection has ended (or failed): frames it cut before are still in the
    /// body's channel, which outlives it.
    connection: Option<Driven>,
    shared: Arc<Shared>,
    /// Fires when the server has sent nothing for the read timeout: armed while the body waits,
    /// moved on (rather than reset on every frame, which would read the clock each time) when
    /// frames arrived since it was armed.
    read_timer: Option<Pin<Box<tokio::time::Sleep>>>,
    progressed: bool,
}

impl InTaskBody {
    fn poll_read_timeout(&mut self, cx: &mut Context<'_>) -> Poll<TransportError> {
        let Some(timeout) = self.shared.read_timeout else {
            return Poll::Pending;
        };
        let timer = self
            .read_timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        loop {
            ready!(timer.as_mut().poll(cx));
            if !std::mem::take(&mut self.progressed) {
                return Poll::Ready(TransportError::ReadTimeout(timeout));
            }
            let deadline = tokio::time::Instant::now() + timeout;
            timer.as_mut().reset(deadline);
        }
    }
}

impl http_body::Body for InTaskBody {
    type Data = Bytes;
    type Error = TransportError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, TransportError>>> {
        let this = self.get_mut();
        let mut drove = false;
        loop {
            match Pin::new(&mut this.incoming).poll_frame(cx) {
                Poll::Ready(Some(frame)) => {
                    this.progressed = true;
                    return Poll::Ready(Some(frame.map_err(TransportError::Http)));
                }
                Poll::Ready(None) => {
                    if let Some(driven) = this.connection.take() {
                        this.shared.put_idle(driven);
                    }
                    return Poll::Ready(None);
                }
                Poll::Pending => {}
            }
            if this.connection.is_none() {
                // The connection is done, and whatever it had for the body was handed over.
                return Poll::Ready(Some(Err(TransportError::Closed)));
            }
            // Once the connection is polled and still waits, its wakers are set, and so is the
            // body's: poll the body once more (the connection may just have cut a frame), no more.
            if drove {
                return match this.poll_read_timeout(cx) {
                    Poll::Ready(err) => {
                        this.connection = None;
                        Poll::Ready(Some(Err(err)))
                    }
                    Poll::Pending => Poll::Pending,
                };
            }
            drove = true;
            if let Some(driven) = &mut this.connection {
                match Pin::new(&mut driven.connection).poll(cx) {
                    Poll::Pending => {}
                    Poll::Ready(Ok(())) => this.connection = None,
                    Poll::Ready(Err(err)) => {
                        this.connection = None;
                        return Poll::Ready(Some(Err(err.into())));
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.incoming.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.incoming.size_hint()
    }
}

/// Bytes read from the socket at once. rustls asks for 4 – 16 KiB per read, one `recv` each;
/// reading through this buffer cut the `recv` calls of back-to-back passes at 10,000 Services
/// fourfold (measured with the ClusterIP bench), for one more copy in memory.
const READ_BUFFER: usize = 64 * 1024;

/// Connects as kube's connector does (`HttpConnector` with `enforce_http(false)`, the TLS layer
/// on top), returning streams read through a buffer ([`BufferedTcp`]).
#[derive(Clone)]
pub struct BufferedConnector(hyper_util::client::legacy::connect::HttpConnector);

impl BufferedConnector {
    fn new() -> Self {
        let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
        http.enforce_http(false);
        Self(http)
    }
}

impl tower::Service<http::Uri> for BufferedConnector {
    type Response = BufferedTcp;
    type Error =
        <hyper_util::client::legacy::connect::HttpConnector as tower::Service<http::Uri>>::Error;
    type Future = Pin<Box<dyn Future<Output = Result<BufferedTcp, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connecting = self.0.call(uri);
        Box::pin(async move {
            let stream = connecting.await?.into_inner();
            Ok(BufferedTcp(hyper_util::rt::TokioIo::new(
                tokio::io::BufReader::with_capacity(READ_BUFFER, stream),
            )))
        })
    }
}

/// A TCP stream whose reads go through tokio's `BufReader` (a read asking for at least the
/// buffer's size goes to the socket directly); writes are not buffered. A type of its own only
/// because the connection info hyper's connectors want (`Connection`) is not implemented for
/// `BufReader`.
pub struct BufferedTcp(hyper_util::rt::TokioIo<tokio::io::BufReader<tokio::net::TcpStream>>);

impl hyper::rt::Read for BufferedTcp {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, out)
    }
}

impl hyper::rt::Write for BufferedTcp {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bytes: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, bytes)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bytes: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bytes)
    }
}

impl hyper_util::client::legacy::connect::Connection for BufferedTcp {
    fn connected(&self) -> hyper_util::client::legacy::connect::Connected {
        self.0.inner().get_ref().connected()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::{BufferedTcp, READ_BUFFER};

    /// Reads of every size see the stream's bytes in order, whether served from the buffer,
    /// refilling it, or going to the socket directly; the end of the stream is a read of 0.
    #[tokio::test]
    async fn buffered_reads_return_the_stream_in_order() {
        use tokio::io::AsyncWriteExt;

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let sent: Vec<u8> = (0..3 * READ_BUFFER + 12_345)
            .map(|i| (i % 251) as u8)
            .collect();
        let server = {
            let sent = sent.clone();
            tokio::spawn(async move {
                let (mut socket, _) = listener.accept().await.unwrap();
                for piece in sent.chunks(10_000) {
                    socket.write_all(piece).await.unwrap();
                }
            })
        };
        let mut stream = BufferedTcp(hyper_util::rt::TokioIo::new(
            tokio::io::BufReader::with_capacity(
                READ_BUFFER,
                tokio::net::TcpStream::connect(address).await.unwrap(),
            ),
        ));
        let mut received = Vec::new();
        // Small reads (from the buffer), one larger than the buffer (straight from the socket
        // once the buffer is empty), and sizes that end in the middle of a buffered read.
        let sizes = [1, 4096, 100, READ_BUFFER + 7, 3, 65_000, 4096];
        for size in sizes.iter().cycle() {
            let mut space = vec![0u8; *size];
            let mut read = hyper::rt::ReadBuf::new(&mut space);
            std::future::poll_fn(|cx| {
                hyper::rt::Read::poll_read(std::pin::Pin::new(&mut stream), cx, read.unfilled())
            })
            .await
            .unwrap();
            let filled = read.filled();
            if filled.is_empty() {
                break;
            }
            received.extend_from_slice(filled);
        }
        server.await.unwrap();
        assert_eq!(received.len(), sent.len());
        assert!(received == sent, "the bytes arrive in order");
    }
}
