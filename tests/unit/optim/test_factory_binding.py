"""megatron-core's real factory builds the class a mode binds, or the build is refused."""

from __future__ import annotations

import pytest

from megatron_ext.config import parse_config

REQUIRED = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
            "--lr", "1e-3", "--train-iters", "2", "--mock-data", "--vocab-size", "100",
            "--device", "cpu", "--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def runtime():
    from mext_testing import single_process_runtime

    with single_process_runtime(REQUIRED) as rt:
        yield rt


def build(runtime, *flags):
    """(config, model chunks, optimizer) of a tiny GPT on the CPU."""
    from megatron_ext.model import build_model
    from megatron_ext.training.optimizer import build_optimizer

    cfg = parse_config([*REQUIRED, *flags])
    cfg.check_world(1)
    model, _ = build_model(cfg, runtime, 128)
    return cfg, model, build_optimizer(cfg, model, runtime)


def chain(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


@pytest.mark.parametrize("flags, module, name", [
    (["--offload-optimizer"], "megatron_ext.offload.optimizer", "OffloadedDistributedOptimizer"),
    (["--zenflow"], "megatron_ext.zenflow.optimizer", "ZenFlowOptimizer"),
])
def test_the_factory_builds_the_bound_class(runtime, flags, module, name):
    import importlib

    from megatron_ext.optim.chain import close_optimizer

    cls = getattr(importlib.import_module(module), name)
    _, _, optimizer = build(runtime, *flags)
    try:
        assert chain(optimizer) and all(isinstance(opt, cls) for opt in chain(optimizer))
    finally:
        close_optimizer(optimizer)
    # The binding ends with the block: the next build is megatron-core's own again.
    import megatron.core.optimizer as mcore_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    assert mcore_optimizer.DistributedOptimizer is DistributedOptimizer


def test_the_plain_mode_builds_megatron_cores_optimizer(runtime):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_ext.optim.sharded_optimizer import ShardedStateOptimizer

    _, _, optimizer = build(runtime)
    assert all(type(opt) is DistributedOptimizer for opt in chain(optimizer))
    assert not any(isinstance(opt, ShardedStateOptimizer) for opt in chain(optimizer))


def test_a_factory_that_ignores_the_binding_is_refused(runtime, monkeypatch):
    """As a megatron-core whose factory no longer looks DistributedOptimizer up by name."""
    import megatron.core.optimizer as mcore_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    real = mcore_optimizer._get_megatron_optimizer_based_on_param_groups

    def ignoring_the_binding(*args, **kwargs):
        bound = mcore_optimizer.DistributedOptimizer
        mcore_optimizer.DistributedOptimizer = DistributedOptimizer
        try:
            return real(*args, **kwargs)
        finally:
            mcore_optimizer.DistributedOptimizer = bound

    monkeypatch.setattr(mcore_optimizer, "_get_megatron_optimizer_based_on_param_groups",
                        ignoring_the_binding)
    with pytest.raises(RuntimeError, match="built megatron.core.optimizer.distrib_optimizer."
                                           "DistributedOptimizer, not the bound "
                                           "OffloadedDistributedOptimizer"):
        build(runtime, "--offload-optimizer")


def test_check_bound_looks_at_every_optimizer_of_a_chain():
    from types import SimpleNamespace

    from megatron_ext.optim.sharded_optimizer import check_bound

    class Bound:
        pass

    good = SimpleNamespace(chained_optimizers=[Bound(), Bound()])
    assert check_bound(good, Bound) is good
    single = Bound()
    assert check_bound(single, Bound) is single
    with pytest.raises(RuntimeError, match="built .*object, not the bound Bound"):
        check_bound(SimpleNamespace(chained_optimizers=[Bound(), object()]), Bound)
