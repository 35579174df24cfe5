"""Megatron-LM's own ``tools/checkpoint/convert.py`` with its bugs at core_v0.16.1 worked around.

Runs the unmodified converter from Megatron-LM's source (``--mlm-dir DIR`` or ``MLM_DIR``) on a
``torch_dist`` checkpoint, e.g. one written by this project's ``pretrain_gpt.py``, with
``--loader core`` and ``--saver core`` or ``--saver legacy``; ``--verify`` then compares every
weight of the converter's output with the checkpoint it read. Not part of this project's tools
(``tools/convert_checkpoint.py`` is).

Usage (repository root)::

    python bench/peers/megatron_lm_convert.py --mlm-dir DIR [--cpu] [--verify] CONVERT_FLAGS...

where CONVERT_FLAGS are convert.py's, e.g. ``--model-type GPT --loader core --saver core
--loader-transformer-impl local --saver-transformer-impl local --load-dir CKPT --save-dir OUT``
(both implementations ``local`` without Transformer Engine).

Without Transformer Engine or Apex, at core_v0.16.1 the converter fails in its own code
before or after reading any weight, whoever wrote the checkpoint (Megatron-LM's own fails
alike). Each fix below is a runtime patch applied before ``convert.py`` runs (its saver
process is forked from this one and inherits them) and prints one line where it acts:

1. ``loader_core``'s ``import_model_provider`` builds ``partial(model_provider, gpt_builder)``
   but returns the bare ``model_provider``, which the loader then calls without its
   ``model_builder`` argument (TypeError). Fix: it returns the partial it built.
2. The loader and the savers keep Megatron-LM's defaults ``apply_rope_fusion`` and
   ``gradient_accumulation_fusion``, which need Transformer Engine (ValueError in
   ``TransformerConfig``) and Apex (RuntimeError in ``ColumnParallelLinear``), and have no
   flag for them. Fix: both are turned off before ``validate_args``, as the converter
   already does for its other fusions; it never runs the model, so nothing else changes.
3. megatron-core's models ask for the data-parallel groups (``GPTModel`` through
   ``ProcessGroupCollection.use_mpu_process_groups``) and ``save_checkpoint`` for the
   pipeline group, which the converter never creates: it fakes only the tensor- and
   expert-parallel ones (AssertionError). Fix: its own ``_ConverterFakeProcessGroup`` for
   them too: data-parallel size 1, the pipeline group reporting the converter's pipeline
   rank and size.
4. The loader reads a ``torch_dist`` checkpoint with ``dist_checkpointing.load``, which
   needs a default process group; the converter never initializes ``torch.distributed``
   (ValueError). Fix: a one-process gloo group in the loader, before it reads the weights
   (not in the saver: there it would send ``save_checkpoint`` down its multi-rank path).
5. ``saver_core`` asserts a Transformer Engine version (``importlib.metadata``'s
   PackageNotFoundError without it) even with ``--saver-transformer-impl local``. Fix: the
   check is skipped; the rest of that method (``--megatron-path``) is kept.
6. ``saver_legacy`` builds Megatron-LM's legacy model, whose ``get_norm`` reads
   ``args.apply_layernorm_1p``, an argument Megatron-LM's parser no longer has
   (AttributeError). Fix: it is set to False (the only value that builds an RMSNorm there)
   where it is missing and legacy models are used.
7. ``convert.py`` exits 0 when its saver process fails. Fix: this script exits 1 then.

``--cpu``: the converter on a machine without a GPU through this project's CUDA-to-CPU layer
plus the stand-ins of ``bench/peers/megatron_lm_launch.py --cpu`` (``torch.cuda.*`` calls, the
``nvcc -V`` of the legacy fused kernels' start-up).

``--verify``: afterwards, every weight of the converter's output (``--save-dir``, a
``torch``-format checkpoint of one rank) is compared with the ``torch_dist`` checkpoint it
read (``--load-dir``, read with ``torch.distributed.checkpoint`` directly, not through
Megatron-LM); names are mapped from megatron-core's local layers or the legacy model, and
every model tensor of the input must be covered exactly once.
"""
from __future__ import annotations

import multiprocessing
import os
import re
import runpy
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _say(message: str) -> None:
    print(f"megatron_lm_convert: {message}", flush=True)


def _apply_fixes() -> None:
    import loader_base
    import loader_core
    import megatron.training.arguments as mlm_arguments
    import megatron.training.global_vars as mlm_global_vars
    import saver_base
    from megatron.core import parallel_state as ps
    from utils import _ConverterFakeProcessGroup

    # 1. The loader's model provider without its model builder.
    import_model_provider = loader_core.MegatronCheckpointLoaderLLM.import_model_provider

    def import_model_provider_with_builder(self):
        bare = import_model_provider(self)
        if getattr(self, "model_provider", None) is not None:
            _say("fix 1: the loader gets model_provider with its model_builder (gpt_builder)")
            return self.model_provider
        return bare

    loader_core.MegatronCheckpointLoaderLLM.import_model_provider = (
        import_model_provider_with_builder)

    # 2. Fusions that need Transformer Engine or Apex, no flag for them.
    validate_args = mlm_arguments.validate_args

    def validate_args_without_fusions(args, *rest, **kwargs):
        on = [name for name in ("apply_rope_fusion", "gradient_accumulation_fusion")
              if getattr(args, name, False)]
        for name in on:
            setattr(args, name, False)
        if on:
            role = "loader" if multiprocessing.parent_process() is None else "saver"
            _say(f"fix 2: {', '.join(on)} off ({role})")
        return validate_args(args, *rest, **kwargs)

    mlm_arguments.validate_args = validate_args_without_fusions

    # 3. Data-parallel and pipeline groups the converter never creates.
    class _PipelineGroup(_ConverterFakeProcessGroup):
        def rank(self):
            return ps.get_pipeline_model_parallel_rank()

        def size(self):
            return ps.get_pipeline_model_parallel_world_size()

    for name in ("_DATA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP_WITH_CP",
                 "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP"):
        setattr(ps, name, _ConverterFakeProcessGroup(size=1))
    ps._PIPELINE_MODEL_PARALLEL_GROUP = _PipelineGroup()
    _say("fix 3: fake data-parallel (size 1) and pipeline groups, as the converter's "
         "tensor-parallel one")

    # 4. A default process group for dist_checkpointing.load, in the loader only.
    load_model_shards = loader_base.MegatronCheckpointLoaderBase.load_model_shards

    def load_model_shards_with_group(self, *args, **kwargs):
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group(
                "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
            _say("fix 4: one-process gloo group for the loader's dist_checkpointing.load")
        return load_model_shards(self, *args, **kwargs)

    loader_base.MegatronCheckpointLoaderBase.load_model_shards = load_model_shards_with_group

    # 5. saver_core's Transformer Engine version check.
    def megatron_path_without_te_check(self):
        if self.args.megatron_path is not None:
            sys.path.insert(0, self.args.megatron_path)
        _say("fix 5: saver's Transformer Engine version check skipped")

    saver_base.MegatronCheckpointSaverBase.insert_megatron_path_and_check_te = (
        megatron_path_without_te_check)

    # 6. The legacy model's apply_layernorm_1p, gone from Megatron-LM's arguments.
    set_global_variables = mlm_global_vars.set_global_variables

    def set_global_variables_with_1p(args, *rest, **kwargs):
        if getattr(args, "use_legacy_models", False) and not hasattr(args, "apply_layernorm_1p"):
            args.apply_layernorm_1p = False
            _say("fix 6: apply_layernorm_1p=False for the legacy model")
        return set_global_variables(args, *rest, **kwargs)

    mlm_global_vars.set_global_variables = set_global_variables_with_1p


def _checked_join():
    """Fix 7: records the exit codes of the processes convert.py joins (its saver)."""
    failed = []
    join = multiprocessing.process.BaseProcess.join

    def join_and_record(self, timeout=None):
        join(self, timeout)
        if self.exitcode:
            failed.append(self.exitcode)

    multiprocessing.process.BaseProcess.join = join_and_record
    return failed


# --verify: output names (legacy model, megatron-core local layers) -> torch_dist names.
_LEGACY_PREFIXES = {"language_model.embedding.": "embedding.",
                    "language_model.output_layer.": "output_layer.",
                    "language_model.encoder.final_norm.": "decoder.final_layernorm.",
                    "language_model.encoder.layers.": "decoder.layers."}
_LEGACY_LAYER_PARTS = {"input_norm.": "input_layernorm.",
                       "post_attention_norm.": "pre_mlp_layernorm.",
                       "self_attention.query_key_value.": "self_attention.linear_qkv.",
                       "self_attention.dense.": "self_attention.linear_proj.",
                       "mlp.dense_h_to_4h.": "mlp.linear_fc1.",
                       "mlp.dense_4h_to_h.": "mlp.linear_fc2."}
# The local layers' separate norms are stored under the fused names in torch_dist.
_CORE_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
               "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def _flatten(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            yield f"{prefix}{key}", value


def _source_of(name):
    """(torch_dist key, layer index or None) of an output tensor's name."""
    for old, new in _LEGACY_PREFIXES.items():
        if name.startswith(old):
            name = new + name[len(old):]
    match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if not match:
        return name, None
    part = match[2]
    for old, new in _LEGACY_LAYER_PARTS.items():
        if part.startswith(old):
            part = new + part[len(old):]
    return "decoder.layers." + _CORE_NORMS.get(part, part), int(match[1])


def _iteration_dir(directory):
    from megatron_ext.checkpoint.checkpointing import TRACKER, checkpoint_name

    with open(os.path.join(directory, TRACKER)) as f:
        tag = f.read().strip()
    return os.path.join(directory, "release") if tag == "release" else checkpoint_name(
        directory, int(tag))


def verify(load_dir, save_dir) -> bool:
    """Compares every weight of the converter's output with the torch_dist checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    source_dir = _iteration_dir(load_dir)
    reader = dcp.FileSystemReader(source_dir)
    source = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
              for key, meta in reader.read_metadata().state_dict_metadata.items()
              if isinstance(meta, TensorStorageMetadata) and not key.startswith("optimizer.")}
    dcp.load(source, storage_reader=reader, no_dist=True)

    out_dir = _iteration_dir(save_dir)
    ranks = sorted(os.listdir(out_dir))
    if ranks != ["mp_rank_00"]:
        _say(f"verify: expects one rank (tensor and pipeline size 1), found {ranks}")
        return False
    output = torch.load(os.path.join(out_dir, ranks[0], "model_optim_rng.pt"),
                        map_location="cpu", weights_only=False)["model"]
    covered = {key: torch.zeros(t.shape[0] if key.startswith("decoder.layers.") else 1,
                                dtype=torch.int64) for key, t in source.items()}
    worst, count, problems = 0.0, 0, []
    for name, tensor in _flatten(output):
        key, layer = _source_of(name)
        if key not in source:
            problems.append(f"{name}: no {key} in the input")
            continue
        expected = source[key] if layer is None else source[key][layer]
        covered[key][0 if layer is None else layer] += 1
        if tensor.shape != expected.shape or tensor.dtype != expected.dtype:
            problems.append(f"{name}: {tuple(tensor.shape)} {tensor.dtype}, input {key}"
                            f"[{layer}] {tuple(expected.shape)} {expected.dtype}")
            continue
        worst = max(worst, (tensor.float() - expected.float()).abs().max().item())
        count += 1
    problems += [f"input {key}: rows covered {c.tolist()}"
                 for key, c in covered.items() if not bool((c == 1).all())]
    for line in problems:
        _say(f"verify: {line}")
    elements = sum(t.numel() for t in source.values())
    _say(f"verify: {count} output tensors compared with {len(source)} input tensors "
         f"({elements} values, all covered once: {not problems}); max |difference| {worst:g}")
    return not problems and worst == 0.0


def _option(flags, name):
    return flags[flags.index(name) + 1] if name in flags else None


def main() -> None:
    """Applies the fixes (and the CPU stand-ins with --cpu), runs convert.py, --verify's."""
    flags = sys.argv[1:]
    mlm = _option(flags, "--mlm-dir") or os.environ.get("MLM_DIR")
    if "--mlm-dir" in flags:
        i = flags.index("--mlm-dir")
        del flags[i:i + 2]
    script = os.path.join(mlm or "", "tools", "checkpoint", "convert.py")
    if not os.path.isfile(script):
        sys.exit("error: --mlm-dir or MLM_DIR must name Megatron-LM's source directory "
                 "(with tools/checkpoint/convert.py)")
    cpu, check = "--cpu" in flags, "--verify" in flags
    flags = [f for f in flags if f not in ("--cpu", "--verify")]
    sys.path[:0] = [os.path.dirname(script), mlm, os.path.dirname(os.path.dirname(HERE))]
    if cpu:
        from megatron_lm_launch import cpu_stand_ins

        cpu_stand_ins()
    _apply_fixes()
    failed = _checked_join()
    sys.argv = [script, *flags]
    runpy.run_path(script, run_name="__main__")
    if failed:
        _say(f"fix 7: convert.py's saver exited with {failed[0]}")
        sys.exit(1)
    if check and not verify(_option(flags, "--load-dir"), _option(flags, "--save-dir")):
        sys.exit(1)


if __name__ == "__main__":
    main()
