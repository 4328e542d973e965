//! A small list+watch cache for the compact records.
//!
//! kube-runtime's reflector decodes into full objects and hides the resource version it has
//! reached. The repair needs both the opposite ways: compact records (memory at 100,000
//! Services) and the cache's resource version, to prove it is at least as new as the API before
//! deleting anything. So this one lists in pages, watches with bookmarks, remembers the last
//! resource version seen (list, event or bookmark) and relists on `410 Gone`.
//!
//! A relist is written into the live map page by page (holding two copies of 100,000 Services
//! would double the memory), so while it runs the store says it is *not synced* and passes
//! refuse to decide; it becomes synced again only when every page has arrived and the objects
//! no page mentioned are dropped. A failed or partial list therefore never leads to a decision.

use std::collections::{HashMap, VecDeque};
use std::fmt::Debug;
use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::time::Duration;

use backon::BackoffBuilder;
use futures::StreamExt;
use futures::stream::BoxStream;
use kube::api::{ListParams, WatchParams};
use kube::core::WatchEvent;
use serde::de::DeserializeOwned;
use tracing::{debug, warn};

use super::model::{IpAddressRecord, IpName, ListPage, ServiceCidrRecord, ServiceRecord};
use super::protobuf::{self, ProtobufRecord};

/// A record kept in a [`Store`].
pub trait Cached:
    DeserializeOwned + ProtobufRecord + Clone + Debug + Send + Sync + 'static
{
    /// Unique key within the collection.
    type Key: std::hash::Hash + Eq + Debug + Send + Sync + 'static;
    fn cache_key(&self) -> Self::Key;
    /// The object's resourceVersion as a number, if it is one.
    fn resource_version(&self) -> Option<u64>;
}

impl Cached for ServiceRecord {
    type Key = (super::model::Name, super::model::Name);
    fn cache_key(&self) -> Self::Key {
        (self.namespace.clone(), self.name.clone())
    }
    fn resource_version(&self) -> Option<u64> {
        Some(self.resource_version).filter(|v| *v != 0)
    }
}

impl Cached for IpAddressRecord {
    /// The name, which is the IP: no allocation for the usual (canonical) names.
    type Key = IpName;
    fn cache_key(&self) -> Self::Key {
        self.name.clone()
    }
    fn resource_version(&self) -> Option<u64> {
        self.resource_version.number()
    }
}

impl Cached for ServiceCidrRecord {
    type Key = Box<str>;
    fn cache_key(&self) -> Self::Key {
        self.name.clone()
    }
    fn resource_version(&self) -> Option<u64> {
        Some(self.resource_version).filter(|v| *v != 0)
    }
}

/// The cached collection and how fresh it is.
#[derive(Debug)]
pub struct StoreState<T: Cached> {
    /// Each object with the list generation that last saw it (for dropping what a relist did
    /// not return).
    objects: HashMap<T::Key, (T, u32)>,
    generation: u32,
    /// Whether the contents are one complete list plus the watch events after it; false during
    /// a (re)list.
    pub synced: bool,
    /// The newest resource version the cache has provably caught up with.
    pub resource_version: Option<u64>,
}

impl<T: Cached> StoreState<T> {
    pub fn values(&self) -> impl Iterator<Item = &T> + Clone {
        self.objects.values().map(|(value, _)| value)
    }

    pub fn get<Q>(&self, key: &Q) -> Option<&T>
    where
        T::Key: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        self.objects.get(key).map(|(value, _)| value)
    }

    pub fn contains_key<Q>(&self, key: &Q) -> bool
    where
        T::Key: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        self.objects.contains_key(key)
    }

    pub fn len(&self) -> usize {
        self.objects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }
}

/// A cache shared between its [`reflect`] stream (the writer) and the passes (readers).
#[derive(Debug)]
pub struct Store<T: Cached> {
    state: RwLock<StoreState<T>>,
}

impl<T: Cached> Default for Store<T> {
    fn default() -> Self {
        Self {
            state: RwLock::new(StoreState {
                objects: HashMap::new(),
                generation: 0,
                synced: false,
                resource_version: None,
            }),
        }
    }
}

impl<T: Cached> Store<T> {
    /// Read access for one synchronous decision. Never hold it across an `.await`.
    pub fn read(&self) -> RwLockReadGuard<'_, StoreState<T>> {
        // A writer that panicked left a consistent map (every mutation is a single insert,
        // remove or swap), so reading on is safe.
        self.state
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, StoreState<T>> {
        self.state
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn is_synced(&self) -> bool {
        self.read().synced
    }

    pub fn resource_version(&self) -> Option<u64> {
        self.read().resource_version
    }

    pub fn len(&self) -> usize {
        self.read().objects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A store that several loops read and one reflector keeps, so the process lists and watches a
/// collection once however many loops need it (the ClusterIP and NodePort repairs both read
/// Services).
#[derive(Debug)]
pub struct SharedStore<T: Cached> {
    store: Arc<Store<T>>,
    /// Counts the changes the reflector applied; readers other than the first wait on it.
    changes: tokio::sync::watch::Sender<u64>,
    fed: std::sync::atomic::AtomicBool,
}

impl<T: Cached> Default for SharedStore<T> {
    fn default() -> Self {
        Self {
            store: Arc::default(),
            changes: tokio::sync::watch::Sender::new(0),
            fed: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

impl<T: Cached> SharedStore<T> {
    pub fn store(&self) -> &Arc<Store<T>> {
        &self.store
    }

    /// A trigger stream for one reader. The first reader's is `reflector(store)`, the stream that
    /// keeps the store, which also wakes the other readers after each change it applied; the
    /// others' yield after each such change.
    pub fn subscribe(
        &self,
        reflector: impl FnOnce(Arc<Store<T>>) -> BoxStream<'static, ()>,
    ) -> BoxStream<'static, ()> {
        if !self.fed.swap(true, std::sync::atomic::Ordering::AcqRel) {
            let changes = self.changes.clone();
            return reflector(self.store.clone())
                .inspect(move |()| changes.send_modify(|count| *count = count.wrapping_add(1)))
                .boxed();
        }
        let mut changes = self.changes.subscribe();
        changes.mark_unchanged();
        futures::stream::unfold(changes, |mut changes| async move {
            changes.changed().await.ok()?;
            Some(((), changes))
        })
        .boxed()
    }
}

/// Resource versions are opaque to clients, but every kube-apiserver (and the simulator) backs
/// them with etcd revisions: integers that only grow. A version that is not an integer cannot be
/// compared, so freshness is then never proven and deletes wait for a live check.
pub fn parse_resource_version(text: &str) -> Option<u64> {
    text.parse().ok()
}

/// Where a collection lives and how to page through it.
#[derive(Clone, Debug)]
pub struct Collection {
    /// `/api/v1/services`, `/apis/networking.k8s.io/v1/ipaddresses`, ...
    pub path: &'static str,
    pub page_size: u32,
    /// Server-side watch timeout; the watch is resumed from the last version after it.
    pub watch_timeout_secs: u32,
    /// Ask for LIST pages in protobuf (JSON when the server does not have it for the kind).
    pub protobuf: bool,
}

/// LIST page size. Paging is latency-bound: each page is requested only once the previous one's
/// continue token has arrived, so every page costs a round trip to the API server, which has
/// to gather the page before it sends its first byte. At 100,000 Services against the
/// simulator, pages of 2,000 instead of client-go's 500 made a fresh pass about 25% faster
/// (BENCHMARKS.md). A page is still small: about 1.3 MB of Services in protobuf, 2.4 MB in JSON.
pub const DEFAULT_PAGE_SIZE: u32 = 2000;

pub const SERVICES: &str = "/api/v1/services";
pub const IPADDRESSES: &str = "/apis/networking.k8s.io/v1/ipaddresses";
pub const SERVICECIDRS: &str = "/apis/networking.k8s.io/v1/servicecidrs";

/// IPAddresses are listed in pages this many times the configured size. An IPAddress is about
/// a third of a Service's bytes, so the pages of both weigh about the same; and the IPAddresses,
/// which the Service phase needs complete, then usually arrive before the Services, so that
/// phase runs while the Services are still being listed (at 100,000 Services and pages of 2,000
/// they did not).
pub const IPADDRESS_PAGE_FACTOR: u32 = 3;

/// The page size `path` is listed with when `page_size` is configured.
pub fn page_size_for(path: &str, page_size: u32) -> u32 {
    if path == IPADDRESSES {
        page_size.saturating_mul(IPADDRESS_PAGE_FACTOR)
    } else {
        page_size
    }
}

impl Collection {
    pub fn new(path: &'static str) -> Self {
        Self {
            path,
            page_size: page_size_for(path, DEFAULT_PAGE_SIZE),
            watch_timeout_secs: 290,
            protobuf: true,
        }
    }

    /// Paged as configured with `page_size` ([`page_size_for`]).
    pub fn paged(mut self, page_size: u32) -> Self {
        self.page_size = page_size_for(self.path, page_size);
        self
    }
}

/// The most items a `remainingItemCount` hint reserves room for.
const MAX_ITEMS_HINT: usize = 2_000_000;

/// Lists a whole collection page by page into compact records; returns the records and the
/// list's resource version. Any failing page fails the whole list.
///
/// While one page arrives the next is already requested: its continue token is taken from the
/// page's first bytes (decoded from protobuf, guessed from JSON), and the prefetch is thrown away
/// unless the whole decoded page confirms the token (an object could contain a look-alike string,
/// or the metadata come twice).
pub async fn list_all<T: DeserializeOwned + ProtobufRecord + Send + 'static>(
    client: &kube::Client,
    collection: &Collection,
) -> Result<(Vec<T>, Option<String>), kube::Error> {
    let mut items = Vec::new();
    let version = list_pages(client, collection, &mut items, |items, remaining| {
        // Sized once from the first page's count of what follows: growing by doubling would
        // copy the records made so far several times (tens of MB at 100,000 Services).
        items.reserve(remaining);
    })
    .await?;
    Ok((items, version))
}

/// Like [`list_all`], putting each page onto the end of `items` and then calling `sink` with
/// them and the number of items the server says are still to come (0 when it does not say;
/// capped, since it is only a hint); returns the list's resource version. `sink` may take what
/// it wants out of `items` (a cache drains each page, so the collection is never held twice) or
/// leave it there (a whole list in one vector).
///
/// Each page is requested as soon as the previous page's continue token is known, up to
/// [`PAGES_IN_FLIGHT`] pages at once. kube-apiserver writes the list metadata before the items,
/// so the token is usually in the first bytes of a page: the next request goes out while the rest
/// of the page is still arriving. Each page is decoded by the task that receives it, protobuf
/// pages while they arrive ([`protobuf::StreamingList`]), so pages in flight are received and
/// decoded side by side; they are handed to `sink` in list order.
pub async fn list_pages<T: DeserializeOwned + ProtobufRecord + Send + 'static>(
    client: &kube::Client,
    collection: &Collection,
    items: &mut Vec<T>,
    mut sink: impl FnMut(&mut Vec<T>, usize),
) -> Result<Option<String>, kube::Error> {
    // The size of the last page received: pages of one list are about the same size, and
    // kube-apiserver does not announce a page's length (it streams it in chunks).
    let mut last_len = 0;
    let fetch = |token: Option<String>, last_len: usize| {
        PageFetch::<Decoding<T>>::start(client, collection, token, last_len)
    };
    // The pages requested and not yet handed over, in list order, each with the continue token
    // it showed early once it did; and the newest page's token while still to come.
    let first = fetch(None, 0);
    let mut newest_token = Some(first.token);
    let mut flights = VecDeque::from([Flight {
        task: first.task,
        guessed: None,
    }]);
    loop {
        let wanted = flights.len() < PAGES_IN_FLIGHT && newest_token.is_some();
        let next_token = async {
            match newest_token.as_mut() {
                Some(token) => token.await.ok().flatten(),
                None => std::future::pending().await,
            }
        };
        let oldest = async {
            match flights.front_mut() {
                Some(flight) => (&mut flight.task).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            // A page's early token is taken before its body: the body is complete only after.
            biased;
            guessed = next_token, if wanted => {
                newest_token = None;
                if let Some(newest) = flights.back_mut() {
                    newest.guessed = Some(guessed.clone());
                }
                if let Some(token) = guessed {
                    let next = fetch(Some(token), last_len);
                    newest_token = Some(next.token);
                    flights.push_back(Flight { task: next.task, guessed: None });
                    // The next page's task sits in this worker's LIFO slot, where no other
                    // worker can steal it: without a yield its request would wait until this
                    // task awaits again.
                    tokio::task::yield_now().await;
                }
            }
            received = oldest => {
                let Some(flight) = flights.pop_front() else {
                    continue;
                };
                if flights.is_empty() {
                    // Its token, if still to come, is of no use now.
                    newest_token = None;
                }
                // Dropping the later pages stops them.
                let (mut page, len) = received
                    .map_err(|err| kube::Error::Service(Box::new(err)))??;
                last_len = len;
                if items.is_empty() {
                    // The page's own vector, sized for a page, without copying it.
                    std::mem::swap(items, &mut page.items);
                } else {
                    items.append(&mut page.items);
                }
                let metadata = page.metadata;
                let remaining = metadata
                    .remaining_item_count
                    .map_or(0, |count| usize::try_from(count).unwrap_or(usize::MAX))
                    .min(MAX_ITEMS_HINT);
                sink(items, remaining);
                let Some(token) = metadata.continue_token.filter(|token| !token.is_empty())
                else {
                    return Ok(metadata.resource_version);
                };
                // The next page was requested with the token this page showed early: keep it
                // (and those after it) only if the whole page confirms that token.
                let confirmed = flight.guessed.as_ref().and_then(Option::as_deref)
                    == Some(token.as_str());
                if !confirmed || flights.is_empty() {
                    flights.clear();
                    let next = fetch(Some(token), last_len);
                    newest_token = Some(next.token);
                    flights.push_back(Flight { task: next.task, guessed: None });
                }
            }
        }
    }
}

/// At most this many pages of one list are requested at once: enough to keep receiving while
/// the server gathers the next page, few enough not to crowd the API server (client-go's pager
/// asks for one at a time).
pub const PAGES_IN_FLIGHT: usize = 3;

/// A page of [`list_pages`] requested and not yet handed over.
struct Flight<P> {
    task: tokio_util::task::AbortOnDropHandle<Result<P, kube::Error>>,
    /// The continue token the page showed early, once it did (`Some(None)`: none).
    guessed: Option<Option<String>>,
}

/// Every page of a collection as received, nothing decoded: what the transfer alone costs
/// (benchmarks). Pages are chained by their guessed continue tokens, unverified.
#[doc(hidden)]
pub async fn fetch_raw_pages(
    client: &kube::Client,
    collection: &Collection,
) -> Result<Vec<bytes::Bytes>, kube::Error> {
    let fetch = |token: Option<String>, size: usize| {
        PageFetch::<Whole>::start(client, collection, token, size)
    };
    let mut pages: Vec<bytes::Bytes> = Vec::new();
    let mut current = fetch(None, 0);
    loop {
        let last_len = pages.last().map_or(0, bytes::Bytes::len);
        let next = current
            .early_token()
            .await
            .map(|token| fetch(Some(token), last_len));
        pages.push(current.body().await?.bytes.freeze());
        match next {
            Some(next) => current = next,
            None => return Ok(pages),
        }
    }
}

/// What a LIST page's body is made into while it arrives, by the task that receives it.
trait Receive: Sized + Send + 'static {
    type Page: Send + 'static;

    /// For a body in protobuf (`protobuf`) or JSON, `expected_len` bytes long as far as known,
    /// of a collection listed `page_size` items a page.
    fn new(protobuf: bool, expected_len: usize, page_size: usize) -> Self;

    /// Takes the next bytes of the body.
    fn push(&mut self, data: &[u8]) -> Result<(), kube::Error>;

    /// The continue token once the bytes so far settle it (`Some(None)`: the last page).
    fn early_token(&self) -> Option<Option<String>>;

    /// The page once the body is complete, and its continue token as well as it can be told.
    fn finish(self) -> Result<(Self::Page, Option<String>), kube::Error>;
}

/// A body as received, whole: error statuses, JSON pages, and the raw pages of
/// [`fetch_raw_pages`].
struct Whole {
    bytes: bytes::BytesMut,
    protobuf: bool,
}

impl Receive for Whole {
    type Page = Self;

    fn new(protobuf: bool, expected_len: usize, _: usize) -> Self {
        // Sized once from the expectation (kube-apiserver streams a LIST without a length):
        // growing by doubling would copy each page about twice more. Capped, since it is only
        // a guess.
        Self {
            bytes: bytes::BytesMut::with_capacity(expected_len.min(MAX_PRESIZE)),
            protobuf,
        }
    }

    fn push(&mut self, data: &[u8]) -> Result<(), kube::Error> {
        self.bytes.extend_from_slice(data);
        Ok(())
    }

    fn early_token(&self) -> Option<Option<String>> {
        if self.protobuf {
            protobuf::early_continue_token(&self.bytes)
        } else {
            early_continue_token(&self.bytes).map(|found| found.map(str::to_owned))
        }
    }

    fn finish(self) -> Result<(Self, Option<String>), kube::Error> {
        let guessed = if self.protobuf {
            protobuf::early_continue_token(&self.bytes).flatten()
        } else {
            let text = std::str::from_utf8(&self.bytes).unwrap_or_default();
            guess_continue_token(text).map(str::to_owned)
        };
        Ok((self, guessed))
    }
}

/// A page decoded into records: protobuf while it arrives, JSON once complete.
enum Decoding<T> {
    Protobuf(protobuf::StreamingList<T>),
    Json(Whole),
}

fn protobuf_error(err: protobuf::DecodeError) -> kube::Error {
    kube::Error::Service(format!("LIST page is not valid protobuf: {err}").into())
}

impl<T: DeserializeOwned + ProtobufRecord + Send + 'static> Receive for Decoding<T> {
    /// The records and the list metadata, and the body's length in bytes.
    type Page = (ListPage<T>, usize);

    fn new(protobuf: bool, expected_len: usize, page_size: usize) -> Self {
        match protobuf {
            true => Decoding::Protobuf(protobuf::StreamingList::new(page_size)),
            false => Decoding::Json(Whole::new(false, expected_len, page_size)),
        }
    }

    fn push(&mut self, data: &[u8]) -> Result<(), kube::Error> {
        match self {
            Decoding::Protobuf(list) => list.feed(data).map_err(protobuf_error),
            Decoding::Json(whole) => whole.push(data),
        }
    }

    fn early_token(&self) -> Option<Option<String>> {
        match self {
            Decoding::Protobuf(list) => list
                .early_continue_token()
                .map(|token| token.map(str::to_owned)),
            Decoding::Json(whole) => whole.early_token(),
        }
    }

    fn finish(self) -> Result<((ListPage<T>, usize), Option<String>), kube::Error> {
        let (page, len) = match self {
            Decoding::Protobuf(list) => {
                let len = list.received();
                (list.finish().map_err(protobuf_error)?, len)
            }
            Decoding::Json(whole) => {
                let text = std::str::from_utf8(&whole.bytes).map_err(|err| {
                    kube::Error::Service(format!("LIST page is not UTF-8: {err}").into())
                })?;
                let page: ListPage<T> =
                    serde_json::from_str(text).map_err(kube::Error::SerdeError)?;
                (page, whole.bytes.len())
            }
        };
        // Decoded, not guessed: the page's own token.
        let token = page.metadata.continue_token.clone();
        Ok(((page, len), token.filter(|token| !token.is_empty())))
    }
}

/// One LIST page being fetched in its own task: the continue token is handed over as soon as it
/// can be read, the page when complete.
/// Dropping it stops the fetch.
struct PageFetch<R: Receive> {
    token: tokio::sync::oneshot::Receiver<Option<String>>,
    task: tokio_util::task::AbortOnDropHandle<Result<R::Page, kube::Error>>,
}

impl<R: Receive> PageFetch<R> {
    /// Requests the page after `token` (the first page without one).
    /// `expected_len` sizes the body's buffer when the response does not announce its length.
    fn start(
        client: &kube::Client,
        collection: &Collection,
        token: Option<String>,
        expected_len: usize,
    ) -> Self {
        let mut params = ListParams::default().limit(collection.page_size);
        if let Some(token) = &token {
            params = params.continue_token(token);
        }
        let protobuf = collection.protobuf;
        let page_size = (collection.page_size as usize).min(MAX_ITEMS_HINT);
        let request = kube::core::Request::new(collection.path)
            .list(&params)
            .map_err(kube::Error::BuildRequest)
            .map(|mut request| {
                if protobuf {
                    request.headers_mut().insert(
                        http::header::ACCEPT,
                        http::HeaderValue::from_static(protobuf::ACCEPT),
                    );
                }
                request
            });
        let client = client.clone();
        let (token_tx, token_rx) = tokio::sync::oneshot::channel();
        let task = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
            fetch_body::<R>(&client, request?, token_tx, expected_len, page_size).await
        }));
        Self {
            token: token_rx,
            task,
        }
    }

    /// The continue token, once read from the page; `None` for the last page or when the page
    /// failed (the body then says why).
    async fn early_token(&mut self) -> Option<String> {
        (&mut self.token).await.ok().flatten()
    }

    async fn body(self) -> Result<R::Page, kube::Error> {
        self.task
            .await
            .map_err(|err| kube::Error::Service(Box::new(err)))?
    }
}

/// One response body, made into a page by `R` frame by frame (`Client::request_text` would
/// copy every page into a `String` first), telling `token` the continue token as soon as the
/// bytes so far show it. Error statuses become `kube::Error::Api` as kube's own calls make
/// them.
async fn fetch_body<R: Receive>(
    client: &kube::Client,
    request: http::Request<Vec<u8>>,
    token: tokio::sync::oneshot::Sender<Option<String>>,
    expected_len: usize,
    page_size: usize,
) -> Result<R::Page, kube::Error> {
    use http_body_util::BodyExt;
    let response = client.send(request.map(kube::client::Body::from)).await?;
    let status = response.status();
    let is_protobuf = response
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.starts_with(protobuf::MEDIA_TYPE));
    // From Content-Length when the server sends one, else from the caller's expectation, an
    // eighth more to absorb a page somewhat larger than the last without a copy.
    let announced = response
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|length| length.to_str().ok()?.parse::<usize>().ok())
        .unwrap_or(expected_len + expected_len / 8);
    let mut body = response.into_body();
    if status.is_client_error() || status.is_server_error() {
        // An error status is a few hundred bytes: no room made for a page.
        let mut whole = Whole::new(is_protobuf, 0, page_size);
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame?.into_data() {
                whole.push(&data)?;
            }
        }
        let received = whole.bytes;
        let decoded = if is_protobuf {
            protobuf::decode_status(&received)
        } else {
            serde_json::from_slice::<kube::core::Status>(&received).ok()
        };
        let status = decoded.unwrap_or_else(|| {
            let text = String::from_utf8_lossy(&received);
            kube::core::Status::failure(text.trim(), "Failed to parse error data")
                .with_code(status.as_u16())
        });
        return Err(kube::Error::Api(status.boxed()));
    }
    let mut page = R::new(is_protobuf, announced, page_size);
    let mut token = Some(token);
    let mut received = 0;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        let seen_before = received;
        received += data.len();
        page.push(&data)?;
        // The list metadata is a few hundred bytes; a page without it in the first 64 KiB lacks
        // the usual layout, and looking again on every frame would cost quadratic time.
        if let Some(tx) = token.take_if(|_| seen_before <= EARLY_TOKEN_WITHIN) {
            match page.early_token() {
                Some(found) => {
                    let _ = tx.send(found);
                    // The task waiting for the token was woken into this worker's LIFO slot,
                    // where no other worker can steal it: without a yield it would wait until
                    // this whole page has arrived, and the next page's request with it.
                    tokio::task::yield_now().await;
                }
                None => token = Some(tx),
            }
        }
    }
    let (page, guessed) = page.finish()?;
    if let Some(tx) = token {
        let _ = tx.send(guessed);
    }
    Ok(page)
}

const EARLY_TOKEN_WITHIN: usize = 64 * 1024;
const MAX_PRESIZE: usize = 64 * 1024 * 1024;

/// The continue token from the first bytes of a page, when they settle it: `Some(Some(token))`
/// when the list metadata came before the items and carried one, `Some(None)` when it came
/// before the items without one (the last page), `None` when the bytes so far do not tell.
fn early_continue_token(prefix: &[u8]) -> Option<Option<&str>> {
    // The top-level metadata is complete before `"items":` starts; a prefix that has not
    // reached `"items":` yet cannot settle anything.
    let items = find(prefix, b"\"items\":")?;
    let head = std::str::from_utf8(&prefix[..items]).ok()?;
    if !head.contains("\"metadata\":") {
        // Items first (sorted keys): the metadata, and the token, come at the end.
        return None;
    }
    Some(guess_continue_token(head))
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

/// The list's `metadata.continue`, found without decoding: the top-level metadata comes either
/// before `items` (kube-apiserver) or after it (sorted keys), so take the first occurrence in
/// the first case and the last in the second. Only a guess; the caller verifies it.
fn guess_continue_token(body: &str) -> Option<&str> {
    const KEY: &str = "\"continue\":\"";
    let first = body.find(KEY)?;
    let at = match body.find("\"items\":") {
        Some(items) if items < first => body.rfind(KEY)?,
        _ => first,
    };
    let rest = &body[at + KEY.len()..];
    let token = &rest[..rest.find('"')?];
    (!token.is_empty()).then_some(token)
}

/// The newest resource version of a collection, from a one-item list (cheap at any size).
pub async fn current_resource_version(
    client: &kube::Client,
    path: &'static str,
) -> Result<Option<String>, kube::Error> {
    let request = kube::core::Request::new(path);
    let page: ListPage<serde::de::IgnoredAny> = client
        .request(
            request
                .list(&ListParams::default().limit(1))
                .map_err(kube::Error::BuildRequest)?,
        )
        .await?;
    Ok(page.metadata.resource_version)
}

enum Phase<T> {
    List,
    Watch {
        from: String,
    },
    Watching {
        events: BoxStream<'static, Result<WatchEvent<T>, kube::Error>>,
    },
    Backoff {
        then: Box<Phase<T>>,
    },
}

struct Reflector<T: Cached> {
    client: kube::Client,
    /// Lists go through this one: see [`crate::transport`].
    list_client: kube::Client,
    collection: Collection,
    store: Arc<Store<T>>,
    phase: Phase<T>,
    backoff: backon::ExponentialBackoff,
    last_version: String,
}

fn new_backoff() -> backon::ExponentialBackoff {
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(200))
        .with_max_delay(Duration::from_secs(30))
        .with_jitter()
        .without_max_times()
        .build()
}

/// Keeps `store` in sync with `collection`, forever; yields `()` after every change applied (a
/// complete list, or one watch event), which makes it a trigger stream for the runner. Lists go
/// through `list_client`, watches through `client` (they may be the same).
pub fn reflect<T: Cached>(
    client: kube::Client,
    list_client: kube::Client,
    collection: Collection,
    store: Arc<Store<T>>,
) -> BoxStream<'static, ()> {
    let reflector = Reflector {
        client,
        list_client,
        collection,
        store,
        phase: Phase::List,
        backoff: new_backoff(),
        last_version: String::new(),
    };
    futures::stream::unfold(reflector, |mut reflector| async move {
        reflector.step_until_change().await;
        Some(((), reflector))
    })
    .boxed()
}

impl<T: Cached> Reflector<T> {
    async fn step_until_change(&mut self) {
        loop {
            let phase = std::mem::replace(&mut self.phase, Phase::List);
            let (next, changed) = self.step(phase).await;
            self.phase = next;
            if changed {
                return;
            }
        }
    }

    fn fail(&mut self, then: Phase<T>) -> (Phase<T>, bool) {
        (
            Phase::Backoff {
                then: Box::new(then),
            },
            false,
        )
    }

    async fn step(&mut self, phase: Phase<T>) -> (Phase<T>, bool) {
        match phase {
            Phase::Backoff { then } => {
                let delay = self.backoff.next().unwrap_or(Duration::from_secs(30));
                tokio::time::sleep(delay).await;
                (*then, false)
            }
            Phase::List => {
                let generation = {
                    let mut state = self.store.write();
                    state.synced = false;
                    state.generation = state.generation.wrapping_add(1);
                    state.generation
                };
                let store = self.store.clone();
                let mut page = Vec::new();
                let listed = list_pages(
                    &self.list_client,
                    &self.collection,
                    &mut page,
                    |page: &mut Vec<T>, remaining| {
                        let mut state = store.write();
                        if state.objects.is_empty() {
                            // First list: room for all of it at once. A relist keeps the old
                            // entries until it ends, so it grows only as far as it has to.
                            state.objects.reserve(page.len() + remaining);
                        }
                        for item in page.drain(..) {
                            state.objects.insert(item.cache_key(), (item, generation));
                        }
                    },
                )
                .await;
                match listed {
                    Ok(version) => {
                        let version = version.unwrap_or_default();
                        {
                            let mut state = self.store.write();
                            state.objects.retain(|_, (_, seen)| *seen == generation);
                            state.objects.shrink_to_fit();
                            state.synced = true;
                            state.resource_version = parse_resource_version(&version);
                        }
                        debug!(path = self.collection.path, %version, "listed");
                        self.last_version = version.clone();
                        self.backoff = new_backoff();
                        (Phase::Watch { from: version }, true)
                    }
                    Err(err) => {
                        warn!(path = self.collection.path, error = %err, "list failed; the cache stays unsynced until a list completes");
                        self.fail(Phase::List)
                    }
                }
            }
            Phase::Watch { from } => {
                let mut params = WatchParams::default().timeout(self.collection.watch_timeout_secs);
                params.bookmarks = true;
                let request =
                    match kube::core::Request::new(self.collection.path).watch(&params, &from) {
                        Ok(request) => request,
                        Err(err) => {
                            warn!(error = %err, "cannot build watch request");
                            return self.fail(Phase::List);
                        }
                    };
                match self.client.request_events::<T>(request).await {
                    Ok(events) => (
                        Phase::Watching {
                            events: events.boxed(),
                        },
                        false,
                    ),
                    Err(kube::Error::Api(status)) if status.code == 410 => (Phase::List, false),
                    Err(err) => {
                        warn!(path = self.collection.path, error = %err, "watch failed");
                        self.fail(Phase::Watch { from })
                    }
                }
            }
            Phase::Watching { mut events } => match events.next().await {
                None => {
                    let from = self.last_version.clone();
                    (Phase::Watch { from }, false)
                }
                Some(Ok(event)) => {
                    let changed = self.apply(event);
                    match changed {
                        Applied::Changed => (Phase::Watching { events }, true),
                        Applied::Quiet => (Phase::Watching { events }, false),
                        Applied::Gone => (Phase::List, false),
                        Applied::Failed => {
                            let from = self.last_version.clone();
                            self.fail(Phase::Watch { from })
                        }
                    }
                }
                Some(Err(kube::Error::Api(status))) if status.code == 410 => (Phase::List, false),
                Some(Err(err)) => {
                    warn!(path = self.collection.path, error = %err, "watch stream failed; resuming");
                    let from = self.last_version.clone();
                    self.fail(Phase::Watch { from })
                }
            },
        }
    }

    fn note_version(&mut self, version: Option<u64>) {
        if let Some(version) = version {
            self.last_version = version.to_string();
        }
    }

    fn apply(&mut self, event: WatchEvent<T>) -> Applied {
        match event {
            WatchEvent::Added(object) | WatchEvent::Modified(object) => {
                let version = object.resource_version();
                {
                    let mut state = self.store.write();
                    let generation = state.generation;
                    state
                        .objects
                        .insert(object.cache_key(), (object, generation));
                    advance(&mut state, version);
                }
                self.note_version(version);
                self.backoff = new_backoff();
                Applied::Changed
            }
            WatchEvent::Deleted(object) => {
                let version = object.resource_version();
                {
                    let mut state = self.store.write();
                    state.objects.remove(&object.cache_key());
                    advance(&mut state, version);
                }
                self.note_version(version);
                Applied::Changed
            }
            WatchEvent::Bookmark(bookmark) => {
                let version = parse_resource_version(&bookmark.metadata.resource_version);
                advance(&mut self.store.write(), version);
                self.note_version(version);
                Applied::Quiet
            }
            WatchEvent::Error(status) if status.code == 410 => Applied::Gone,
            WatchEvent::Error(status) => {
                warn!(path = self.collection.path, code = status.code, message = %status.message, "watch error event");
                Applied::Failed
            }
        }
    }
}

enum Applied {
    Changed,
    Quiet,
    Gone,
    Failed,
}

fn advance<T: Cached>(state: &mut StoreState<T>, version: Option<u64>) {
    if let Some(version) = version {
        state.resource_version = Some(
            state
                .resource_version
                .map_or(version, |old| old.max(version)),
        );
    }
}

/// The three caches the IPAddress-mode repair reads, with their trigger streams.
#[derive(Debug, Default)]
pub struct Caches {
    pub services: Arc<Store<ServiceRecord>>,
    pub ip_addresses: Arc<Store<IpAddressRecord>>,
    pub service_cidrs: Arc<Store<ServiceCidrRecord>>,
}

#[cfg(test)]
mod tests {
    use super::{early_continue_token, guess_continue_token};

    /// A LIST whose first page shows one continue token in its first bytes and then a second
    /// list metadata with another (protobuf merges a message met twice; kube-apiserver never
    /// sends this): the page requested with the early token is dropped, and the list goes on
    /// from the token the whole page decodes to.
    #[tokio::test]
    #[allow(clippy::unwrap_used)]
    async fn a_page_that_contradicts_its_early_token_is_followed_by_its_decoded_token() {
        use std::sync::{Arc, Mutex};

        use bytes::Bytes;
        use http_body_util::StreamBody;

        use super::{Collection, SERVICES, list_all};
        use crate::clusterip_repair::model::ServiceRecord;
        use crate::clusterip_repair::protobuf::MEDIA_TYPE;
        use crate::clusterip_repair::protobuf::test_bodies::{list_body_of, push_field};

        fn list_meta(continue_token: &str) -> Vec<u8> {
            let mut meta = Vec::new();
            push_field(&mut meta, 2, b"7");
            if !continue_token.is_empty() {
                push_field(&mut meta, 3, continue_token.as_bytes());
            }
            meta
        }
        fn service(name: &str) -> Vec<u8> {
            let mut meta = Vec::new();
            push_field(&mut meta, 1, name.as_bytes());
            push_field(&mut meta, 3, b"default");
            let mut service = Vec::new();
            push_field(&mut service, 1, &meta);
            service
        }
        /// The page's list fields, in order: (1, metadata) or (2, item).
        fn page(fields: &[(u64, Vec<u8>)]) -> Vec<u8> {
            let fields: Vec<(u64, &[u8])> = fields.iter().map(|(n, v)| (*n, &v[..])).collect();
            list_body_of(&fields)
        }

        let first = page(&[
            (1, list_meta("guessed")),
            (2, service("a")),
            (2, service("b")),
            (1, list_meta("decoded")),
        ]);
        // The first frame ends where the first item starts: the early token is "guessed".
        let item = service("a");
        let cut = first
            .windows(item.len())
            .position(|window| window == item)
            .unwrap()
            - 2;
        let guessed_page = page(&[(1, list_meta("")), (2, service("wrong"))]);
        let decoded_page = page(&[(1, list_meta("")), (2, service("c"))]);
        let requests = Arc::new(Mutex::new(Vec::<String>::new()));
        let guessed_requested = Arc::new(tokio::sync::Notify::new());
        let service = {
            let (requests, guessed_requested) = (requests.clone(), guessed_requested.clone());
            tower::service_fn(move |request: http::Request<kube::client::Body>| {
                let token = request
                    .uri()
                    .query()
                    .unwrap_or("")
                    .split('&')
                    .find_map(|pair| pair.strip_prefix("continue="))
                    .unwrap_or("")
                    .to_owned();
                requests.lock().unwrap().push(token.clone());
                let frames: Vec<Bytes> = match token.as_str() {
                    "" => vec![
                        Bytes::copy_from_slice(&first[..cut]),
                        Bytes::copy_from_slice(&first[cut..]),
                    ],
                    "guessed" => {
                        guessed_requested.notify_one();
                        vec![Bytes::from(guessed_page.clone())]
                    }
                    _ => vec![Bytes::from(decoded_page.clone())],
                };
                let guessed_requested = guessed_requested.clone();
                // The rest of the first page waits until the page after it has been requested
                // with the early token, so that the prefetch is certain to happen.
                let body = futures::stream::unfold(
                    (frames.into_iter(), token.is_empty(), 0),
                    move |(mut frames, first_page, sent)| {
                        let guessed_requested = guessed_requested.clone();
                        async move {
                            if first_page && sent == 1 {
                                guessed_requested.notified().await;
                            }
                            let frame = frames.next()?;
                            Some((
                                Ok::<_, std::io::Error>(http_body::Frame::data(frame)),
                                (frames, first_page, sent + 1),
                            ))
                        }
                    },
                );
                let response = http::Response::builder()
                    .header(http::header::CONTENT_TYPE, MEDIA_TYPE)
                    .body(StreamBody::new(body))
                    .unwrap();
                async move { Ok::<_, std::io::Error>(response) }
            })
        };
        let client = kube::Client::new(service, "default");
        let mut collection = Collection::new(SERVICES).paged(2);
        collection.protobuf = true;
        let (items, version) = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            list_all::<ServiceRecord>(&client, &collection),
        )
        .await
        .expect("the list ends: the page after the first must be requested with the early token")
        .unwrap();
        let names: Vec<&str> = items.iter().map(|service| service.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert_eq!(version.as_deref(), Some("7"));
        let requests = requests.lock().unwrap().clone();
        assert_eq!(requests, ["", "guessed", "decoded"]);
    }

    #[test]
    fn continue_token_is_read_early_only_when_the_prefix_settles_it() {
        let page = br#"{"kind":"ServiceList","metadata":{"resourceVersion":"9","continue":"abc"},"items":[{"metadata":{"annotations":{"continue":"fake"}}}]}"#;
        assert_eq!(early_continue_token(&page[..20]), None);
        assert_eq!(early_continue_token(&page[..90]), Some(Some("abc")));
        assert_eq!(early_continue_token(page), Some(Some("abc")));
        let last = br#"{"kind":"ServiceList","metadata":{"resourceVersion":"9"},"items":[{"metadata":{"annotations":{"continue":"fake"}}}]}"#;
        assert_eq!(early_continue_token(last), Some(None));
        let sorted = br#"{"items":[{"metadata":{"annotations":{"continue":"fake"}}}],"kind":"ServiceList","metadata":{"continue":"xyz"}}"#;
        assert_eq!(early_continue_token(sorted), None);
    }

    #[test]
    fn continue_token_is_guessed_from_either_layout() {
        let apiserver = r#"{"kind":"ServiceList","metadata":{"resourceVersion":"9","continue":"abc"},"items":[{"metadata":{"annotations":{"continue":"fake"}}}]}"#;
        assert_eq!(guess_continue_token(apiserver), Some("abc"));
        let sorted = r#"{"items":[{"metadata":{"annotations":{"continue":"fake"}}}],"kind":"ServiceList","metadata":{"continue":"xyz","resourceVersion":"9"}}"#;
        assert_eq!(guess_continue_token(sorted), Some("xyz"));
        assert_eq!(
            guess_continue_token(r#"{"items":[],"metadata":{"resourceVersion":"9"}}"#),
            None
        );
        assert_eq!(
            guess_continue_token(r#"{"metadata":{"continue":""},"items":[]}"#),
            None
        );
    }
}
