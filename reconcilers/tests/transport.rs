//! The LIST transport (`reconcilers::transport`): against the simulator it lists what kube's
//! client lists; against a scripted raw HTTP/1.1 server it reuses connections, replaces one the
//! server closed, and turns a body cut short or a silent server into errors, never into a
//! shorter body or a hang.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use apiserver_sim::{Sim, SimConfig};
use http_body_util::BodyExt;
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use kube::{Api, Client};
use reconcilers::clusterip_repair::model::{IpAddressRecord, ServiceRecord};
use reconcilers::clusterip_repair::reflector::{Collection, IPADDRESSES, SERVICES, list_all};
use reconcilers::transport::in_task_client;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Long enough for anything these tests wait for on a slow machine; never a timing assertion.
const DEADLINE: Duration = Duration::from_secs(30);

#[tokio::test]
async fn lists_through_the_transport_are_what_kubes_client_lists() -> Result<()> {
    let sim = Sim::start(SimConfig {
        service_cluster_ip_ranges: vec!["10.96.0.0/16".parse()?, "fd00:10:96::/108".parse()?],
        seed_namespaces: vec!["default".into()],
        ..SimConfig::default()
    })
    .await?;
    let client = sim.new_client().await?;
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    for i in 0..120 {
        let service = Service {
            metadata: ObjectMeta {
                name: Some(format!("svc-{i}")),
                ..ObjectMeta::default()
            },
            spec: Some(ServiceSpec {
                ports: Some(vec![ServicePort {
                    port: 80,
                    ..ServicePort::default()
                }]),
                ..ServiceSpec::default()
            }),
            ..Service::default()
        };
        services.create(&PostParams::default(), &service).await?;
    }
    let config = sim.kube_config().await?;
    assert!(config.cluster_url.scheme_str() == Some("https"), "over TLS");
    let transport = in_task_client(&config)?.context("the simulator's kubeconfig is covered")?;
    for protobuf in [true, false] {
        let mut collection = Collection::new(SERVICES).paged(25);
        collection.protobuf = protobuf;
        let (expected, _) = list_all::<ServiceRecord>(&client, &collection).await?;
        let (listed, _) = list_all::<ServiceRecord>(&transport, &collection).await?;
        assert_eq!(expected.len(), 120);
        assert_eq!(listed, expected, "Services, protobuf {protobuf}");
        let mut collection = Collection::new(IPADDRESSES).paged(10);
        collection.protobuf = protobuf;
        let (expected, _) = list_all::<IpAddressRecord>(&client, &collection).await?;
        let (listed, _) = list_all::<IpAddressRecord>(&transport, &collection).await?;
        assert!(expected.len() >= 120, "an IPAddress per cluster IP");
        assert_eq!(listed, expected, "IPAddresses, protobuf {protobuf}");
    }
    // Errors come back as kube's own calls make them.
    let missing: Api<Service> = Api::namespaced(transport, "default");
    match missing.get("no-such-service").await {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 404),
        other => panic!("expected a 404, got {other:?}"),
    }
    Ok(())
}

/// A raw HTTP/1.1 server: `answer` gets each accepted connection and its number (from 1).
async fn raw_server<F, Fut>(answer: F) -> Result<(Client, Arc<AtomicUsize>)>
where
    F: Fn(usize, TcpStream) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    raw_server_with(answer, |_| {}).await
}

async fn raw_server_with<F, Fut>(
    answer: F,
    configure: impl FnOnce(&mut kube::Config),
) -> Result<(Client, Arc<AtomicUsize>)>
where
    F: Fn(usize, TcpStream) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let number = counter.fetch_add(1, Ordering::SeqCst) + 1;
            tokio::spawn(answer(number, stream));
        }
    });
    let mut config = kube::Config::new(format!("http://{address}").parse()?);
    configure(&mut config);
    let client = in_task_client(&config)?.context("a plain kubeconfig is covered")?;
    Ok((client, accepted))
}

/// Reads one request's head (these tests send no bodies); false when the client closed.
async fn read_request(stream: &mut TcpStream) -> bool {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte).await {
            Ok(1) => head.push(byte[0]),
            _ => return false,
        }
    }
    true
}

const OK: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";

async fn get(client: &Client, path: &str) -> Result<String> {
    let request = http::Request::get(path).body(kube::client::Body::empty())?;
    let response = tokio::time::timeout(DEADLINE, client.send(request))
        .await
        .context("the request ended")??;
    let body = tokio::time::timeout(DEADLINE, response.into_body().collect())
        .await
        .context("the body ended")?
        .map_err(|err| anyhow::anyhow!("{err}"))?;
    Ok(String::from_utf8(body.to_bytes().to_vec())?)
}

#[tokio::test]
async fn a_connection_is_reused_once_its_body_is_read() -> Result<()> {
    let (client, accepted) = raw_server(|_, mut stream| async move {
        while read_request(&mut stream).await {
            if stream.write_all(OK).await.is_err() {
                return;
            }
        }
    })
    .await?;
    for _ in 0..3 {
        assert_eq!(get(&client, "/api/v1/services").await?, "abcde");
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "one connection for all");
    Ok(())
}

#[tokio::test]
async fn a_reused_connection_the_server_closed_is_replaced() -> Result<()> {
    // Connection 1 answers one request, then closes on the next without answering it: the
    // request went out, no answer came. Connection 2 answers one request, then closes a moment
    // later while idle, without saying so first (as servers time out idle connections).
    // Connection 3 and later answer everything.
    let (client, accepted) = raw_server(|number, mut stream| async move {
        match number {
            1 => {
                if read_request(&mut stream).await {
                    let _ = stream.write_all(OK).await;
                    read_request(&mut stream).await;
                }
            }
            2 => {
                if read_request(&mut stream).await {
                    let _ = stream.write_all(OK).await;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            _ => {
                while read_request(&mut stream).await {
                    if stream.write_all(OK).await.is_err() {
                        return;
                    }
                }
            }
        }
    })
    .await?;
    assert_eq!(get(&client, "/api/v1/services").await?, "abcde");
    // Sent on connection 1, which closes: sent again on a new one.
    assert_eq!(get(&client, "/api/v1/services").await?, "abcde");
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Connection 2 has closed by now: a third one.
    assert_eq!(get(&client, "/api/v1/services").await?, "abcde");
    assert_eq!(accepted.load(Ordering::SeqCst), 3);
    Ok(())
}

/// Only a GET or HEAD goes again: any other request may have been acted on.
#[tokio::test]
async fn other_requests_are_not_sent_twice() -> Result<()> {
    let (client, accepted) = raw_server(|number, mut stream| async move {
        if read_request(&mut stream).await {
            let _ = stream.write_all(OK).await;
            if number == 1 {
                read_request(&mut stream).await;
            }
        }
    })
    .await?;
    assert_eq!(get(&client, "/api/v1/services").await?, "abcde");
    let request = http::Request::delete("/api/v1/namespaces/default/services/a")
        .body(kube::client::Body::empty())?;
    let sent = tokio::time::timeout(DEADLINE, client.send(request)).await?;
    assert!(sent.is_err(), "{sent:?}");
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
    Ok(())
}

#[tokio::test]
async fn a_body_cut_short_is_an_error_not_a_shorter_body() -> Result<()> {
    let (client, _) = raw_server(|_, mut stream| async move {
        if read_request(&mut stream).await {
            let _ = stream
                .write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
                .await;
        }
    })
    .await?;
    let got = get(&client, "/api/v1/services").await;
    assert!(got.is_err(), "{got:?}");
    Ok(())
}

#[tokio::test]
async fn a_server_that_goes_silent_is_a_read_timeout() -> Result<()> {
    let (client, _) = raw_server_with(
        |_, mut stream| async move {
            if read_request(&mut stream).await {
                let _ = stream
                    .write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
                    .await;
                // Holds the connection open and sends nothing more.
                tokio::time::sleep(Duration::from_secs(3600)).await;
            }
        },
        |config| config.read_timeout = Some(Duration::from_millis(300)),
    )
    .await?;
    let err = get(&client, "/api/v1/services").await.unwrap_err();
    assert!(err.to_string().contains("no data from the server"), "{err}");
    Ok(())
}

#[tokio::test]
async fn a_server_that_closes_every_connection_fails_the_request() -> Result<()> {
    let (client, accepted) = raw_server(|_, stream| async move { drop(stream) }).await?;
    let got = get(&client, "/api/v1/services").await;
    assert!(got.is_err(), "{got:?}");
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "a fresh connection is not tried again"
    );
    Ok(())
}

/// kube's client retries 429, 503 and 504 answers when `default_retry` is on (the default); so
/// does this transport, and only then.
#[tokio::test]
async fn overload_answers_are_retried_as_kubes_client_retries_them() -> Result<()> {
    for default_retry in [true, false] {
        let answered = Arc::new(AtomicUsize::new(0));
        let count = answered.clone();
        let (client, _) = raw_server_with(
            move |_, mut stream| {
                let count = count.clone();
                async move {
                    while read_request(&mut stream).await {
                        let answer: &[u8] = if count.fetch_add(1, Ordering::SeqCst) == 0 {
                            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"
                        } else {
                            OK
                        };
                        if stream.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                }
            },
            |config| config.default_retry = default_retry,
        )
        .await?;
        let request = http::Request::get("/api/v1/services").body(kube::client::Body::empty())?;
        let response = tokio::time::timeout(DEADLINE, client.send(request)).await??;
        let expected = if default_retry { 200 } else { 503 };
        assert_eq!(
            response.status().as_u16(),
            expected,
            "default_retry {default_retry}"
        );
        assert_eq!(
            answered.load(Ordering::SeqCst),
            if default_retry { 2 } else { 1 }
        );
    }
    Ok(())
}

/// A server that closes the connection right after a complete answer: the connection ends while
/// the body's last frames are still on their way to the reader, and none is lost.
#[tokio::test]
async fn a_complete_answer_followed_by_a_close_is_read_whole() -> Result<()> {
    let (client, accepted) = raw_server(|_, mut stream| async move {
        if read_request(&mut stream).await {
            let _ = stream.write_all(OK).await;
        }
    })
    .await?;
    for _ in 0..20 {
        assert_eq!(get(&client, "/api/v1/services").await?, "abcde");
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 20);
    Ok(())
}
