"""Host-memory throughput of ZenFlow's CPU side: accumulation (C kernel vs torch) and Adam.

What runs, on one machine, in one process, over N elements (default 1.15e9: the delayed
columns of the 1.28B reference GPT at k=0.1):
  * torch-accumulate: CpuWorker's torch path (bf16 grad -> fp32 chunk, clip, add), once;
  * c-accumulate@T: the one-pass C kernel (megatron_ext/runtime/host_kernels.py) with T
    threads, --repeats times each;
  * adam: torch's fused CPU AdamW on N fp32 elements (what a window's update runs),
    --repeats times;
  * overlap@T: c-accumulate@T while adam runs in another thread, as during training
    (both times reported).
Throughput is elements per second, and the bytes a kernel must move (accumulation: 2 read
+ 4 read + 4 write per element; fused AdamW: 4 x 4 read + 3 x 4 write) per second.

Usage: python bench/cpu/host_kernels_bench.py --output results.json [--numel 1.15e9]
"""

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from megatron_ext.optim.adamw import adam_update  # noqa: E402
from megatron_ext.runtime import host_kernels  # noqa: E402
from megatron_ext.zenflow.cpu_worker import CpuWorker  # noqa: E402

ACC_BYTES = 10
ADAM_BYTES = 28
HP = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def timed(fn, repeats):
    """Seconds of ``repeats`` calls: min, median, max, n."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"min": min(times), "median": statistics.median(times), "max": max(times),
            "n": len(times)}


def rates(stats, n, nbytes):
    """``stats`` with elements/s and bytes/s at the median."""
    return dict(stats, gelem_s=n / stats["median"] / 1e9,
                gb_s=n * nbytes / stats["median"] / 1e9)


def main():
    """Runs the measurements; writes --output."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=float, default=1.15e9)
    parser.add_argument("--threads", default="2,4,8,12,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    n = int(args.numel)
    lib = host_kernels.load()
    grad = torch.randn(n, dtype=torch.bfloat16)
    acc = torch.zeros(n)
    side = CpuWorker({}, torch.bfloat16, pin=False)
    side._kernels = None
    out = {"numel": n, "torch_threads": torch.get_num_threads(), "cpus": platform.machine(),
           "host_kernels": lib is not None, "runs": {}}
    out["runs"]["torch-accumulate"] = rates(timed(
        lambda: side._add_fp32(acc, [grad], [None], [0.5], False, None), 1), n, ACC_BYTES)
    print("torch-accumulate", out["runs"]["torch-accumulate"], flush=True)
    for t in [int(x) for x in args.threads.split(",")]:
        out["runs"][f"c-accumulate@{t}"] = rates(timed(
            lambda: host_kernels.accumulate(lib, acc, grad, inv_scale=None, clip=0.5,
                                            first=False, divisor=None, threads=t),
            args.repeats), n, ACC_BYTES)
        print(f"c-accumulate@{t}", out["runs"][f"c-accumulate@{t}"], flush=True)
    del grad
    master, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    step = [0]

    def adam():
        step[0] += 1
        adam_update(master, acc, m, v, step[0], HP, fused=True)
    out["runs"]["adam"] = rates(timed(adam, args.repeats), n, ADAM_BYTES)
    print("adam", out["runs"]["adam"], flush=True)
    grad = torch.randn(n, dtype=torch.bfloat16)
    acc2 = torch.zeros(n)
    for t in (4, 8, 16):
        result = {}
        thread = threading.Thread(target=lambda: result.update(adam=timed(adam, 1)))
        thread.start()
        result["accumulate"] = timed(lambda: host_kernels.accumulate(
            lib, acc2, grad, inv_scale=None, clip=0.5, first=False, divisor=None, threads=t),
            2)
        thread.join()
        out["runs"][f"overlap@{t}"] = result
        print(f"overlap@{t}", result, flush=True)
    side.close()
    Path(args.output).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
