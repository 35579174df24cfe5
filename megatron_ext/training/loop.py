"""The training loop: megatron-core schedules, DDP, optimizer, scheduler, checkpoints.

The loop never names a training mode: each one (the registered optimizer modes of
:mod:`megatron_ext.optim.modes`, e.g. offload and ZenFlow) enters through
:func:`megatron_ext.training.optimizer.build_optimizer`, the optimizer's own methods and
its metrics, which :func:`~megatron_ext.training.metrics.format_line` hands to the modes.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import os
import sys

import torch

from megatron_ext.checkpoint import checkpointing as ckpt
from megatron_ext.checkpoint import load_checks, save_lock
from megatron_ext.data.datasets import build_loader
from megatron_ext.errors import UsageError
from megatron_ext.optim.chain import close_optimizer, optimizer_metrics
from megatron_ext.optim.modes import derived_metrics
from megatron_ext.runtime import faults
from megatron_ext.runtime.batch_schedule import BatchRamp
from megatron_ext.runtime.fatal import during
from megatron_ext.runtime.quiet import quiet_cuda_advice, quiet_optional_dependencies
from megatron_ext.runtime.signals import ExitSignalHandler
from megatron_ext.runtime.to_host import ToHost
from megatron_ext.training.metrics import (
    EtaClock,
    MetricsWriter,
    Stopwatch,
    dir_size_text,
    format_line,
    maybe_float,
    memory_stats,
    num_parameters,
)
from megatron_ext.training.profiling import Profiler
from megatron_ext.training.reductions import _mean, _params_norm
from megatron_ext.training.step import Steps
from megatron_ext.training.tensorboard import TensorBoardWriter

log = logging.getLogger("megatron_ext")


def _setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(message)s", stream=sys.stdout, force=True)
    logging.getLogger("megatron").setLevel(logging.WARNING if rank == 0 else logging.ERROR)
    # Mock datasets have no cache directory; megatron-core warns about it per split.
    logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)


def _minutes_since_start() -> float:
    """Minutes since this process started (Megatron-LM counts from its start too)."""
    import time

    import psutil

    return (time.time() - psutil.Process().create_time()) / 60.0


def _deterministic(runtime) -> None:
    """--deterministic-mode: deterministic torch kernels (and NCCL_ALGO, as Megatron-LM)."""
    if not runtime.is_cpu and os.environ.get("NCCL_ALGO") not in (
            "Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS"):
        raise UsageError("--deterministic-mode needs NCCL_ALGO set to one of Tree, Ring, "
                         "CollnetDirect, CollnetChain, ^NVLS (as Megatron-LM), e.g. "
                         "NCCL_ALGO=Ring")
    # cuBLAS is deterministic only with a fixed workspace; torch insists on this variable.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def _evaluates(cfg, valid_ds) -> bool:
    """Whether the run evaluates: --eval-iters > 0 and a validation split with samples.

    As Megatron-LM, no validation split means no evaluation; said once at start here (an
    empty split evaluated printed a nan loss at every interval). --skip-train (and
    tools/evaluate.py) would have nothing to do: refused.

    Raises:
        UsageError: --skip-train with an empty validation split.
    """
    if not cfg.training.eval_iters:
        return False
    if valid_ds is not None and len(valid_ds) > 0:
        return True
    split = cfg.data.split
    if cfg.training.skip_train:
        raise UsageError(f"validation split is empty (--split {split}): there is nothing to "
                         "evaluate; give the split a validation share")
    log.info("validation split is empty (--split %s): evaluation is skipped; give the split "
             "a validation share to evaluate", split)
    return False


class Trainer(Steps):
    """One run: model, optimizer, data and the loop over iterations."""

    def __init__(self, cfg):
        from megatron.core.distributed import finalize_model_grads

        from megatron_ext.data.datasets import build_datasets, check_data
        from megatron_ext.data.tokenizer import build_tokenizer
        from megatron_ext.memory.report import plan_metrics
        from megatron_ext.memory.startup import plan_before_start
        from megatron_ext.model import build_model, padded_vocab_size
        from megatron_ext.runtime.distributed import initialize
        from megatron_ext.training.optimizer import build_optimizer, build_scheduler
        from megatron_ext.training.timers import SyncTimers

        self.cfg = cfg
        self._sync_stream_only = cfg.runtime.step_sync == "stream"
        self.runtime = rt = initialize(cfg)
        _setup_logging(rt.rank)
        # Before anything is read or written: one run per --save directory.
        self.save_lock = save_lock.take(cfg.checkpoint.save, rt)
        if cfg.checkpoint.save_note():
            log.info("%s", cfg.checkpoint.save_note())
        if cfg.training.deterministic_mode:
            _deterministic(rt)
        tokenizer = build_tokenizer(cfg.data)
        # Before the plan and the model: the corpus readable, its ids in the vocabulary.
        check_data(cfg.data, tokenizer.vocab_size, cfg.data.tokenizer_type)
        load_dir = load_checks.resolve_load_dir(cfg)
        # Before anything is built from it: every file verified, the model settings taken
        # (--use-checkpoint-args) or compared.
        common = load_checks.prepare_load(load_dir, cfg, rt) if load_dir else None
        # Before the first allocation: what goes where, and a one-line refusal of what
        # cannot fit (megatron_ext.memory).
        self.memory_plan = plan_before_start(cfg, rt, tokenizer.vocab_size)
        log.info("start-up: building the datasets")
        self.train_ds, self.valid_ds, _ = build_datasets(cfg, rt, tokenizer)
        self.evaluates = _evaluates(cfg, self.valid_ds)
        self.vocab_size = padded_vocab_size(tokenizer.vocab_size,
                                            cfg.model.make_vocab_size_divisible_by, rt.tp)
        if common is not None:
            load_checks.check_model(common, cfg, self.vocab_size, load_dir)
        log.info("start-up: building the model")
        self.model, self.config = build_model(cfg, rt, self.vocab_size)
        log.info("start-up: building the optimizer")
        self.optimizer = build_optimizer(cfg, self.model, rt, plan=self.memory_plan)
        self.scheduler = build_scheduler(cfg, self.optimizer)
        self.timers = SyncTimers(self._synchronize, log_level=2, log_option="max")
        self._wire_megatron_hooks(finalize_model_grads)
        self.state = ckpt.TrainState()
        if load_dir:
            log.info("start-up: loading checkpoint %s (%s)", load_dir, dir_size_text(load_dir))
            self.state = ckpt.load_checkpoint(load_dir, self.model, self.optimizer,
                                              self.scheduler, cfg, rt, verified=True)
            log.info("loaded %s (iteration %d, %d samples consumed)", load_dir,
                     self.state.iteration, self.state.consumed_train_samples)
        self.num_params = num_parameters(cfg, self.vocab_size)
        # Evaluation takes full global batches (Megatron-LM's eval_batch_size); training
        # the current batch of --rampup-batch-size's ramp.
        self.eval_microbatches = cfg.training.global_batch_size // (
            cfg.training.micro_batch_size * rt.dp)
        self.ramp = BatchRamp(cfg.training, rt.rank, rt.dp)
        self.num_microbatches = self.ramp.update(self.state.consumed_train_samples)
        self.writer = MetricsWriter(cfg, enabled=rt.rank == 0)
        self._plan_record = plan_metrics(self.memory_plan)  # into the first logged record
        self.tensorboard = TensorBoardWriter(cfg, rt.rank, rt.world_size, rt.is_cpu)
        log.info("megatron_ext: %s x%d (TP=%d PP=%d DP=%d%s), %.2fM parameters, vocab %d "
                 "(padded from %d), %d micro-batches per iteration%s",
                 rt.device.type, rt.world_size, rt.tp, rt.pp, rt.dp,
                 f", interleaved: {len(self.model)} model chunks per pipeline rank"
                 if len(self.model) > 1 else "", self.num_params / 1e6,
                 self.vocab_size, tokenizer.vocab_size, self.num_microbatches,
                 f" (--rampup-batch-size: growing to {self.eval_microbatches})"
                 if self.num_microbatches != self.eval_microbatches else "")

    def save(self) -> None:
        """Saves a checkpoint of the current iteration (when --save is given)."""
        if not self.cfg.checkpoint.save:
            return
        watch = Stopwatch()
        with during(f"saving the checkpoint of iteration {self.state.iteration}"), \
                self._params_gathered():
            path = ckpt.save_checkpoint(self.cfg.checkpoint.save, self.state, self.model,
                                        self.optimizer, self.scheduler, self.cfg, self.runtime)
        self.last_saved = self.state.iteration
        log.info("saved checkpoint %s in %.2f s", path, watch.lap())

    def _log(self, reads: dict, iters, samples, t_fb, t_opt, elapsed, grad_norm,
             skipped) -> None:
        cfg, rt = self.cfg, self.runtime
        loss = _mean(reads["loss"])
        scale = reads["loss_scale"]
        timer = lambda name: self.timers(name).elapsed(reset=True) / iters  # noqa: E731
        gbs = self.ramp.global_batch_size
        per_iter = elapsed / iters
        # Tokens per iteration over the interval (the batch changes along a ramp).
        tokens = samples / iters * cfg.model.seq_length
        record = {
            "iteration": self.state.iteration,
            "consumed_samples": self.state.consumed_train_samples,
            "global_batch_size": gbs,
            "lm_loss": loss,
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": maybe_float(grad_norm),
            "loss_scale": maybe_float(scale.get() if isinstance(scale, ToHost) else scale),
            # Per log interval, as Megatron-LM's line (the checkpoint keeps the total).
            "skipped_iterations": skipped,
            "time/iteration_s": per_iter,
            "time/forward_backward_s": t_fb / iters,
            "time/forward_s": timer("forward-compute"),
            "time/backward_s": timer("backward-compute"),
            "time/grad_sync_s": timer("all-grads-sync"),
            "time/optimizer_s": t_opt / iters,
            "throughput/tokens_per_s": tokens / per_iter,
            "throughput/tflops_per_gpu": 6.0 * self.num_params * tokens / per_iter
            / rt.world_size / 1e12,
        }
        if cfg.logging.log_num_zeros_in_grad:
            record["num_zeros_in_grad"] = maybe_float(self.num_zeros_in_grad)
        if cfg.logging.log_params_norm:
            record["params_norm"] = _params_norm(self.model)
        record.update(optimizer_metrics(self.optimizer))
        record.update(memory_stats(rt))
        record.update(self._plan_record)
        self._plan_record = {}
        record.update(derived_metrics(record))  # e.g. offload's roofline ratio
        record["time/eta_s"] = self.eta.add(iters, elapsed, self.state.iteration)
        if rt.rank == 0:
            print(format_line(record, cfg.training.train_iters, cfg.logging.log_throughput),
                  flush=True)
        self.writer.write(record)
        self.tensorboard.timers(record)

    def _log_tensorboard(self, reads: dict, grad_norm) -> None:
        """Writes the iteration's scalars to TensorBoard (Megatron-LM's tags)."""
        scale = reads["loss_scale"]
        self.tensorboard.train(self.state.iteration, self.state.consumed_train_samples, {
            "lm_loss": _mean(reads["step_loss"]),
            "lr": self.optimizer.param_groups[0]["lr"],
            "global_batch_size": self.ramp.global_batch_size,
            "loss_scale": maybe_float(scale.get() if isinstance(scale, ToHost) else scale),
            "grad_norm": maybe_float(grad_norm),
        })

    def train(self) -> int:
        """Runs the loop to --train-iters (or an exit condition); returns the exit status."""
        cfg, rt = self.cfg, self.runtime
        train = cfg.training
        if train.skip_train:
            log.info("skipping training (--skip-train is on): evaluating at iteration %d",
                     self.state.iteration)
            self._log_eval()
            return 0
        if self.state.iteration > 0 and self.state.iteration >= train.train_iters:
            # A re-run of a finished run: its final evaluation and checkpoint exist, and a
            # second evaluation would only duplicate its records (Megatron-LM evaluates
            # again). --skip-train evaluates a checkpoint on purpose.
            log.info("iteration %d of --train-iters %d already reached: nothing to train",
                     self.state.iteration, train.train_iters)
            return 0
        if self.state.iteration >= train.train_iters:
            # --train-iters 0 from scratch: nothing to train; the evaluation below runs on
            # the model as it is.
            log.info("no training: iteration %d, --train-iters %d", self.state.iteration,
                     train.train_iters)
        consumed = self.state.consumed_train_samples
        data_iterator = self._data_iterator(lambda: build_loader(self.train_ds, consumed, cfg, rt,
                                                                 faults.armed()))
        self.last_saved = self.state.iteration
        interval_loss = torch.zeros(2, dtype=torch.float64, device=rt.device)
        iters = skipped = samples = 0
        t_fb = t_opt = 0.0
        window = Stopwatch()
        profiler = Profiler(cfg.logging, rt.rank, rt.is_cpu, cfg.logging.tensorboard_dir)
        self.eta = EtaClock(train.train_iters)
        log.info("start-up: done; training from iteration %d (the first iterations include "
                 "warm-up)", self.state.iteration + 1)
        with ExitSignalHandler() as signals, profiler:
            while self.state.iteration < train.train_iters:
                it = self.state.iteration + 1
                faults.armed().reached(it)
                if self._next_batch():
                    window.lap()
                profiler.before(it)
                logs = it % train.log_interval == 0 or it == train.train_iters
                tb = self.tensorboard.wants(it)
                reads, ok, grad_norm, fb, opt = self.train_step(data_iterator, interval_loss, logs,
                                                                step_loss=tb)
                self.state.iteration = it
                profiler.after(self.state.iteration)
                self.state.consumed_train_samples += self.ramp.global_batch_size
                # The 6N estimate of the metrics (Megatron-LM counts per layer).
                self.state.num_floating_point_operations_so_far += (
                    6.0 * self.num_params * self.ramp.global_batch_size * cfg.model.seq_length)
                samples += self.ramp.global_batch_size
                if ok:
                    self.state.optimizer_steps += 1
                else:
                    self.state.skipped_iterations += 1
                    skipped += 1
                if tb:
                    self._log_tensorboard(reads, grad_norm)
                iters += 1
                t_fb += fb
                t_opt += opt
                if logs:
                    self._log(reads, iters, samples, t_fb, t_opt, window.lap(), grad_norm,
                              skipped)
                    interval_loss.zero_()
                    iters, skipped, samples, t_fb, t_opt = 0, 0, 0, 0.0, 0.0
                if train.manual_gc and train.manual_gc_interval \
                        and it % train.manual_gc_interval == 0:
                    gc.collect()
                if (self.evaluates and train.eval_interval and it % train.eval_interval == 0
                        and it < train.train_iters):
                    self._log_eval()
                    window.lap()
                ck = cfg.checkpoint
                if ck.save_interval and it % ck.save_interval == 0:
                    self.save()
                    window.lap()
                if signals.should_exit(rt.host_group):
                    log.info("exit signal received: saving at iteration %d and exiting", it)
                    if self.last_saved != it:
                        self.save()
                    return 0
                if train.exit_interval and it % train.exit_interval == 0:
                    log.info("--exit-interval %d reached at iteration %d", train.exit_interval, it)
                    if self.last_saved != it:
                        self.save()
                    return 0
                if train.exit_duration_in_mins and self._duration_reached():
                    log.info("--exit-duration-in-mins %d reached at iteration %d",
                             train.exit_duration_in_mins, it)
                    if self.last_saved != it:
                        self.save()
                    return 0
        if self.evaluates:
            self._log_eval()
        if self.last_saved != self.state.iteration:
            self.save()
        return 0

    def _next_batch(self) -> bool:
        """Sets the next iteration's batch from the ramp; whether a checkpoint was saved.

        As Megatron-LM: when the ramp grows the batch, the iteration before is saved
        (with --save), so a run can resume at every batch size.
        """
        before = self.num_microbatches
        self.num_microbatches = self.ramp.update(self.state.consumed_train_samples)
        if (self.num_microbatches != before and self.state.iteration and self.cfg.checkpoint.save
                and self.last_saved != self.state.iteration):
            self.save()
            return True
        return False

    def _duration_reached(self) -> bool:
        """Whether --exit-duration-in-mins has passed on any rank (all agree)."""
        done = torch.tensor([_minutes_since_start() > self.cfg.training.exit_duration_in_mins],
                            dtype=torch.int)
        if self.runtime.host_group is not None:
            torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MAX,
                                         group=self.runtime.host_group)
        return bool(done.item())

    def _log_eval(self) -> None:
        manual_gc = self.cfg.training.manual_gc and self.cfg.training.manual_gc_eval
        if manual_gc:
            gc.collect()
        with during(f"evaluating (iteration {self.state.iteration})"):
            loss = self.evaluate()
        if manual_gc:
            gc.collect()
        ppl = math.exp(min(20.0, loss)) if not math.isnan(loss) else float("nan")
        if self.runtime.rank == 0:
            print(f" validation loss at iteration {self.state.iteration} | lm loss value: "
                  f"{loss:.6E} | lm loss PPL: {ppl:.6E} |", flush=True)
        self.writer.write({"iteration": self.state.iteration, "eval/lm_loss": loss,
                           "eval/lm_ppl": ppl})
        self.tensorboard.validation(self.state.iteration, self.state.consumed_train_samples,
                                    loss, ppl)

    def close(self) -> None:
        """Closes the metrics writers and the optimizer's threads and files."""
        close_optimizer(self.optimizer)
        self.ramp.close()
        self.writer.close()
        self.tensorboard.close()
        if self.save_lock is not None:
            self.save_lock.release()


def _interrupted(cfg, started: bool) -> str:
    """What a Ctrl-C leaves (``started``: the trainer was built), and the signal that saves.

    Ctrl-C raises where it lands, mid-step perhaps, in a state not fit to save; SIGTERM is
    recorded and answered with a checkpoint at the next iteration (runtime/signals.py).
    """
    if not started:
        return ""
    if not cfg.checkpoint.save:
        return ("nothing saved (no --save); with --save DIR, SIGTERM saves a checkpoint and "
                "exits")
    return "nothing saved since the last checkpoint; send SIGTERM to save a checkpoint and exit"


def pretrain(cfg) -> int:
    """Trains a GPT as configured; returns the process exit status.

    A failure is reported at once, in one line for the whole job
    (:func:`megatron_ext.runtime.fatal.announce`), the run's writers and threads are closed
    with a bound, and the exception goes on to the entry point, which ends the process.
    """
    from megatron_ext.runtime import fatal
    from megatron_ext.runtime.distributed import shutdown
    from megatron_ext.training.oom_advice import oom_advice

    quiet_optional_dependencies()
    trainer = None
    try:
        with during("starting up"):
            trainer = Trainer(cfg)
        if trainer.runtime.is_cpu:
            quiet_cuda_advice()
        faults.arm(faults.Crashes(cfg.faults.crash, trainer.runtime.rank))
        if cfg.training.manual_gc:
            # Collections at fixed points only, so that ranks pause together (Megatron-LM).
            gc.disable()
            gc.collect()
        status = trainer.train()
    except BaseException as exc:
        fatal.announce(exc, functools.partial(oom_advice, cfg),
                       interrupted=_interrupted(cfg, trainer is not None))
        if trainer is not None:
            fatal.bounded(trainer.close)
        raise
    finally:
        faults.arm(faults.Crashes())
        if cfg.training.manual_gc:
            gc.enable()
    # The ranks leave at their own pace from here: a rank that is gone is no failure.
    fatal.detach()
    trainer.close()
    shutdown()
    return status
