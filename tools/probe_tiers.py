"""Measures the read/write bandwidth of offload tier directories for ``--offload-paths``.

Each directory is probed ``--repeat`` times (rounds go over all directories in turn, so a
passing disturbance spreads over them rather than hitting one): a ``--size-mb`` file is
written by ``--threads`` threads in ``--block-mb`` blocks, fsynced, dropped from the page
cache (or written with O_DIRECT, ``--direct-io``), read back and removed; see
``megatron_ext.offload.probe.probe_bandwidth``. Progress goes to stderr; stdout gets a
table (min / median / max per path, and the effective bandwidth for one read plus one
write, which is what the placement weighs) and, last, the line to paste into a job
script, with the medians::

    python tools/probe_tiers.py /local/nvme /scratch/$USER/offload --repeat 3
    # ...
    # --offload-paths /local/nvme@6.12,3.40 /scratch/alice/offload@1.80,1.20

Probe with the size the engine will really move (a few GB on a node with much RAM) for
numbers that hold: a small file fits in device and controller caches. Two paths on one
file system share its bandwidth; the tool notes it, since the paths then add nothing.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from _common import (
    ToolArgumentParser,
    ToolError,
    ensure_parent_dir,
    log,
    log_start,
    positive_int,
    run_tool,
    temporary_path,
)

from megatron_ext.offload.paths import (  # noqa: E402
    TierFullError,
    TierSpec,
    check_free_space,
    format_tier_spec,
)
from megatron_ext.offload.probe import probe_bandwidth  # noqa: E402

_MIB = 1 << 20


@dataclass
class PathSamples:
    """Every round's result for one directory."""

    path: str
    read_gbps: List[float] = field(default_factory=list)
    write_gbps: List[float] = field(default_factory=list)
    direct_io_used: List[bool] = field(default_factory=list)

    def median_spec(self) -> TierSpec:
        return TierSpec(self.path, statistics.median(self.read_gbps),
                        statistics.median(self.write_gbps))


def check_directory(path: str, needed_bytes: int) -> None:
    """Raises a ToolError unless ``path`` is a writable directory with room for the probe."""
    if not os.path.exists(path):
        raise ToolError(f"{path}: directory not found")
    if not os.path.isdir(path):
        raise ToolError(f"{path}: not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ToolError(f"{path}: directory not writable")
    try:
        check_free_space(path, needed_bytes)
    except TierFullError as err:
        raise ToolError(f"{path}: the probe needs {needed_bytes // _MIB} MiB but only "
                        f"{err.free_bytes[0] // _MIB} MiB is free; lower --size-mb") from None


def same_file_system_notes(paths: Sequence[str]) -> List[str]:
    """One note per group of paths on one file system (they share its bandwidth)."""
    groups: Dict[int, List[str]] = {}
    for path in paths:
        groups.setdefault(os.stat(path).st_dev, []).append(path)
    return [f"note: {', '.join(group)} are on one file system and share its bandwidth"
            for group in groups.values() if len(group) > 1]


def offload_paths_line(samples: Sequence[PathSamples]) -> str:
    """``--offload-paths DIR@R,W ...`` with the medians, each item quoted for a shell."""
    items = [shlex.quote(format_tier_spec(s.median_spec())) for s in samples]
    return "--offload-paths " + " ".join(items)


def format_table(samples: Sequence[PathSamples]) -> List[str]:
    """The summary table, one line per path, bandwidths in GB/s."""
    def triple(values: Sequence[float]) -> str:
        return (f"{min(values):.2f} / {statistics.median(values):.2f} / "
                f"{max(values):.2f}")

    header = ["path", "I/O", "read GB/s min/med/max", "write GB/s min/med/max",
              "effective GB/s"]
    rows = [header]
    for s in samples:
        rows.append([s.path, "direct" if all(s.direct_io_used) else "buffered",
                     triple(s.read_gbps), triple(s.write_gbps),
                     f"{s.median_spec().effective_gbps:.2f}"])
    widths = [max(len(row[col]) for row in rows) for col in range(len(header))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
            for row in rows]


def summary_json(samples: Sequence[PathSamples], args) -> dict:
    def stats(values: Sequence[float]) -> dict:
        return {"min": min(values), "median": statistics.median(values), "max": max(values),
                "samples": list(values)}

    return {
        "settings": {"size_mb": args.size_mb, "block_mb": args.block_mb,
                     "threads": args.threads, "direct_io": args.direct_io,
                     "repeat": args.repeat},
        "paths": [{"path": s.path, "read_gbps": stats(s.read_gbps),
                   "write_gbps": stats(s.write_gbps),
                   "effective_gbps": s.median_spec().effective_gbps,
                   "direct_io_used": all(s.direct_io_used)} for s in samples],
        "offload_paths": offload_paths_line(samples),
    }


def check_json_output(path: str) -> None:
    """Refuses a --json path that cannot be written, before the probes take their time."""
    if path.endswith(os.sep) or os.path.isdir(path):
        raise ToolError(f"--json {path} is a directory; give a file path")
    ensure_parent_dir(path)


def write_json(path: str, data: dict) -> None:
    ensure_parent_dir(path)
    tmp = temporary_path(path)
    try:
        with open(tmp, "w") as stream:
            json.dump(data, stream, indent=2)
            stream.write("\n")
        os.replace(tmp, path)
    except OSError as err:
        raise ToolError(f"--json {path}: cannot write ({err.strerror})") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def build_parser() -> ToolArgumentParser:
    parser = ToolArgumentParser(
        prog="probe_tiers.py",
        description="Measure the read/write bandwidth of offload tier directories and print "
                    "the --offload-paths DIR@READ_GBPS,WRITE_GBPS line for pretrain_gpt.py.")
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="tier directories to probe")
    parser.add_argument("--size-mb", type=positive_int, default=256,
                        help="MiB written and read per directory and round (default 256)")
    parser.add_argument("--block-mb", type=positive_int, default=8,
                        help="MiB per read/write call (default 8)")
    parser.add_argument("--threads", type=positive_int, default=4,
                        help="I/O threads per directory (default 4)")
    parser.add_argument("--direct-io", action="store_true",
                        help="use O_DIRECT where the file system supports it (else "
                             "buffered I/O with the page cache dropped before reading)")
    parser.add_argument("--repeat", type=positive_int, default=3,
                        help="rounds per directory; the medians are printed (default 3)")
    parser.add_argument("--json", metavar="OUT",
                        help="also write every sample and the summary to this JSON file")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    block = args.block_mb * _MIB
    needed = -(-args.size_mb * _MIB // block) * block
    seen: Dict[str, str] = {}
    for path in args.dirs:
        check_directory(path, needed)
        real = os.path.realpath(path)
        if real in seen:
            raise ToolError(f"{path}: same directory as {seen[real]}, listed twice")
        seen[real] = path
    if args.json:
        check_json_output(args.json)
    for note in same_file_system_notes(args.dirs):
        log_start(f"probe_tiers: {note}")

    samples = [PathSamples(path) for path in args.dirs]
    for round_index in range(1, args.repeat + 1):
        for s in samples:
            try:
                result = probe_bandwidth(s.path, size_mb=args.size_mb, block_mb=args.block_mb,
                                         threads=args.threads, direct_io=args.direct_io)
            except OSError as err:
                raise ToolError(f"{s.path}: probe failed ({err.strerror or err})") from None
            s.read_gbps.append(result.read_gbps)
            s.write_gbps.append(result.write_gbps)
            s.direct_io_used.append(result.direct_io_used)
            mode = "O_DIRECT" if result.direct_io_used else "buffered, page cache dropped"
            if args.direct_io and not result.direct_io_used:
                mode = "O_DIRECT not supported; " + mode
            log(f"probe_tiers: round {round_index}/{args.repeat} {s.path}: write "
                f"{result.write_gbps:.2f} GB/s, read {result.read_gbps:.2f} GB/s "
                f"({result.size_mb} MiB, {mode})")

    if args.json:
        write_json(args.json, summary_json(samples, args))
    for line in format_table(samples):
        print(line)
    print(offload_paths_line(samples), flush=True)


if __name__ == "__main__":
    raise SystemExit(run_tool(main))
