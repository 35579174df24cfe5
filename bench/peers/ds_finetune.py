#!/usr/bin/env python3
r"""DeepSpeed's side of bench/gpu/zenflow_finetune.py: its Adam and its ZenFlow on the same data.

One process (run it under the DeepSpeed bundle's env.sh; bench/gpu/zenflow_finetune.py --part
deepspeed does): pretrains the bundle's GPT (``zero_infinity_bench.py``'s model: LayerNorm,
GELU, learned positions, untied head) of the given shape with DeepSpeed's Adam (ZeRO-2,
``torch_adam``, bf16, no offload) on ``--pretrain-data``, keeps its weights, then for every
seed fine-tunes from them on ``--finetune-data``: ``ds-adam`` (the same engine) and
``ds-zenflow`` (ZeRO-2 with ``offload_optimizer cpu`` and the ``zenflow`` block, as
DeepSpeed's tutorial sets it up: ``overlap_step``, warm-up 0; k, S and the re-selection
interval from the flags). Same schedule as ours: linear warm-up over a tenth of the steps,
cosine to a tenth of the lr; betas (0.9, 0.95), weight decay 0.1, clip 1.0.

Data: the ``.bin/.idx`` that bench/gpu/zenflow_finetune.py made (byte ids), split by documents
as megatron-core splits them (``98,2,0`` for the pretraining, ``85,15,0`` for the fine-tune:
the validation documents are the same). Training samples: per seed, the training documents
in a shuffled order, concatenated and cut into ``seq + 1`` tokens, the pieces shuffled;
validation: the first ``--eval-iters`` x micro-batch pieces of the validation documents.

``--engine torch``: a plain-PyTorch stand-in (AdamW, fp32, no DeepSpeed) for a smoke test of
everything else on a CPU; its rows are not DeepSpeed's.

Writes ``--output`` (JSON) after every run: per run the validation loss against step and
training wall time, the training loss and step times, in bench/gpu/zenflow_finetune.py's form.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def split_range(num_docs: int, split: str, part: int) -> range:
    """Documents of split ``part`` (0 train, 1 validation), megatron-core's way.

    Each part's weight over their sum, boundaries at the rounded cumulative fractions.
    """
    weights = [float(x) for x in split.split(",")]
    total = sum(weights)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * num_docs)))
    bounds[-1] = num_docs
    return range(bounds[part], min(bounds[part + 1], num_docs))


def pieces(docs, order, length: int) -> np.ndarray:
    """The documents in ``order`` concatenated, cut into rows of ``length`` tokens."""
    flat = np.concatenate([np.asarray(docs[i], dtype=np.int64) for i in order])
    rows = len(flat) // length
    return flat[:rows * length].reshape(rows, length)


class Batches:
    """Training batches of one seed: shuffled documents and pieces, epoch after epoch."""

    def __init__(self, docs, doc_range: range, seq: int, micro_batch: int, seed: int):
        self.docs, self.range, self.seq, self.mb = docs, doc_range, seq, micro_batch
        self.rng = np.random.default_rng(seed)
        self.rows, self.pos = None, 0

    def next(self) -> np.ndarray:
        """The next micro-batch, ``[micro_batch, seq + 1]`` token ids."""
        if self.rows is None or self.pos + self.mb > len(self.rows):
            order = self.rng.permutation(np.array(self.range))
            rows = pieces(self.docs, order, self.seq + 1)
            if len(rows) < self.mb:
                raise SystemExit(f"error: {len(rows)} samples of {self.seq + 1} tokens, fewer "
                                 f"than a micro-batch of {self.mb}")
            self.rows, self.pos = rows[self.rng.permutation(len(rows))], 0
        batch = self.rows[self.pos:self.pos + self.mb]
        self.pos += self.mb
        return batch


def lr_at(step: int, iters: int, peak: float) -> float:
    """Linear warm-up over a tenth of the steps, cosine to a tenth (megatron's schedule).

    ``step`` counts from 1 (the lr of the step's update).
    """
    warmup = max(1, iters // 10)
    if step <= warmup:
        return peak * step / warmup
    low = peak / 10
    frac = min(1.0, (step - warmup) / max(1, iters - warmup))
    return low + (peak - low) * 0.5 * (1 + math.cos(math.pi * frac))


def load_model_class(bundle: str):
    """The bundle's GPT class (its zero_infinity_bench.py's build_model_classes())."""
    path = Path(bundle) / "zero_infinity_bench.py"
    spec = importlib.util.spec_from_file_location("zero_infinity_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_model_classes()


def ds_config(a, zenflow: bool, bf16: bool = True) -> dict:
    """DeepSpeed's config: ZeRO-2 with torch's AdamW, or ZeRO-Offload with ZenFlow."""
    cfg = {"train_micro_batch_size_per_gpu": a.micro_batch, "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0, "steps_per_print": 10**9, "wall_clock_breakdown": False,
           "bf16": {"enabled": bf16},
           "optimizer": {"type": "AdamW", "params": {"lr": a.pretrain_lr, "betas": [0.9, 0.95],
                                                     "eps": 1e-8, "weight_decay": 0.1}},
           "zero_optimization": {"stage": 2, "contiguous_gradients": True,
                                 "overlap_comm": True}}
    if zenflow:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        cfg["zero_optimization"]["zenflow"] = {
            "topk_ratio": a.zenflow_topk, "update_interval": a.zenflow_update_interval,
            "select_strategy": "step", "select_interval": a.zenflow_select_interval,
            "full_warm_up_rounds": 0, "overlap_step": True}
    else:
        cfg["optimizer"]["params"]["torch_adam"] = True
    return cfg


class Trainer:
    """Builds a model and an engine, trains and evaluates (DeepSpeed or plain torch)."""

    def __init__(self, a):
        import torch
        self.a, self.torch = a, torch
        self.GPT = load_model_class(a.bundle)
        self.device = torch.device("cpu")
        if a.engine == "deepspeed":
            for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                               ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
                os.environ.setdefault(key, value)
            if "MASTER_PORT" not in os.environ:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    os.environ["MASTER_PORT"] = str(s.getsockname()[1])
            import logging

            import deepspeed
            from deepspeed.accelerator import get_accelerator
            from deepspeed.utils import logger
            logger.setLevel(logging.WARNING)
            # DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu, no GPU) runs it too: gloo, fp32.
            self.device = torch.device(get_accelerator().device_name())
            deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda"
                                       else "gloo")
            if self.device.type == "cuda":
                torch.cuda.set_device(0)

    def model(self, weights=None):
        """A fresh GPT (fixed init seed), with ``weights`` loaded when given."""
        a = self.a
        self.torch.manual_seed(1234)
        m = self.GPT(a.vocab, a.hidden, a.layers, a.heads, 4 * a.hidden, a.seq, False)
        if weights is not None:
            m.load_state_dict(weights)
        return m

    def engine(self, model, zenflow: bool):
        """(engine, optimizer) over ``model``."""
        if self.a.engine == "torch":
            opt = self.torch.optim.AdamW(model.parameters(), lr=self.a.pretrain_lr,
                                         betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
            return model, opt
        import deepspeed
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds_config(self.a, zenflow,
                                                                self.device.type == "cuda"))
        return engine, engine.optimizer

    def step(self, engine, opt, batch, lr: float) -> float:
        """One training step at ``lr``; its loss."""
        torch = self.torch
        x = torch.from_numpy(batch).to(self.device)
        for group in opt.param_groups:
            group["lr"] = lr
        if self.a.engine == "torch":
            loss = engine(x[:, :-1], x[:, 1:])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(engine.parameters(), 1.0)
            opt.step()
            return float(loss.detach())
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    def evaluate(self, engine, valid: np.ndarray) -> float:
        """Mean loss over the validation samples."""
        torch = self.torch
        module = engine.module if hasattr(engine, "module") else engine
        module.eval()
        losses = []
        with torch.no_grad():
            for i in range(0, len(valid), self.a.micro_batch):
                x = torch.from_numpy(valid[i:i + self.a.micro_batch]).to(self.device)
                with torch.autocast("cuda", dtype=torch.bfloat16,
                                    enabled=self.device.type == "cuda"):
                    losses.append(float(module(x[:, :-1], x[:, 1:])))
        module.train()
        return sum(losses) / len(losses)

    def sync(self):
        """Waits for the GPU (step times are wall times of finished steps)."""
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def train(self, engine, opt, batches: Batches, iters: int, peak: float, valid=None,
              eval_interval: int = 0) -> dict:
        """``iters`` steps on ``batches``; the curves (bench/gpu/zenflow_finetune.py's form)."""
        curves = {"iteration": [], "train_loss": [], "step_s": [], "eval_iteration": [],
                  "eval_loss": [], "eval_wall_s": []}
        wall = 0.0
        if valid is not None:
            # Step 0: the weights as the engine holds them before any update. Every row starts
            # from the same pretrained weights, so a row whose step-0 loss differs has had them
            # changed by its engine's set-up (seen with ZenFlow on DeepSpeed's CPU accelerator).
            curves["eval_iteration"].append(0)
            curves["eval_loss"].append(self.evaluate(engine, valid))
            curves["eval_wall_s"].append(0.0)
        for it in range(1, iters + 1):
            batch = batches.next()
            self.sync()
            start = time.perf_counter()
            loss = self.step(engine, opt, batch, lr_at(it, iters, peak))
            self.sync()
            took = time.perf_counter() - start
            wall += took
            curves["iteration"].append(it)
            curves["train_loss"].append(loss)
            curves["step_s"].append(round(took, 4))
            if valid is not None and eval_interval and (it % eval_interval == 0 or it == iters):
                curves["eval_iteration"].append(it)
                curves["eval_loss"].append(self.evaluate(engine, valid))
                curves["eval_wall_s"].append(round(wall, 3))
        return curves

    def release(self, engine):
        """Stops a ZenFlow optimizer process and frees the engine's memory."""
        opt = getattr(engine, "optimizer", None)
        proc = getattr(opt, "process", None)
        if proc is not None:
            proc.terminate()
            proc.join(timeout=30)
        del engine, opt
        gc.collect()
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()


def selective_steps(opt):
    """DeepSpeed ZenFlow's selective (GPU-side) AdamW: the most steps of any of its params.

    None for other optimizers. A check that the selected columns were updated at all.
    """
    selective = getattr(opt, "selective_optimizer", None)
    if selective is None:
        return None
    steps = [float(st["step"]) for st in selective.state.values() if "step" in st]
    return max(steps) if steps else 0.0


def main(argv=None) -> int:
    """Pretrains, then fine-tunes every row and seed; 0 when every run finished."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pretrain-data", required=True)
    p.add_argument("--finetune-data", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--work-dir", default="/tmp/ds-finetune")
    p.add_argument("--bundle", default=os.environ.get("DSBUNDLE_DIR") or next(
        (str(d) for d in (ROOT / ".peers" / "deepspeed", Path("/work/shared/peers/deepspeed"))
         if (d / "zero_infinity_bench.py").exists()), ""))
    p.add_argument("--engine", choices=("deepspeed", "torch"), default="deepspeed")
    for name, default in (("layers", 24), ("hidden", 2048), ("heads", 16), ("seq", 1024),
                          ("vocab", 32000), ("micro-batch", 8), ("pretrain-iters", 150),
                          ("finetune-iters", 100), ("eval-interval", 20), ("eval-iters", 4),
                          ("zenflow-update-interval", 4), ("zenflow-select-interval", 100)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--pretrain-lr", type=float, default=3e-4)
    p.add_argument("--finetune-lr", type=float, default=1e-4)
    p.add_argument("--zenflow-topk", type=float, default=0.1)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--rows", nargs="+", default=["ds-adam", "ds-zenflow"])
    p.add_argument("--deadline-at", type=float, default=0,
                   help="epoch seconds: a run that would end after it (by the last run of its "
                        "row, else the pretraining's time) is skipped and recorded as such")
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    pre = IndexedDataset(a.pretrain_data)
    fine = IndexedDataset(a.finetune_data)
    valid_docs = split_range(len(fine), "85,15,0", 1)
    valid = pieces(fine, list(valid_docs), a.seq + 1)[:a.eval_iters * a.micro_batch]
    print(f"[ds_finetune] engine {a.engine}; pretrain docs {len(pre)}, fine-tune docs "
          f"{len(fine)} (validation {len(valid_docs)}, {len(valid)} samples)", flush=True)
    trainer = Trainer(a)
    result = {"engine": a.engine, "runs": []}
    out = Path(a.output)

    def save():
        out.write_text(json.dumps(result))

    start = time.time()
    model = trainer.model()
    engine, opt = trainer.engine(model, zenflow=False)
    curves = trainer.train(engine, opt, Batches(pre, split_range(len(pre), "98,2,0", 0), a.seq,
                                                a.micro_batch, 1234),
                           a.pretrain_iters, a.pretrain_lr)
    module = engine.module if hasattr(engine, "module") else engine
    weights = {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}
    result["pretrain"] = {"final_train_loss": curves["train_loss"][-1],
                          "seconds": round(time.time() - start, 1)}
    print(f"[ds_finetune] pretrain: loss {curves['train_loss'][-1]:.4f}, "
          f"{time.time() - start:.0f} s", flush=True)
    trainer.release(engine)
    save()
    train_docs = split_range(len(fine), "85,15,0", 0)
    took = {}
    for seed in a.seeds:
        for row in a.rows:
            start = time.time()
            run = {"row": row, "seed": seed, "framework": "deepspeed", "engine": a.engine}
            guess = took.get(row, result["pretrain"]["seconds"])
            if a.deadline_at and start + guess > a.deadline_at:
                run.update(returncode=None, skipped=True, curves={})
                result["runs"].append(run)
                save()
                print(f"[ds_finetune] {row} seed {seed}: skipped (deadline)", flush=True)
                continue
            try:
                engine, opt = trainer.engine(trainer.model(weights), zenflow=row == "ds-zenflow")
                run["curves"] = trainer.train(
                    engine, opt, Batches(fine, train_docs, a.seq, a.micro_batch, seed),
                    a.finetune_iters, a.finetune_lr, valid, a.eval_interval)
                run["returncode"] = 0
                run["selective_steps"] = selective_steps(opt)
                trainer.release(engine)
                del engine, opt  # the next run's engine starts without this one's memory
            except Exception:  # a failed run is recorded; the others go on
                run["returncode"], run["error"] = 1, traceback.format_exc()[-3000:]
                run.setdefault("curves", {})
                print(run["error"], flush=True)
            run["process_s"] = took[row] = round(time.time() - start, 1)
            result["runs"].append(run)
            save()
            losses = run["curves"].get("eval_loss") or [None]
            print(f"[ds_finetune] {row} seed {seed}: final val loss {losses[-1]}, "
                  f"{run['process_s']} s", flush=True)
    return 0 if all(r["returncode"] == 0 or r.get("skipped") for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
