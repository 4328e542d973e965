//! What a tenant's API server can make the process hold before anything reads it: a TLS server
//! on loopback speaking HTTP/2 answers every request with a body without end, written as fast
//! as the client's flow-control windows let it, and counts what it was let write while the
//! client holds the responses and reads nothing of them.
#![allow(clippy::unwrap_used)]

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use bootstrap_controller::client::{ReadAhead, builder_reading_ahead};
use bootstrap_controller::limits::Limits;
use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{CertificateParams, KeyPair, SanType};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

const CHUNK: usize = 16 * 1024;

/// Serves HTTP/2 over TLS on loopback; every answer a body of `chunk`-byte frames without end.
/// Returns the URL, the server's certificate (DER) and the bytes the server was let write.
async fn serve_endless(chunk: usize) -> Result<(String, Vec<u8>, Arc<AtomicUsize>)> {
    serve(chunk, usize::MAX).await
}

/// [`serve_endless`], every body ending after `frames` frames.
async fn serve(chunk: usize, frames: usize) -> Result<(String, Vec<u8>, Arc<AtomicUsize>)> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(vec!["localhost".to_owned()])?;
    params
        .subject_alt_names
        .push(SanType::IpAddress("127.0.0.1".parse()?));
    let cert = params.self_signed(&key)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(
            vec![CertificateDer::from(cert.der().to_vec())],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("https://{}", listener.local_addr()?);
    let written = Arc::new(AtomicUsize::new(0));
    let counter = written.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let counter = counter.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = hyper::service::service_fn(move |_request| {
                    let counter = counter.clone();
                    // hyper asks the body for a frame only once the stream has window for it.
                    let frames = futures::stream::repeat_with(move || {
                        counter.fetch_add(chunk, Ordering::AcqRel);
                        Ok::<_, Infallible>(Frame::data(Bytes::from(vec![b'x'; chunk])))
                    })
                    .take(frames);
                    async move { Ok::<_, Infallible>(http::Response::new(StreamBody::new(frames))) }
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    Ok((url, cert.der().to_vec(), written))
}

fn config(url: &str, ca: Vec<u8>) -> Result<kube::Config> {
    let mut config = kube::Config::new(url.parse()?);
    config.root_cert = Some(vec![ca]);
    Ok(config)
}

fn get(path: &str) -> Result<http::Request<kube::client::Body>> {
    Ok(http::Request::get(path).body(Vec::new().into())?)
}

/// What the server was let write while a client built with `read_ahead` holds `streams`
/// responses on its one connection and reads none of them: counted once it stops growing.
async fn written_ahead(read_ahead: Option<ReadAhead>, streams: usize) -> Result<usize> {
    let (url, ca, written) = serve_endless(CHUNK).await?;
    let client = builder_reading_ahead(&config(&url, ca)?, read_ahead)?.build();
    let mut held = Vec::new();
    for stream in 0..streams {
        let response = client.send(get(&format!("/api/v1/s{stream}"))?).await?;
        ensure!(response.status() == http::StatusCode::OK, "{response:?}");
        held.push(response);
    }
    let last = settled(&written).await?;
    drop(held);
    Ok(last)
}

/// The count of `written` once it stops growing.
async fn settled(written: &AtomicUsize) -> Result<usize> {
    let mut last = usize::MAX;
    let mut unchanged = 0;
    // Settled once five looks 100 ms apart see the same count (the loopback server writes a
    // window in far less); the count is bounded by the windows however long it is watched.
    for _ in 0..600 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = written.load(Ordering::Acquire);
        unchanged = if now == last { unchanged + 1 } else { 0 };
        last = now;
        if unchanged == 5 {
            break;
        }
    }
    ensure!(
        unchanged == 5,
        "the server never stopped writing ({last} bytes)"
    );
    Ok(last)
}

#[tokio::test]
async fn a_tenant_server_writes_at_most_the_tenant_windows_ahead_of_the_reader() -> Result<()> {
    let stream_window = usize::try_from(ReadAhead::TENANT.h2_stream_window)?;
    let connection_window = usize::try_from(ReadAhead::TENANT.h2_connection_window)?;
    // One response: its stream's window, and the frame the server had in hand when it ran out.
    let one = written_ahead(Some(ReadAhead::TENANT), 1).await?;
    ensure!(
        one <= stream_window + CHUNK,
        "the server wrote {one} bytes ahead of one tenant response, over its {stream_window}-byte \
         window"
    );
    // Four responses on the connection: the connection's window, however many streams.
    let four = written_ahead(Some(ReadAhead::TENANT), 4).await?;
    ensure!(
        four <= connection_window + 4 * CHUNK,
        "the server wrote {four} bytes ahead of four tenant responses, over the connection's \
         {connection_window}-byte window"
    );
    ensure!(
        four > stream_window + CHUNK,
        "four streams were let no more than one ({four} bytes): the test shows nothing of the \
         connection's window"
    );
    // hyper's defaults (the management cluster's client) let it write its 2 MiB stream window:
    // what the tenant windows save.
    let default = written_ahead(None, 1).await.context("hyper's defaults")?;
    ensure!(
        default >= 2 * 1024 * 1024,
        "with hyper's defaults the server wrote only {default} bytes ahead"
    );
    println!(
        "written ahead of the reader: tenant {one} bytes (one response), {four} (four); \
         hyper's defaults {default} (one response)"
    );
    Ok(())
}

/// A server writing one-byte frames that nobody reads spends h2's budget for the frames'
/// overhead, and h2 closes the connection: the tenant's client reports the flood as a broken
/// bound and pauses, as for its other bounds, rather than failing with a transport error and
/// asking again at once.
#[tokio::test]
async fn a_flood_of_tiny_frames_is_a_broken_bound_and_pauses_the_tenant() -> Result<()> {
    let (url, ca, written) = serve_endless(1).await?;
    let client = builder_reading_ahead(&config(&url, ca)?, Some(ReadAhead::TENANT))?
        .with_layer(&Limits::TENANT.for_one_client(None))
        .build();
    let response = client.send(get("/api/v1/namespaces")?).await?;
    ensure!(response.status() == http::StatusCode::OK, "{response:?}");
    // Unread, the frames pile up until h2 closes the connection.
    for _ in 0..600 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let before = written.load(Ordering::Acquire);
        tokio::time::sleep(Duration::from_millis(100)).await;
        if written.load(Ordering::Acquire) == before {
            break;
        }
    }
    let err = response
        .into_body()
        .collect()
        .await
        .err()
        .context("the flooded response ended without an error")?;
    let err = err.to_string();
    ensure!(
        err.contains("flooded its HTTP/2 connection") && err.contains("too_many_data_frames"),
        "the flood is not named as a broken bound: {err}"
    );
    let again = client
        .send(get("/api/v1/namespaces")?)
        .await
        .err()
        .context("a request right after the flood was sent")?
        .to_string();
    ensure!(
        again.contains("not asking the API server anything") && again.contains("flooded"),
        "the client is not paused for the flood: {again}"
    );
    Ok(())
}

/// The tenant windows cost legitimate traffic nothing. A LIST page near the bound of one
/// response, in the 2 KiB pieces Go's server writes, arrives whole through the tenant's
/// bounds. And frames of 200 bytes (a watch's smallest events, bookmarks aside) filling every
/// window while nothing reads them never spend h2's budget for small frames: each spends 56
/// bytes of it, and the 512 KiB connection window holds at most 2,621 of them, 146,776 bytes
/// against a budget of 262,144 (half the window). Any frame of 171 bytes or more is so safe
/// however slow the reader.
#[tokio::test]
async fn legitimate_traffic_fits_the_tenant_windows() -> Result<()> {
    const PIECE: usize = 2048;
    const PAGE: usize = 7 * 1024 * 1024;
    let (url, ca, _) = serve(PIECE, PAGE / PIECE).await?;
    let client = builder_reading_ahead(&config(&url, ca)?, Some(ReadAhead::TENANT))?
        .with_layer(&Limits::TENANT.for_one_client(None))
        .build();
    let response = client.send(get("/api/v1/services")?).await?;
    ensure!(response.status() == http::StatusCode::OK, "{response:?}");
    let page = response.into_body().collect().await?.to_bytes();
    ensure!(
        page.len() == PAGE,
        "the page arrived with {} bytes",
        page.len()
    );

    const EVENT: usize = 200;
    let (url, ca, written) = serve_endless(EVENT).await?;
    let client = builder_reading_ahead(&config(&url, ca)?, Some(ReadAhead::TENANT))?
        .with_layer(&Limits::TENANT.for_one_client(None))
        .build();
    let mut watches = Vec::new();
    for watch in 0..4 {
        let path = format!("/api/v1/s{watch}?watch=true");
        let response = client.send(get(&path)?).await?;
        ensure!(response.status() == http::StatusCode::OK, "{response:?}");
        watches.push(response.into_body());
    }
    let ahead = settled(&written).await?;
    let window = usize::try_from(ReadAhead::TENANT.h2_connection_window)?;
    ensure!(
        ahead >= window - 4 * EVENT,
        "the server filled only {ahead} bytes of the {window}-byte window: the test shows \
         nothing of a full one"
    );
    // h2 never closed the connection for a flood: the client would be paused, and a further
    // request would fail at once naming the flood.
    let response = client.send(get("/api/v1/namespaces")?).await?;
    ensure!(response.status() == http::StatusCode::OK, "{response:?}");
    drop(watches);
    Ok(())
}
