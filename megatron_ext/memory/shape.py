"""The model as the memory plan sees it: parameters, bytes, activations, FLOPs. Pure.

Everything here is computed from the run's config alone (no torch, no model built), so
``tools/plan_memory.py`` gives the same numbers on a laptop as the start-up plan on the
GPU machine.

* Parameters per rank follow megatron-core's layout: column- and row-parallel matrices
  split over TP, row-parallel biases and norms replicated, the embedding and the output
  layer split over the (padded) vocabulary, the most loaded pipeline stage (the first one
  holds the embedding, the last the output layer; with tied embeddings and PP > 1 the last
  stage holds its own copy). With the distributed optimizer a rank's shard is 1/DP of them.
* Activations: the per-layer estimate of Korthikanti et al., "Reducing Activation
  Recomputation in Large Transformer Models" (arXiv 2205.05198), term by term so that GQA,
  SwiGLU and any FFN size fit; flash / fused attention keeps no s^2 score matrix;
  selective recomputation drops it too; full recomputation keeps one input per chunk and
  one chunk's activations during its backward; the logits of the output layer with their
  fp32 copy in the cross entropy; 1F1B keeps up to PP micro-batches in flight on the
  first stage.
* FLOPs: 2 per multiply-add of every matmul, forward x 3 for forward+backward (x 4 for
  layers under full recomputation), attention's QK^T and AV with the causal half.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

# Bytes of a dtype by its Megatron-LM name.
_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


def state_array_bytes(cfg) -> Tuple[int, int, int]:
    """Bytes per element of the offloaded (master, exp_avg, exp_avg_sq) arrays.

    The master is 2 bytes when it is stored as its 16-bit remainder beside the bf16
    parameter (megatron-core's ``store_param_remainders`` semantics): with ``--bf16``, an
    fp32 ``--main-params-dtype`` and remainders on (``--no-store-param-remainders`` turns
    them off). The moments take ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype``.
    """
    opt = cfg.optimizer
    master = _DTYPE_BYTES[opt.main_params_dtype]
    # The offload engine's rule (offload/states.py: StateLayout.remainders_apply).
    remainders = cfg.offload.store_param_remainders
    if remainders and cfg.training.bf16 and opt.main_params_dtype == "fp32":
        master = 2
    return master, _DTYPE_BYTES[opt.exp_avg_dtype], _DTYPE_BYTES[opt.exp_avg_sq_dtype]


def state_bytes_per_element(cfg) -> int:
    """Bytes of offloaded optimizer state per element.

    12 exact fp32; 10 with the master as a remainder beside bf16 parameters; 8 / 6 with
    bf16 moments.
    """
    return sum(state_array_bytes(cfg))


def state_nbytes(arrays: Tuple[int, int, int], numel: int) -> int:
    """Bytes of a ``numel``-element subgroup's state.

    Each array starts on a 4-byte boundary (the engine's ``StateLayout.nbytes``).
    """
    return sum(-(-numel * size // 4) * 4 for size in arrays)


def grads_in_fp32(cfg) -> bool:
    """Whether gradients are reduced in fp32 (Megatron-LM's rule, ``model.build.grads_in_fp32``).

    With --bf16 unless --grad-reduce-in-bf16, with --fp16 under
    --accumulate-allreduce-grads-in-fp32; otherwise in the parameters' dtype (fp32 training
    has fp32 gradients anyway). The model's module imports torch; the plan does without.
    """
    if cfg.training.bf16:
        return not cfg.parallel.grad_reduce_in_bf16
    return cfg.parallel.accumulate_allreduce_grads_in_fp32


def padded_vocab(vocab_size: int, divisible_by: int, tp: int) -> int:
    """The tokenizer's vocabulary padded to a multiple of ``divisible_by`` x TP (Megatron-LM)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The numbers of one run's model on its most loaded rank (all counts per rank).

    Attributes:
        total_params: parameters of the whole model (a tied embedding once).
        rank_params: parameters on the most loaded rank (its pipeline stage, its TP shard).
        rank_vector_params: of those, in 1-D tensors (norms, biases).
        shard_elements: elements of the rank's optimizer shard (rank_params / DP with the
            distributed optimizer, rounded up).
        param_bytes: bytes per weight (2 with --bf16/--fp16, else 4).
        grad_bytes: bytes per gradient element (the DDP buffer's dtype).
        activation_bytes: the peak of forward+backward activations on the rank.
        flops_per_iteration: model FLOPs of one iteration over all ranks (recomputation
            included).
        padded_vocab: the vocabulary as the embedding holds it.
        tp, pp, dp: the parallel layout.
        microbatches: micro-batches per iteration on each data-parallel rank.
    """

    total_params: int
    rank_params: int
    rank_vector_params: int
    shard_elements: int
    param_bytes: int
    grad_bytes: int
    activation_bytes: int
    flops_per_iteration: float
    padded_vocab: int
    tp: int
    pp: int
    dp: int
    microbatches: int

    @property
    def world_size(self) -> int:
        """The ranks of the run."""
        return self.tp * self.pp * self.dp

    @property
    def weights_bytes(self) -> int:
        """The rank's model weights in the training dtype."""
        return self.rank_params * self.param_bytes

    @property
    def grads_bytes(self) -> int:
        """The rank's gradient buffer."""
        return self.rank_params * self.grad_bytes


def _layer_params(m, tp: int) -> Tuple[int, int, int]:
    """(whole layer, the layer's TP shard, its 1-D part on a rank) of one transformer layer."""
    h, ffn = m.hidden_size, m.ffn_hidden_size
    heads = m.num_attention_heads
    head_dim = m.kv_channels or h // heads
    groups = m.num_query_groups if m.group_query_attention else heads
    bias = 0 if m.disable_bias_linear else 1
    qkv_bias = 1 if bias or m.add_qkv_bias else 0
    norm = h * (2 if m.normalization == "LayerNorm" else 1)
    q, kv = heads * head_dim, groups * head_dim
    fc1 = ffn * (2 if m.swiglu else 1)
    qk_norm = 2 * head_dim * (2 if m.normalization == "LayerNorm" else 1) if m.qk_layernorm else 0
    split = h * (q + 2 * kv) + q * h + h * fc1 + ffn * h + qkv_bias * (q + 2 * kv) + bias * fc1
    replicated = bias * h * 2 + 2 * norm + qk_norm  # row-parallel biases, norms
    vectors = qkv_bias * (q + 2 * kv) // tp + bias * fc1 // tp + replicated
    return split + replicated, split // tp + replicated, vectors


def _stage_params(cfg, vocab: int, tp: int, pp: int) -> Tuple[int, int, int]:
    """(whole model, most loaded rank, its 1-D part)."""
    m = cfg.model
    layer, layer_rank, layer_vectors = _layer_params(m, tp)
    h = m.hidden_size
    final_norm = h * (2 if m.normalization == "LayerNorm" else 1)
    positions = m.max_position_embeddings * h if m.position_embedding_type == \
        "learned_absolute" else 0
    embedding = vocab * h
    per_stage = m.num_layers // pp
    first = per_stage * layer_rank + embedding // tp + positions
    last = per_stage * layer_rank + final_norm
    if m.untie_embeddings_and_output_weights or pp > 1:
        last += embedding // tp  # its own output layer (or, tied, the embedding's copy)
    if pp == 1:
        rank = first + last - per_stage * layer_rank
        vectors = per_stage * layer_vectors + final_norm
    elif first >= last:
        rank, vectors = first, per_stage * layer_vectors
    else:
        rank, vectors = last, per_stage * layer_vectors + final_norm
    output = embedding if m.untie_embeddings_and_output_weights else 0
    total = m.num_layers * layer + embedding + positions + final_norm + output
    return total, rank, vectors


def _act_bytes(cfg) -> int:
    return 4 if not (cfg.training.bf16 or cfg.training.fp16) else 2


def materializes_scores(cfg) -> bool:
    """Whether the core attention keeps the s x s score matrix for the backward.

    megatron-core's DotProductAttention (``--attention-backend local`` / ``unfused``)
    does; flash, fused and SDPA kernels keep only per-row statistics; selective
    recomputation recomputes the matrix instead of keeping it.
    """
    m = cfg.model
    return m.attention_backend in ("local", "unfused") and m.recompute_granularity != "selective"


def layer_activation_bytes(cfg, tp: int) -> int:
    """Activations one transformer layer keeps for its backward, per micro-batch.

    Korthikanti et al.'s terms: the norms' inputs, the QKV input, Q, K and V, the attention
    output, the MLP's inputs and its activation's input, and the dropout masks (1 byte,
    when dropout is on); the score matrix (softmax output, its dropout mask and output)
    only where it is materialized. Inside the TP regions they are split over TP; outside
    them only with --sequence-parallel.
    """
    m, e = cfg.model, _act_bytes(cfg)
    s, b, h = m.seq_length, cfg.training.micro_batch_size, m.hidden_size
    heads = m.num_attention_heads
    head_dim = m.kv_channels or h // heads
    q = heads * head_dim
    kv = (m.num_query_groups if m.group_query_attention else heads) * head_dim
    f = m.ffn_hidden_size
    masks = 2 if m.hidden_dropout > 0 else 0
    outside = s * b * h * (4 * e + masks)
    inside = e * s * b * (q + 2 * kv + q + f * (2 if m.swiglu else 1) + f)
    if materializes_scores(cfg):
        inside += s * s * b * heads * (e + ((1 + e) if m.attention_dropout > 0 else 0))
    else:
        inside += 4 * s * b * heads  # the kernel's fp32 softmax statistics
    sequence_parallel = cfg.parallel.sequence_parallel and tp > 1
    return outside // (tp if sequence_parallel else 1) + inside // tp


def activation_bytes(cfg, tp: int, pp: int, microbatches: int, vocab: int) -> int:
    """The peak of one iteration's activations on the most loaded rank.

    The first stage holds the stored activations of up to PP micro-batches in flight
    under 1F1B (more with the interleaved schedule, Megatron-LM's penalty); the last stage
    one micro-batch's and the logits: the output layer's bf16 logits, their fp32 copy in
    the cross entropy and its fp32 gradient.
    """
    m, e = cfg.model, _act_bytes(cfg)
    s, b, h = m.seq_length, cfg.training.micro_batch_size, m.hidden_size
    sequence_parallel = cfg.parallel.sequence_parallel and tp > 1
    hidden = e * s * b * h // (tp if sequence_parallel else 1)
    layer = layer_activation_bytes(cfg, tp)
    layers = m.num_layers // pp
    if m.recompute_granularity == "full":
        n = min(m.recompute_num_layers, layers)
        if m.recompute_method == "uniform":
            stored, transient = math.ceil(layers / n) * hidden, n * layer
        else:  # block: the first n layers of the stage recomputed, the others kept
            stored, transient = n * hidden + (layers - n) * layer, layer if n else 0
    else:
        stored, transient = layers * layer, 0
    stored += hidden + 8 * s * b  # the embedding's output and the token ids
    vpp = cfg.virtual_pipeline_size()
    if pp == 1:
        in_flight = 1.0
    elif vpp:
        in_flight = pp * (1 + (pp - 1) / (pp * vpp))
    else:
        in_flight = min(microbatches, pp)
    logits = s * b * vocab // tp * (e + 4 + 4) + 2 * hidden
    first = int(stored * in_flight) + transient
    if pp == 1:
        return first + logits
    return max(first, stored + transient + logits)


def flops_per_iteration(cfg, vocab: int) -> float:
    """Model FLOPs of one iteration (forward+backward, recomputation included)."""
    m = cfg.model
    h, s, f = m.hidden_size, m.seq_length, m.ffn_hidden_size
    heads = m.num_attention_heads
    head_dim = m.kv_channels or h // heads
    q = heads * head_dim
    kv = (m.num_query_groups if m.group_query_attention else heads) * head_dim
    matmul = h * (q + 2 * kv) + q * h + h * f * (3 if m.swiglu else 2)
    attention = 2 * q * s  # QK^T and AV: 2 x 2 FLOPs x q x s / 2 (causal)
    layer = 2 * matmul + attention
    passes = 3.0
    extra = 0.0
    if m.recompute_granularity == "full":
        layers_per_stage = m.num_layers // cfg.parallel.pipeline_model_parallel_size
        n = min(m.recompute_num_layers, layers_per_stage)
        share = 1.0 if m.recompute_method == "uniform" else n / layers_per_stage
        extra = share * layer
    elif m.recompute_granularity == "selective":
        extra = attention
    per_token = m.num_layers * (passes * layer + extra) + passes * 2 * h * vocab
    return per_token * cfg.training.global_batch_size * s


def model_shape(cfg, vocab_size: int, world_size: int,
                distributed_optimizer: Optional[bool] = None) -> ModelShape:
    """The :class:`ModelShape` of ``cfg`` on ``world_size`` ranks.

    Args:
        cfg: the run's config (its global batch set, as ``RunConfig.check_world`` does).
        vocab_size: the tokenizer's vocabulary (padded here as the model pads it).
        world_size: the ranks of the run.
        distributed_optimizer: whether states are sharded over DP (default: the flag).
    """
    par, train = cfg.parallel, cfg.training
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    dp = max(1, world_size // (tp * pp))
    vocab = padded_vocab(vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
    total, rank, vectors = _stage_params(cfg, vocab, tp, pp)
    if distributed_optimizer is None:
        distributed_optimizer = par.use_distributed_optimizer
    shard = -(-rank // dp) if distributed_optimizer else rank
    microbatches = max(1, (train.global_batch_size or train.micro_batch_size * dp)
                       // (train.micro_batch_size * dp))
    param_bytes = _act_bytes(cfg)
    return ModelShape(
        total_params=total, rank_params=rank, rank_vector_params=vectors,
        shard_elements=shard, param_bytes=param_bytes,
        grad_bytes=4 if grads_in_fp32(cfg) else param_bytes,
        activation_bytes=activation_bytes(cfg, tp, pp, microbatches, vocab),
        flops_per_iteration=flops_per_iteration(cfg, vocab), padded_vocab=vocab,
        tp=tp, pp=pp, dp=dp, microbatches=microbatches)
