#!/usr/bin/env python3
"""What the controller's heap holds at one moment, from a heaptrack recording.

heaptrack_print reports the peak and what is still allocated at exit; the controller frees its
tenants when it is stopped, so neither is a fleet at rest. This replays the recording's
allocations and frees up to a given time and sums what is live then, by kind (the first kind
whose pattern matches a frame of the allocation's stack) and by call site.

Record (the bench stops the controller with SIGTERM, so the recording is complete):

    cat > /tmp/ht.sh <<'EOF'
    #!/bin/sh
    export LD_PRELOAD=/usr/lib/heaptrack/libheaptrack_preload.so
    export DUMP_HEAPTRACK_OUTPUT=/tmp/ht.raw
    exec "$CONTROLLER" "$@"
    EOF
    chmod +x /tmp/ht.sh
    CONTROLLER=$PWD/target/debug/bootstrap-controller cargo bench -p e2e --bench multi_tenant \\
        -- --tenants 300 --rest-secs 20 --heal-trials 0 --controller /tmp/ht.sh
    /usr/lib/heaptrack/libexec/heaptrack_interpret < /tmp/ht.raw > /tmp/ht.int

Then `python3 e2e/benches/heap_live.py /tmp/ht.int MILLISECONDS TENANTS [SITES]`, a time within
the fleet's rest (the bench prints when it converged), the fleet's size, and how many call
sites to list (default 0).
"""

import collections
import re
import sys

# Kinds, first match wins; None is the watch line buffer, told by two frames.
KINDS = [
    ("watch line buffer (tokio-util FramedRead in kube's request_events, 8 KiB a stream)", None),
    ("TLS session cache (rustls)", r"LimitedCache|ClientSessionMemoryCache"),
    ("caches (watch caches' objects and records)",
     r"reconcilers::watch_cache::StoreState|watch_cache\.\.Lenient|service_cache"),
    ("events (kube Recorder)", r"kube_runtime::events|reconcilers::events"),
    ("metrics (the tenant's registry)",
     r"prometheus_client|bootstrap_controller::metrics|reconcilers::metrics"),
    ("tracing spans", r"tracing_subscriber|sharded_slab"),
    ("kube Client's request queue (tower Buffer)", r"tower::buffer"),
    ("HTTP/2 connection (h2 codec buffers, hyper's dispatch channel, stream slabs)",
     r"^h2::|hyper::proto::h2|hyper::client::conn::http2|_\$LT\$h2\.\."),
    ("TLS connection (rustls buffers, keys)", r"rustls"),
    ("watch streams (the list+watch's state, its boxed futures)",
     r"reconcilers::budget|reconcilers::list_watch"),
    ("tasks (spawned futures)", r"RawTask::new"),
]

NOISE = re.compile(
    r"^(alloc::|core::|std::|__rust|hashbrown::|bytes::|tokio::util|tokio::loom|_\$LT\$alloc|"
    r"_\$LT\$core|_\$LT\$std|_\$LT\$hashbrown|_\$LT\$bytes|\?|malloc|realloc|calloc|_R|$)"
)


def main():
    path, until, tenants = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    sites_wanted = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    strings, ips, traces, allocs = [""], [0], [(0, 0)], []
    live = collections.Counter()
    now = 0
    with open(path, errors="replace") as recording:
        for line in recording:
            kind = line[:1]
            if kind == "+":
                live[int(line[2:], 16)] += 1
            elif kind == "-":
                live[int(line[2:], 16)] -= 1
            elif kind == "a":
                size, trace = line.split()[1:3]
                allocs.append((int(size, 16), int(trace, 16)))
            elif kind == "c":
                now = int(line[2:], 16)
                if now >= until:
                    break
            elif kind == "s":
                strings.append(line.rstrip("\n").split(" ", 2)[2])
            elif kind == "i":
                fields = line.split()
                ips.append(int(fields[3], 16) if len(fields) > 3 else 0)
            elif kind == "t":
                ip, parent = line.split()[1:3]
                traces.append((int(ip, 16), int(parent, 16)))

    def frames(trace):
        out = []
        while trace:
            ip, trace = traces[trace]
            out.append(strings[ips[ip]] if ips[ip] < len(strings) else "?")
        return out

    by_kind, by_site, total = collections.Counter(), collections.Counter(), 0
    for index, count in live.items():
        if count <= 0:
            continue
        size, trace = allocs[index]
        bytes_live = size * count
        total += bytes_live
        stack = frames(trace)
        found = "other"
        for name, pattern in KINDS:
            if pattern is None:
                if any("FramedRead" in f and "::new" in f for f in stack) and any(
                    "request_events" in f for f in stack
                ):
                    found = name
                    break
            elif any(re.search(pattern, f) for f in stack):
                found = name
                break
        by_kind[found] += bytes_live
        site = [f for f in stack if not NOISE.search(f)][:2]
        by_site[" <- ".join(f[:90] for f in site)] += bytes_live

    print(f"live at {now} ms: {total / 2**20:.2f} MiB, {total / tenants / 1024:.1f} KiB a tenant")
    print("| what | KiB a tenant |\n|---|---:|")
    for name, bytes_live in by_kind.most_common():
        print(f"| {name} | {bytes_live / tenants / 1024:.1f} |")
    for site, bytes_live in by_site.most_common(sites_wanted):
        print(f"{bytes_live / tenants / 1024:7.1f} KiB  {site}")


if __name__ == "__main__":
    main()
