"""Placement of subgroups on the tier paths, and their rebalancing while training runs.

The paths' bandwidths (:class:`~megatron_ext.offload.paths.TierSpec`, given or probed) are
the weights; this module decides which path holds each subgroup's file. Pure logic: it
reads no clock and does no I/O (the engine feeds it sizes, free bytes and timings), so the
decisions are tested apart from the files. It holds:

* :data:`PLACEMENT_POLICIES` and :func:`place_subgroups`: MLP-Offload's
  bandwidth-proportional placement (T_i = M * B_i / sum B), interleaved, with optional
  per-path capacity filled like water (:func:`_water_fill`); or round-robin;
* :class:`Rebalancer`: beyond the paper, moves subgroups off a path whose observed
  throughput drops (contention), with hysteresis;
* :func:`_balancing_moves`: the one rule both end with, so that a fresh placement gives a
  Rebalancer nothing to move.

Arithmetic on targets is exact (fractions): the result does not depend on floating-point
rounding. Units: weights are relative (any scale); sizes in bytes; observed throughput in
GB/s (10**9 bytes per second).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import List, Optional, Sequence, Tuple

from megatron_ext.offload.paths import TierFullError, human_bytes

__all__ = [
    "PLACEMENT_POLICIES",
    "Rebalancer",
    "place_subgroups",
]

PLACEMENT_POLICIES = ("bandwidth", "round-robin")
_GB = 1e9


def place_subgroups(sizes: Sequence[int], weights: Sequence[float], policy: str = "bandwidth",
                    capacity: Optional[Sequence[Optional[int]]] = None, *,
                    names: Optional[Sequence[str]] = None) -> List[int]:
    """Assigns each subgroup to a tier path.

    ``"bandwidth"`` (MLP-Offload's rule): path i receives a share of the bytes proportional
    to ``weights[i]`` (T_i = M * B_i / sum B). Subgroups are taken in order and each goes to
    the path with the largest deficit, ``target_i - assigned_i``, where the target counts the
    bytes placed so far including this subgroup (a smooth weighted round-robin, by bytes).
    Ties go to a path other than the previous subgroup's, then to the larger weight, then to
    the lower index: weights 1:1 alternate, 3:1 repeat 0,0,1,0, 1:1:1 repeat 0,1,2. A final
    pass makes the same moves as :class:`Rebalancer` would (see there), so every path ends
    within one subgroup of its target and a Rebalancer with these weights starts with
    nothing to move. Arithmetic is exact (fractions): the result does not depend on
    floating-point rounding.

    ``"round-robin"``: subgroup k goes to path ``k % len(weights)``; weights only have to
    be valid.

    With ``capacity``, a path never receives more than its bytes. The targets are filled
    like water: a path whose proportional share exceeds its capacity is capped at it, and
    the rest is shared by the others in proportion to their weights (round-robin: the next
    path in cyclic order that has room). A path of weight 0 receives nothing.

    Args:
        sizes: bytes of each subgroup (any unit, the same as ``capacity``).
        weights: relative bandwidth of each path (e.g. effective GB/s), >= 0.
        policy: ``"bandwidth"`` or ``"round-robin"``.
        capacity: free bytes per path; ``None`` (or a ``None`` entry) is unlimited.
        names: path names for error messages (default ``path 0``, ``path 1``, ...).

    Returns:
        The path index of each subgroup.

    Raises:
        ValueError: no weights, a negative or non-finite weight, all weights 0, a negative
            size, an unknown policy, or ``capacity``/``names`` of the wrong length.
        TierFullError: the subgroups do not fit in the paths' capacity.
    """
    fractions = _weights_as_fractions(weights)
    n = len(fractions)
    if policy not in PLACEMENT_POLICIES:
        raise ValueError(f"unknown placement policy {policy!r}; "
                         f"expected one of {', '.join(PLACEMENT_POLICIES)}")
    if any(size < 0 for size in sizes):
        raise ValueError("subgroup sizes must be >= 0")
    free = _free_list(capacity, n)
    labels = list(names) if names is not None else [f"path {i}" for i in range(n)]
    if len(labels) != n:
        raise ValueError(f"names has {len(labels)} entries for {n} paths")
    usable = [i for i in range(n) if fractions[i] > 0]
    total = sum(sizes)
    if all(free[i] is not None for i in usable):
        room = sum(free[i] for i in usable)
        if total > room:
            raise TierFullError(
                f"offload tier paths too small: {len(sizes)} subgroups need "
                f"{human_bytes(total)} but only {human_bytes(room)} is free "
                f"({_describe_free(labels, free, usable)}); free space, or add a path or "
                "host cache", total, free)
    targets = _water_fill(fractions, free, total) if total else fractions
    target_sum = sum(targets)

    assigned = [0] * n
    deficit = [Fraction(0)] * n  # (target - assigned) * target_sum, kept exact
    result: List[int] = []
    previous = -1
    for index, size in enumerate(sizes):
        for i in range(n):
            deficit[i] += size * targets[i]
        fits = [i for i in usable if free[i] is None or assigned[i] + size <= free[i]]
        if not fits:
            left = _left(free, assigned)
            raise TierFullError(
                f"offload tier paths too small: subgroup {index} ({human_bytes(size)}) "
                f"fits on no path ({_describe_free(labels, left, usable)}); "
                "free space, or add a path or host cache", size, left)
        if policy == "round-robin":
            choice = min(fits, key=lambda i: (i - index) % n)
        else:
            choice = min(fits, key=lambda i: (-deficit[i], i == previous, -fractions[i], i))
        assigned[choice] += size
        deficit[choice] -= size * target_sum
        result.append(choice)
        previous = choice
    if policy == "bandwidth":
        for subgroup, _, receiver in _balancing_moves(result, sizes, targets,
                                                      _left(free, assigned), None, True):
            result[subgroup] = receiver
    return result


def _water_fill(weights: Sequence[Fraction], free: Sequence[Optional[int]],
                total: int) -> List[Fraction]:
    """Target bytes per path: proportional to ``weights``, capped at ``free``.

    The bytes a capped path cannot take go to the uncapped ones, again in proportion to
    their weights, until no target exceeds its path's capacity.
    """
    targets = [Fraction(0)] * len(weights)
    open_paths = [i for i, w in enumerate(weights) if w > 0]
    remaining = Fraction(total)
    while open_paths:
        weight_sum = sum(weights[i] for i in open_paths)
        capped = [i for i in open_paths if free[i] is not None
                  and remaining * weights[i] / weight_sum > free[i]]
        if not capped:
            for i in open_paths:
                targets[i] = remaining * weights[i] / weight_sum
            break
        for i in capped:
            targets[i] = Fraction(free[i])
            remaining -= free[i]
            open_paths.remove(i)
    return targets


def _weights_as_fractions(weights: Sequence[float]) -> List[Fraction]:
    if len(weights) == 0:
        raise ValueError("no tier paths: weights is empty")
    for weight in weights:
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"tier weights must be finite and >= 0, got {list(weights)}")
    if not any(weight > 0 for weight in weights):
        raise ValueError(f"tier weights are all 0: {list(weights)}")
    return [Fraction(weight) for weight in weights]


def _free_list(capacity: Optional[Sequence[Optional[int]]], n: int) -> List[Optional[int]]:
    if capacity is None:
        return [None] * n
    if len(capacity) != n:
        raise ValueError(f"capacity has {len(capacity)} entries for {n} paths")
    return list(capacity)


def _left(free: Sequence[Optional[int]], used: Sequence[int]) -> List[Optional[int]]:
    return [None if f is None else f - u for f, u in zip(free, used)]


def _describe_free(labels: Sequence[str], free: Sequence[Optional[int]],
                   usable: Sequence[int]) -> str:
    parts = [f"{labels[i]}: " + ("unlimited" if free[i] is None else human_bytes(free[i]))
             for i in usable]
    return "free " + ", ".join(parts)


class Rebalancer:
    """Moves subgroups off a tier path whose observed throughput drops, with hysteresis.

    The caller reports each step's I/O per path (:meth:`observe`: bytes and the seconds
    spent on them) and calls :meth:`end_step`, which returns the moves to make. Pure logic:
    no clock, no I/O; the caller applies the moves to its assignment (a move costs little,
    since every non-cached subgroup is read and written each step anyway: read from the
    old path, write to the new one).

    The rule, per :meth:`end_step`:

    1. Each path observed this step updates its throughput estimate, an EWMA of
       bytes / seconds (GB/s) with weight ``alpha`` on the new value.
    2. A path is *slow* when its estimate relative to its weight (observed / expected) is
       below ``slow_ratio`` times that of the other paths pooled (their summed estimates
       over their summed weights). Only paths with weight > 0 and an estimate take part.
    3. When a path has been slow for ``patience`` consecutive steps, the weights become the
       estimates (paths without one keep their weight, scaled like the others), so the
       target bytes per path follow observed bandwidth; the streaks restart.
    4. Then, every step, up to ``max_moves`` subgroups move toward the targets (each
       path's weight share of the bytes on the paths): from the path most over its target
       (after a slowdown, the slow path) to the path most under it (the one fastest
       relative to its load) that has room, and only if the gap between the two exceeds
       the subgroup's size. Each move strictly lowers the sum of squared distances to the
       targets, so moving back is never a gain, and moving stops at the latest once every
       path is within one subgroup of its target. Among the donor's subgroups that
       qualify, the one that makes the shortest run of consecutive subgroups on the
       receiver moves (then the highest index), to keep the interleaving.
       :func:`place_subgroups` ends with the same rule, so its placement starts with
       nothing to move.

    Hysteresis: weights change only after ``patience`` steps beyond ``slow_ratio``, so equal
    or noisy throughputs (within that ratio) never move anything, and a move is never
    undone unless the throughputs change again. The weights are relative: any scale (probe
    effective GB/s, or read+write bytes per second) works, as only ratios are compared.

    Limitation: a path that loses all its subgroups is no longer observed, so its recovery
    is not seen; that takes a throughput below ``1 / (number of subgroups)`` of the total.
    """

    def __init__(self, weights: Sequence[float], *, alpha: float = 0.5,
                 slow_ratio: float = 0.7, patience: int = 2, max_moves: int = 1):
        _weights_as_fractions(weights)
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not 0 < slow_ratio < 1:
            raise ValueError(f"slow_ratio must be in (0, 1), got {slow_ratio}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        if max_moves < 0:
            raise ValueError(f"max_moves must be >= 0, got {max_moves}")
        self._weights = [float(weight) for weight in weights]
        self._alpha = alpha
        self._slow_ratio = slow_ratio
        self._patience = patience
        self._max_moves = max_moves
        n = len(self._weights)
        self._estimate: List[Optional[float]] = [None] * n
        self._step_bytes = [0] * n
        self._step_seconds = [0.0] * n
        self._streak = [0] * n
        self._reweights = 0

    @property
    def weights(self) -> List[float]:
        """The current relative weight of each path (a copy)."""
        return list(self._weights)

    @property
    def reweight_count(self) -> int:
        """How many times the weights were reset to the observed throughputs."""
        return self._reweights

    def observed_gbps(self, path: int) -> Optional[float]:
        """The EWMA throughput of ``path`` in GB/s, ``None`` before its first observation."""
        self._check_path(path)
        return self._estimate[path]

    def observe(self, path: int, nbytes: int, seconds: float) -> None:
        """Adds ``nbytes`` moved on ``path`` in ``seconds`` to the current step's totals."""
        self._check_path(path)
        if nbytes < 0 or not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"observe: need nbytes >= 0 and finite seconds >= 0, "
                             f"got {nbytes}, {seconds}")
        self._step_bytes[path] += nbytes
        self._step_seconds[path] += seconds

    def end_step(self, assignment: Sequence[int], sizes: Sequence[int], *,
                 free_bytes: Optional[Sequence[Optional[int]]] = None
                 ) -> List[Tuple[int, int, int]]:
        """Closes a step: updates the estimates and returns the moves to make.

        Args:
            assignment: the path of each subgroup; a negative entry is a subgroup that is
                on no path (kept in the host cache) and is never moved.
            sizes: bytes of each subgroup.
            free_bytes: free bytes per path (``None``: unlimited); a move never puts more
                on a path than this.

        Returns:
            ``(subgroup, from_path, to_path)`` for each move, at most ``max_moves``, each
            subgroup at most once. ``assignment`` is not modified.
        """
        n = len(self._weights)
        if len(assignment) != len(sizes):
            raise ValueError(f"assignment has {len(assignment)} entries, sizes {len(sizes)}")
        if any(path >= n for path in assignment):
            raise ValueError(f"assignment names a path >= {n}")
        for path in range(n):
            nbytes, seconds = self._step_bytes[path], self._step_seconds[path]
            if nbytes > 0 and seconds > 0:
                rate = nbytes / seconds / _GB
                old = self._estimate[path]
                self._estimate[path] = rate if old is None else (
                    self._alpha * rate + (1 - self._alpha) * old)
        self._step_bytes = [0] * n
        self._step_seconds = [0.0] * n
        self._update_streaks()
        if any(streak >= self._patience for streak in self._streak):
            self._reweight()
        weights = [Fraction(w) for w in self._weights]
        return _balancing_moves(assignment, sizes, weights, _free_list(free_bytes, n),
                                self._max_moves, False)

    def _check_path(self, path: int) -> None:
        if not 0 <= path < len(self._weights):
            raise ValueError(f"path {path} out of range 0..{len(self._weights) - 1}")

    def _active(self) -> List[int]:
        return [i for i, (w, e) in enumerate(zip(self._weights, self._estimate))
                if w > 0 and e is not None]

    def _update_streaks(self) -> None:
        active = self._active()
        streak = [0] * len(self._weights)
        if len(active) >= 2:
            total_est = sum(self._estimate[i] for i in active)
            total_w = sum(self._weights[i] for i in active)
            for i in active:
                others = (total_est - self._estimate[i]) / (total_w - self._weights[i])
                if self._estimate[i] / self._weights[i] < self._slow_ratio * others:
                    streak[i] = self._streak[i] + 1
        self._streak = streak

    def _reweight(self) -> None:
        active = self._active()
        scale = (sum(self._estimate[i] for i in active)
                 / sum(self._weights[i] for i in active))
        self._weights = [
            0.0 if w == 0 else (self._estimate[i] if i in active else w * scale)
            for i, w in enumerate(self._weights)]
        self._streak = [0] * len(self._weights)
        self._reweights += 1


def _balancing_moves(assignment: Sequence[int], sizes: Sequence[int],
                     weights: Sequence[Fraction], free: Sequence[Optional[int]],
                     max_moves: Optional[int], repeat: bool) -> List[Tuple[int, int, int]]:
    """Moves that bring each path's bytes to within one subgroup of its target.

    The target of path i is its weight's share of the bytes on the paths. With
    ``excess_i = bytes_i - target_i``: the donor is the path most over its target, the
    receiver the path most under it (among those with room); a subgroup of size s moves
    only if ``excess_donor - excess_receiver > s``. Each move strictly lowers the sum of
    squared excesses, so moving back is never allowed and the moves end, at the latest
    when every path is within s of its target.

    Args:
        assignment: path of each subgroup; negative entries are on no path.
        sizes: bytes of each subgroup.
        weights: relative weight of each path (exact).
        free: room left per path (``None``: unlimited).
        max_moves: the most moves to return; ``None`` for as many as it takes.
        repeat: whether a subgroup may move more than once.

    Returns:
        ``(subgroup, from_path, to_path)`` in the order to make them.
    """
    n = len(weights)
    weight_sum = sum(weights)
    where = list(assignment)
    loads = [0] * n
    members: List[List[int]] = [[] for _ in range(n)]
    for subgroup, path in enumerate(where):
        if path >= 0:
            loads[path] += sizes[subgroup]
            members[path].append(subgroup)
    on_paths = sum(loads)
    room = list(free)
    # Excess scaled by weight_sum, so that it stays an exact integer-valued comparison.
    excess = [loads[i] * weight_sum - on_paths * weights[i] for i in range(n)]

    moves: List[Tuple[int, int, int]] = []
    while max_moves is None or len(moves) < max_moves:
        candidates = []
        # The donors in order of excess: the most loaded one may hold only subgroups too
        # large to move, while the next one's would still even things out.
        for donor in sorted((i for i in range(n) if members[i]), key=lambda i: (-excess[i], i)):
            for subgroup in members[donor]:
                size = sizes[subgroup]
                receivers = [r for r in range(n) if r != donor and weights[r] > 0
                             and (room[r] is None or size <= room[r])]
                if not receivers:
                    continue
                receiver = min(receivers, key=lambda r: (excess[r], r))
                if excess[donor] - excess[receiver] > size * weight_sum:
                    # Consecutive subgroups on different paths overlap their I/O, so
                    # prefer the subgroup that makes the shortest run on the receiver.
                    candidates.append(
                        (_run_length(where, subgroup, receiver), -subgroup, receiver))
            if candidates:
                break
        if not candidates:
            break
        _, negated, receiver = min(candidates)
        subgroup, size = -negated, sizes[-negated]
        donor = where[subgroup]
        members[donor].remove(subgroup)
        if repeat:
            members[receiver].append(subgroup)
        where[subgroup] = receiver
        excess[donor] -= size * weight_sum
        excess[receiver] += size * weight_sum
        if room[receiver] is not None:
            room[receiver] -= size
        moves.append((subgroup, donor, receiver))
    return moves


def _run_length(where: Sequence[int], subgroup: int, path: int) -> int:
    """Length of the run of consecutive subgroups on ``path`` once ``subgroup`` joins it."""
    run = 1
    for step in (-1, 1):
        index = subgroup + step
        while 0 <= index < len(where) and where[index] == path:
            run += 1
            index += step
    return run
