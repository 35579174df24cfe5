"""One iteration's work on megatron-core's schedules, the base of the training loop's Trainer.

:class:`Steps` runs forward and backward over the micro-batches and the optimizer step
(:meth:`Steps.train_step`), the evaluation (:meth:`Steps.evaluate`), and wires the
callbacks megatron-core's schedules expect. The model, optimizer, scheduler, data and
batch ramp it uses are the :class:`~megatron_ext.training.loop.Trainer`'s, which builds
them and runs the loop over iterations.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from megatron_ext.data.datasets import build_loader
from megatron_ext.runtime import faults
from megatron_ext.runtime.fatal import during
from megatron_ext.runtime.to_host import ToHost
from megatron_ext.training.metrics import Stopwatch
from megatron_ext.training.reductions import _global_mean, _global_sum, _sum_reports


def _empty_cache(runtime) -> None:
    if not runtime.is_cpu:
        torch.cuda.empty_cache()


def _to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """Token-summed masked loss, the token count, and both for reporting."""
    losses = output.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss.detach(), mask.sum()])
    return loss, num_tokens, {"lm loss": report}


def _forward_step(device, iteration, data_iterator, model):
    """One micro-batch's forward; ``iteration`` is None in evaluation (for the crash faults)."""
    with during("loading data"):
        batch = next(data_iterator)
    batch = _to_device(batch, device)
    if iteration is not None:
        faults.crash_point("forward", iteration)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    if iteration is not None:
        output = faults.crashes_in_backward(output, iteration)
    return output, functools.partial(_loss_func, batch["loss_mask"])


class Steps:
    """An iteration's forward, backward and optimizer step, and the evaluation.

    The base of :class:`~megatron_ext.training.loop.Trainer`; it reads the Trainer's
    ``cfg``, ``runtime``, ``model``, ``config``, ``optimizer``, ``scheduler``, ``ramp``,
    ``timers``, ``valid_ds``, ``num_microbatches``, ``eval_microbatches`` and
    ``_sync_stream_only``.
    """

    def _wire_megatron_hooks(self, finalize_model_grads) -> None:
        """The callbacks megatron-core's schedules expect on the model config."""
        config, par = self.config, self.cfg.parallel
        config.grad_scale_func = self.optimizer.scale_loss
        config.timers = self.timers
        config.finalize_model_grads_func = finalize_model_grads
        # One function per model chunk with the interleaved schedule (Megatron-LM's wiring).
        one = len(self.model) == 1
        if par.overlap_grad_reduce:
            no_sync = [chunk.no_sync for chunk in self.model]
            config.no_sync_func = no_sync[0] if one else no_sync
            config.grad_sync_func = [chunk.start_grad_sync for chunk in self.model]
            if one:
                config.grad_sync_func = config.grad_sync_func[0]
        if par.overlap_param_gather:
            param_sync = [chunk.start_param_sync for chunk in self.model]
            config.param_sync_func = param_sync[0] if one else param_sync

    @contextlib.contextmanager
    def _params_gathered(self):
        """For eval and save: with overlapped param gather, gather the parameters first."""
        overlap = self.cfg.parallel.overlap_param_gather
        if overlap:
            for chunk in self.model:
                chunk.disable_forward_pre_hook(param_sync=True)
        try:
            yield
        finally:
            if overlap:
                for chunk in self.model:
                    chunk.enable_forward_pre_hook()

    def _synchronize(self) -> None:
        """Waits for the GPU's work before a phase's time is taken (see RuntimeConfig.step_sync)."""
        if self.runtime.is_cpu:
            return
        if self._sync_stream_only:
            torch.cuda.current_stream(self.runtime.device).synchronize()
        else:
            torch.cuda.synchronize()

    def _data_iterator(self, make_loader):
        """The schedule's data iterator: one, or one per model chunk (interleaved schedule).

        Every chunk's forward step reads its own micro-batch (its stage's tokens and labels),
        so with several chunks each gets its own loader over the same samples, as in
        Megatron-LM.
        """
        if len(self.model) == 1:
            return iter(make_loader())
        return [iter(make_loader()) for _ in self.model]

    def train_step(self, data_iterator, interval_loss: torch.Tensor, logs: bool = False,
                   step_loss: bool = False):
        """One iteration: forward/backward over the micro-batches, then the optimizer.

        Adds the iteration's (loss, tokens) into ``interval_loss``. With ``logs`` (the
        iteration is logged) returns what the log reads from the GPU, on its way to the
        host before the optimizer step (see :class:`ToHost`): the global (loss, tokens)
        sum and the loss scale this iteration's backward ran with; else None. With
        ``step_loss`` (TensorBoard writes this iteration) the same, plus this iteration's
        own global (loss, tokens) sum as ``step_loss``.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        cfg = self.cfg
        it = self.state.iteration + 1
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        watch = Stopwatch()
        with during(f"running forward and backward (iteration {it})"):
            losses = get_forward_backward_func()(
                forward_step_func=functools.partial(_forward_step, self.runtime.device, it),
                data_iterator=data_iterator,
                model=self.model,
                num_microbatches=self.num_microbatches,
                seq_length=cfg.model.seq_length,
                micro_batch_size=cfg.training.micro_batch_size,
                forward_only=False,
            )
            self._synchronize()
        t_fb = watch.lap()
        if cfg.training.empty_unused_memory_level >= 1:
            _empty_cache(self.runtime)
        step_sum = _sum_reports(losses, self.runtime.device)
        interval_loss += step_sum
        reads = None
        if logs or step_loss:
            scale = self.optimizer.get_loss_scale()
            reads = {"loss_scale": ToHost(scale.detach()) if torch.is_tensor(scale) else scale}
            if logs:
                reads["loss"] = _global_sum(interval_loss)
            if step_loss:
                reads["step_loss"] = _global_sum(step_sum)
        with during(f"taking the optimizer step (iteration {it})"):
            faults.crash_point("optimizer", it)
            ok, grad_norm, self.num_zeros_in_grad = self.optimizer.step()
            self._synchronize()
        t_opt = watch.lap()
        if cfg.training.empty_unused_memory_level >= 2:
            _empty_cache(self.runtime)
        if ok:
            # Megatron-LM's scheduler counts samples: this iteration's global batch.
            self.scheduler.step(increment=self.ramp.global_batch_size)
        return reads, ok, grad_norm, t_fb, t_opt

    def evaluate(self) -> float:
        """Loss on the first --eval-iters global batches of the validation split."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        cfg = self.cfg
        loader = build_loader(self.valid_ds, 0, cfg, self.runtime)
        if loader is None or len(loader) < cfg.training.eval_iters * self.eval_microbatches:
            return float("nan")
        it = self._data_iterator(lambda: build_loader(self.valid_ds, 0, cfg, self.runtime))
        total = torch.zeros(2, dtype=torch.float64, device=self.runtime.device)
        for chunk in self.model:
            chunk.eval()
        # The schedule's forward timers belong to training: evaluation must not add to them.
        timers, self.config.timers = self.config.timers, None
        with torch.no_grad(), self._params_gathered():
            for _ in range(cfg.training.eval_iters):
                losses = get_forward_backward_func()(
                    forward_step_func=functools.partial(_forward_step, self.runtime.device,
                                                        None),
                    data_iterator=it, model=self.model, num_microbatches=self.eval_microbatches,
                    seq_length=cfg.model.seq_length,
                    micro_batch_size=cfg.training.micro_batch_size, forward_only=True)
                total += _sum_reports(losses, self.runtime.device)
        self.config.timers = timers
        for chunk in self.model:
            chunk.train()
        return _global_mean(total)
