"""The device tier's AdamW with remainders: torch's passes against the one-pass kernel.

One subgroup of ``--elements`` bf16 weights with remainders and fp32 moments (10 bytes of
state per element) on the GPU, its bf16 gradients in a model-like buffer; each way is run
``--reps`` times after ``--warmup`` and timed with CUDA events. Prints and writes (JSON)
min/median/max milliseconds and the effective bandwidth of the one-pass kernel's bytes
(26 per element: weight, gradient, remainder and both moments read, all but the gradient
written), so the two ways compare on the bytes that must move. Run on the GPU machine:

    python3 bench/gpu/device_adam_bench.py --elements 268435456 --output $OUT/device_adam.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron_ext.offload.remainders import encode, sign_bits  # noqa: E402
from megatron_ext.offload.states import StateLayout  # noqa: E402
from megatron_ext.offload.subgroups import ShardParam, partition  # noqa: E402
from megatron_ext.offload.store import StepStats  # noqa: E402
from megatron_ext.offload.updaters import DeviceUpdater, StepArgs, SubgroupAdam  # noqa: E402
from megatron_ext.optim import device_adam  # noqa: E402

BYTES_PER_ELEMENT = 26
HPARAMS = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}]


def _setup(n: int):
    weights = torch.randn(n, device="cuda").to(torch.bfloat16)
    grads = (torch.randn(n, device="cuda") * 1e-2).to(torch.bfloat16)
    layout = StateLayout().with_remainders()
    state = torch.empty(layout.nbytes(n), dtype=torch.uint8, device="cuda")
    rem, exp_avg, exp_avg_sq = layout.views(state, n)
    exp_avg.zero_()
    exp_avg_sq.zero_()
    encode(weights.float(), rem, sign_bits(exp_avg_sq), torch.empty_like(weights))
    params = [ShardParam(numel=n, group=0, grad=lambda: grads, out=weights,
                         init=lambda: weights)]
    subgroups = partition([n], [0], n)
    return params, subgroups, layout, state


def _time(fn, reps: int, warmup: int):
    for step in range(warmup):
        fn(step + 1)
    times = []
    for step in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(warmup + step + 1)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 28,
                        help="elements of the subgroup (default 2^28: 2.7 GB of state)")
    parser.add_argument("--reps", type=int, default=10, help="timed steps per way")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--output", help="JSON file for the results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or device_adam.triton is None:
        print("device_adam_bench: needs a CUDA GPU and Triton", file=sys.stderr)
        return 2
    results = {"elements": args.elements, "reps": args.reps, "warmup": args.warmup,
               "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for way in ("torch", "fused"):
        params, subgroups, layout, state = _setup(args.elements)
        adam = SubgroupAdam(subgroups, layout, fused=True)
        updater = DeviceUpdater(params, subgroups, adam, StepStats(0), device=torch.device("cuda"),
                                max_numel=args.elements, allocate=True,
                                param_dtype=torch.bfloat16)
        updater.one_pass = way == "fused"

        def step(k, updater=updater, state=state):
            updater.apply(0, state, StepArgs(k, HPARAMS, None, None))
        ms = _time(step, args.reps, args.warmup)
        med = statistics.median(ms)
        results[way] = {"ms_min": min(ms), "ms_median": med, "ms_max": max(ms),
                        "gbps_median": BYTES_PER_ELEMENT * args.elements / med / 1e6}
        print(f"{way:6s}: {min(ms):8.2f} / {med:8.2f} / {max(ms):8.2f} ms (min/median/max), "
              f"{results[way]['gbps_median']:.0f} GB/s of the one-pass bytes")
        del params, subgroups, state, adam, updater
        torch.cuda.empty_cache()
    results["speedup_median"] = results["torch"]["ms_median"] / results["fused"]["ms_median"]
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
