//! HTTP(S) serving: routing, discovery, LIST/WATCH, the `/sim` admin API and fault application.

use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use base64::Engine;
use bytes::{Bytes, BytesMut};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode, header};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::errors::ApiError;
use crate::faults::{FaultKind, FaultRule, RequestLog, RequestRecord, Verb};
use crate::ops::{PatchKind, Shared, WriteOptions};
use crate::resources::{self, RESOURCES, ResIdx};
use crate::selectors::{FieldSelector, LabelSelector};
use crate::store::{EventType, Stored, WatchEvent};

pub type Body = UnsyncBoxBody<Bytes, Infallible>;

/// Returned from the service to make hyper close the connection without a response.
#[derive(Debug)]
pub struct DropConnection;

impl std::fmt::Display for DropConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection dropped by fault injection")
    }
}

impl std::error::Error for DropConnection {}

/// Per-server context shared by all connections.
#[derive(Debug)]
pub struct Ctx {
    pub shared: Arc<Shared>,
    pub requests: RequestLog,
    /// `host:port` advertised in `/api`.
    pub address: String,
    pub cancel: CancellationToken,
    /// Cancelled (and replaced) to end every open watch stream.
    pub watch_epoch: std::sync::Mutex<CancellationToken>,
    /// Cancelled (and replaced) to close every open connection.
    pub conn_epoch: std::sync::Mutex<CancellationToken>,
    /// Open watch streams per resource (index into RESOURCES).
    pub open_watches: Arc<Vec<std::sync::atomic::AtomicUsize>>,
    /// Connections served since the start (over TLS: those whose handshake completed).
    pub connections: std::sync::atomic::AtomicUsize,
}

/// Counts a watch stream as open for as long as it lives.
struct WatchGuard {
    counts: Arc<Vec<std::sync::atomic::AtomicUsize>>,
    res: ResIdx,
}

impl WatchGuard {
    fn new(counts: Arc<Vec<std::sync::atomic::AtomicUsize>>, res: ResIdx) -> Self {
        counts[res].fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Self { counts, res }
    }
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.counts[self.res].fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Ctx {
    pub fn new(shared: Arc<Shared>, address: String) -> Self {
        let cancel = CancellationToken::new();
        Self {
            shared,
            requests: RequestLog::default(),
            address,
            watch_epoch: std::sync::Mutex::new(cancel.child_token()),
            conn_epoch: std::sync::Mutex::new(cancel.child_token()),
            open_watches: Arc::new(
                RESOURCES
                    .iter()
                    .map(|_| std::sync::atomic::AtomicUsize::new(0))
                    .collect(),
            ),
            connections: std::sync::atomic::AtomicUsize::new(0),
            cancel,
        }
    }

    fn current(epoch: &std::sync::Mutex<CancellationToken>) -> CancellationToken {
        epoch.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn renew(&self, epoch: &std::sync::Mutex<CancellationToken>) {
        let mut g = epoch.lock().unwrap_or_else(|e| e.into_inner());
        g.cancel();
        *g = self.cancel.child_token();
    }

    /// Ends every open watch stream (cleanly, as an apiserver restart or an idle-timeout would).
    pub fn close_watches(&self) {
        self.renew(&self.watch_epoch);
    }

    /// Closes every open connection without a response to in-flight requests.
    pub fn drop_connections(&self) {
        self.renew(&self.conn_epoch);
    }
}

struct ChannelBody(mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

/// One ADDED event line of about `bytes` bytes (a name of that length), sent in 64 KiB chunks.
async fn send_huge_event(tx: &mpsc::Sender<Bytes>, bytes: u64) {
    if tx
        .send(Bytes::from_static(
            br#"{"type":"ADDED","object":{"metadata":{"name":""#,
        ))
        .await
        .is_err()
    {
        return;
    }
    let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
    let mut left = bytes;
    while left > 0 {
        let part = chunk.slice(..usize::try_from(left.min(64 * 1024)).unwrap_or(64 * 1024));
        left = left.saturating_sub(part.len() as u64);
        if tx.send(part).await.is_err() {
            return;
        }
    }
    let _ = tx.send(Bytes::from_static(b"\"}}}\n")).await;
}

/// A 200 JSON list that never ends: items are produced as fast as the client reads them.
fn endless_list() -> Response<Body> {
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    tokio::spawn(async move {
        let item = Bytes::from_static(br#"{"metadata":{"name":"again-and-again"}},"#);
        if tx
            .send(Bytes::from_static(
                br#"{"kind":"List","apiVersion":"v1","metadata":{},"items":["#,
            ))
            .await
            .is_err()
        {
            return;
        }
        while tx.send(item.clone()).await.is_ok() {}
    });
    respond(200, "application/json", ChannelBody(rx).boxed_unsync())
}

fn full(status: u16, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    respond(status, content_type, Full::new(body.into()).boxed_unsync())
}

fn respond(status: u16, content_type: &str, body: Body) -> Response<Body> {
    let mut r = Response::new(body);
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    if let Ok(v) = header::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(header::CONTENT_TYPE, v);
    }
    r
}

/// A LIST body as kube-apiserver sends one: without Content-Length, in HTTP/1.1 chunks of
/// 2 KiB. Go's `net/http` announces a length only for bodies that fit its 2 KiB buffer before
/// chunking, and kube-apiserver (1.33+, streaming collection encoding) writes a list item by
/// item, so a client cannot size its buffer from the headers and reads a page in small chunks.
fn list_response(content_type: &str, body: Bytes) -> Response<Body> {
    respond(200, content_type, GoChunks(body).boxed_unsync())
}

/// Go's `bufferBeforeChunkingSize`: the size of the chunks a streamed response is sent in.
const GO_CHUNK: usize = 2048;

/// A body sent in [`GO_CHUNK`]-sized frames, its length unannounced (so hyper sends it chunked).
struct GoChunks(Bytes);

impl hyper::body::Body for GoChunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.0.is_empty() {
            return Poll::Ready(None);
        }
        let len = self.0.len().min(GO_CHUNK);
        Poll::Ready(Some(Ok(Frame::data(self.0.split_to(len)))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_empty()
    }
}

fn json_response(status: u16, body: impl Into<Bytes>) -> Response<Body> {
    full(status, "application/json", body)
}

fn value_response(status: u16, v: &Value) -> Response<Body> {
    json_response(status, serde_json::to_vec(v).unwrap_or_default())
}

fn protobuf_response(status: u16, body: impl Into<Bytes>) -> Response<Body> {
    full(status, crate::protobuf::MEDIA_TYPE, body)
}

/// The error as a protobuf `Status` (JSON when it cannot be encoded, which would be a bug).
fn protobuf_error_response(e: &ApiError) -> Response<Body> {
    let Ok(body) = crate::protobuf::encode_single("Status", "v1", &e.to_status()) else {
        return error_response(e);
    };
    let mut r = protobuf_response(e.code, body);
    if let Some(secs) = e.retry_after
        && let Ok(v) = header::HeaderValue::from_str(&secs.to_string())
    {
        r.headers_mut().insert(header::RETRY_AFTER, v);
    }
    r
}

fn error_response(e: &ApiError) -> Response<Body> {
    let mut r = value_response(e.code, &e.to_status());
    if let Some(secs) = e.retry_after
        && let Ok(v) = header::HeaderValue::from_str(&secs.to_string())
    {
        r.headers_mut().insert(header::RETRY_AFTER, v);
    }
    r
}

fn percent_decode(s: &str) -> String {
    fn hex(b: u8) -> Option<u8> {
        (b as char).to_digit(16).map(|d| d as u8)
    }
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h * 16 + l);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_query(q: Option<&str>) -> HashMap<String, String> {
    q.unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (percent_decode(k), percent_decode(v)),
            None => (percent_decode(p), String::new()),
        })
        .collect()
}

fn truthy(q: &HashMap<String, String>, k: &str) -> bool {
    q.get(k).is_some_and(|v| v == "true" || v == "1")
}

/// A request on a resource path.
#[derive(Debug)]
struct Target {
    res: ResIdx,
    /// `None` for cluster-scoped resources and all-namespace collections.
    ns: Option<String>,
    name: Option<String>,
    sub: Option<String>,
}

fn parse_target(group: &str, version: &str, segs: &[&str]) -> Option<Target> {
    let namespaced_res =
        |p: &str| resources::find(group, version, p).filter(|i| RESOURCES[*i].namespaced);
    if segs.len() >= 3
        && segs[0] == "namespaces"
        && let Some(res) = namespaced_res(segs[2])
    {
        return match segs.len() {
            3 => Some(Target {
                res,
                ns: Some(segs[1].into()),
                name: None,
                sub: None,
            }),
            4 => Some(Target {
                res,
                ns: Some(segs[1].into()),
                name: Some(segs[3].into()),
                sub: None,
            }),
            5 => Some(Target {
                res,
                ns: Some(segs[1].into()),
                name: Some(segs[3].into()),
                sub: Some(segs[4].into()),
            }),
            _ => None,
        };
    }
    let res = resources::find(group, version, segs.first()?)?;
    let def = &RESOURCES[res];
    match segs.len() {
        1 => Some(Target {
            res,
            ns: None,
            name: None,
            sub: None,
        }),
        2 if !def.namespaced => Some(Target {
            res,
            ns: None,
            name: Some(segs[1].into()),
            sub: None,
        }),
        3 if !def.namespaced => Some(Target {
            res,
            ns: None,
            name: Some(segs[1].into()),
            sub: Some(segs[2].into()),
        }),
        _ => None,
    }
}

fn not_found_path() -> ApiError {
    ApiError::new(
        404,
        "NotFound",
        "the server could not find the requested resource",
    )
}

/// Entry point for every HTTP request.
pub async fn handle(
    ctx: Arc<Ctx>,
    req: Request<Incoming>,
) -> Result<Response<Body>, DropConnection> {
    let path = req.uri().path().to_string();
    let query = parse_query(req.uri().query());
    let user_agent = req
        .headers()
        .get(header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    if let Some(rest) = path.strip_prefix("/sim/") {
        let rest = rest.to_string();
        return Ok(admin(&ctx, req, &rest, &query).await);
    }
    let mut record = RequestRecord {
        time: crate::meta::now_rfc3339_micros(),
        verb: req.method().as_str().to_lowercase(),
        resource: String::new(),
        subresource: String::new(),
        namespace: String::new(),
        name: String::new(),
        path: path.clone(),
        status: 0,
        user_agent,
    };
    let result = route(&ctx, req, &path, &query, &mut record).await;
    record.status = match &result {
        Ok(r) => r.status().as_u16(),
        Err(_) => 0,
    };
    ctx.requests.push(record);
    result
}

async fn route(
    ctx: &Arc<Ctx>,
    req: Request<Incoming>,
    path: &str,
    query: &HashMap<String, String>,
    record: &mut RequestRecord,
) -> Result<Response<Body>, DropConnection> {
    let trimmed = path.trim_end_matches('/');
    match trimmed {
        "/livez" | "/healthz" => return Ok(full(200, "text/plain; charset=utf-8", "ok")),
        "/readyz" => {
            return Ok(if ctx.shared.is_ready() {
                full(200, "text/plain; charset=utf-8", "ok")
            } else {
                full(
                    500,
                    "text/plain; charset=utf-8",
                    "[-]apiserver-sim-ready failed: reason withheld\nreadyz check failed\n",
                )
            });
        }
        "/version" => return Ok(value_response(200, &version())),
        "/api" => {
            return Ok(value_response(
                200,
                &json!({
                    "kind": "APIVersions",
                    "versions": ["v1"],
                    "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": ctx.address}],
                }),
            ));
        }
        "/apis" => return Ok(value_response(200, &api_group_list())),
        _ => {}
    }
    let segs: Vec<&str> = trimmed.split('/').filter(|s| !s.is_empty()).collect();
    // An older cluster (before 1.33) serves no networking.k8s.io/v1.
    if let ["apis", "networking.k8s.io", ..] = segs.as_slice()
        && !ctx
            .shared
            .serve_networking_v1
            .load(std::sync::atomic::Ordering::SeqCst)
    {
        return Ok(error_response(&not_found_path()));
    }
    let (group, version, rest) = match segs.as_slice() {
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g] => {
            return Ok(match api_group(g) {
                Some(v) => value_response(200, &v),
                None => error_response(&not_found_path()),
            });
        }
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return Ok(error_response(&not_found_path())),
    };
    if rest.is_empty() {
        return Ok(match resource_list(group, version) {
            Some(v) => value_response(200, &v),
            None => error_response(&not_found_path()),
        });
    }
    let Some(target) = parse_target(group, version, rest) else {
        return Ok(error_response(&not_found_path()));
    };
    let def = &RESOURCES[target.res];
    let method = req.method().clone();
    let verb = match (&method, target.name.is_some()) {
        (&Method::GET, true) => Verb::Get,
        (&Method::GET, false) if truthy(query, "watch") => Verb::Watch,
        (&Method::GET, false) => Verb::List,
        (&Method::POST, false) => Verb::Create,
        (&Method::PUT, true) => Verb::Update,
        (&Method::PATCH, true) => Verb::Patch,
        (&Method::DELETE, true) => Verb::Delete,
        (&Method::DELETE, false) => Verb::Deletecollection,
        _ => {
            return Ok(error_response(&ApiError::method_not_allowed(
                "the server does not allow this method on the requested resource",
            )));
        }
    };
    record.verb = verb.as_str().to_string();
    record.resource = def.plural.to_string();
    record.subresource = target.sub.clone().unwrap_or_default();
    record.namespace = target.ns.clone().unwrap_or_default();
    record.name = target.name.clone().unwrap_or_default();
    if let Some(sub) = &target.sub
        && !(sub == "status" && def.has_status)
    {
        return Ok(error_response(&not_found_path()));
    }
    // Readiness only shows on /readyz: an apiserver that reports not-ready still serves.
    let mut watch_faults = Vec::new();
    for fault in ctx
        .shared
        .faults
        .take(verb, def.plural, &def.qualified(), &record.user_agent)
    {
        match fault {
            FaultKind::Latency { millis } => {
                tokio::time::sleep(Duration::from_millis(millis)).await
            }
            FaultKind::Error {
                code,
                retry_after_seconds,
            } => {
                return Ok(error_response(&ApiError::for_code(
                    code,
                    retry_after_seconds,
                )));
            }
            FaultKind::DropConnection => return Err(DropConnection),
            FaultKind::Hang => {
                // Until the client gives up and the connection (so this future) is dropped.
                std::future::pending::<()>().await;
            }
            FaultKind::EndlessResponse => return Ok(endless_list()),
            FaultKind::EndlessPages => {
                let flood = crate::flood::Flood::new(
                    target.res,
                    target.ns.as_deref(),
                    &ctx.shared.alloc.ranges,
                    ctx.shared.current_rv(),
                );
                return Ok(list_response("application/json", flood.page(query)));
            }
            other => watch_faults.push(other),
        }
    }
    if matches!(verb, Verb::Create | Verb::Update) {
        let ct = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("application/json");
        let protobuf_body =
            ct.starts_with(crate::protobuf::MEDIA_TYPE) && crate::protobuf::supports(def.kind);
        if !ct.is_empty()
            && !ct.starts_with("application/json")
            && !ct.starts_with("*/*")
            && !protobuf_body
        {
            return Ok(error_response(&ApiError::new(
                415,
                "UnsupportedMediaType",
                format!(
                    "the body of the request was in an unknown format - accepted media types include: application/json, application/vnd.kubernetes.protobuf; got {ct:?}"
                ),
            )));
        }
    }
    let dry_run = query.get("dryRun").is_some_and(|v| v == "All");
    let field_manager = query
        .get("fieldManager")
        .map(String::as_str)
        .filter(|m| !m.is_empty());
    // kube-apiserver names an unnamed updater after the User-Agent's product token.
    let updater = field_manager.map(str::to_string).unwrap_or_else(|| {
        match record.user_agent.split('/').next() {
            Some(p) if !p.is_empty() => p.to_string(),
            _ => "unknown".to_string(),
        }
    });
    let write_opts = WriteOptions {
        dry_run,
        field_manager,
        updater: &updater,
        force: truthy(query, "force"),
    };
    let ns = target.ns.clone().unwrap_or_default();
    if def.namespaced && target.ns.is_none() && !matches!(verb, Verb::List | Verb::Watch) {
        return Ok(error_response(&ApiError::method_not_allowed(
            "the server does not allow this method on the requested resource",
        )));
    }
    let shared = &ctx.shared;
    let as_table = req
        .headers()
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(crate::table::wants_table)
        && target.sub.is_none();
    let res = target.res;
    let sres = crate::convert::storage_idx(res);
    // Protobuf for GET and LIST of the kinds that have a schema, when the client prefers it;
    // errors of such requests are protobuf Status objects, as kube-apiserver sends them.
    let protobuf = sres == res
        && !as_table
        && target.sub.is_none()
        && matches!(verb, Verb::Get | Verb::List)
        && req
            .headers()
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|accept| crate::protobuf::preferred(accept, RESOURCES[res].kind));
    // Objects of a converted resource (events.k8s.io) are stored in another's form.
    let out = |b: Bytes| -> Bytes {
        if sres == res {
            b
        } else {
            Bytes::from(crate::convert::bytes_from_storage(res, &b))
        }
    };
    let result: Result<Response<Body>, ApiError> = match verb {
        Verb::Get if protobuf => shared
            .get(sres, &ns, target.name.as_deref().unwrap_or(""))
            .and_then(|b| {
                let def = &RESOURCES[res];
                let value: Value = serde_json::from_slice(&b)
                    .map_err(|e| ApiError::internal(format!("stored object is not JSON: {e}")))?;
                crate::protobuf::encode_single(def.kind, &def.api_version(), &value)
                    .map_err(|e| ApiError::internal(e.to_string()))
            })
            .map(|b| protobuf_response(200, b)),
        Verb::List if protobuf => list_protobuf(shared, sres, target.ns.as_deref(), query)
            .map(|b| list_response(crate::protobuf::MEDIA_TYPE, b)),
        Verb::Get => shared
            .get(sres, &ns, target.name.as_deref().unwrap_or(""))
            .map(out)
            .map(|b| {
                if as_table {
                    table_response(def, &b, false)
                } else {
                    json_response(200, b)
                }
            }),
        Verb::List => list(shared, sres, target.ns.as_deref(), query)
            .map(|b| convert_list(res, b))
            .map(|b| {
                if as_table {
                    table_response(def, &b, true)
                } else {
                    list_response("application/json", b)
                }
            }),
        Verb::Watch => watch(ctx, res, target.ns.clone(), query, watch_faults, as_table),
        Verb::Create => match read_json(req).await {
            Ok(body) => shared
                .create(target.res, &ns, body, dry_run)
                .map(|b| json_response(201, out(b))),
            Err(e) => Err(e),
        },
        Verb::Update => match read_json(req).await {
            Ok(body) => shared
                .create_or_update(
                    target.res,
                    &ns,
                    target.name.as_deref().unwrap_or(""),
                    target.sub.is_some(),
                    body,
                    write_opts,
                )
                .map(|w| json_response(if w.created { 201 } else { 200 }, out(w.json))),
            Err(e) => Err(e),
        },
        Verb::Patch => {
            let ct = req
                .headers()
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            let kind = if ct.starts_with("application/merge-patch+json") {
                Some(PatchKind::Merge)
            } else if ct.starts_with("application/json-patch+json") {
                Some(PatchKind::Json)
            } else if ct.starts_with("application/strategic-merge-patch+json") {
                Some(PatchKind::StrategicMerge)
            } else if ct.starts_with("application/apply-patch+yaml") {
                Some(PatchKind::Apply)
            } else {
                None
            };
            match kind {
                None => Err(ApiError::unsupported_media(&ct)),
                Some(kind) => match read_bytes(req).await {
                    Ok(body) => shared
                        .patch(
                            target.res,
                            &ns,
                            target.name.as_deref().unwrap_or(""),
                            target.sub.is_some(),
                            kind,
                            &body,
                            write_opts,
                        )
                        .map(|w| json_response(if w.created { 201 } else { 200 }, out(w.json))),
                    Err(e) => Err(e),
                },
            }
        }
        Verb::Delete => match read_optional_json(req).await {
            Ok(opts) => shared
                .delete(
                    target.res,
                    &ns,
                    target.name.as_deref().unwrap_or(""),
                    opts.as_ref(),
                    dry_run,
                )
                .map(|b| json_response(200, out(b))),
            Err(e) => Err(e),
        },
        Verb::Deletecollection => delete_collection(shared, target.res, &ns, query, dry_run),
    };
    Ok(result.unwrap_or_else(|e| {
        let e = rename_error(res, e);
        if protobuf {
            protobuf_error_response(&e)
        } else {
            error_response(&e)
        }
    }))
}

/// Errors from a converted resource's storage name the resource the client asked for.
fn rename_error(res: ResIdx, mut e: ApiError) -> ApiError {
    let sres = crate::convert::storage_idx(res);
    if sres == res {
        return e;
    }
    let (api, stored) = (&RESOURCES[res], &RESOURCES[sres]);
    e.message = e.message.replacen(
        &format!("{} \"", stored.qualified()),
        &format!("{} \"", api.qualified()),
        1,
    );
    if let Some(d) = e.details.as_mut()
        && d.get("kind").and_then(Value::as_str) == Some(stored.plural)
    {
        d["group"] = json!(api.group);
    }
    e
}

/// A stored-form list → the list of a converted resource.
fn convert_list(res: ResIdx, body: Bytes) -> Bytes {
    if !crate::convert::is_converted(res) {
        return body;
    }
    let Ok(mut v) = serde_json::from_slice::<Value>(&body) else {
        return body;
    };
    let def = &RESOURCES[res];
    if let Some(items) = v.get_mut("items").and_then(Value::as_array_mut) {
        for item in items.iter_mut() {
            *item = crate::convert::from_storage(res, std::mem::take(item));
        }
    }
    v["kind"] = json!(format!("{}List", def.kind));
    v["apiVersion"] = json!(def.api_version());
    serde_json::to_vec(&v).map(Bytes::from).unwrap_or(body)
}

/// Re-renders a JSON object or list as a Table for kubectl's human-readable output.
fn table_response(
    def: &crate::resources::ResourceDef,
    body: &[u8],
    is_list: bool,
) -> Response<Body> {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return json_response(200, Bytes::copy_from_slice(body));
    };
    let t = if is_list {
        let items = v
            .get("items")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        crate::table::table(def, &items, v.get("metadata").cloned().unwrap_or(json!({})))
    } else {
        let rv = v
            .pointer("/metadata/resourceVersion")
            .cloned()
            .unwrap_or(json!(""));
        crate::table::table(
            def,
            std::slice::from_ref(&v),
            json!({"resourceVersion": rv}),
        )
    };
    value_response(200, &t)
}

fn table_event_object(res: ResIdx, object: &[u8]) -> Vec<u8> {
    match serde_json::from_slice::<Value>(object) {
        Ok(v) => {
            let rv = v
                .pointer("/metadata/resourceVersion")
                .cloned()
                .unwrap_or(json!(""));
            let t = crate::table::table(
                &RESOURCES[res],
                std::slice::from_ref(&v),
                json!({"resourceVersion": rv}),
            );
            serde_json::to_vec(&t).unwrap_or_else(|_| object.to_vec())
        }
        Err(_) => object.to_vec(),
    }
}

async fn read_bytes(req: Request<Incoming>) -> Result<Bytes, ApiError> {
    req.into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .map_err(|e| ApiError::bad_request(format!("reading request body: {e}")))
}

/// The request body as JSON: as sent, or decoded from protobuf (kubectl's generators send it).
async fn read_json(req: Request<Incoming>) -> Result<Value, ApiError> {
    let protobuf = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with(crate::protobuf::MEDIA_TYPE));
    let b = read_bytes(req).await?;
    if protobuf {
        return crate::protobuf::decode_single(&b)
            .map_err(|e| ApiError::bad_request(e.to_string()));
    }
    serde_json::from_slice(&b).map_err(|e| {
        ApiError::bad_request(format!("the body of the request is not valid JSON: {e}"))
    })
}

async fn read_optional_json(req: Request<Incoming>) -> Result<Option<Value>, ApiError> {
    let b = read_bytes(req).await?;
    if b.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    serde_json::from_slice(&b).map(Some).map_err(|e| {
        ApiError::bad_request(format!("the body of the request is not valid JSON: {e}"))
    })
}

fn version() -> Value {
    json!({
        "major": "1",
        "minor": "33",
        "gitVersion": "v1.33.0-apiserver-sim",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2025-04-23T00:00:00Z",
        "goVersion": "go1.24.2",
        "compiler": "gc",
        "platform": "linux/amd64",
    })
}

fn group_entry(g: &str) -> Value {
    let gv = json!({"groupVersion": format!("{g}/v1"), "version": "v1"});
    json!({"name": g, "versions": [gv.clone()], "preferredVersion": gv})
}

fn api_group_list() -> Value {
    json!({
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": resources::groups().into_iter().map(group_entry).collect::<Vec<_>>(),
    })
}

fn api_group(g: &str) -> Option<Value> {
    resources::groups().contains(&g).then(|| {
        let mut v = group_entry(g);
        v["kind"] = json!("APIGroup");
        v["apiVersion"] = json!("v1");
        v
    })
}

fn resource_list(group: &str, version: &str) -> Option<Value> {
    let defs: Vec<_> = RESOURCES
        .iter()
        .filter(|r| r.group == group && r.version == version)
        .collect();
    if defs.is_empty() {
        return None;
    }
    let mut out = Vec::new();
    for d in defs {
        out.push(json!({
            "name": d.plural,
            "singularName": d.singular,
            "namespaced": d.namespaced,
            "kind": d.kind,
            "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"],
            "shortNames": d.short_names,
        }));
        if d.has_status {
            out.push(json!({
                "name": format!("{}/status", d.plural),
                "singularName": "",
                "namespaced": d.namespaced,
                "kind": d.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
    }
    let gv = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    Some(
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": out}),
    )
}

#[derive(serde::Serialize, serde::Deserialize)]
struct ContinueToken {
    rv: u64,
    ns: String,
    name: String,
    /// Items handed out by the pages before, so `remainingItemCount` needs no walk over the
    /// rest of the collection (which made paging through 100,000 objects quadratic).
    #[serde(default)]
    offset: u64,
}

struct Selection {
    labels: LabelSelector,
    fields: FieldSelector,
}

impl Selection {
    fn parse(query: &HashMap<String, String>) -> Result<Self, ApiError> {
        Ok(Self {
            labels: LabelSelector::parse(
                query.get("labelSelector").map(String::as_str).unwrap_or(""),
            )?,
            fields: FieldSelector::parse(
                query.get("fieldSelector").map(String::as_str).unwrap_or(""),
            )?,
        })
    }

    fn matches(&self, ns: &str, name: &str, s: &Stored) -> bool {
        self.labels.matches(&s.labels)
            && (self.fields.is_empty()
                || self
                    .fields
                    .matches(ns, name, || serde_json::from_slice(&s.json).ok()))
    }
}

/// One page of a LIST, borrowed from the store while its lock is held: each item's bytes in
/// the requested encoding, and the list metadata. Encoding the body from borrowed slices
/// (rather than a reference-counted copy per item) spares 230,000 atomic increments and their
/// cache misses per 100,000-Service list, which the repair bench pays for on the same 2 cores.
struct ListPage<'a> {
    items: Vec<&'a [u8]>,
    /// `resourceVersion`, and `continue` and `remainingItemCount` when cut short.
    meta: Value,
}

/// LIST in JSON: the body is assembled from stored bytes without re-serializing objects.
fn list(
    shared: &Shared,
    res: ResIdx,
    ns: Option<&str>,
    query: &HashMap<String, String>,
) -> Result<Bytes, ApiError> {
    let def = &RESOURCES[res];
    list_page(
        shared,
        res,
        ns,
        query,
        |s| Ok(&s.json[..]),
        |page| {
            let head = format!(
                "{{\"kind\":\"{}List\",\"apiVersion\":\"{}\",\"metadata\":{},\"items\":[",
                def.kind,
                def.api_version(),
                page.meta
            );
            let total: usize =
                page.items.iter().map(|b| b.len() + 1).sum::<usize>() + head.len() + 2;
            let mut out = BytesMut::with_capacity(total);
            out.extend_from_slice(head.as_bytes());
            for (i, b) in page.items.iter().enumerate() {
                if i > 0 {
                    out.extend_from_slice(b",");
                }
                out.extend_from_slice(b);
            }
            out.extend_from_slice(b"]}");
            Ok(out.freeze())
        },
    )
}

/// LIST in protobuf, from each object's cached encoding.
fn list_protobuf(
    shared: &Shared,
    res: ResIdx,
    ns: Option<&str>,
    query: &HashMap<String, String>,
) -> Result<Bytes, ApiError> {
    let def = &RESOURCES[res];
    list_page(
        shared,
        res,
        ns,
        query,
        |s| s.protobuf(def.kind),
        |page| {
            crate::protobuf::encode_list(&def.api_version(), def.kind, &page.meta, &page.items)
                .map(Bytes::from)
                .map_err(|e| ApiError::internal(e.to_string()))
        },
    )
}

/// Selects one page of `res` and hands it to `encode`, all under the store lock so that the
/// items can be borrowed.
fn list_page(
    shared: &Shared,
    res: ResIdx,
    ns: Option<&str>,
    query: &HashMap<String, String>,
    item: impl for<'s> Fn(&'s Stored) -> Result<&'s [u8], ApiError>,
    encode: impl FnOnce(&ListPage<'_>) -> Result<Bytes, ApiError>,
) -> Result<Bytes, ApiError> {
    let sel = Selection::parse(query)?;
    let limit: usize = match query.get("limit").map(String::as_str) {
        None | Some("") | Some("0") => usize::MAX,
        Some(l) => l
            .parse()
            .map_err(|_| ApiError::bad_request(format!("invalid limit: {l:?}")))?,
    };
    let token = match query.get("continue").map(String::as_str) {
        None | Some("") => None,
        Some(c) => Some(
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(c)
                .ok()
                .and_then(|b| serde_json::from_slice::<ContinueToken>(&b).ok())
                .ok_or_else(|| ApiError::bad_request("continue key is not valid: incorrect encoded start resourceVersion (version meta.k8s.io/v1)"))?,
        ),
    };
    let mut selected: Vec<&Stored> = Vec::new();
    let mut more = false;
    let mut in_scope: Option<usize> = None;
    let unselective = sel.labels.is_empty() && sel.fields.is_empty();
    let offset = token.as_ref().map_or(0, |t| t.offset);
    let st = shared.read();
    let list_rv = match &token {
        Some(t) => {
            if t.rv < st.compacted_rv {
                return Err(ApiError::gone(
                    "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.",
                ));
            }
            t.rv
        }
        None => st.rv,
    };
    let map = &st.objects[res];
    let start_ns = token
        .as_ref()
        .map(|t| t.ns.clone())
        .or(ns.map(str::to_string))
        .unwrap_or_default();
    let start_name = token.as_ref().map(|t| t.name.clone()).unwrap_or_default();
    let start = (start_ns, start_name);
    // A continue token names the last key handed out: resume strictly after it.
    let from = match &token {
        Some(_) => std::ops::Bound::Excluded(&start),
        None => std::ops::Bound::Included(&start),
    };
    let mut last: Option<&(String, String)> = None;
    for (key, s) in map.range::<(String, String), _>((from, std::ops::Bound::Unbounded)) {
        if let Some(ns) = ns
            && key.0 != ns
        {
            break;
        }
        if !sel.matches(&key.0, &key.1, s) {
            continue;
        }
        if selected.len() >= limit {
            more = true;
            break;
        }
        selected.push(s);
        last = Some(key);
    }
    if more && unselective {
        // Counted only when a page is cut short, and then without selectors (as
        // kube-apiserver, which omits the count for selective lists). Not a consistent
        // snapshot: objects created or deleted during the list make it an estimate, which
        // the API allows.
        in_scope = Some(match ns {
            None => map.len(),
            Some(ns) => map
                .range((ns.to_string(), String::new())..)
                .take_while(|(k, _)| k.0 == ns)
                .count(),
        });
    }
    // Only now is each item's encoding looked up: the walk above stays inside the map's
    // nodes, and this short loop lets the cache misses of different items overlap.
    let items = selected
        .into_iter()
        .map(&item)
        .collect::<Result<Vec<_>, _>>()?;
    let mut meta = json!({"resourceVersion": list_rv.to_string()});
    if more && let Some((last_ns, last_name)) = last {
        let handed_out = offset + items.len() as u64;
        let token = ContinueToken {
            rv: list_rv,
            ns: last_ns.clone(),
            name: last_name.clone(),
            offset: handed_out,
        };
        let encoded = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(serde_json::to_vec(&token).unwrap_or_default());
        meta["continue"] = json!(encoded);
        if let Some(in_scope) = in_scope {
            meta["remainingItemCount"] = json!((in_scope as u64).saturating_sub(handed_out));
        }
    }
    encode(&ListPage { items, meta })
}

fn delete_collection(
    shared: &Arc<Shared>,
    res: ResIdx,
    ns: &str,
    query: &HashMap<String, String>,
    dry_run: bool,
) -> Result<Response<Body>, ApiError> {
    let sel = Selection::parse(query)?;
    let names: Vec<String> = {
        let st = shared.read();
        st.objects[crate::convert::storage_idx(res)]
            .range((ns.to_string(), String::new())..)
            .take_while(|((n, _), _)| n == ns)
            .filter(|((n, name), s)| sel.matches(n, name, s))
            .map(|((_, name), _)| name.clone())
            .collect()
    };
    let mut items = Vec::new();
    for name in names {
        match shared.delete(res, ns, &name, None, dry_run) {
            Ok(b) => items.push(Bytes::from(crate::convert::bytes_from_storage(res, &b))),
            Err(e) if e.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    let def = &RESOURCES[res];
    let mut out = BytesMut::new();
    out.extend_from_slice(
        format!(
            "{{\"kind\":\"{}List\",\"apiVersion\":\"{}\",\"metadata\":{{\"resourceVersion\":\"{}\"}},\"items\":[",
            def.kind,
            def.api_version(),
            shared.current_rv()
        )
        .as_bytes(),
    );
    for (i, b) in items.iter().enumerate() {
        if i > 0 {
            out.extend_from_slice(b",");
        }
        out.extend_from_slice(b);
    }
    out.extend_from_slice(b"]}");
    Ok(json_response(200, out.freeze()))
}

fn watch_line(kind: &str, object: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(object.len() + 32);
    b.extend_from_slice(b"{\"type\":\"");
    b.extend_from_slice(kind.as_bytes());
    b.extend_from_slice(b"\",\"object\":");
    b.extend_from_slice(object);
    b.extend_from_slice(b"}\n");
    b.freeze()
}

fn bookmark_line(res: ResIdx, rv: u64, initial_end: bool) -> Bytes {
    let def = &RESOURCES[res];
    let mut meta = json!({"resourceVersion": rv.to_string(), "creationTimestamp": null});
    if initial_end {
        meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    let obj = json!({"kind": def.kind, "apiVersion": def.api_version(), "metadata": meta});
    watch_line("BOOKMARK", &serde_json::to_vec(&obj).unwrap_or_default())
}

fn gone_line(requested: u64, oldest: u64) -> Bytes {
    let status =
        ApiError::gone(format!("too old resource version: {requested} ({oldest})")).to_status();
    watch_line("ERROR", &serde_json::to_vec(&status).unwrap_or_default())
}

/// How an event looks through a selector: kube-apiserver's watch cache turns an update that
/// enters or leaves the selection into ADDED or DELETED.
fn filter_event(ev: &WatchEvent, ns: Option<&str>, sel: &Selection) -> Option<&'static str> {
    if let Some(ns) = ns
        && ev.ns != ns
    {
        return None;
    }
    let now = sel.labels.matches(&ev.labels)
        && (sel.fields.is_empty()
            || sel
                .fields
                .matches(&ev.ns, &ev.name, || serde_json::from_slice(&ev.json).ok()));
    let before = match (&ev.prev_labels, &ev.prev_json) {
        (Some(l), Some(j)) => {
            sel.labels.matches(l)
                && (sel.fields.is_empty()
                    || sel
                        .fields
                        .matches(&ev.ns, &ev.name, || serde_json::from_slice(j).ok()))
        }
        _ => false,
    };
    match ev.kind {
        EventType::Added => now.then_some("ADDED"),
        EventType::Deleted => before.then_some("DELETED"),
        EventType::Modified => match (before, now) {
            (true, true) => Some("MODIFIED"),
            (false, true) => Some("ADDED"),
            (true, false) => Some("DELETED"),
            (false, false) => None,
        },
    }
}

fn watch(
    ctx: &Arc<Ctx>,
    res: ResIdx,
    ns: Option<String>,
    query: &HashMap<String, String>,
    faults: Vec<FaultKind>,
    as_table: bool,
) -> Result<Response<Body>, ApiError> {
    let api_res = res;
    let res = crate::convert::storage_idx(api_res);
    let render = move |kind: &str, obj: &[u8]| {
        let converted;
        let obj = if res == api_res {
            obj
        } else {
            converted = crate::convert::bytes_from_storage(api_res, obj);
            &converted[..]
        };
        if as_table {
            watch_line(kind, &table_event_object(api_res, obj))
        } else {
            watch_line(kind, obj)
        }
    };
    let sel = Selection::parse(query)?;
    let bookmarks = truthy(query, "allowWatchBookmarks");
    let send_initial = truthy(query, "sendInitialEvents");
    let timeout = query
        .get("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .filter(|t| *t > 0)
        .map(|t| Duration::from_secs(t.min(86_400)));
    let requested_rv: Option<u64> = match query.get("resourceVersion").map(String::as_str) {
        None | Some("") | Some("0") => None,
        Some(v) => Some(
            v.parse()
                .map_err(|_| ApiError::bad_request(format!("invalid resource version: {v:?}")))?,
        ),
    };
    let mut cut_after_events: Option<u64> = None;
    let mut cut_after: Option<Duration> = None;
    let mut gone = false;
    let mut undecodable = false;
    let mut huge_event: Option<u64> = None;
    let mut endless_new = false;
    for f in faults {
        match f {
            FaultKind::CutWatchAfterEvents { events } => cut_after_events = Some(events),
            FaultKind::CutWatchAfter { millis } => cut_after = Some(Duration::from_millis(millis)),
            FaultKind::WatchGone => gone = true,
            FaultKind::UndecodableWatchEvent => undecodable = true,
            FaultKind::HugeWatchEvent { bytes } => huge_event = Some(bytes),
            FaultKind::EndlessNewObjects => endless_new = true,
            _ => {}
        }
    }
    let (tx, rx) = mpsc::channel::<Bytes>(256);
    let shared = Arc::clone(&ctx.shared);
    let cancel = Ctx::current(&ctx.watch_epoch);
    let mut rv_rx = shared.rv_tx.subscribe();
    // Snapshot under the lock so no event is missed between the initial state and the stream.
    let (mut last, initial, early_gone): (u64, Vec<Bytes>, Option<Bytes>) = {
        let st = shared.read();
        if gone {
            (
                st.rv,
                Vec::new(),
                Some(gone_line(requested_rv.unwrap_or(0), st.compacted_rv)),
            )
        } else {
            match requested_rv {
                Some(rv) if send_initial || rv < st.compacted_rv => {
                    if rv < st.compacted_rv {
                        (st.rv, Vec::new(), Some(gone_line(rv, st.compacted_rv)))
                    } else {
                        (st.rv, snapshot(&st.objects[res], ns.as_deref(), &sel), None)
                    }
                }
                Some(rv) => (rv, Vec::new(), None),
                None => (st.rv, snapshot(&st.objects[res], ns.as_deref(), &sel), None),
            }
        }
    };
    rv_rx.mark_changed();
    let flood = endless_new
        .then(|| crate::flood::Flood::new(api_res, ns.as_deref(), &shared.alloc.ranges, last));
    let guard = WatchGuard::new(Arc::clone(&ctx.open_watches), api_res);
    tokio::spawn(async move {
        let _guard = guard;
        if let Some(line) = early_gone {
            let _ = tx.send(line).await;
            return;
        }
        if undecodable {
            let _ = tx
                .send(Bytes::from_static(
                    b"{\"type\":\"ADDED\",\"object\":\"x\"}\n",
                ))
                .await;
            return;
        }
        if let Some(bytes) = huge_event {
            send_huge_event(&tx, bytes).await;
            return;
        }
        if let Some(flood) = flood {
            flood.stream(tx, cancel).await;
            return;
        }
        let mut sent: u64 = 0;
        for obj in initial {
            if tx.send(render("ADDED", &obj)).await.is_err() {
                return;
            }
            sent += 1;
            if cut_after_events.is_some_and(|n| sent >= n) {
                return;
            }
        }
        if send_initial && bookmarks && tx.send(bookmark_line(api_res, last, true)).await.is_err() {
            return;
        }
        let deadline = tokio::time::Instant::now()
            + [timeout, cut_after]
                .into_iter()
                .flatten()
                .min()
                .unwrap_or(Duration::from_secs(365 * 24 * 3600));
        let mut bookmark_tick = tokio::time::interval(shared.bookmark_interval);
        bookmark_tick.tick().await;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tx.closed() => return,
                _ = tokio::time::sleep_until(deadline) => return,
                _ = bookmark_tick.tick(), if bookmarks => {
                    if tx.send(bookmark_line(api_res, last, false)).await.is_err() {
                        return;
                    }
                }
                changed = rv_rx.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let (events, head) = {
                        let st = shared.read();
                        (st.events_after(last), st.rv)
                    };
                    let Some(events) = events else {
                        let oldest = shared.read().compacted_rv;
                        let _ = tx.send(gone_line(last, oldest)).await;
                        return;
                    };
                    for ev in events {
                        last = ev.rv;
                        if ev.res != res {
                            continue;
                        }
                        if let Some(kind) = filter_event(&ev, ns.as_deref(), &sel) {
                            if tx.send(render(kind, &ev.json)).await.is_err() {
                                return;
                            }
                            sent += 1;
                            if cut_after_events.is_some_and(|n| sent >= n) {
                                return;
                            }
                        }
                    }
                    last = last.max(head);
                }
            }
        }
    });
    let mut r = Response::new(ChannelBody(rx).boxed_unsync());
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    Ok(r)
}

fn snapshot(
    map: &std::collections::BTreeMap<(String, String), Stored>,
    ns: Option<&str>,
    sel: &Selection,
) -> Vec<Bytes> {
    let start = (ns.unwrap_or("").to_string(), String::new());
    map.range(start..)
        .take_while(|((n, _), _)| ns.is_none_or(|ns| n == ns))
        .filter(|((n, name), s)| sel.matches(n, name, s))
        .map(|(_, s)| s.json.clone())
        .collect()
}

/// The `/sim/...` admin API (see the crate README for the JSON shapes).
async fn admin(
    ctx: &Arc<Ctx>,
    req: Request<Incoming>,
    rest: &str,
    query: &HashMap<String, String>,
) -> Response<Body> {
    let method = req.method().clone();
    let segs: Vec<&str> = rest
        .trim_end_matches('/')
        .split('/')
        .filter(|s| !s.is_empty())
        .collect();
    let shared = &ctx.shared;
    let res: Result<Response<Body>, ApiError> = async {
        match (method.as_str(), segs.as_slice()) {
            ("GET", ["requests"]) => Ok(value_response(200, &json!(ctx.requests.snapshot()))),
            ("DELETE", ["requests"]) => {
                ctx.requests.clear();
                Ok(value_response(200, &json!({})))
            }
            ("GET", ["faults"]) => Ok(value_response(200, &json!(shared.faults.rules()))),
            ("POST", ["faults"]) => {
                let body = read_json(req).await?;
                let rule: FaultRule = serde_json::from_value(body)
                    .map_err(|e| ApiError::bad_request(format!("invalid fault rule: {e}")))?;
                shared.faults.inject(rule);
                Ok(value_response(201, &json!(shared.faults.rules())))
            }
            ("DELETE", ["faults"]) => {
                shared.faults.clear();
                Ok(value_response(200, &json!([])))
            }
            ("GET", ["ready"]) => Ok(value_response(200, &json!({"ready": shared.is_ready()}))),
            ("PUT" | "POST", ["ready"]) => {
                let body = read_json(req).await?;
                let ready = body
                    .get("ready")
                    .and_then(Value::as_bool)
                    .ok_or_else(|| ApiError::bad_request("expected {\"ready\": true|false}"))?;
                shared
                    .ready
                    .store(ready, std::sync::atomic::Ordering::SeqCst);
                Ok(value_response(200, &json!({"ready": ready})))
            }
            ("PUT" | "POST", ["backdoor"]) => {
                let body = read_json(req).await?;
                shared.backdoor_put(body).map(|b| json_response(200, b))
            }
            ("GET" | "DELETE", ["backdoor", resource, more @ ..]) => {
                let idx = resources::find_by_name(resource).ok_or_else(|| {
                    ApiError::bad_request(format!("backdoor: unknown resource {resource:?}"))
                })?;
                let (ns, name) = match more {
                    [name] => ("", *name),
                    [ns, name] => (*ns, *name),
                    _ => {
                        return Err(ApiError::bad_request(
                            "backdoor path: /sim/backdoor/RESOURCE[/NAMESPACE]/NAME",
                        ));
                    }
                };
                if method == Method::GET {
                    shared.get(idx, ns, name).map(|b| json_response(200, b))
                } else {
                    match shared.backdoor_delete(idx, ns, name)? {
                        Some(b) => Ok(json_response(200, b)),
                        None => Err(ApiError::not_found(&RESOURCES[idx], name)),
                    }
                }
            }
            ("POST", ["close-watches"]) => {
                ctx.close_watches();
                Ok(value_response(200, &json!({})))
            }
            ("POST", ["drop-connections"]) => {
                ctx.drop_connections();
                Ok(value_response(200, &json!({})))
            }
            ("GET", ["watches"]) => {
                let counts: serde_json::Map<String, Value> = RESOURCES
                    .iter()
                    .zip(ctx.open_watches.iter())
                    .map(|(d, c)| {
                        (
                            d.qualified(),
                            json!(c.load(std::sync::atomic::Ordering::SeqCst)),
                        )
                    })
                    .collect();
                Ok(value_response(200, &Value::Object(counts)))
            }
            ("GET", ["rv"]) => Ok(value_response(
                200,
                &json!({"resourceVersion": shared.current_rv().to_string()}),
            )),
            _ => {
                let _ = query;
                Err(not_found_path())
            }
        }
    }
    .await;
    res.unwrap_or_else(|e| error_response(&e))
}

/// Accepts connections until `ctx.cancel` fires.
pub async fn serve(
    listener: tokio::net::TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    ctx: Arc<Ctx>,
) {
    loop {
        let accepted = tokio::select! {
            _ = ctx.cancel.cancelled() => return,
            a = listener.accept() => a,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let ctx = Arc::clone(&ctx);
        let tls = tls.clone();
        tokio::spawn(async move {
            let cancel = Ctx::current(&ctx.conn_epoch);
            match tls {
                Some(acceptor) => {
                    let tls_stream = tokio::select! {
                        _ = cancel.cancelled() => return,
                        s = acceptor.accept(stream) => match s {
                            Ok(s) => s,
                            Err(e) => {
                                tracing::debug!(error = %e, "TLS handshake failed");
                                return;
                            }
                        },
                    };
                    serve_connection(tls_stream, ctx, cancel).await;
                }
                None => serve_connection(stream, ctx, cancel).await,
            }
        });
    }
}

/// Serves one accepted (and, over TLS, handshaken) connection with `ctx` until it ends or
/// `cancel` fires.
async fn serve_connection<S>(stream: S, ctx: Arc<Ctx>, cancel: CancellationToken)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    ctx.connections
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let svc = hyper::service::service_fn(move |req| handle(Arc::clone(&ctx), req));
    // HTTP/1.1 or h2, whichever the client speaks (over TLS, what ALPN chose).
    let builder =
        hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
    let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
    tokio::select! {
        _ = cancel.cancelled() => {}
        r = conn => if let Err(e) = r { tracing::debug!(error = %e, "connection ended") },
    }
}

/// The simulators behind one shared TLS listener, by the server name (SNI) their clients send.
pub type Routes = Arc<std::sync::RwLock<HashMap<String, Arc<Ctx>>>>;

/// One TLS listener for many simulators: each connection goes to the simulator its ClientHello
/// names (SNI); a connection naming none, or one that is unknown or stopped, is closed before
/// the handshake completes. Ends when `cancel` fires.
pub async fn serve_shared(
    listener: tokio::net::TcpListener,
    config: Arc<rustls::ServerConfig>,
    routes: Routes,
    cancel: CancellationToken,
) {
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => return,
            a = listener.accept() => a,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let routes = Arc::clone(&routes);
        let config = Arc::clone(&config);
        let cancel = cancel.clone();
        tokio::spawn(async move {
            let acceptor =
                tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), stream);
            let start = tokio::select! {
                _ = cancel.cancelled() => return,
                s = acceptor => match s {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::debug!(error = %e, "TLS ClientHello unreadable");
                        return;
                    }
                },
            };
            let name = start.client_hello().server_name().map(str::to_owned);
            let ctx = name.as_deref().and_then(|n| {
                routes
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(n)
                    .cloned()
            });
            let Some(ctx) = ctx.filter(|c| !c.cancel.is_cancelled()) else {
                tracing::debug!(server_name = ?name, "no simulator by that server name");
                return;
            };
            let conn_cancel = Ctx::current(&ctx.conn_epoch);
            let tls_stream = tokio::select! {
                _ = conn_cancel.cancelled() => return,
                s = start.into_stream(config) => match s {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::debug!(error = %e, "TLS handshake failed");
                        return;
                    }
                },
            };
            serve_connection(tls_stream, ctx, conn_cancel).await;
        });
    }
}
