"""Plots the metrics JSONL of a run (``pretrain_gpt.py --metrics-path``) into one PNG.

Panels, top to bottom, sharing the iteration axis:

* ``time``: the per-iteration time breakdown, stacked: forward, backward, grad sync,
  optimizer and "other" (``time/iteration_s`` minus those four, clipped at 0), with the
  measured iteration time drawn over the bars;
* ``loss``: the training ``lm_loss`` and, when the run evaluated, ``eval/lm_loss``;
* ``throughput``: tokens/s; ``memory``: the memory fields (``memory/*_gib``: host RSS,
  and on a GPU the peak allocated and reserved memory);
* for the fields of an optional feature (any prefix other than ``time/``, ``throughput/``,
  ``memory/`` and ``eval/``: ``offload/...``, ``zenflow/...``, read from the records), only
  when the file has them, one panel per kind of field, found by the unit in the name:
  ``<p>/time`` (``*_s``, stacked: phases of the iteration that add up), ``<p>/background``
  (``*_bg_s``, lines: busy time of threads that run alongside, e.g. the offload engine's
  I/O, which must not be stacked onto the phases), ``<p>/ratio`` (``*_rate``,
  ``*_ratio``, ``*_fraction`` or fields whose values all lie in [0, 1]),
  ``<p>/bandwidth`` (``*_gbps``), ``<p>/memory`` (``*_gib``), ``<p>/rate`` (``*_per_s``),
  ``<p>/bytes`` (``*_bytes``: bytes moved per iteration, on an axis in B, KB, MB or GB
  as their size asks) and ``<p>/values`` (anything else: counts and plain numbers such as
  subgroups per path or ZenFlow's S, never on the axis of the bytes). New fields of those
  features therefore show up without changing this tool. On a run without GPU (no
  ``memory/gpu_*`` field), a feature field that is 0 in every record (its device tier, its
  streamed updates) is not drawn: a line at the bottom of the figure names those fields,
  and a panel left without fields is not drawn.

Each training record is the mean over its logging interval, so with ``--log-interval N``
a bar spans the N iterations it averages. When a resumed run appended iterations that the
file already holds, the later record of an iteration wins.

:func:`plot` is the entry point for code (it returns the names of the panels drawn);
the command line is::

    python tools/plot_breakdown.py runs/quickstart/metrics.jsonl --output breakdown.png \\
        [--title "my run"]

It prints the output path on stdout. Bad input (a missing or empty file, a line that is
not a JSON object, no training records) is one ``error: FILE[:LINE]: ...`` line on stderr
and exit status 2.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from _common import (
    ToolArgumentParser,
    ToolError,
    check_input_file,
    ensure_parent_dir,
    log,
    remove_quietly,
    run_tool,
    temporary_path,
)

# The breakdown of panel "time": (field, legend label); "other" is computed.
BREAKDOWN = (("time/forward_s", "forward"), ("time/backward_s", "backward"),
             ("time/grad_sync_s", "grad sync"), ("time/optimizer_s", "optimizer"))
ITERATION_TIME = "time/iteration_s"
TRAIN_LOSS, EVAL_LOSS = "lm_loss", "eval/lm_loss"
TOKENS_PER_S = "throughput/tokens_per_s"
MEMORY_PREFIX, MEMORY_SUFFIX = "memory/", "_gib"
# The core fields' prefixes; any other "<name>/" prefix of a training record's fields is
# an optional feature's (offload/, zenflow/, ...), read from the records, with panels of its
# own only when the file has its fields.
CORE_PREFIXES = ("time/", "throughput/", "memory/", "eval/")
# pretrain_gpt.py records the GPU's memory (memory/gpu_max_allocated_gib, ...) only on a
# GPU: a run without such a field ran on the CPU.
GPU_MEMORY_PREFIX = "memory/gpu_"

# Kinds of feature fields by name suffix, the first match wins (so "_per_s" before "_s").
# Ratios are also recognised by their values (see classify_field).
_SUFFIX_KINDS = (("_per_s", "rate"), ("_gbps", "bandwidth"), ("_gib", "memory"),
                 ("_bytes", "bytes"),
                 # A lower bound of the step (offload's I/O floor), and the step over its
                 # bound (>= 1): lines, not phases to stack or ratios in 0-1.
                 ("_floor_s", "floor"), ("roofline_ratio", "roofline"),
                 ("_bg_s", "background"), ("_s", "time"), ("_rate", "ratio"),
                 ("_ratio", "ratio"), ("_fraction", "ratio"),
                 # Counts (of subgroups, copies) are values even when they are 0 or 1.
                 ("_n", "values"), ("_subgroups", "values"), ("_copies", "values"))
_KIND_ORDER = ("time", "background", "floor", "roofline", "ratio", "bandwidth", "memory",
               "rate", "bytes", "values")
_KIND_YLABEL = {"time": "time per iteration ({unit})",
                "background": "busy time per iteration (s)",
                "floor": "lower bound per iteration (s)",
                "roofline": "iteration / max(fwd+bwd, floor)", "ratio": "ratio (0-1)",
                "bandwidth": "GB/s", "memory": "GiB", "rate": "per second",
                "bytes": "bytes per iteration ({unit})", "values": "count or value"}
# Above this many records a stacked area replaces the stacked bars (faster, and bars
# would be thinner than a pixel anyway).
_MAX_BARS = 300


@dataclass
class Series:
    """One plotted quantity: a JSONL field (or a derived one) and its legend label."""

    key: str
    label: str


@dataclass
class Panel:
    """One axes of the figure.

    Attributes:
        name: stable identifier returned by :func:`plot` (``"time"``, ``"offload/ratio"``).
        title: the axes title.
        kind: ``"stacked"`` (bars or area, summed) or ``"lines"``.
        ylabel: the y-axis label, with its unit (``{unit}``: chosen when drawing).
        series: the quantities drawn.
        ylim: fixed y limits, e.g. (0, 1) for ratios.
        from_zero: start the y axis at 0 (non-negative quantities: a steady value then
            reads as steady instead of as noise magnified to the full height).
    """

    name: str
    title: str
    kind: str
    ylabel: str
    series: List[Series]
    ylim: Optional[Tuple[float, float]] = None
    from_zero: bool = False


# ----------------------------------------------------------------------------- reading


def read_records(path: str) -> List[dict]:
    """Reads a metrics JSONL file: one JSON object with an ``iteration`` per line.

    Blank lines are skipped. Raises a :class:`ToolError` naming ``path:line`` for a line
    that is not a JSON object or has no integer ``iteration``, and one for a missing or
    empty file.
    """
    check_input_file(path, "metrics file")
    records = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            records.append(parse_record(raw, f"{path}:{line_no}"))
    if not records:
        raise ToolError(f"{path}: empty file (no records); write one with "
                        "pretrain_gpt.py --metrics-path")
    return records


def parse_record(raw, where: str) -> dict:
    """Parses one line; ``where`` (``file:line``) prefixes the error message."""
    try:
        record = json.loads(raw.rstrip(b"\r\n") if isinstance(raw, bytes) else raw)
    except UnicodeDecodeError as err:
        raise ToolError(f"{where}: not valid UTF-8 ({err.reason})") from None
    except json.JSONDecodeError as err:
        raise ToolError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise ToolError(f"{where}: expected a JSON object, got {type(record).__name__}")
    iteration = record.get("iteration")
    if isinstance(iteration, bool) or not isinstance(iteration, int):
        raise ToolError(f'{where}: record has no integer "iteration"')
    return record


def is_training(record: dict) -> bool:
    """Whether a record is a logged training iteration (not an evaluation)."""
    return TRAIN_LOSS in record or ITERATION_TIME in record


def split_records(records: Sequence[dict]) -> Tuple[List[dict], List[dict]]:
    """Training and evaluation records, each sorted by iteration, one per iteration.

    A resumed run appends to the same file and may repeat iterations; the later record
    of an iteration replaces the earlier one.
    """
    train: Dict[int, dict] = {}
    evals: Dict[int, dict] = {}
    for record in records:
        if is_training(record):
            train[record["iteration"]] = record
        elif EVAL_LOSS in record:
            evals[record["iteration"]] = record
    return [train[i] for i in sorted(train)], [evals[i] for i in sorted(evals)]


def number(value) -> float:
    """A record value as a float; NaN for null, booleans, strings and missing values."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def column(records: Sequence[dict], key: str) -> List[float]:
    return [number(r.get(key)) for r in records]


def has_field(records: Sequence[dict], key: str) -> bool:
    return any(math.isfinite(v) for v in column(records, key))


# ------------------------------------------------------------------- choosing the panels


def classify_field(key: str, values: Sequence[float]) -> str:
    """The kind of a feature field: its unit from the name suffix, else ratio by value.

    >>> classify_field("offload/fetch_s", [0.1])
    'time'
    >>> classify_field("zenflow/rho", [0.1, 0.2])
    'ratio'
    """
    for suffix, kind in _SUFFIX_KINDS:
        if key.endswith(suffix):
            return kind
    finite = [v for v in values if math.isfinite(v)]
    if finite and all(0.0 <= v <= 1.0 for v in finite):
        return "ratio"
    return "values"


def feature_label(key: str, prefix: str, kind: str) -> str:
    """A legend label: the key without the feature prefix and the unit suffix."""
    label = key[len(prefix):]
    for suffix, suffix_kind in _SUFFIX_KINDS:
        if suffix_kind == kind and label.endswith(suffix) and kind != "ratio":
            label = label[:-len(suffix)]
            break
    return label.replace("_", " ")


def feature_prefixes(train: Sequence[dict]) -> List[str]:
    """The optional features' prefixes (``offload/``, ``zenflow/``) among the records' fields.

    >>> feature_prefixes([{"iteration": 1, "time/forward_s": 1.0, "zenflow/rho": 0.1,
    ...                    "offload/path/nvme/read_gbps": 2.0, "lm_loss": 3.0}])
    ['offload/', 'zenflow/']
    """
    prefixes = {key.split("/", 1)[0] + "/" for r in train for key in r if "/" in key}
    return sorted(p for p in prefixes if p not in CORE_PREFIXES)


def ran_on_cpu(train: Sequence[dict]) -> bool:
    """Whether the records are of a run without GPU (no ``memory/gpu_*`` field)."""
    return not any(key.startswith(GPU_MEMORY_PREFIX) for r in train for key in r)


def left_out_fields(train: Sequence[dict]) -> List[str]:
    """The feature fields not drawn because they say nothing: on a CPU run, those that are
    0 in every record (the GPU's share of a feature: its device tier, its streamed updates),
    which would otherwise be drawn as flat zeros. A GPU run keeps every field."""
    if not ran_on_cpu(train):
        return []
    left_out = []
    for prefix in feature_prefixes(train):
        for key in sorted({k for r in train for k in r if k.startswith(prefix)}):
            finite = [v for v in column(train, key) if math.isfinite(v)]
            if finite and all(v == 0.0 for v in finite):
                left_out.append(key)
    return left_out


def feature_panels(train: Sequence[dict], prefix: str,
                   left_out: Sequence[str] = ()) -> List[Panel]:
    """The panels of one feature's fields (``offload/...``): none when it has none.

    Fields in ``left_out`` (see :func:`left_out_fields`) are not drawn; a panel left with
    no field is not drawn either.
    """
    keys = sorted({k for r in train for k in r if k.startswith(prefix)} - set(left_out))
    groups: Dict[str, List[Series]] = {}
    for key in keys:
        values = column(train, key)
        if not any(math.isfinite(v) for v in values):
            continue
        kind = classify_field(key, values)
        groups.setdefault(kind, []).append(Series(key, feature_label(key, prefix, kind)))
    feature = prefix.rstrip("/")
    panels = []
    for kind in _KIND_ORDER:
        if kind not in groups:
            continue
        panels.append(Panel(
            name=f"{feature}/{kind}", title=f"{feature}: {kind}",
            kind="stacked" if kind == "time" else "lines", ylabel=_KIND_YLABEL[kind],
            series=groups[kind], ylim=(0.0, 1.05) if kind == "ratio" else None,
            from_zero=kind in ("floor", "roofline", "bandwidth", "memory", "rate", "bytes",
                               "values")))
    return panels


def plan_panels(train: Sequence[dict], evals: Sequence[dict]) -> List[Panel]:
    """Decides which panels to draw and what goes on each (pure: no drawing).

    Args:
        train: training records (see :func:`split_records`).
        evals: evaluation records.

    Returns:
        The panels, top to bottom; a panel whose fields are all absent is left out.
    """
    panels = []
    parts = [Series(key, label) for key, label in BREAKDOWN if has_field(train, key)]
    if has_field(train, ITERATION_TIME):
        parts.append(Series("other", "other"))
    if parts:
        panels.append(Panel("time", "time per iteration, stacked", "stacked",
                            "time per iteration ({unit})", parts))
    losses = []
    if has_field(train, TRAIN_LOSS):
        losses.append(Series(TRAIN_LOSS, "train lm loss"))
    if has_field(evals, EVAL_LOSS):
        losses.append(Series(EVAL_LOSS, "validation lm loss"))
    if losses:
        panels.append(Panel("loss", "language-model loss", "lines",
                            "cross-entropy (nats/token)", losses))
    if has_field(train, TOKENS_PER_S):
        panels.append(Panel("throughput", "training throughput", "lines", "tokens/s",
                            [Series(TOKENS_PER_S, "tokens/s")], from_zero=True))
    memory_keys = sorted({k for r in train for k in r
                          if k.startswith(MEMORY_PREFIX) and k.endswith(MEMORY_SUFFIX)})
    memory = [Series(k, k[len(MEMORY_PREFIX):-len(MEMORY_SUFFIX)].replace("_", " "))
              for k in memory_keys if has_field(train, k)]
    if memory:
        panels.append(Panel("memory", "memory", "lines", "GiB", memory, from_zero=True))
    left_out = left_out_fields(train)
    for prefix in feature_prefixes(train):
        panels.extend(feature_panels(train, prefix, left_out))
    return panels


def stacked_values(train: Sequence[dict], panel: Panel) -> List[List[float]]:
    """The rows of a stacked panel, missing values as 0; "other" is the remainder."""
    rows = []
    for series in panel.series:
        if series.key == "other":
            total = column(train, ITERATION_TIME)
            parts = [column(train, k) for k, _ in BREAKDOWN]
            rows.append([max(0.0, t - sum(p[i] for p in parts if math.isfinite(p[i])))
                         if math.isfinite(t) else 0.0 for i, t in enumerate(total)])
        else:
            rows.append([v if math.isfinite(v) else 0.0 for v in column(train, series.key)])
    return rows


def bar_spans(iterations: Sequence[int]) -> List[Tuple[float, float]]:
    """(left, width) of each record's bar: the logging interval the record averages.

    A record at iteration i logged every N iterations covers (i - N, i]. pretrain_gpt.py
    logs at the multiples of N and at the last iteration, so N is taken as the greatest
    common divisor of all but the last iteration. A bar is as wide as the gap to the
    previous record, capped at N: records missing after a crash, or a resumed run's first
    record, would otherwise give one wide bar.
    """
    interval = math.gcd(*iterations[:-1]) if len(iterations) > 1 else iterations[0]
    interval = max(1, interval)
    spans = []
    previous = 0
    for it in iterations:
        width = max(1, min(it - previous, interval))
        spans.append((it - width, width))
        previous = it
    return spans


# ----------------------------------------------------------------------------- drawing


def _matplotlib():
    """Imports matplotlib's Figure and its Agg canvas (files only, no display needed).

    The figure is drawn on an Agg canvas of its own, without pyplot: no global backend
    is switched and no figure stays registered, so :func:`plot` can be called from any
    program (a notebook, a test) any number of times.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise ToolError("matplotlib is not installed: pip install -r requirements.txt") \
            from None
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
    return Figure, FigureCanvasAgg, MaxNLocator


def _time_unit(rows: Sequence[Sequence[float]]) -> Tuple[float, str]:
    """(scale, unit) for a stacked time panel: milliseconds unless totals reach 2 s."""
    totals = [sum(values) for values in zip(*rows)] or [0.0]
    return (1.0, "s") if max(totals) >= 2.0 else (1000.0, "ms")


def _draw_stacked(ax, train, panel, colors):
    iterations = [r["iteration"] for r in train]
    rows = stacked_values(train, panel)
    scale, unit = _time_unit(rows)
    rows = [[v * scale for v in row] for row in rows]
    if len(train) <= _MAX_BARS:
        spans = bar_spans(iterations)
        lefts, widths = [s[0] for s in spans], [s[1] for s in spans]
        bottom = [0.0] * len(train)
        for series, row, color in zip(panel.series, rows, colors):
            ax.bar(lefts, row, width=widths, bottom=bottom, align="edge", color=color,
                   label=series.label, linewidth=0)
            bottom = [b + v for b, v in zip(bottom, row)]
    else:
        ax.stackplot(iterations, *rows, labels=[s.label for s in panel.series],
                     colors=colors, step="pre", linewidth=0)
    if panel.name == "time" and has_field(train, ITERATION_TIME):
        # The measured iteration time over the stack: "other" is the part no timer
        # covers, and where the timed parts add up to more, the stack rises above it.
        total = [v * scale for v in column(train, ITERATION_TIME)]
        if len(train) <= _MAX_BARS:
            ax.hlines(total, lefts, [a + b for a, b in zip(lefts, widths)], color="black",
                      linewidth=1.5, label="iteration (measured)")
        else:
            ax.step(iterations, total, where="pre", color="black", linewidth=1.0,
                    label="iteration (measured)")
    ax.set_ylabel(panel.ylabel.format(unit=unit))
    ax.set_ylim(bottom=0)


def bytes_unit(values: Sequence[float]) -> Tuple[float, str]:
    """(divisor, unit) for an axis of byte counts: the largest unit its maximum reaches.

    >>> bytes_unit([3e9, 1e6])
    (1000000000.0, 'GB')
    """
    top = max((abs(v) for v in values if math.isfinite(v)), default=0.0)
    for divisor, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "KB")):
        if top >= divisor:
            return divisor, unit
    return 1.0, "B"


def _draw_lines(ax, records_for, series_list, colors, divisor: float = 1.0):
    """Draws one line per series (its finite points only); returns the line handles."""
    handles = []
    for series, color in zip(series_list, colors):
        records = records_for(series.key)
        points = [(r["iteration"], number(r.get(series.key)) / divisor) for r in records]
        points = [(x, y) for x, y in points if math.isfinite(y)]
        if not points:
            continue
        xs, ys = zip(*points)
        # Markers keep a lone point (one evaluation, one logged record) visible; the
        # evaluations' diamonds are drawn above the training line they may sit on.
        is_eval = series.key.startswith("eval/")
        marker = "D" if is_eval else ("o" if len(points) <= 20 else None)
        line, = ax.plot(xs, ys, color=color, marker=marker, markersize=5 if is_eval else 4,
                        linewidth=1.4, label=series.label, zorder=3 if is_eval else 2)
        handles.append(line)
    return handles


def plot(records: Sequence[dict], output: str, title: Optional[str] = None) -> List[str]:
    """Draws the panels of ``records`` into the image file ``output``.

    Args:
        records: metrics records as read from the JSONL file (training and evaluation).
        output: the image path; the format follows its extension (``.png``, ``.svg``,
            ``.pdf``, ...). Written under a temporary name and renamed.
        title: the figure title; default: a summary of the records.

    Returns:
        The names of the panels drawn, top to bottom (see :func:`plan_panels`).

    Raises:
        ToolError: no training records, or an output format matplotlib cannot write.
    """
    train, evals = split_records(records)
    if not train:
        raise ToolError("no training records (records with lm_loss or time/iteration_s), "
                        f"only {len(evals)} evaluation records")
    panels = plan_panels(train, evals)
    Figure, FigureCanvasAgg, MaxNLocator = _matplotlib()

    fig = Figure(figsize=(11, 0.8 + 2.4 * len(panels)), dpi=110, layout="constrained")
    canvas = FigureCanvasAgg(fig)
    fmt = os.path.splitext(output)[1].lstrip(".").lower() or "png"
    if fmt not in canvas.get_supported_filetypes():
        raise ToolError(f"--output {output}: unsupported image format .{fmt}; "
                        f"use one of {', '.join(sorted(canvas.get_supported_filetypes()))}")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    # matplotlib's 10 default colors, repeated when a panel has more series.
    palette = [f"C{i % 10}" for i in range(max(len(p.series) for p in panels))]

    def records_for(key: str) -> List[dict]:
        return evals if key.startswith("eval/") else train

    for ax, panel in zip(axes, panels):
        if panel.kind == "stacked":
            _draw_stacked(ax, train, panel, palette)
            handles, labels = ax.get_legend_handles_labels()
        else:
            divisor, unit = 1.0, ""
            if "{unit}" in panel.ylabel:  # bytes: the unit their size asks for
                divisor, unit = bytes_unit([v for s in panel.series
                                            for v in column(records_for(s.key), s.key)])
            handles = _draw_lines(ax, records_for, panel.series, palette, divisor)
            ax.set_ylabel(panel.ylabel.format(unit=unit))
            if panel.ylim:
                ax.set_ylim(*panel.ylim)
            elif panel.from_zero and handles:
                ax.set_ylim(0, max(ax.dataLim.y1, 1e-9) * 1.1)
            labels = [h.get_label() for h in handles]
        ax.set_title(panel.title, loc="left", fontsize=10)
        ax.grid(True, alpha=0.3)
        # Outside the axes, so that it never hides the data.
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  fontsize=8, frameon=False)
    axes[-1].set_xlabel("iteration")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    first, last = train[0]["iteration"], train[-1]["iteration"]
    fig.suptitle(title or f"{len(train)} logged iterations ({first}-{last}), "
                 f"{len(evals)} evaluations", fontsize=12)
    note = left_out_note(left_out_fields(train))
    if note:
        fig.supxlabel(note, fontsize=8, color="0.35")

    ensure_parent_dir(output)
    tmp = temporary_path(output)
    try:
        fig.savefig(tmp, format=fmt)
        os.replace(tmp, output)
    except OSError as err:
        raise ToolError(f"--output {output}: cannot write ({err.strerror})") from None
    finally:
        remove_quietly([tmp])
    return [panel.name for panel in panels]


def left_out_note(left_out: Sequence[str]) -> Optional[str]:
    """The figure's line saying which fields a CPU run's plot leaves out, or None.

    >>> left_out_note(["offload/device_update_s", "offload/stream_issue_s"])
    'no GPU in this run: not drawn, 0 in every record: offload: device_update_s, stream_issue_s'
    """
    if not left_out:
        return None
    groups: Dict[str, List[str]] = {}
    for key in left_out:
        prefix, rest = key.split("/", 1)
        groups.setdefault(prefix, []).append(rest)
    fields = "; ".join(f"{prefix}: {', '.join(rest)}" for prefix, rest in groups.items())
    return textwrap.fill(f"no GPU in this run: not drawn, 0 in every record: {fields}", 160)


# ------------------------------------------------------------------------ command line


def build_parser() -> ToolArgumentParser:
    parser = ToolArgumentParser(
        prog="plot_breakdown.py",
        description="Plot a run's metrics JSONL (pretrain_gpt.py --metrics-path): time "
                    "breakdown, loss, throughput and memory, and the offload / ZenFlow "
                    "fields when present.")
    parser.add_argument("metrics", help="the metrics JSONL file")
    parser.add_argument("--output", required=True,
                        help="image to write (.png; other matplotlib formats by extension)")
    parser.add_argument("--title", help="figure title (default: a summary of the records)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    records = read_records(args.metrics)
    if not any(is_training(r) for r in records):
        raise ToolError(f"{args.metrics}: no training records (none of its {len(records)} "
                        "records has lm_loss or time/iteration_s)")
    panels = plot(records, args.output, title=args.title)
    log(f"plot_breakdown: panels {', '.join(panels)}")
    note = left_out_note(left_out_fields(split_records(records)[0]))
    if note:
        log(f"plot_breakdown: {' '.join(note.split())}")
    print(args.output, flush=True)


if __name__ == "__main__":
    raise SystemExit(run_tool(main))
