//! Bounds on what one API server can make this process wait for or hold: a tower layer for the
//! clients of tenant control planes, which are untrusted (management mode).
//!
//! kube's client waits for an answer without a deadline (its read timeout is unset by default,
//! so a server that accepts a connection and never answers holds the request for ever), reads
//! a whole non-watch response into memory whatever its size, and buffers a watch event until its
//! newline however long it is. One broken or hostile tenant API could so stop its loops for good
//! or exhaust the memory every tenant shares. With this layer:
//!
//! - every request's answer (status and headers) must arrive within `answer_timeout`;
//! - a non-watch response's body must be complete within `answer_timeout` of the request and
//!   hold at most `max_response_bytes`;
//! - a watch response may stream for as long as the server keeps it open (the caches' list+watch
//!   ends a silent one after the server-side timeout plus a margin), but each of its lines (one
//!   event) holds at most `max_watch_line_bytes`.
//!
//! The clients of all tenants may share a [`BytePool`]: the most bytes all their responses
//! hold at once, whatever the number of tenants ([`TENANTS_RESPONSE_POOL_BYTES`]). A response
//! whose growth would take the pool over what it may hold fails as over a bound of its own,
//! unless its client holds no more than the pool's floor: a tenant reading small responses is
//! never failed by what others read. As for the caches' pool, every client's floor is kept out
//! of what the clients above theirs may take, and the floor is at most half a fair share, so
//! for a given set of clients the pool holds at most its total (beside the chunk that breaches)
//! however many there are.
//!
//! A request over a bound fails with an error naming the bound; the loop's pass fails and is
//! retried with backoff, as for any API error. A server that broke a bound is then not asked
//! anything for a pause (`first_pause`, doubling with each further breach up to `max_pause`,
//! back to `first_pause` once a response completes within its bounds): requests in the pause
//! fail at once, naming the breach. Without it each of a hostile tenant's watches and passes
//! would retry on its own backoff, and every retry would read another endless body up to its
//! bound, costing the CPU and memory that every tenant shares.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::{Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use reconcilers::budget::{BytePool, Count, PoolShare, move_count};
use tokio::time::{Instant, Sleep};
use tower::{Layer, Service};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The bounds; [`Limits::TENANT`] for tenant clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub answer_timeout: Duration,
    pub max_response_bytes: usize,
    pub max_watch_line_bytes: usize,
    /// What all of one client's responses may hold at once (bodies being read, watch events not
    /// yet complete): the loops of one cluster list several collections at a time.
    pub max_in_flight_bytes: usize,
    /// What one chunk of a non-watch body costs its reader beyond its bytes, counted against the
    /// bounds: a reader keeps every chunk until the body is complete (kube collects them before
    /// parsing), each with its own bookkeeping, so a body of many tiny chunks costs far more
    /// than its bytes.
    pub chunk_cost: usize,
    /// How long a server that broke a bound is not asked anything, the first time.
    pub first_pause: Duration,
    /// The longest pause, however often the server breaks its bounds.
    pub max_pause: Duration,
    /// The most pages one LIST may take (a server whose `continue` token never ends would
    /// otherwise be asked for pages for ever); each page is bounded by `max_response_bytes`.
    pub max_list_pages: u32,
    /// The most events one watch response may stream (a server that streams changes without
    /// end costs the CPU every tenant shares); the watch then starts again after the pause.
    pub max_watch_events: u64,
}

impl Limits {
    /// kube-apiserver refuses request bodies over 3 MiB, so no object, and no watch event (one
    /// object and a few bytes around it), comes near 4 MiB: the caches' watch reader bounds its
    /// lines at the same size (`reconcilers::list_watch::MAX_LINE_BYTES`). A LIST page of the objects the loops
    /// read (500 per page by default, `loops.*.pageSize`) is well under 1 MiB for typical
    /// Services and far smaller for the other kinds; 8 MiB leaves room for pages of unusually
    /// large objects. A healthy apiserver answers within seconds.
    pub const TENANT: Limits = Limits {
        answer_timeout: Duration::from_secs(60),
        max_response_bytes: 8 * 1024 * 1024,
        max_watch_line_bytes: reconcilers::list_watch::MAX_LINE_BYTES,
        max_in_flight_bytes: 24 * 1024 * 1024,
        // A `Bytes` handle and its share of the buffer bookkeeping, rounded up.
        chunk_cost: 64,
        // Long against the watches' backoff (it reaches 30 s, as kube-runtime's default), short
        // against the 60 s a healthy tenant's loops take to notice a change they missed.
        first_pause: Duration::from_secs(30),
        max_pause: Duration::from_secs(300),
        // 5,000,000 objects at the default 500 a page: more than any cache budget lets a
        // cluster hold, so only a list that never ends reaches it.
        max_list_pages: 10_000,
        // A watch asks the server to end it after about five minutes; a million events in
        // one is over 3,000 a second, far beyond a healthy control plane's Service churn.
        max_watch_events: 1_000_000,
    };

    /// The pause after a breach that follows `earlier` breaches without a completed response.
    fn pause_after(&self, earlier: u32) -> Duration {
        self.first_pause
            .saturating_mul(2u32.saturating_pow(earlier.min(16)))
            .min(self.max_pause)
    }

    /// The layer for one client: its responses share one in-flight budget and one pause, and
    /// their bytes count in `pool` too, if given.
    pub fn for_one_client(self, pool: Option<&BytePool>) -> LimitLayer {
        // The client takes a share of the pool while it lives.
        let client = ClientState {
            pool: pool.map(BytePool::join),
            ..ClientState::default()
        };
        LimitLayer {
            limits: self,
            client: Arc::new(client),
        }
    }
}

/// The most bytes all tenants' responses hold at once. A few tenants can read a response of the
/// largest size one may have (8 MiB) at once; a flood of hostile tenants costs no more than this,
/// whatever their number.
pub const TENANTS_RESPONSE_POOL_BYTES: usize = 32 * 1024 * 1024;

/// What each tenant's client may hold of [`TENANTS_RESPONSE_POOL_BYTES`] whatever the others hold
/// (a LIST page of 500 typical Services is well under it), shrinking to half its fair share when
/// the clients are more than 16.
pub const TENANTS_RESPONSE_FLOOR_BYTES: usize = 1024 * 1024;

/// [`Limits`] as a tower layer, with the state of the client it is part of.
#[derive(Clone, Debug)]
pub struct LimitLayer {
    limits: Limits,
    client: Arc<ClientState>,
}

impl LimitLayer {
    /// `hook` is told when the client's server starts breaking bounds (the first breach, or
    /// the first after a longest pause without one).
    pub fn on_breach(&self, hook: BreachNotice) {
        self.client.pause().notice = Some(hook);
    }

    /// A bound broken outside the layer (the cluster's caches over their budget): the client
    /// pauses as for a bound of its own; returns the pause.
    pub fn breach(&self, cause: LimitError) -> Duration {
        self.client.breached(&self.limits, &cause)
    }
}

/// What one client's requests share.
#[derive(Debug, Default)]
struct ClientState {
    /// The bytes its responses hold.
    in_flight: Count,
    /// Where those bytes count too, with other clients'.
    pool: Option<PoolShare>,
    pause: Mutex<Pause>,
    /// The pages of the LIST under way, by path: a request without a `continue` token starts
    /// a list, one with a token continues the last list of its path. Paths are the client's
    /// own requests, so the map stays small whatever the server does.
    list_pages: Mutex<std::collections::HashMap<String, u32>>,
}

/// Called with the cause and the pause when a client's server breaks a bound: once when it
/// starts to, not on every breach while it goes on (see [`LimitLayer::on_breach`]).
pub type BreachNotice = Arc<dyn Fn(&LimitError, Duration) + Send + Sync>;

#[derive(Default)]
struct Pause {
    /// When the last breach's pause ends: a breach within the longest pause after it is the
    /// same misbehaviour, not told again.
    until: Option<Instant>,
    /// Breaches since the last response that completed within its bounds.
    breaches: u32,
    cause: Option<LimitError>,
    /// Who is told when the server starts breaking bounds.
    notice: Option<BreachNotice>,
}

impl std::fmt::Debug for Pause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pause")
            .field("until", &self.until)
            .field("breaches", &self.breaches)
            .field("cause", &self.cause)
            .field("notice", &self.notice.is_some())
            .finish()
    }
}

impl ClientState {
    fn pause(&self) -> std::sync::MutexGuard<'_, Pause> {
        // A panic while holding the lock leaves a consistent `Pause` (plain field writes).
        self.pause.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The error for a request made now, if the client is in a pause.
    fn paused(&self, now: Instant) -> Option<LimitError> {
        let pause = self.pause();
        let until = pause.until.filter(|until| *until > now)?;
        Some(LimitError::Paused {
            remaining: until.saturating_duration_since(now),
            cause: Box::new(pause.cause.clone()?),
        })
    }

    /// A bound broken: the next pause starts now; returns its length.
    fn breached(&self, limits: &Limits, cause: &LimitError) -> Duration {
        self.breached_at(limits, cause, Instant::now())
    }

    fn breached_at(&self, limits: &Limits, cause: &LimitError, now: Instant) -> Duration {
        let (length, hook) = {
            let mut pause = self.pause();
            let length = limits.pause_after(pause.breaches);
            // Told once while the server goes on breaking bounds: a breach within the longest
            // pause after the last pause ended is the same misbehaviour (a server that breaks one
            // bound with a list and answers the other requests well would otherwise be told of
            // every pause, and one breaking a bound at every chance would be told once per
            // longest pause).
            let new = (pause.until)
                .is_none_or(|last| now.saturating_duration_since(last) > limits.max_pause);
            pause.until = Some(now + length);
            pause.breaches = pause.breaches.saturating_add(1);
            pause.cause = Some(cause.clone());
            (length, pause.notice.clone().filter(|_| new))
        };
        if let Some(hook) = hook {
            hook(cause, length);
        }
        length
    }

    /// A connection closed for a flood: one breach, however many of its requests report it.
    /// The first starts the pause; the others, failing with the same cause while it lasts,
    /// would otherwise double it once each.
    fn flooded(&self, limits: &Limits, cause: &LimitError) {
        {
            let pause = self.pause();
            if pause.until.is_some_and(|until| until > Instant::now())
                && pause.cause.as_ref() == Some(cause)
            {
                return;
            }
        }
        self.breached(limits, cause);
    }

    fn completed(&self) {
        self.pause().breaches = 0;
    }

    /// Counts a LIST page of `path`; the error when the list has taken too many.
    fn list_page(&self, path: &str, continued: bool, limits: &Limits) -> Result<(), LimitError> {
        let mut lists = self
            .list_pages
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let pages = lists.entry(path.to_owned()).or_insert(0);
        *pages = if continued {
            pages.saturating_add(1)
        } else {
            1
        };
        if *pages > limits.max_list_pages {
            return Err(LimitError::TooManyPages(limits.max_list_pages));
        }
        Ok(())
    }
}

/// Why a response was cut off.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum LimitError {
    #[error("the API server did not answer within {0:?}")]
    NoAnswer(Duration),
    #[error("the API server's response did not complete within {0:?}")]
    TooSlow(Duration),
    #[error("the API server's response exceeded {0} bytes (the limit for one response)")]
    TooLarge(usize),
    #[error("a watch event from the API server exceeded {0} bytes (the limit for one event)")]
    LineTooLong(usize),
    #[error(
        "the API server's responses being read at once exceeded {0} bytes (the limit for one \
         cluster)"
    )]
    TooMuchAtOnce(usize),
    #[error(
        "the responses being read from every tenant at once exceeded {0} bytes (the limit for \
         the process, less the floor kept for every tenant)"
    )]
    PoolExhausted(usize),
    #[error("a list took more than {0} pages (the limit for one list)")]
    TooManyPages(u32),
    #[error("a watch streamed more than {0} events (the limit for one watch)")]
    TooManyEvents(u64),
    /// The server sent what h2's flood protection closes a connection for: small DATA
    /// frames (or resets) beyond what it keeps for a reader that has not read them yet.
    /// Carries h2's own words (`too_many_data_frames`, ...).
    #[error(
        "the API server flooded its HTTP/2 connection, which was closed ({0}): more small \
         frames or resets than the client holds for its reader (the limit for one connection)"
    )]
    Flooded(String),
    /// The cluster's caches would have gone over their budget ([`reconcilers::budget`]).
    #[error("{0}")]
    OverBudget(String),
    #[error(
        "not asking the API server anything for {} s more, after it broke a bound: {cause}",
        remaining.as_secs().max(1)
    )]
    Paused {
        remaining: Duration,
        cause: Box<LimitError>,
    },
}

impl<S> Layer<S> for LimitLayer {
    type Service = Limited<S>;

    fn layer(&self, inner: S) -> Limited<S> {
        Limited {
            inner,
            limits: self.limits,
            client: self.client.clone(),
        }
    }
}

/// A service whose answers are bounded by [`Limits`].
#[derive(Clone, Debug)]
pub struct Limited<S> {
    inner: S,
    limits: Limits,
    client: Arc<ClientState>,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Limited<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    ResBody: Body<Data = Bytes> + Unpin,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<BoundedBody<ResBody>>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Self::Response, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let limits = self.limits;
        let client = self.client.clone();
        let now = Instant::now();
        if let Some(paused) = client.paused(now) {
            return Box::pin(async move { Err(paused.into()) });
        }
        let watch = is_watch(request.uri());
        if !watch && request.method() == http::Method::GET {
            let continued = request
                .uri()
                .query()
                .is_some_and(|query| query.split('&').any(|pair| pair.starts_with("continue=")));
            if let Err(err) = client.list_page(request.uri().path(), continued, &limits) {
                client.breached(&limits, &err);
                return Box::pin(async move { Err(err.into()) });
            }
        }
        let deadline = now + limits.answer_timeout;
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = match tokio::time::timeout_at(deadline, answer).await {
                Ok(Ok(response)) => response,
                Ok(Err(err)) => {
                    let err: BoxError = err.into();
                    // The other requests on a connection that a flood closed end with it.
                    return Err(match flooded(err.as_ref()) {
                        Some(flood) => {
                            client.flooded(&limits, &flood);
                            flood.into()
                        }
                        None => err,
                    });
                }
                Err(_) => {
                    let err = LimitError::NoAnswer(limits.answer_timeout);
                    client.breached(&limits, &err);
                    return Err(err.into());
                }
            };
            Ok(response.map(|body| BoundedBody::new(body, limits, watch, deadline, client)))
        })
    }
}

/// The bound `err` reports broken, if h2 closed the connection for a flood. h2 bounds what a
/// connection's frames cost beyond their payload (`Counts::record_data_frame` in h2's
/// `proto/streams/counts.rs`: each unread DATA frame under 256 bytes spends the difference
/// from a budget of half the connection window) and the resets a peer provokes, and ends the
/// connection with a GOAWAY of its own, `ENHANCE_YOUR_CALM`, when one is spent. However large
/// the window, a server writing tiny frames faster than they are read spends it: that is the
/// server breaking a bound, to be paused for as any other, not a transport error to retry at
/// once.
fn flooded(err: &(dyn std::error::Error + 'static)) -> Option<LimitError> {
    let mut cause = Some(err);
    while let Some(err) = cause {
        if let Some(h2) = err.downcast_ref::<h2::Error>()
            && h2.is_go_away()
            && h2.is_library()
            && h2.reason() == Some(h2::Reason::ENHANCE_YOUR_CALM)
        {
            return Some(LimitError::Flooded(h2.to_string()));
        }
        cause = err.source();
    }
    None
}

/// `?watch=true` (or `1`): kube's watch requests.
fn is_watch(uri: &http::Uri) -> bool {
    uri.query().is_some_and(|query| {
        query
            .split('&')
            .any(|pair| pair == "watch=true" || pair == "watch=1")
    })
}

/// A response body cut off at its bound.
pub struct BoundedBody<B> {
    inner: B,
    bound: Bound,
    failed: bool,
    /// The client (its bytes in flight, of which this body holds `held`).
    client: Arc<ClientState>,
    held: usize,
    limits: Limits,
}

impl<B> Drop for BoundedBody<B> {
    fn drop(&mut self) {
        // Giving back is never over a bound.
        let _ = self.hold(0);
    }
}

/// What a body has read so far, against its [`Limits`].
enum Bound {
    Whole {
        read: usize,
        deadline: Pin<Box<Sleep>>,
    },
    Lines {
        since_newline: usize,
        events: u64,
    },
}

impl<B> BoundedBody<B> {
    fn new(
        inner: B,
        limits: Limits,
        watch: bool,
        deadline: Instant,
        client: Arc<ClientState>,
    ) -> Self {
        let bound = if watch {
            Bound::Lines {
                since_newline: 0,
                events: 0,
            }
        } else {
            Bound::Whole {
                read: 0,
                deadline: Box::pin(tokio::time::sleep_until(deadline)),
            }
        };
        BoundedBody {
            inner,
            bound,
            failed: false,
            client,
            held: 0,
            limits,
        }
    }

    /// Ends the body with a broken bound, which starts the client's pause.
    fn fail(&mut self, err: LimitError) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.failed = true;
        self.client.breached(&self.limits, &err);
        Poll::Ready(Some(Err(err.into())))
    }

    /// Moves this body's share of the client's bytes in flight (and of the pool's) to `held`
    /// (what it holds now: all it read, or a watch's unfinished event); the error when the
    /// client's total is over, or the pool's (its total less the floors kept for every client)
    /// while the client holds more than its floor.
    fn hold(&mut self, held: usize) -> Result<(), LimitError> {
        let total = move_count(&self.client.in_flight, self.held, held);
        let pooled = (self.client.pool.as_ref()).map(|pool| pool.moved(self.held, held, total));
        self.held = held;
        if total > self.limits.max_in_flight_bytes {
            return Err(LimitError::TooMuchAtOnce(self.limits.max_in_flight_bytes));
        }
        if let Some(Err(above_floors)) = pooled {
            return Err(LimitError::PoolExhausted(above_floors));
        }
        Ok(())
    }
}

impl Bound {
    /// Counts a chunk; the error when it crosses a bound of `limits`.
    fn count(&mut self, data: &[u8], limits: &Limits) -> Result<(), LimitError> {
        match self {
            Bound::Whole { read, .. } => {
                let max = limits.max_response_bytes;
                *read = read
                    .saturating_add(data.len())
                    .saturating_add(limits.chunk_cost);
                if *read > max {
                    return Err(LimitError::TooLarge(max));
                }
            }
            Bound::Lines {
                since_newline,
                events,
            } => {
                let (max, max_events) = (limits.max_watch_line_bytes, limits.max_watch_events);
                let mut segments = data.split(|byte| *byte == b'\n');
                // The first segment continues the line before this chunk.
                let first = segments.next().map_or(0, <[u8]>::len);
                let mut line = since_newline.saturating_add(first);
                for segment in segments {
                    if line > max {
                        return Err(LimitError::LineTooLong(max));
                    }
                    *events = events.saturating_add(1);
                    if *events > max_events {
                        return Err(LimitError::TooManyEvents(max_events));
                    }
                    line = segment.len();
                }
                if line > max {
                    return Err(LimitError::LineTooLong(max));
                }
                *since_newline = line;
            }
        }
        Ok(())
    }

    /// The bytes this body holds for its reader: all of a whole response, a watch's unfinished
    /// event.
    fn held(&self) -> usize {
        match self {
            Bound::Whole { read, .. } => *read,
            Bound::Lines { since_newline, .. } => *since_newline,
        }
    }

    /// The deadline of a whole response, if it has passed (registers the waker otherwise).
    fn poll_deadline(&mut self, cx: &mut Context<'_>, limits: &Limits) -> Option<LimitError> {
        match self {
            Bound::Whole { deadline, .. } => (deadline.as_mut().poll(cx).is_ready())
                .then_some(LimitError::TooSlow(limits.answer_timeout)),
            Bound::Lines { .. } => None,
        }
    }
}

impl<B> Body for BoundedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.failed {
            return Poll::Ready(None);
        }
        if let Some(err) = this.bound.poll_deadline(cx, &this.limits) {
            return this.fail(err);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => {
                if matches!(this.bound, Bound::Whole { .. }) {
                    this.client.completed();
                }
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(err))) => {
                let err: BoxError = err.into();
                match flooded(err.as_ref()) {
                    Some(flood) => {
                        this.failed = true;
                        this.client.flooded(&this.limits, &flood);
                        Poll::Ready(Some(Err(flood.into())))
                    }
                    None => Poll::Ready(Some(Err(err))),
                }
            }
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    let counted = this.bound.count(data, &this.limits);
                    let held = this.bound.held();
                    if let Err(err) = counted.and_then(|()| this.hold(held)) {
                        return this.fail(err);
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::{BodyExt, StreamBody};

    use super::*;

    const SMALL: Limits = Limits {
        answer_timeout: Duration::from_millis(200),
        max_response_bytes: 10,
        max_watch_line_bytes: 5,
        max_in_flight_bytes: 15,
        chunk_cost: 0,
        first_pause: Duration::from_secs(30),
        max_pause: Duration::from_secs(100),
        max_list_pages: 3,
        max_watch_events: 4,
    };

    type Chunks =
        StreamBody<futures::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, BoxError>>>>;

    fn chunks(parts: &[&'static str]) -> Chunks {
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = parts
            .iter()
            .map(|part| Ok(Frame::data(Bytes::from_static(part.as_bytes()))))
            .collect();
        StreamBody::new(futures::stream::iter(frames))
    }

    async fn read(body: BoundedBody<Chunks>) -> Result<Vec<u8>, String> {
        body.collect()
            .await
            .map(|all| all.to_bytes().to_vec())
            .map_err(|err| err.to_string())
    }

    fn bounded(parts: &[&'static str], watch: bool) -> BoundedBody<Chunks> {
        bounded_in(parts, watch, &Arc::default())
    }

    fn bounded_in(
        parts: &[&'static str],
        watch: bool,
        client: &Arc<ClientState>,
    ) -> BoundedBody<Chunks> {
        BoundedBody::new(
            chunks(parts),
            SMALL,
            watch,
            Instant::now() + SMALL.answer_timeout,
            client.clone(),
        )
    }

    #[test]
    fn watch_requests_are_told_by_their_query() {
        let uri = |text: &str| text.parse::<http::Uri>().unwrap();
        assert!(is_watch(&uri(
            "/api/v1/services?watch=true&resourceVersion=1"
        )));
        assert!(is_watch(&uri(
            "/api/v1/services?allowWatchBookmarks=true&watch=1"
        )));
        assert!(!is_watch(&uri("/api/v1/services?limit=500")));
        assert!(!is_watch(&uri("/api/v1/services?watchx=true")));
    }

    #[tokio::test]
    async fn a_response_within_its_bound_passes_whole() {
        assert_eq!(
            read(bounded(&["12345", "67890"], false)).await.unwrap(),
            b"1234567890"
        );
    }

    #[tokio::test]
    async fn many_tiny_chunks_count_their_cost_too() {
        let costly = Limits {
            chunk_cost: 2,
            ..SMALL
        };
        let body = |parts| {
            BoundedBody::new(
                chunks(parts),
                costly,
                false,
                Instant::now() + SMALL.answer_timeout,
                Arc::default(),
            )
        };
        // 3 bytes in 3 chunks cost 9; 4 bytes in 4 chunks cost 12, over the bound of 10.
        assert_eq!(read(body(&["a", "b", "c"])).await.unwrap(), b"abc");
        let err = read(body(&["a", "b", "c", "d"])).await.unwrap_err();
        assert_eq!(err, LimitError::TooLarge(10).to_string());
    }

    #[tokio::test]
    async fn a_response_over_its_bound_is_cut_off_naming_the_bound() {
        let err = read(bounded(&["12345", "678901"], false))
            .await
            .unwrap_err();
        assert_eq!(err, LimitError::TooLarge(10).to_string());
    }

    #[tokio::test]
    async fn watch_lines_are_bounded_one_by_one_across_chunks() {
        // Many short lines add up to more than the whole-response bound: fine for a watch.
        let fine = read(bounded(&["abc\nde", "f\nghij\n", "12345\n"], true)).await;
        assert_eq!(fine.unwrap(), b"abc\ndef\nghij\n12345\n");
        // A line split over chunks is counted whole.
        let err = read(bounded(&["ab\ncde", "fgh\n"], true))
            .await
            .unwrap_err();
        assert_eq!(err, LimitError::LineTooLong(5).to_string());
        // So is a long line inside one chunk.
        let err = read(bounded(&["a\n123456\nb"], true)).await.unwrap_err();
        assert_eq!(err, LimitError::LineTooLong(5).to_string());
    }

    #[tokio::test]
    async fn a_watch_streams_at_most_its_events() {
        // SMALL allows 4 events a watch.
        let fine = read(bounded(&["a\nb\n", "c\nd\n"], true)).await;
        assert_eq!(fine.unwrap(), b"a\nb\nc\nd\n");
        let err = read(bounded(&["a\nb\n", "c\nd\ne\n"], true))
            .await
            .unwrap_err();
        assert_eq!(err, LimitError::TooManyEvents(4).to_string());
    }

    #[tokio::test]
    async fn a_list_takes_at_most_its_pages_and_a_new_list_starts_the_count_again() {
        let server = tower::service_fn(|_: Request<()>| {
            futures::future::ready(Ok::<_, BoxError>(Response::new(chunks(&["{}"]))))
        });
        let mut limited = SMALL.for_one_client(None).layer(server);
        let mut get = async |uri: &str| -> Result<(), String> {
            let request = Request::get(uri).body(()).map_err(|e| e.to_string())?;
            let response = limited.call(request).await.map_err(|e| e.to_string())?;
            response
                .into_body()
                .collect()
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        // SMALL allows 3 pages a list: the first page and two continuations.
        for _ in 0..2 {
            get("/api/v1/services?limit=500").await.unwrap();
            get("/api/v1/services?limit=500&continue=a").await.unwrap();
            get("/api/v1/services?limit=500&continue=b").await.unwrap();
        }
        // Another collection's list is counted on its own.
        get("/api/v1/namespaces?limit=500").await.unwrap();
        let err = get("/api/v1/services?limit=500&continue=c")
            .await
            .unwrap_err();
        assert_eq!(err, LimitError::TooManyPages(3).to_string());
        // The breach pauses the client, as any other.
        let refused = get("/api/v1/namespaces?limit=500").await.unwrap_err();
        assert!(
            refused.starts_with("not asking the API server anything"),
            "{refused}"
        );
    }

    #[tokio::test]
    async fn one_clients_responses_share_a_budget_given_back_when_they_are_dropped() {
        let client = Arc::new(ClientState::default());
        let in_flight = &client.in_flight;
        // Each within its own bound (10), together over the client's (15).
        let mut first = bounded_in(&["12345678"], false, &client);
        let frame = first.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), "12345678");
        assert_eq!(in_flight.get(), 8);
        let err = read(bounded_in(&["12345678"], false, &client))
            .await
            .unwrap_err();
        assert_eq!(err, LimitError::TooMuchAtOnce(15).to_string());
        drop(first);
        assert_eq!(in_flight.get(), 0);
        assert_eq!(
            read(bounded_in(&["12345678"], false, &client))
                .await
                .unwrap(),
            b"12345678"
        );
        // A watch holds only its unfinished event.
        let watch = read(bounded_in(
            &["1234\n", "1234\n", "1234\n", "1234\n"],
            true,
            &client,
        ));
        assert_eq!(watch.await.unwrap().len(), 20);
        assert_eq!(in_flight.get(), 0);
    }

    /// Many clients: the floor shrinks to half a fair share, and the floors are kept out of what
    /// the clients above them may take, so their number cannot take the pool past its total.
    #[tokio::test]
    async fn with_many_clients_the_floor_is_half_a_fair_share_of_the_pool() {
        let pool = BytePool::new(24, 4);
        let clients: Vec<_> = (0..6)
            .map(|_| SMALL.for_one_client(Some(&pool)).client)
            .collect();
        assert_eq!(pool.bounds(), (2, 12));
        let mut bodies = Vec::new();
        for client in &clients[..4] {
            let mut body = bounded_in(&["123"], false, client);
            body.frame().await.unwrap().unwrap();
            bodies.push(body);
        }
        assert_eq!(pool.held(), 12);
        // Within the 4-byte floor of a pool of few clients, but over its share of 2.
        let mut over = bounded_in(&["123"], false, &clients[4]);
        let err = over.frame().await.unwrap().unwrap_err();
        assert_eq!(err.to_string(), LimitError::PoolExhausted(12).to_string());
        drop(over);
        // The clients within their floor still read, and the pool stays within its total.
        for client in &clients[4..] {
            let mut body = bounded_in(&["1", "1"], false, client);
            body.frame().await.unwrap().unwrap();
            body.frame().await.unwrap().unwrap();
            bodies.push(body);
        }
        assert_eq!(pool.held(), 16);
        drop(clients);
        drop(bodies);
        assert_eq!(pool.bounds().0, 4, "clients gone give back their shares");
        assert_eq!(pool.held(), 0);
    }

    #[tokio::test]
    async fn clients_share_the_pool_and_the_one_that_grows_past_it_fails_above_its_floor() {
        // Three clients with a floor of 4 each: those above it may fill the pool to 12.
        let pool = BytePool::new(24, 4);
        let client = || SMALL.for_one_client(Some(&pool)).client;
        let (first, second, third) = (client(), client(), client());
        assert_eq!(pool.bounds(), (4, 12));
        let mut large = bounded_in(&["12345678"], false, &first);
        large.frame().await.unwrap().unwrap();
        assert_eq!(pool.held(), 8);
        // Within its floor (4) a client reads even with the pool over what the others may take.
        let mut small = bounded_in(&["1234", "5"], false, &second);
        small.frame().await.unwrap().unwrap();
        let mut other = bounded_in(&["1234"], false, &third);
        other.frame().await.unwrap().unwrap();
        assert_eq!(pool.held(), 16);
        // The one that grows past its floor with the pool over fails, naming the pool.
        let err = small.frame().await.unwrap().unwrap_err();
        assert_eq!(err.to_string(), LimitError::PoolExhausted(12).to_string());
        drop(small);
        drop(other);
        drop(large);
        assert_eq!(pool.held(), 0, "dropped bodies give back their bytes");
        // The failure paused that client alone.
        assert!(second.paused(Instant::now()).is_some());
        assert!(first.paused(Instant::now()).is_none());
    }

    #[tokio::test]
    async fn a_response_that_never_completes_fails_at_the_deadline() {
        let pending = StreamBody::new(futures::stream::pending::<Result<Frame<Bytes>, BoxError>>());
        let deadline = Instant::now() + SMALL.answer_timeout;
        let body = BoundedBody::new(pending, SMALL, false, deadline, Arc::default());
        let err = body.collect().await.map(|_| ()).unwrap_err();
        assert_eq!(
            err.to_string(),
            LimitError::TooSlow(SMALL.answer_timeout).to_string()
        );
    }

    #[tokio::test]
    async fn a_server_that_never_answers_fails_at_the_deadline() {
        let never = tower::service_fn(|_: Request<()>| {
            futures::future::pending::<Result<Response<Chunks>, BoxError>>()
        });
        let mut limited = SMALL.for_one_client(None).layer(never);
        let err = limited
            .call(Request::new(()))
            .await
            .map(|_| ())
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            LimitError::NoAnswer(SMALL.answer_timeout).to_string()
        );
    }

    #[test]
    fn pauses_double_up_to_their_cap() {
        let pauses: Vec<u64> = (0..5).map(|n| SMALL.pause_after(n).as_secs()).collect();
        assert_eq!(pauses, [30, 60, 100, 100, 100]);
        assert_eq!(SMALL.pause_after(u32::MAX), SMALL.max_pause);
    }

    #[tokio::test]
    async fn a_server_that_broke_a_bound_is_not_asked_again_until_its_pause_ends() {
        let quick = Limits {
            first_pause: Duration::from_millis(50),
            max_pause: Duration::from_millis(50),
            ..SMALL
        };
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        // The first and second answers are over the bound, the third fits.
        let server = tower::service_fn(move |_: Request<()>| {
            let n = counted.fetch_add(1, Ordering::AcqRel);
            let body = if n < 2 {
                chunks(&["12345678901"])
            } else {
                chunks(&["123"])
            };
            futures::future::ready(Ok::<_, BoxError>(Response::new(body)))
        });
        let mut limited = quick.for_one_client(None).layer(server);
        let mut get = async || -> Result<Vec<u8>, String> {
            let response = limited
                .call(Request::new(()))
                .await
                .map_err(|e| e.to_string())?;
            let body = response
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?;
            Ok(body.to_bytes().to_vec())
        };
        assert_eq!(
            get().await.unwrap_err(),
            LimitError::TooLarge(10).to_string()
        );
        // In the pause: refused without asking, naming the breach.
        let refused = get().await.unwrap_err();
        assert!(
            refused.starts_with("not asking the API server anything"),
            "{refused}"
        );
        assert!(
            refused.ends_with(&LimitError::TooLarge(10).to_string()),
            "{refused}"
        );
        assert_eq!(calls.load(Ordering::Acquire), 1);
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(
            get().await.unwrap_err(),
            LimitError::TooLarge(10).to_string()
        );
        assert_eq!(calls.load(Ordering::Acquire), 2);
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(get().await.unwrap(), b"123");
        assert_eq!(calls.load(Ordering::Acquire), 3);
        // A completed response starts the count of breaches again.
        assert_eq!(limited.client.pause().breaches, 0);
    }

    #[test]
    fn a_flooded_connection_is_one_breach_however_many_requests_report_it() {
        let client = ClientState::default();
        let flood = LimitError::Flooded("connection error detected: Enhance your calm".into());
        client.flooded(&SMALL, &flood);
        client.flooded(&SMALL, &flood);
        assert_eq!(client.pause().breaches, 1);
        assert!(client.paused(Instant::now()).is_some());
        // Another bound broken in the pause counts, and a flood after it counts again.
        client.breached(&SMALL, &LimitError::TooLarge(10));
        assert_eq!(client.pause().breaches, 2);
        client.flooded(&SMALL, &flood);
        assert_eq!(client.pause().breaches, 3);
    }

    #[test]
    fn a_server_breaking_bounds_is_told_once_until_it_stops_for_a_longest_pause() {
        let layer = SMALL.for_one_client(None);
        let told = Arc::new(Mutex::new(Vec::new()));
        let seen = told.clone();
        layer.on_breach(Arc::new(move |cause, pause| {
            seen.lock().unwrap().push((cause.to_string(), pause));
        }));
        let start = Instant::now();
        let at = |secs| start + Duration::from_secs(secs);
        let client = &layer.client;
        client.breached_at(&SMALL, &LimitError::TooManyPages(3), at(0));
        client.breached_at(&SMALL, &LimitError::TooManyPages(3), at(40));
        client.breached_at(&SMALL, &LimitError::TooLarge(10), at(130));
        assert_eq!(told.lock().unwrap().len(), 1, "one notice while it goes on");
        assert_eq!(told.lock().unwrap()[0].1, SMALL.first_pause);
        // Again as soon as its longest pause (until 230 s) ends, and again after the next one
        // (until 331 s): still the same misbehaviour.
        client.breached_at(&SMALL, &LimitError::TooManyPages(3), at(231));
        client.breached_at(&SMALL, &LimitError::TooManyPages(3), at(332));
        assert_eq!(told.lock().unwrap().len(), 1, "one notice while it goes on");
        // Longer than the longest pause without a breach after a pause (until 432 s) ended: a
        // new occurrence.
        client.breached_at(&SMALL, &LimitError::TooManyPages(3), at(533));
        assert_eq!(told.lock().unwrap().len(), 2);
    }
}
