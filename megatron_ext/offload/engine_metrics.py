"""The offload engine's per-iteration metrics (``offload/...``): times, cache, tiers, I/O floor.

:class:`EngineMetrics` reads the engine's step statistics, tier plan and store at each
logged iteration and keeps what spans intervals (the lock wait seen so far, the bytes and
seconds each path moved over the run); the engine (:mod:`.engine`) owns one.
"""

from __future__ import annotations

from typing import Dict

from megatron_ext.offload.tier_model import io_floor


class EngineMetrics:
    """The metrics of one :class:`~megatron_ext.offload.engine.OffloadEngine`."""

    def __init__(self, paths: int):
        self._lock_wait_seen = 0.0
        # What the paths moved over the run: the bandwidth behind the I/O floor when a
        # logging interval moved nothing on a path.
        self._io_totals = [[0, 0.0, 0, 0.0] for _ in range(paths)]

    def collect(self, engine) -> Dict[str, float]:
        """Per-iteration averages of ``engine`` since the last call (then reset)."""
        s = engine.stats
        steps = max(s.steps, 1)
        # Phases of the main thread (they add up to the optimizer step, less bookkeeping)
        # are *_s; the I/O threads' busy time, which runs alongside, is *_bg_s.
        record = {f"offload/{k}_s": s.time[k] / steps
                  for k in ("stall", "convert", "update", "writeback")}
        record["offload/fetch_bg_s"] = s.time["fetch"] / steps
        record["offload/flush_bg_s"] = s.time["flush"] / steps
        locks = engine.store.locks
        record["offload/lock_wait_bg_s"] = (locks.wait_s - self._lock_wait_seen) / steps
        self._lock_wait_seen = locks.wait_s
        record["offload/cache_hit_rate"] = s.hits / s.needed if s.needed else 1.0
        host = engine.cache.allocated * engine.buffer_bytes
        record["offload/host_cache_gib"] = host / 2**30
        record["offload/device_tier_gib"] = engine.device_bytes() / 2**30
        # What the tier really holds in GPU memory (the tensors' own device, not the plan).
        record["offload/device_tier_cuda_gib"] = engine.store.device_state_bytes() / 2**30
        record["offload/device_subgroups_n"] = len(engine.device_members)
        record["offload/device_update_s"] = s.time["device_update"] / steps
        record["offload/stream_issue_s"] = s.time["stream_issue"] / steps
        record["offload/streamed_subgroups"] = s.streamed_subgroups / steps
        record["offload/state_bytes_per_element"] = engine.layout.bytes_per_element
        record["offload/host_cache_subgroups"] = (
            len(engine.subgroups) - len(engine.device_members) if engine.tier_plan.capacity is None
            else engine.tier_plan.capacity)
        record["offload/host_only_subgroups"] = engine.tier_plan.host_only()
        record.update(s.path_metrics(steps, [engine.tier_plan.path_subgroups(i)
                                             for i in range(len(engine.tiers))]))
        record.update(self._io_floor(engine, record))
        s.reset()
        return record

    def _io_floor(self, engine, record: Dict[str, float]) -> Dict[str, float]:
        """The I/O floor of a step: the seconds its path traffic needs at least.

        The bytes that must cross each path per step (given where the subgroups live and
        what the cache keeps) over the bandwidth the path showed in this run: this
        interval's, else the run's so far, else its given or probed one.
        """
        s = engine.stats
        each_way = engine.tier_plan.path_io_per_step()
        rates = []
        for i, tier in enumerate(engine.tiers):
            total = self._io_totals[i]
            total[0] += s.read_bytes[i]
            total[1] += s.read_s[i]
            total[2] += s.write_bytes[i]
            total[3] += s.write_s[i]
            read = (record[f"offload/path{i}_read_gbps"]
                    or (total[0] / total[1] / 1e9 if total[1] else tier.read_gbps))
            write = (record[f"offload/path{i}_write_gbps"]
                     or (total[2] / total[3] / 1e9 if total[3] else tier.write_gbps))
            rates.append((read, write))
        seconds = io_floor(each_way, each_way, [r for r, _ in rates], [w for _, w in rates])
        out = {f"offload/path{i}_floor_bytes": 2 * b for i, b in enumerate(each_way)}
        out["offload/io_floor_bytes"] = 2 * sum(each_way)
        out["offload/io_floor_s"] = max(seconds, default=0.0)
        return out
