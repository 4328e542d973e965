//! One NodePort repair scan over a Service cache of 100,000 Services, 2,768 of them holding every
//! port of the default range (30000-32767): the work of a pass in API-only mode, without I/O.
//! Prints the pass times and the process's peak resident memory.
//!
//! `cargo bench -p bootstrap-reconcilers --bench nodeport_pass -- [--services N] [--passes N]`

use std::time::{Duration, Instant};

use reconcilers::alloc::PortRange;
use reconcilers::findings::ReportOnce;
use reconcilers::nodeport_repair::plan::scan;
use reconcilers::service_cache::record::{ClusterIp, Protocol, ServiceRecord, Token};

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|line| line.starts_with("VmHWM:"))
                .and_then(|line| line.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kib| kib / 1024.0)
}

fn main() {
    let services = arg("--services", 100_000);
    let passes = arg("--passes", 30);
    let range = PortRange::default();
    let records: Vec<ServiceRecord> = (0..services)
        .map(|i| {
            let node_ports = if i < range.size() {
                let port = i32::from(range.base()) + i32::try_from(i).unwrap_or(0);
                vec![(port, Protocol::Tcp)].into_boxed_slice()
            } else {
                Box::default()
            };
            ServiceRecord {
                namespace: format!("ns-{}", i % 1000).into(),
                name: format!("svc-{i}").into(),
                uid: Token::new(&format!("00000000-0000-4000-8000-{i:012}")),
                resource_version: 1,
                cluster_ips: [ClusterIp::parse(&format!(
                    "10.{}.{}.{}",
                    96 + i / 65_536,
                    (i / 256) % 256,
                    i % 256
                ))]
                .into_iter()
                .collect(),
                node_ports,
                health_check_node_port: 0,
                created: None,
            }
        })
        .collect();
    let reported = ReportOnce::new();
    let mut times: Vec<Duration> = Vec::with_capacity(passes);
    let mut findings = 0;
    for _ in 0..passes {
        let started = Instant::now();
        let result = scan(records.iter(), range);
        reported.update(result.findings.iter().cloned());
        times.push(started.elapsed());
        findings = result.findings.len();
        assert_eq!(result.in_use.count_ones(..), range.size().min(services));
    }
    times.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "nodeport scan: {services} Services, {} holding node ports, {findings} findings, {passes} passes: median {:.2} ms, max {:.2} ms; peak RSS {:.1} MiB",
        range.size().min(services),
        ms(times[times.len() / 2]),
        ms(times[times.len() - 1]),
        peak_rss_mib()
    );
}
