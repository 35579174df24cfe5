#!/usr/bin/env python3
"""Where a ``--profile`` trace's time went, per labelled range: host time and device time.

Reads the Chrome trace that ``pretrain_gpt.py --profile`` writes (``rank0-iterA-B.json``,
optionally gzipped) and prints, for each labelled range (``optimizer/update``,
``zenflow/send_delayed_grads``, ``optimizer/grad_norm``, ...; ``--labels`` picks them):

- its wall time on the host (sum over its occurrences) and how many times it ran;
- the device time of the kernels and copies it launched (matched through the launch's
  correlation id, so work that runs after the range closed still counts for it), and the
  number of launches;
- the device work it launched, by name, largest first (``--top``).

A range whose device time is far below its host time is bound by the host (launches,
Python, waits); one close to it, by the device. Device time is summed per operation: work
on several streams at once adds up to more than the wall time it covered.

    python bench/gpu/profile_summary.py profile/rank0-iter9-12.json --top 15
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
from typing import Dict, List

DEFAULT_LABELS = ("optimizer/update", "optimizer/grad_norm", "zenflow/gpu_update",
                  "zenflow/send_delayed_grads", "zenflow/flush_pending")
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def load(path: str) -> List[dict]:
    """The trace's events."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(events: List[dict], labels, top: int) -> Dict[str, dict]:
    """Per label: host_ms, count, device_ms, launches, by_name {name: [ms, count]}."""
    ranges = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("name") in labels and e.get("cat") == "user_annotation":
            ranges[e["name"]].append((e["ts"], e["ts"] + e["dur"], e.get("tid")))
    device = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                device.setdefault(corr, []).append(e)
    launches = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"
                and (e.get("args") or {}).get("correlation") in device]
    out = {}
    for label in labels:
        spans = ranges.get(label, [])
        result = {"host_ms": sum(b - a for a, b, _ in spans) / 1e3, "count": len(spans),
                  "device_ms": 0.0, "launches": 0, "by_name": {}}
        by_name = collections.defaultdict(lambda: [0.0, 0])
        for launch in launches:
            if not any(a <= launch["ts"] <= b and tid == launch.get("tid")
                       for a, b, tid in spans):
                continue
            result["launches"] += 1
            for work in device[launch["args"]["correlation"]]:
                ms = work["dur"] / 1e3
                result["device_ms"] += ms
                entry = by_name[work["name"][:90]]
                entry[0] += ms
                entry[1] += 1
        result["by_name"] = dict(sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top])
        out[label] = result
    return out


def main(argv=None) -> int:
    """Prints the summary of one trace; 2 for an unreadable one."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="the Chrome trace of --profile (.json or .json.gz)")
    p.add_argument("--labels", nargs="+", default=list(DEFAULT_LABELS),
                   help="labelled ranges to summarize (default: %(default)s)")
    p.add_argument("--top", type=int, default=12, help="device operations listed per range")
    p.add_argument("--json", help="also write the summary here")
    a = p.parse_args(argv)
    try:
        events = load(a.trace)
    except (OSError, ValueError, KeyError) as err:
        print(f"error: {a.trace}: not a readable Chrome trace ({err})", file=sys.stderr)
        return 2
    summary = summarize(events, a.labels, a.top)
    for label, r in summary.items():
        print(f"{label}: host {r['host_ms']:.1f} ms over {r['count']} ranges, device "
              f"{r['device_ms']:.1f} ms in {r['launches']} launches")
        for name, (ms, n) in r["by_name"].items():
            print(f"    {ms:9.2f} ms {n:6d}x  {name}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
