#!/usr/bin/env python3
"""Pools the `pairs (pass/floor ms, in order): ...` lines of several clusterip_repair bench runs
and prints, per transport and role, the median pass/floor ratio over all pairs, over the pairs
measured with every CPU at full speed, and over the pairs whose floor ran fast.

Each virtual CPU of this kind of VM runs at full speed or at about half of it, for seconds at a
time and independently of the other. The floor (JSON-decoding the LIST bodies) is one thread;
the pass uses both CPUs and shares them with the simulator. The bench probes each CPU's speed
around every pair (`probes (fastest/slowest CPU ms ...)` lines); a pair counts as at full speed
when its slowest probe is within `--full-speed` of the full-speed level (the 10th percentile of
the pairs' fastest probes in the whole file), and as slower when even its fastest probe is not. Pairs
selected by a fast floor alone (the older view, `--fast-ip`/`--fast-audit`) include pairs whose
floor ran on a fast CPU while the other CPU was slow, which penalises the pass.

usage: for i in 1 2 3; do for p in 1 0; do echo "plain=$p"; BENCH_PLAIN_HTTP=$p <bench binary> \
           --sizes 100000 --roles ipaddress-fresh,audit-fresh 2>&1; done; done > runs.txt
       benches/paired-ratios.py runs.txt [--fast-ip MS] [--fast-audit MS] [--full-speed F]
The `plain=` lines tell the transport; without them everything counts as one transport.
--fast-ip/--fast-audit: the floor (ms) below which a pair counts as having a fast floor
(defaults 100 and 70: the normal floors measured here at 100,000 Services were 83 and 58 ms;
at 10,000 use 10 and 7).
--full-speed: how much slower than the full-speed level a probe may be and still count as full
speed (default 1.3: the readings here cluster at 0.20 - 0.28 and 0.32 - 0.50 ms).

Each median comes with a 95 % interval from a bootstrap over runs: the runs (each the 10 pairs of
one result row) are drawn with replacement, and the median of their pairs taken, 2,000 times.
Runs, not pairs, are drawn because pairs of one run share the VM's state: two batches of the
same build have differed by more than the pairs alone would suggest.
"""
import argparse
import random
import re
import statistics

RESAMPLES = 2000


def interval(runs):
    """95 % bootstrap interval of the median ratio, drawing whole runs (lists of ratios)."""
    runs = [run for run in runs if run]
    if len(runs) < 2:
        return "one run: no interval"
    draw = random.Random(0)
    medians = sorted(
        statistics.median([r for run in draw.choices(runs, k=len(runs)) for r in run])
        for _ in range(RESAMPLES)
    )
    return f"95 % interval {medians[RESAMPLES // 40]:.2f} - {medians[RESAMPLES - 1 - RESAMPLES // 40]:.2f}x over {len(runs)} runs"


def summary(runs):
    """`runs`: the ratios of each run."""
    ratios = sorted(r for run in runs for r in run)
    return (
        f"median {statistics.median(ratios):.2f}x ({interval(runs)}),"
        f" 3rd quartile {ratios[(3 * len(ratios)) // 4]:.2f}x"
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("runs")
    parser.add_argument("--fast-ip", type=float, default=100.0)
    parser.add_argument("--fast-audit", type=float, default=70.0)
    parser.add_argument("--full-speed", type=float, default=1.3)
    args = parser.parse_args()
    # (transport, role) -> [(pass, floor, fastest probe or None, slowest probe or None)]
    pooled = {}
    transport, role, last, run = "?", None, None, 0
    with open(args.runs) as runs:
        for line in runs:
            if m := re.match(r"plain=(\d)", line):
                transport = "plain HTTP" if m.group(1) == "1" else "HTTPS"
            elif "pairs (pass/floor ms" in line:
                if role is None:
                    raise SystemExit(f"pairs before any result row: {line.strip()}")
                pairs = [tuple(map(float, p.split("/"))) for p in line.split(":", 1)[1].split()]
                run += 1
                last = [[p, f, None, None, run] for p, f in pairs]
                pooled.setdefault((transport, role), []).extend(last)
            elif "probes (fastest/slowest CPU ms" in line:
                probes = [tuple(map(float, p.split("/"))) for p in line.split(":", 1)[1].split()]
                if last is None or len(probes) != len(last):
                    raise SystemExit(f"probes without their pairs: {line.strip()}")
                for pair, (fastest, slowest) in zip(last, probes):
                    pair[2], pair[3] = fastest, slowest
                last = None
            elif m := re.search(r"\b(ipaddress-fresh|audit-fresh)\b", line):
                role = m.group(1)
    if not pooled:
        raise SystemExit("no pairs found")
    # The probes are bimodal (here about 0.22 and 0.40 ms); the 10th percentile of the fastest
    # readings is the full-speed level, robust to an odd low reading.
    probed = sorted(p[2] for pairs in pooled.values() for p in pairs if p[2] is not None)
    full_speed = probed[len(probed) // 10] * args.full_speed if probed else None
    def by_run(selected):
        """The ratios of `selected` pairs, grouped by the run they came from."""
        runs = {}
        for p, f, _, _, run in selected:
            runs.setdefault(run, []).append(p / f)
        return list(runs.values())

    for (transport, role), pairs in sorted(pooled.items()):
        fast_floor = args.fast_ip if role.startswith("ipaddress") else args.fast_audit
        line = (
            f"{transport:10} {role:15} {len(pairs):3} pairs: {summary(by_run(pairs))}"
            f" (pass {statistics.median(p[0] for p in pairs):.0f} ms)"
        )
        if full_speed is not None:
            full = [p for p in pairs if p[3] is not None and p[3] <= full_speed]
            if full:
                line += (
                    f"; {len(full)} with every CPU at full speed: {summary(by_run(full))}"
                    f" (pass {statistics.median(p[0] for p in full):.0f} ms,"
                    f" floor {statistics.median(p[1] for p in full):.0f} ms)"
                )
            else:
                line += "; none with every CPU at full speed"
            slow = [p for p in pairs if p[2] is not None and p[2] > full_speed]
            if slow:
                line += (
                    f"; {len(slow)} with every CPU slower: {summary(by_run(slow))}"
                    f" (pass {statistics.median(p[0] for p in slow):.0f} ms,"
                    f" floor {statistics.median(p[1] for p in slow):.0f} ms)"
                )
        fast = [p for p in pairs if p[1] < fast_floor]
        if fast:
            line += f"; {len(fast)} with the floor under {fast_floor:.0f} ms: {summary(by_run(fast))}"
        print(line)


if __name__ == "__main__":
    main()
