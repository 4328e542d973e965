#!/usr/bin/env python3
"""Pools the `pairs (pass/floor ms, in order): ...` lines of several clusterip_repair bench runs
and prints, per transport and role, the median pass/floor ratio over all pairs and over the
pairs whose floor ran at the machine's normal speed.

The floor (JSON-decoding the LIST bodies, one thread) slows down on this kind of VM by up to 2x
at times, much more than the pass does, which flatters the ratio then; the pairs with a fast
floor are the fair ones.

usage: for i in 1 2 3; do for p in 1 0; do echo "plain=$p"; BENCH_PLAIN_HTTP=$p <bench binary> \
           --sizes 100000 --roles ipaddress-fresh,audit-fresh 2>&1; done; done > runs.txt
       benches/paired-ratios.py runs.txt [--fast-ip MS] [--fast-audit MS]
The `plain=` lines tell the transport; without them everything counts as one transport.
--fast-ip/--fast-audit: the floor (ms) below which a pair counts as at normal speed
(defaults 100 and 70: the normal floors measured here were 83 and 58 ms).
"""
import argparse
import re
import statistics


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("runs")
    parser.add_argument("--fast-ip", type=float, default=100.0)
    parser.add_argument("--fast-audit", type=float, default=70.0)
    args = parser.parse_args()
    pooled = {}
    transport, role = "?", None
    with open(args.runs) as runs:
        for line in runs:
            if m := re.match(r"plain=(\d)", line):
                transport = "plain HTTP" if m.group(1) == "1" else "HTTPS"
            elif "pairs (pass/floor ms" in line:
                if role is None:
                    raise SystemExit(f"pairs before any result row: {line.strip()}")
                pairs = [tuple(map(float, p.split("/"))) for p in line.split(":", 1)[1].split()]
                pooled.setdefault((transport, role), []).extend(pairs)
            elif m := re.search(r"\b(ipaddress-fresh|audit-fresh)\b", line):
                role = m.group(1)
    if not pooled:
        raise SystemExit("no pairs found")
    for (transport, role), pairs in sorted(pooled.items()):
        fast_floor = args.fast_ip if role.startswith("ipaddress") else args.fast_audit
        ratios = sorted(p / f for p, f in pairs)
        fast = sorted(p / f for p, f in pairs if f < fast_floor)
        line = (
            f"{transport:10} {role:15} {len(ratios):3} pairs: median {statistics.median(ratios):.2f}x"
            f" (pass {statistics.median(p for p, _ in pairs):.0f} ms)"
        )
        if fast:
            line += (
                f"; {len(fast)} with the floor under {fast_floor:.0f} ms: median"
                f" {statistics.median(fast):.2f}x, 3rd quartile {fast[(3 * len(fast)) // 4]:.2f}x"
            )
        print(line)


if __name__ == "__main__":
    main()
