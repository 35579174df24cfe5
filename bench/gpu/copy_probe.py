"""Small copies behind large ones: what a GPU's copy queues do to a training loop.

ZenFlow moves ~2.3 GB per step to the host (the delayed gradients) and, once per window,
as much back (the CPU update's new weights), on side streams, to overlap them with the
next iteration. Whether they overlap depends on what the small synchronous copies of the
loop (a metric's ``.item()``, a batch's H2D) do while a large copy is in flight on another
stream: if copies in one direction are served in order, a 16-byte read waits for the whole
2.3 GB. This probe measures, on the machine it runs on:

- the bandwidth of a large pinned copy, as one copy and in chunks;
- the latency of a small read (D2H, ``.item()``) and of a small H2D copy followed by a
  kernel that needs it, issued on the default stream while a large copy (one piece or
  chunked) runs on a side stream, in each direction;
- the same with the large D2H done by the SMs (an elementwise kernel writing into pinned
  host memory through its device address) instead of a copy engine, and what that kernel
  and a copy-engine copy cost a concurrent matmul loop.

Usage (on a GPU machine): ``python3 bench/gpu/copy_probe.py --output probe.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def parse_args(argv=None):
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=2300, help="size of the large copy, MB (2300: "
                   "ZenFlow's delayed grads per step on the 1.28B reference at k=0.1)")
    p.add_argument("--chunks-mb", default="0,256,64,16",
                   help="chunk sizes of the large copy to try, MB (0: one copy)")
    p.add_argument("--reps", type=int, default=5, help="repetitions per measurement")
    p.add_argument("--delay-ms", type=float, default=3.0,
                   help="how long after the large copy's launch the small one is issued")
    p.add_argument("--output", help="write the results as JSON here")
    return p.parse_args(argv)


class _DeviceView:
    """A pinned host tensor's memory as seen from the device (``__cuda_array_interface__``)."""

    def __init__(self, host: torch.Tensor):
        assert host.dtype == torch.int16 and host.is_pinned()
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": "<i2",
                                         "data": (host.data_ptr(), False), "version": 2}


def _copy(dst: torch.Tensor, src: torch.Tensor, chunk: int, stream) -> None:
    with torch.cuda.stream(stream):
        if chunk <= 0:
            dst.copy_(src, non_blocking=True)
            return
        for start in range(0, src.numel(), chunk):
            dst[start:start + chunk].copy_(src[start:start + chunk], non_blocking=True)


def _sm_copy(dst_view: torch.Tensor, src: torch.Tensor, chunk: int, stream) -> None:
    """Copies device ``src`` into host memory (``dst_view``, its device address) by a kernel."""
    with torch.cuda.stream(stream):
        if chunk <= 0:
            torch.bitwise_or(src, 0, out=dst_view)
            return
        for start in range(0, src.numel(), chunk):
            torch.bitwise_or(src[start:start + chunk], 0, out=dst_view[start:start + chunk])


def _timed_big(launch, stream) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    launch()
    stream.synchronize()
    return time.perf_counter() - t0


def _small_read(scalar: torch.Tensor) -> float:
    t0 = time.perf_counter()
    scalar.item()
    return time.perf_counter() - t0


def _small_h2d(host_small: torch.Tensor, dev_small: torch.Tensor) -> float:
    """A pinned 4 KB H2D copy and a kernel using it, on the default stream, to completion."""
    t0 = time.perf_counter()
    dev_small.copy_(host_small, non_blocking=True)
    dev_small.add_(1)
    torch.cuda.current_stream().synchronize()
    return time.perf_counter() - t0


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def main(argv=None) -> int:
    """Runs the probe; prints a table and writes --output."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("copy_probe: no GPU visible; run it on the GPU machine", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    n = args.mb * 2**20 // 2
    src_dev = torch.randint(-100, 100, (n,), dtype=torch.int16, device=dev)
    dst_dev = torch.empty_like(src_dev)
    host = torch.empty(n, dtype=torch.int16, pin_memory=True)
    host.fill_(1)
    try:
        host_view = torch.as_tensor(_DeviceView(host), device=dev)
    except Exception as err:  # noqa: BLE001 (report it and probe the copy engines only)
        print(f"copy_probe: no device view of pinned memory ({err}); SM copies skipped")
        host_view = None
    scalar = torch.ones((), device=dev)
    host_small = torch.ones(1024, dtype=torch.int32, pin_memory=True)
    dev_small = torch.empty(1024, dtype=torch.int32, device=dev)
    side = torch.cuda.Stream(dev)
    chunks = [int(c) * 2**20 // 2 for c in args.chunks_mb.split(",")]
    results = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
               "mb": args.mb, "reps": args.reps, "rows": []}

    def row(**kw):
        results["rows"].append(kw)
        print(json.dumps(kw), flush=True)

    # Warm up every path once.
    _copy(host, src_dev, 0, side)
    _copy(dst_dev, host, 0, side)
    torch.cuda.synchronize()
    if host_view is not None:
        host.fill_(1)
        _sm_copy(host_view, src_dev, 0, side)
        torch.cuda.synchronize()
        sm_ok = torch.equal(host, src_dev.cpu())
        results["sm_copy_exact"] = sm_ok
        if not sm_ok:
            print("copy_probe: the SM copy into host memory did not arrive; SM copies skipped")
            host_view = None
    _small_read(scalar)
    _small_h2d(host_small, dev_small)
    idle_read = _median([_small_read(scalar) for _ in range(20)])
    idle_h2d = _median([_small_h2d(host_small, dev_small) for _ in range(20)])
    row(case="idle", small_read_ms=idle_read * 1e3, small_h2d_ms=idle_h2d * 1e3)

    paths = {
        "d2h_ce": lambda c: _copy(host, src_dev, c, side),
        "h2d_ce": lambda c: _copy(dst_dev, host, c, side),
    }
    if host_view is not None:
        paths["d2h_sm"] = lambda c: _sm_copy(host_view, src_dev, c, side)
    for name, launch in paths.items():
        for chunk in chunks:
            big = [_timed_big(lambda: launch(chunk), side) for _ in range(args.reps)]
            waits = {"small_read": [], "small_h2d": []}
            for kind in waits:
                for _ in range(args.reps):
                    torch.cuda.synchronize()
                    launch(chunk)
                    time.sleep(args.delay_ms / 1e3)
                    waits[kind].append(_small_read(scalar) if kind == "small_read"
                                       else _small_h2d(host_small, dev_small))
                    torch.cuda.synchronize()
            bw = [args.mb * 2**20 / t / 1e9 for t in big]
            row(case=name, chunk_mb=chunk * 2 / 2**20, big_ms_median=_median(big) * 1e3,
                gbps_median=_median(bw), gbps_min=min(bw), gbps_max=max(bw),
                small_read_ms_median=_median(waits["small_read"]) * 1e3,
                small_read_ms_max=max(waits["small_read"]) * 1e3,
                small_h2d_ms_median=_median(waits["small_h2d"]) * 1e3,
                small_h2d_ms_max=max(waits["small_h2d"]) * 1e3)

    # A matmul loop on the default stream, alone and beside each large D2H.
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)

    def gemms(k=40) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(k):
            a @ b
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / k

    gemms(5)
    for name in ("none", *paths):
        times = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            if name != "none":
                paths[name](64 * 2**20 // 2)
            times.append(gemms(20))  # ~20 ms of matmuls while the copy runs (it takes ~40)
            torch.cuda.synchronize()
        row(case="gemm_beside", copy=name, gemm_ms_median=_median(times),
            tflops_median=2 * 8192**3 / (_median(times) / 1e3) / 1e12)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
