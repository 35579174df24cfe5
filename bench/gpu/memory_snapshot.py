#!/usr/bin/env python3
"""Where the GPU memory of a training run goes, at its peak.

Runs ``pretrain_gpt.py`` in this process with PyTorch's CUDA allocator history on
(``torch.cuda.memory._record_memory_history``), then replays the recorded allocation
events to find the moment of the highest allocated total and groups the blocks alive at
that moment by the first frame in this project or megatron-core that allocated them
(``file:function``). Prints a table (GiB per group, largest first) and writes it as JSON.

Usage (on a GPU machine, repository root):
    python bench/gpu/memory_snapshot.py --output mem.json [--top 25] -- <pretrain_gpt.py flags>

The history costs host memory per event (``--max-entries``); a few training iterations of
a large model produce fewer than a million events.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIB = float(1 << 30)
# Frames from these parts of a path name the allocation's owner (first match wins).
OWNERS = ("megatron_ext/", "megatron/core/", "pretrain_gpt.py")


def owner(frames: Sequence[dict]) -> str:
    """The innermost frame of this project or megatron-core: ``path:function``."""
    for frame in frames:
        name = frame.get("filename", "")
        for marker in OWNERS:
            at = name.find(marker)
            if at >= 0:
                return f"{name[at:]}:{frame.get('name', '?')}"
    if frames:
        return f"{os.path.basename(frames[0].get('filename', '?'))}:{frames[0].get('name', '?')}"
    return "(no frames)"


def peak_blocks(events: Sequence[dict]) -> Tuple[int, int, Dict[int, Tuple[int, str]]]:
    """Replays allocator events; returns (peak bytes, event index, live blocks at the peak).

    ``events`` are one device's trace entries (``action`` alloc / free_completed, ``addr``,
    ``size``, ``frames``). A block is live from its ``alloc`` to its ``free_completed``.
    Blocks allocated before the history started are not seen (start it early).
    """
    live: Dict[int, Tuple[int, str]] = {}
    total = best = best_at = 0
    best_live: Dict[int, Tuple[int, str]] = {}
    for i, ev in enumerate(events):
        action = ev.get("action")
        if action == "alloc":
            live[ev["addr"]] = (ev["size"], owner(ev.get("frames", ())))
            total += ev["size"]
            if total > best:
                best, best_at = total, i
                best_live = dict(live)
        elif action == "free_completed":
            size_owner = live.pop(ev["addr"], None)
            if size_owner is not None:
                total -= size_owner[0]
    return best, best_at, best_live


def group(blocks: Dict[int, Tuple[int, str]]) -> List[Tuple[str, int, int]]:
    """(owner, bytes, count) per owner, largest first."""
    sizes: Dict[str, List[int]] = defaultdict(lambda: [0, 0])
    for size, who in blocks.values():
        sizes[who][0] += size
        sizes[who][1] += 1
    return sorted(((w, s, c) for w, (s, c) in sizes.items()), key=lambda r: -r[1])


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the training with the allocator history on and prints the peak's owners."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("error: give pretrain_gpt.py's flags after --", file=sys.stderr)
        return 2
    cut = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="JSON file for the table")
    parser.add_argument("--top", type=int, default=25, help="rows to print")
    parser.add_argument("--max-entries", type=int, default=2_000_000,
                        help="allocator events kept (oldest dropped beyond)")
    args = parser.parse_args(argv[:cut])
    import torch

    sys.path.insert(0, ROOT)
    import pretrain_gpt

    torch.cuda.memory._record_memory_history(max_entries=args.max_entries)
    rc = pretrain_gpt.main(argv[cut + 1:])
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    traces = snapshot.get("device_traces", [[]])
    events = traces[torch.cuda.current_device()] if traces else []
    peak, at, blocks = peak_blocks(events)
    rows = group(blocks)
    result = {
        "rc": rc,
        "events": len(events),
        "peak_event_index": at,
        "peak_allocated_gib_seen": peak / GIB,
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
        "max_memory_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        "owners": [{"owner": w, "gib": s / GIB, "blocks": c} for w, s, c in rows],
    }
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
    print(f"peak {peak / GIB:.2f} GiB seen in {len(events)} events (max_memory_allocated "
          f"{result['max_memory_allocated_gib']:.2f}, reserved "
          f"{result['max_memory_reserved_gib']:.2f})")
    for w, s, c in rows[:args.top]:
        print(f"{s / GIB:9.3f} GiB  {c:6d} blocks  {w}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
