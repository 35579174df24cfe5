"""Plots the metrics JSONL of a run (``pretrain_gpt.py --metrics-path``) into one PNG.

Panels, top to bottom, sharing the iteration axis:

* ``time``: the per-iteration time breakdown, stacked: forward, backward, grad sync,
  optimizer and "other" (``time/iteration_s`` minus those four, clipped at 0), with the
  measured iteration time drawn over the bars;
* ``loss``: the training ``lm_loss`` and, when the run evaluated, ``eval/lm_loss``;
* ``throughput``: tokens/s; ``memory``: the memory fields (``memory/*_gib``: host RSS,
  and on a GPU the peak allocated and reserved memory);
* with ``--panels all`` (the default, ``summary``, draws the four above and names at the
  bottom of the figure how many panels more the file's optional features would add), for
  the fields of an optional feature (any prefix other than ``time/``, ``throughput/``,
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
        [--title "my run"] [--panels all]

It prints the output path on stdout. Bad input (a missing or empty file, a line that is
not a JSON object, no training records) is one ``error: FILE[:LINE]: ...`` line on stderr
and exit status 2.
"""

from __future__ import annotations

import math
import os
import textwrap
from typing import Dict, List, Optional, Sequence, Tuple

from _breakdown_panels import (
    ITERATION_TIME,
    bar_spans,
    column,
    has_field,
    is_training,
    left_out_fields,
    number,
    optional_panels,
    plan_panels,
    read_records,
    split_records,
    stacked_values,
)
from _common import (
    ToolArgumentParser,
    ToolError,
    ensure_parent_dir,
    log,
    remove_quietly,
    run_tool,
    temporary_path,
)

# Above this many records a stacked area replaces the stacked bars (faster, and bars
# would be thinner than a pixel anyway).
_MAX_BARS = 300


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


def plot(records: Sequence[dict], output: str, title: Optional[str] = None,
         detail: str = "summary") -> List[str]:
    """Draws the panels of ``records`` into the image file ``output``.

    Args:
        records: metrics records as read from the JSONL file (training and evaluation).
        output: the image path; the format follows its extension (``.png``, ``.svg``,
            ``.pdf``, ...). Written under a temporary name and renamed.
        title: the figure title; default: a summary of the records.
        detail: ``"summary"`` (the four core panels) or ``"all"`` (and the optional
            features' panels); see :func:`plan_panels`.

    Returns:
        The names of the panels drawn, top to bottom (see :func:`plan_panels`).

    Raises:
        ToolError: no training records, or an output format matplotlib cannot write.
    """
    train, evals = split_records(records)
    if not train:
        raise ToolError("no training records (records with lm_loss or time/iteration_s), "
                        f"only {len(evals)} evaluation records")
    panels = plan_panels(train, evals, detail)
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
    note = figure_note(train, detail)
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


def figure_note(train: Sequence[dict], detail: str) -> Optional[str]:
    """The figure's bottom line: in a summary, the optional features' panels it leaves
    out and the flag that draws them; with all panels, the fields a CPU run leaves out."""
    if detail == "all":
        return left_out_note(left_out_fields(train))
    more = optional_panels(train)
    if not more:
        return None
    features = sorted({panel.name.split("/", 1)[0] for panel in more})
    return (f"{' and '.join(features)} fields: {len(more)} more panels with --panels all")


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
    parser.add_argument("--panels", choices=("summary", "all"), default="summary",
                        help="summary (default): the time breakdown, loss, throughput and "
                             "memory; all: also one panel per kind of field of the optional "
                             "features (offload/..., zenflow/...) in the file")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    records = read_records(args.metrics)
    if not any(is_training(r) for r in records):
        raise ToolError(f"{args.metrics}: no training records (none of its {len(records)} "
                        "records has lm_loss or time/iteration_s)")
    panels = plot(records, args.output, title=args.title, detail=args.panels)
    log(f"plot_breakdown: panels {', '.join(panels)}")
    note = figure_note(split_records(records)[0], args.panels)
    if note:
        log(f"plot_breakdown: {' '.join(note.split())}")
    print(args.output, flush=True)


if __name__ == "__main__":
    raise SystemExit(run_tool(main))
