"""The metrics records of tools/plot_breakdown.py, and the panels they make. Pure: no drawing.

Reads a metrics JSONL file (:func:`read_records`, one ``error: FILE:LINE: ...`` per bad
line), splits it into training and evaluation records (:func:`split_records`), and decides
which panels to draw and what goes on each (:func:`plan_panels`: the core panels, then one
per kind of field of each optional feature, found by the unit in the field's name;
:func:`classify_field`). The figure itself is drawn by tools/plot_breakdown.py, whose
docstring describes the panels.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from _common import ToolError, check_input_file

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
        # A field that is its unit's whole name (offload/roofline_ratio) keeps it: an empty
        # label would be matplotlib's "_child0" in the legend.
        if suffix_kind == kind and label.endswith(suffix) and kind != "ratio" \
                and label != suffix.lstrip("_"):
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


def plan_panels(train: Sequence[dict], evals: Sequence[dict],
                detail: str = "summary") -> List[Panel]:
    """Decides which panels to draw and what goes on each (pure: no drawing).

    Args:
        train: training records (see :func:`split_records`).
        evals: evaluation records.
        detail: ``"summary"``: the core panels (time, loss, throughput, memory) only;
            ``"all"``: those and every optional feature's (see :func:`feature_panels`).

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
    if detail == "all":
        panels.extend(optional_panels(train))
    return panels


def optional_panels(train: Sequence[dict]) -> List[Panel]:
    """Every optional feature's panels (what ``detail="all"`` adds to the summary)."""
    left_out = left_out_fields(train)
    return [panel for prefix in feature_prefixes(train)
            for panel in feature_panels(train, prefix, left_out)]


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
