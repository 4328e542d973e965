//! The list+watch that feeds every cache: kube-runtime's watcher (its `ListWatch` initial list
//! strategy, `watcher::Config`'s paging, selectors, timeout and bookmarks, its default backoff)
//! with a body reader that holds nothing between events.
//!
//! A management-mode process keeps thousands of watch streams open. kube's
//! `Client::request_events` reads a watch body through a `LinesCodec` whose buffer is allocated
//! with 8 KiB up front and kept for the life of the stream, and kube-runtime's watcher adds its
//! state machine and boxed futures beside it. Here a stream at rest holds its response body, the
//! resourceVersion to resume from and an empty [`LineSplitter`]: a line is copied only while it
//! spans chunks, and its bytes are handed on (not kept) once it is complete.
//!
//! The cases of kube-runtime's `watcher::step_trampolined` that the caches' configs reach, kept:
//! the initial list paged by `page_size` (`Init`, `InitApply` per object, `InitDone`); a list
//! without a resourceVersion or a continue token is an error ([`watcher::Error::NoResourceVersion`])
//! and lists again; the watch starts at the list's resourceVersion and resumes from the last one
//! seen (bookmarks included) when it ends, or when nothing arrives for the server-side timeout
//! plus a margin; an `ERROR` event with code 410 (the resourceVersion is too old) makes it list
//! again, other `ERROR` events are reported and the watch goes on; an object without a
//! resourceVersion is an error and lists again. Beside those: a watch that cannot start because
//! its resourceVersion is gone (a `410 Gone` answer) lists again instead of retrying the same
//! version, and an event line that does not decode is reported as [`ListWatchError::Undecodable`]
//! (kube's client drops a truncated line silently and reports any other as an API error of code
//! 0). Every error is followed by a pause before the next request, and so is a watch that ended
//! without sending a line (kube-runtime's watcher would watch again at once, however often the
//! server does that). The pauses are kube-runtime's `DefaultBackoff` (800 ms doubling to 30 s,
//! jittered, from 800 ms again once two minutes have passed since the last pause), reset by every
//! event but `Init`, which is said before the LIST is sent (kube-runtime's `StreamBackoff` resets
//! on it too, so a LIST that keeps failing is retried every second or so there; here its pauses
//! grow). A LIST that the watch forced (a `410`, an event that does not decode, an object without
//! a resourceVersion) waits on a second backoff of the same shape that no event resets, only its
//! own two minutes: a server that forces one after every list would otherwise be listed, whole,
//! about every second for ever. The initial list is always a paged LIST: kube-runtime's
//! `StreamingList` strategy is not used by any cache.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use kube::api::{ListParams, VersionMatch, WatchEvent, WatchParams};
use kube::client::Body;
use kube::core::Status;
use kube::runtime::utils::Backoff as _;
use kube::runtime::watcher::{self, DefaultBackoff, Event, ListSemantic};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;

/// The longest event line a watch may send. kube-apiserver refuses request bodies over 3 MiB, so
/// no object, and no watch event (one object and a few bytes around it), comes near 4 MiB. The
/// clients of tenant control planes bound each line of a watch response at the same size
/// (`Limits::TENANT` in the controllers' `limits` module), before it reaches this reader.
pub const MAX_LINE_BYTES: usize = 4 * 1024 * 1024;

/// How much longer than the server-side timeout a watch may stay silent before it is ended and
/// resumed (kube-runtime's `WATCH_IDLE_TIMEOUT_MARGIN`).
const IDLE_MARGIN: Duration = Duration::from_secs(5);

/// The server-side timeout kube asks for when the config sets none (`timeoutSeconds`).
const DEFAULT_TIMEOUT_SECS: u32 = 290;

/// Why a list+watch yielded no event. Every error is retried after a pause.
#[derive(Debug, thiserror::Error)]
pub enum ListWatchError {
    /// As kube-runtime's watcher reports it: a list or a watch that failed or could not start,
    /// an `ERROR` event, a missing resourceVersion.
    #[error(transparent)]
    Watch(#[from] watcher::Error),
    /// An event line that is not a watch event of the watched kind: the object it carried is
    /// not known (the watch ends and lists again).
    #[error("a watch event could not be decoded: {0}")]
    Undecodable(#[source] serde_json::Error),
    /// An event line longer than [`MAX_LINE_BYTES`] (the watch ends and resumes).
    #[error("a watch event exceeded {0} bytes (the limit for one event)")]
    LineTooLong(usize),
}

/// The events of `api`'s objects as `config` selects them, for ever ([`ListWatch::next`]): see
/// the module doc.
pub struct ListWatch<K> {
    api: Api<K>,
    config: watcher::Config,
    phase: Phase<K>,
    /// Pauses after an error that leaves the list current, or a LIST that failed.
    backoff: DefaultBackoff,
    /// Pauses before a LIST the watch forced; not reset by events (see the module doc).
    relist_backoff: DefaultBackoff,
    /// After an error, when the next request may be sent.
    resume_at: Option<tokio::time::Instant>,
}

enum Phase<K> {
    /// Nothing listed: the next step says `Init` and lists.
    Empty,
    /// Listing: the objects of the last page not yet yielded, and what the page said.
    Page {
        continue_token: Option<String>,
        objects: std::vec::IntoIter<K>,
        resource_version: Option<String>,
    },
    /// Listed (or watched) up to `resource_version`, without a watch open.
    Listed { resource_version: String },
    Watching {
        resource_version: String,
        body: Body,
        lines: LineSplitter,
        /// Whether the watch has sent a line (an event or a bookmark).
        heard: bool,
    },
}

/// What one step did: an item to yield, or nothing yet (step again).
type Step<K> = Option<Result<Event<K>, ListWatchError>>;

impl<K> ListWatch<K>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    pub fn new(api: Api<K>, config: watcher::Config) -> Self {
        ListWatch {
            api,
            config,
            phase: Phase::Empty,
            backoff: DefaultBackoff::default(),
            relist_backoff: DefaultBackoff::default(),
            resume_at: None,
        }
    }

    /// Drops what is listed or watched: the next event is the `Init` of a new list, sent at
    /// once, its backoff started again.
    pub fn restart(&mut self) {
        self.phase = Phase::Empty;
        self.backoff = DefaultBackoff::default();
        self.relist_backoff = DefaultBackoff::default();
        self.resume_at = None;
    }

    /// The next event or error. Dropping the future before it completes loses nothing: a
    /// request under way is sent again, a watch read on from where it was.
    pub async fn next(&mut self) -> Result<Event<K>, ListWatchError> {
        loop {
            if let Some(at) = self.resume_at {
                tokio::time::sleep_until(at).await;
                self.resume_at = None;
            }
            let Some(item) = self.step().await else {
                continue;
            };
            match &item {
                // Said before the LIST is sent: no sign that the API answers again.
                Ok(Event::Init) => {}
                Ok(_) => self.backoff.reset(),
                Err(err) => {
                    let forced_list = matches!(self.phase, Phase::Empty)
                        && !matches!(
                            err,
                            ListWatchError::Watch(watcher::Error::InitialListFailed(_))
                        );
                    let backoff = if forced_list {
                        &mut self.relist_backoff
                    } else {
                        &mut self.backoff
                    };
                    // Never `None`: the backoff sets no limit on attempts.
                    let pause = backoff.next();
                    tracing::debug!(error = %err, ?pause, "list+watch failed; backing off");
                    self.resume_at = pause.map(|pause| tokio::time::Instant::now() + pause);
                }
            }
            return item;
        }
    }

    async fn step(&mut self) -> Step<K> {
        match &mut self.phase {
            Phase::Empty => {
                self.phase = Phase::Page {
                    continue_token: None,
                    objects: Vec::new().into_iter(),
                    resource_version: None,
                };
                Some(Ok(Event::Init))
            }
            Phase::Page {
                continue_token,
                objects,
                resource_version,
            } => {
                if let Some(object) = objects.next() {
                    return Some(Ok(Event::InitApply(object)));
                }
                if continue_token.is_none()
                    && let Some(resource_version) = resource_version.take()
                {
                    self.phase = Phase::Listed { resource_version };
                    return Some(Ok(Event::InitDone));
                }
                let continue_token = continue_token.clone();
                self.list_page(continue_token).await
            }
            Phase::Listed { resource_version } => {
                let resource_version = resource_version.clone();
                self.start(resource_version).await
            }
            Phase::Watching { .. } => self.read_watch().await,
        }
    }

    /// Lists the page after `continue_token` (the first without one).
    async fn list_page(&mut self, continue_token: Option<String>) -> Step<K> {
        let mut params = list_params(&self.config);
        params.continue_token = continue_token;
        // Boxed: the list's future is large and lives only while the list is read.
        match Box::pin(self.api.list(&params)).await {
            Ok(list) => {
                let resource_version = list.metadata.resource_version.filter(|v| !v.is_empty());
                let continue_token = list.metadata.continue_.filter(|c| !c.is_empty());
                if resource_version.is_none() && continue_token.is_none() {
                    self.phase = Phase::Empty;
                    return Some(Err(watcher::Error::NoResourceVersion.into()));
                }
                self.phase = Phase::Page {
                    continue_token,
                    objects: list.items.into_iter(),
                    resource_version,
                };
                None
            }
            Err(err) => {
                self.phase = Phase::Empty;
                Some(Err(watcher::Error::InitialListFailed(err).into()))
            }
        }
    }

    /// Opens a watch from `resource_version`.
    async fn start(&mut self, resource_version: String) -> Step<K> {
        let started = Box::pin(start_watch(
            &self.api,
            &watch_params(&self.config),
            &resource_version,
        ))
        .await;
        match started {
            Ok(body) => {
                self.phase = Phase::Watching {
                    resource_version,
                    body,
                    lines: LineSplitter::new(MAX_LINE_BYTES),
                    heard: false,
                };
                None
            }
            Err(err) => {
                // The version is gone: watching from it again would fail again.
                if matches!(&err, kube::Error::Api(status) if status.code == 410) {
                    self.phase = Phase::Empty;
                }
                Some(Err(watcher::Error::WatchStartFailed(err).into()))
            }
        }
    }

    /// Reads the open watch's next line: an event, a bookmark, or its end.
    async fn read_watch(&mut self) -> Step<K> {
        let Phase::Watching {
            resource_version,
            body,
            lines,
            heard,
        } = &mut self.phase
        else {
            return None;
        };
        let idle = idle_timeout(&self.config);
        let line = match idle {
            Some(idle) => tokio::time::timeout(idle, next_line(body, lines))
                .await
                .unwrap_or_else(|_| {
                    tracing::debug!(?idle, "watch idle; resuming it");
                    Ok(None)
                }),
            None => next_line(body, lines).await,
        };
        let line = match line {
            Ok(Some(line)) => line,
            Ok(None) => {
                // A server that ends every watch at once, sending nothing, would
                // otherwise be asked again and again without a pause.
                if !*heard {
                    self.resume_at = self
                        .backoff
                        .next()
                        .map(|pause| tokio::time::Instant::now() + pause);
                }
                self.phase = Phase::Listed {
                    resource_version: std::mem::take(resource_version),
                };
                return None;
            }
            Err(err) => {
                self.phase = Phase::Listed {
                    resource_version: std::mem::take(resource_version),
                };
                return Some(Err(err));
            }
        };
        let event = match serde_json::from_slice::<WatchEvent<K>>(&line) {
            Ok(event) => event,
            Err(err) => {
                // What came after it is not known to follow from the versions seen.
                self.phase = Phase::Empty;
                return Some(Err(ListWatchError::Undecodable(err)));
            }
        };
        drop(line);
        *heard = true;
        match event {
            WatchEvent::Added(object) | WatchEvent::Modified(object) => {
                applied(&mut self.phase, object, Event::Apply)
            }
            WatchEvent::Deleted(object) => applied(&mut self.phase, object, Event::Delete),
            WatchEvent::Bookmark(bookmark) => {
                *resource_version = bookmark.metadata.resource_version;
                None
            }
            WatchEvent::Error(status) => {
                if status.code == 410 {
                    self.phase = Phase::Empty;
                }
                Some(Err(watcher::Error::WatchError(status).into()))
            }
        }
    }
}

/// An object the watch sent, as `event`; its resourceVersion is the one to resume from. One
/// without a resourceVersion gives nothing to resume from: the watch lists again.
fn applied<K: Resource>(phase: &mut Phase<K>, object: K, event: fn(K) -> Event<K>) -> Step<K> {
    let version = object.resource_version().unwrap_or_default();
    match phase {
        Phase::Watching {
            resource_version, ..
        } if !version.is_empty() => {
            *resource_version = version;
            Some(Ok(event(object)))
        }
        _ => {
            *phase = Phase::Empty;
            Some(Err(watcher::Error::NoResourceVersion.into()))
        }
    }
}

/// `config`'s LIST parameters, as kube-runtime's `Config::to_list_params` sets them.
fn list_params(config: &watcher::Config) -> ListParams {
    let (resource_version, version_match) = match config.list_semantic {
        ListSemantic::Any => (Some("0".to_owned()), Some(VersionMatch::NotOlderThan)),
        ListSemantic::MostRecent => (None, None),
    };
    ListParams {
        label_selector: config.label_selector.clone(),
        field_selector: config.field_selector.clone(),
        resource_version,
        version_match,
        limit: config.page_size,
        continue_token: None,
        ..ListParams::default()
    }
}

/// `config`'s watch parameters, as kube-runtime's `Config::to_watch_params` sets them for a
/// watch after a list (its `initial_list_strategy` is not read: the list is always paged).
fn watch_params(config: &watcher::Config) -> WatchParams {
    WatchParams {
        label_selector: config.label_selector.clone(),
        field_selector: config.field_selector.clone(),
        timeout: config.timeout,
        bookmarks: config.bookmarks,
        send_initial_events: false,
    }
}

/// How long a watch may stay silent: the server-side timeout plus a margin; none when the
/// config asks for no timeout (`Some(0)`), as kube-runtime's `next_with_idle_timeout`.
fn idle_timeout(config: &watcher::Config) -> Option<Duration> {
    match config.timeout {
        Some(0) => None,
        timeout => Some(
            Duration::from_secs(u64::from(timeout.unwrap_or(DEFAULT_TIMEOUT_SECS))) + IDLE_MARGIN,
        ),
    }
}

/// Starts a watch of `api` from `version` as kube's `Api::watch` does (the request kube builds,
/// marked `"watch"`, uncompressed as `Client::request_events` asks); its body, or the error the
/// server answered with.
async fn start_watch<K: Resource + Clone>(
    api: &Api<K>,
    params: &WatchParams,
    version: &str,
) -> Result<Body, kube::Error> {
    let mut request = kube::core::Request::new(api.resource_url())
        .watch(params, version)
        .map_err(kube::Error::BuildRequest)?;
    request.extensions_mut().insert("watch");
    // Kubernetes compresses watch streams one gzip member per event, which the client's
    // decompression does not read past the first: kube's own watches ask for none either.
    request.headers_mut().insert(
        http::header::ACCEPT_ENCODING,
        http::HeaderValue::from_static("identity"),
    );
    // The API's own client: a stream keeps no second one beside it.
    let response = api
        .clone()
        .into_client()
        .send(request.map(Body::from))
        .await?;
    let status = response.status();
    if status.is_client_error() || status.is_server_error() {
        return Err(kube::Error::Api(
            error_status(response.into_body(), status.as_u16())
                .await?
                .boxed(),
        ));
    }
    Ok(response.into_body())
}

/// The `Status` an error answer carries, as kube's client reads it (one it builds from the text
/// when the body is not a `Status`), reading at most [`MAX_LINE_BYTES`] of it.
async fn error_status(mut body: Body, code: u16) -> Result<Status, kube::Error> {
    let mut text = BytesMut::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            if text.len().saturating_add(data.len()) > MAX_LINE_BYTES {
                let message = format!(
                    "an error answer to a watch exceeded {MAX_LINE_BYTES} bytes (the limit for \
                     one event)"
                );
                return Ok(Status::failure(&message, "Failed to read error data").with_code(code));
            }
            text.extend_from_slice(&data);
        }
    }
    Ok(serde_json::from_slice::<Status>(&text).unwrap_or_else(|_| {
        let text = String::from_utf8_lossy(&text);
        Status::failure(text.trim(), "Failed to parse error data").with_code(code)
    }))
}

/// The next whole line of a watch body; `None` when the body ends (or breaks off as a watch
/// that reached its end does), dropping any line it left unfinished: the watch resumes from the
/// last complete event's version, so the server sends that event again.
async fn next_line(
    body: &mut Body,
    lines: &mut LineSplitter,
) -> Result<Option<Bytes>, ListWatchError> {
    loop {
        if let Some(line) = lines.next_line()? {
            return Ok(Some(line));
        }
        match body.frame().await {
            None => {
                lines.clear();
                return Ok(None);
            }
            Some(Ok(frame)) => {
                // Trailers carry no events.
                if let Ok(data) = frame.into_data() {
                    lines.push(data);
                }
            }
            Some(Err(err)) if is_end_of_watch(&err) => {
                tracing::debug!(error = %err, "watch body broke off; resuming it");
                lines.clear();
                return Ok(None);
            }
            Some(Err(err)) => {
                lines.clear();
                return Err(watcher::Error::WatchFailed(err).into());
            }
        }
    }
}

/// Whether a body error is a watch that ended, as kube's `Client::request_events` tells them
/// (an unexpected EOF somewhere in the error's chain, or the chunk decoder's words for one, or
/// a read timeout): the watch resumes without an error.
fn is_end_of_watch(error: &kube::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(err) = source {
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::TimedOut
            )
        {
            return true;
        }
        if err.to_string().contains("unexpected EOF during chunk") {
            return true;
        }
        source = err.source();
    }
    false
}

/// Splits a body's chunks into lines, holding bytes only while a line is incomplete: a line
/// within one chunk is a slice of it (no copy); a line across chunks is gathered in a buffer
/// that is handed on with the line, so nothing is kept between events. A line longer than its
/// bound fails instead of growing the buffer further.
#[derive(Debug)]
pub struct LineSplitter {
    /// The start of a line whose end has not come yet.
    partial: Vec<u8>,
    /// What is left of the last chunk, after the lines already taken from it.
    rest: Bytes,
    max: usize,
}

impl LineSplitter {
    /// A splitter of lines of at most `max` bytes (their newline excluded).
    pub fn new(max: usize) -> Self {
        LineSplitter {
            partial: Vec::new(),
            rest: Bytes::new(),
            max,
        }
    }

    /// Adds the body's next chunk; call only once [`next_line`](Self::next_line) gives `None`.
    pub fn push(&mut self, chunk: Bytes) {
        debug_assert!(
            self.rest.is_empty(),
            "a chunk pushed before the last was split"
        );
        self.rest = chunk;
    }

    /// The next whole line (without its `\n` or `\r\n`; empty lines are skipped), or `None`
    /// when more bytes are needed. A line over the bound is an error, and what was held of it
    /// is dropped.
    pub fn next_line(&mut self) -> Result<Option<Bytes>, ListWatchError> {
        loop {
            if self.rest.is_empty() {
                // An empty slice may still share the chunk it was cut from.
                self.rest = Bytes::new();
                return Ok(None);
            }
            let Some(end) = self.rest.iter().position(|&b| b == b'\n') else {
                if self.partial.len().saturating_add(self.rest.len()) > self.max {
                    self.clear();
                    return Err(ListWatchError::LineTooLong(self.max));
                }
                self.partial.extend_from_slice(&self.rest);
                self.rest = Bytes::new();
                return Ok(None);
            };
            if self.partial.len().saturating_add(end) > self.max {
                self.clear();
                return Err(ListWatchError::LineTooLong(self.max));
            }
            let mut line = self.rest.split_to(end + 1);
            line.truncate(end);
            let mut line = if self.partial.is_empty() {
                line
            } else {
                self.partial.extend_from_slice(&line);
                Bytes::from(std::mem::take(&mut self.partial))
            };
            if line.last() == Some(&b'\r') {
                line.truncate(line.len() - 1);
            }
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            if self.rest.is_empty() {
                self.rest = Bytes::new();
            }
            return Ok(Some(line));
        }
    }

    /// Whether nothing is held: no bytes and no buffer between events.
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.partial.capacity() == 0 && self.rest.is_empty()
    }

    /// Drops what is held.
    pub fn clear(&mut self) {
        self.partial = Vec::new();
        self.rest = Bytes::new();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn lines(splitter: &mut LineSplitter) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(line) = splitter.next_line().unwrap() {
            out.push(String::from_utf8(line.to_vec()).unwrap());
        }
        out
    }

    #[test]
    fn several_lines_in_one_chunk_are_slices_of_it_and_nothing_is_held_after() {
        let mut splitter = LineSplitter::new(100);
        let chunk = Bytes::from_static(b"{\"a\":1}\n{\"b\":2}\r\n\n{\"c\":3}\n");
        splitter.push(chunk.clone());
        let first = splitter.next_line().unwrap().unwrap();
        assert_eq!(first, "{\"a\":1}");
        // Cut from the chunk, not copied.
        assert_eq!(first.as_ptr(), chunk.as_ptr());
        assert_eq!(lines(&mut splitter), ["{\"b\":2}", "{\"c\":3}"]);
        assert!(splitter.is_empty());
    }

    #[test]
    fn a_line_across_chunks_is_gathered_and_its_buffer_goes_with_it() {
        let mut splitter = LineSplitter::new(100);
        for part in ["{\"a\"", ":", "1}"] {
            splitter.push(Bytes::from(part));
            assert_eq!(splitter.next_line().unwrap(), None);
            assert!(!splitter.is_empty(), "the start of the line is held");
        }
        splitter.push(Bytes::from_static(b"\n{\"b\":"));
        assert_eq!(lines(&mut splitter), ["{\"a\":1}"]);
        splitter.push(Bytes::from_static(b"2}\n"));
        assert_eq!(lines(&mut splitter), ["{\"b\":2}"]);
        assert!(splitter.is_empty(), "no buffer kept between events");
        assert_eq!(splitter.partial.capacity(), 0);
    }

    #[test]
    fn a_line_over_the_bound_fails_naming_it_and_drops_what_was_held() {
        let mut splitter = LineSplitter::new(8);
        splitter.push(Bytes::from_static(b"12345"));
        assert_eq!(splitter.next_line().unwrap(), None);
        splitter.push(Bytes::from_static(b"6789"));
        let err = splitter.next_line().unwrap_err();
        assert!(matches!(err, ListWatchError::LineTooLong(8)), "{err:?}");
        assert!(err.to_string().contains("exceeded 8 bytes"), "{err}");
        assert!(splitter.is_empty());

        // Whole in one chunk, too; a line of exactly the bound passes.
        splitter.push(Bytes::from_static(b"12345678\n123456789\n"));
        assert_eq!(splitter.next_line().unwrap().unwrap(), "12345678");
        assert!(matches!(
            splitter.next_line(),
            Err(ListWatchError::LineTooLong(8))
        ));
        assert!(splitter.is_empty());
    }

    #[test]
    fn the_list_and_watch_parameters_are_kube_runtimes() {
        let config = watcher::Config::default()
            .labels("app=x")
            .fields("metadata.name=a");
        let list = list_params(&config);
        assert_eq!(list.limit, Some(500));
        assert_eq!(list.label_selector.as_deref(), Some("app=x"));
        assert_eq!(list.field_selector.as_deref(), Some("metadata.name=a"));
        assert_eq!(list.resource_version, None);
        let any = list_params(&config.clone().any_semantic());
        assert_eq!(any.resource_version.as_deref(), Some("0"));
        let watch = watch_params(&config);
        assert!(watch.bookmarks && !watch.send_initial_events);
        assert_eq!(watch.field_selector.as_deref(), Some("metadata.name=a"));
        assert_eq!(idle_timeout(&config), Some(Duration::from_secs(295)));
        assert_eq!(idle_timeout(&config.clone().timeout(0)), None);
    }
}
