"""Megatron <-> Hugging Face transformers: the name mappings, as data, in one place.

Two model families have an HF counterpart:

* ``llama``: RMSNorm, SwiGLU, RoPE, optional GQA, tied or untied embeddings, biases
  optional -> ``LlamaForCausalLM``;
* ``gpt2``: LayerNorm, GeLU, learned absolute positions, biases, multi-head attention
  -> ``GPT2LMHeadModel``.

Everything here is pure: state dicts (name -> tensor) of megatron-core's GPTModel with
the local layer spec (TP=1, PP=1, the module's own ``state_dict`` names) in, HF state
dicts and config fields out, and back. Each row of a table is one parameter; its
*transform* names how the tensor changes on the way:

* ``copy``: the same tensor;
* ``t``: transposed (GPT-2's Conv1D stores [in, out]);
* ``qkv``: megatron-core's fused QKV, laid out per query group as [q heads of the
  group, k, v], split into (or merged from) separate q, k, v;
* ``qkv_cat``: the same fused QKV as GPT-2's one c_attn, [all q, all k, all v];
* ``gate_up``: the fused SwiGLU fc1, [gate; up], split into (merged from) two.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron_ext.errors import UsageError

LAYER = "decoder.layers.{i}."

# (megatron name, HF name(s), transform). Names with {i} repeat per layer.
LLAMA: List[Tuple[str, Tuple[str, ...], str]] = [
    ("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "copy"),
    (LAYER + "input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",), "copy"),
    (LAYER + "self_attention.linear_qkv.weight",
     ("model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
      "model.layers.{i}.self_attn.v_proj.weight"), "qkv"),
    (LAYER + "self_attention.linear_qkv.bias",
     ("model.layers.{i}.self_attn.q_proj.bias", "model.layers.{i}.self_attn.k_proj.bias",
      "model.layers.{i}.self_attn.v_proj.bias"), "qkv"),
    (LAYER + "self_attention.linear_proj.weight", ("model.layers.{i}.self_attn.o_proj.weight",),
     "copy"),
    (LAYER + "self_attention.linear_proj.bias", ("model.layers.{i}.self_attn.o_proj.bias",),
     "copy"),
    (LAYER + "pre_mlp_layernorm.weight", ("model.layers.{i}.post_attention_layernorm.weight",),
     "copy"),
    (LAYER + "mlp.linear_fc1.weight",
     ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
     "gate_up"),
    (LAYER + "mlp.linear_fc1.bias",
     ("model.layers.{i}.mlp.gate_proj.bias", "model.layers.{i}.mlp.up_proj.bias"), "gate_up"),
    (LAYER + "mlp.linear_fc2.weight", ("model.layers.{i}.mlp.down_proj.weight",), "copy"),
    (LAYER + "mlp.linear_fc2.bias", ("model.layers.{i}.mlp.down_proj.bias",), "copy"),
    ("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"),
    ("output_layer.weight", ("lm_head.weight",), "copy"),
]

GPT2: List[Tuple[str, Tuple[str, ...], str]] = [
    ("embedding.word_embeddings.weight", ("transformer.wte.weight",), "copy"),
    ("embedding.position_embeddings.weight", ("transformer.wpe.weight",), "copy"),
    (LAYER + "input_layernorm.weight", ("transformer.h.{i}.ln_1.weight",), "copy"),
    (LAYER + "input_layernorm.bias", ("transformer.h.{i}.ln_1.bias",), "copy"),
    (LAYER + "self_attention.linear_qkv.weight", ("transformer.h.{i}.attn.c_attn.weight",),
     "qkv_cat"),
    (LAYER + "self_attention.linear_qkv.bias", ("transformer.h.{i}.attn.c_attn.bias",),
     "qkv_cat"),
    (LAYER + "self_attention.linear_proj.weight", ("transformer.h.{i}.attn.c_proj.weight",), "t"),
    (LAYER + "self_attention.linear_proj.bias", ("transformer.h.{i}.attn.c_proj.bias",), "copy"),
    (LAYER + "pre_mlp_layernorm.weight", ("transformer.h.{i}.ln_2.weight",), "copy"),
    (LAYER + "pre_mlp_layernorm.bias", ("transformer.h.{i}.ln_2.bias",), "copy"),
    (LAYER + "mlp.linear_fc1.weight", ("transformer.h.{i}.mlp.c_fc.weight",), "t"),
    (LAYER + "mlp.linear_fc1.bias", ("transformer.h.{i}.mlp.c_fc.bias",), "copy"),
    (LAYER + "mlp.linear_fc2.weight", ("transformer.h.{i}.mlp.c_proj.weight",), "t"),
    (LAYER + "mlp.linear_fc2.bias", ("transformer.h.{i}.mlp.c_proj.bias",), "copy"),
    ("decoder.final_layernorm.weight", ("transformer.ln_f.weight",), "copy"),
    ("decoder.final_layernorm.bias", ("transformer.ln_f.bias",), "copy"),
    ("output_layer.weight", ("lm_head.weight",), "copy"),
]

FAMILIES = {"llama": LLAMA, "gpt2": GPT2}
ARCHITECTURES = {"LlamaForCausalLM": "llama", "GPT2LMHeadModel": "gpt2"}
HF_CLASS = {family: arch for arch, family in ARCHITECTURES.items()}

# ModelConfig fields <-> HF config fields that map one to one, per family.
CONFIG_FIELDS = {
    "llama": [("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"),
              ("num_attention_heads", "num_attention_heads"),
              ("ffn_hidden_size", "intermediate_size"),
              ("max_position_embeddings", "max_position_embeddings"),
              ("norm_epsilon", "rms_norm_eps"), ("init_method_std", "initializer_range"),
              ("attention_dropout", "attention_dropout")],
    "gpt2": [("num_layers", "n_layer"), ("hidden_size", "n_embd"),
             ("num_attention_heads", "n_head"), ("ffn_hidden_size", "n_inner"),
             ("max_position_embeddings", "n_positions"), ("norm_epsilon", "layer_norm_epsilon"),
             ("init_method_std", "initializer_range"), ("hidden_dropout", "resid_pdrop"),
             ("attention_dropout", "attn_pdrop")],
}


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the QKV and MLP transforms need to know of the model."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.hidden_size // self.num_attention_heads

    @property
    def heads_per_group(self) -> int:
        """Query heads that share one key/value head."""
        return self.num_attention_heads // self.num_query_groups


def shape_of(model_cfg) -> Shape:
    """The :class:`Shape` of a ModelConfig."""
    groups = (model_cfg.num_query_groups if model_cfg.group_query_attention
              else model_cfg.num_attention_heads)
    return Shape(model_cfg.num_layers, model_cfg.hidden_size, model_cfg.num_attention_heads,
                 groups)


def family_of(model_cfg) -> str:
    """The HF family (``llama`` or ``gpt2``) of a ModelConfig.

    Raises:
        UsageError: the architecture has no HF counterpart here.
    """
    m = model_cfg
    if m.normalization == "RMSNorm" and m.swiglu and m.position_embedding_type == "rope":
        return "llama"
    if (m.normalization == "LayerNorm" and not m.swiglu
            and m.position_embedding_type == "learned_absolute" and not m.disable_bias_linear
            and not (m.group_query_attention and m.num_query_groups != m.num_attention_heads)):
        return "gpt2"
    raise UsageError(
        f"no Hugging Face architecture for this model (--normalization {m.normalization}, "
        f"swiglu={m.swiglu}, --position-embedding-type {m.position_embedding_type}, "
        f"bias={not m.disable_bias_linear}); supported: RMSNorm+SwiGLU+RoPE "
        "(LlamaForCausalLM) and LayerNorm+GeLU+learned_absolute with biases, no GQA "
        "(GPT2LMHeadModel)")


def _split_qkv(t: torch.Tensor, s: Shape) -> List[torch.Tensor]:
    """Fused [per group: q heads, k, v] -> q, k, v (rows; works for weights and biases)."""
    rest = t.shape[1:]
    grouped = t.reshape(s.num_query_groups, s.heads_per_group + 2, s.head_dim, *rest)
    q = grouped[:, :s.heads_per_group].reshape(-1, *rest)
    k = grouped[:, s.heads_per_group].reshape(-1, *rest)
    v = grouped[:, s.heads_per_group + 1].reshape(-1, *rest)
    return [q.clone(), k.clone(), v.clone()]


def _merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: Shape) -> torch.Tensor:
    """q, k, v -> megatron-core's fused [per group: q heads, k, v]."""
    rest = q.shape[1:]
    q = q.reshape(s.num_query_groups, s.heads_per_group, s.head_dim, *rest)
    k = k.reshape(s.num_query_groups, 1, s.head_dim, *rest)
    v = v.reshape(s.num_query_groups, 1, s.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest).clone()


def _to_hf(transform: str, t: torch.Tensor, s: Shape) -> List[torch.Tensor]:
    if transform == "copy":
        return [t.clone()]
    if transform == "t":
        return [t.t().contiguous()]
    if transform == "qkv":
        return _split_qkv(t, s)
    if transform == "qkv_cat":
        merged = torch.cat(_split_qkv(t, s), dim=0)
        return [merged.t().contiguous() if merged.dim() == 2 else merged]
    if transform == "gate_up":
        return [c.clone() for c in torch.chunk(t, 2, dim=0)]
    raise ValueError(transform)


def _from_hf(transform: str, ts: Sequence[torch.Tensor], s: Shape) -> torch.Tensor:
    if transform == "copy":
        return ts[0].clone()
    if transform == "t":
        return ts[0].t().contiguous()
    if transform == "qkv":
        return _merge_qkv(*ts, s)
    if transform == "qkv_cat":
        t = ts[0].t() if ts[0].dim() == 2 else ts[0]
        q, k, v = torch.chunk(t, 3, dim=0)
        return _merge_qkv(q, k, v, s)
    if transform == "gate_up":
        return torch.cat(list(ts), dim=0).clone()
    raise ValueError(transform)


def _rows(family: str, num_layers: int):
    """(megatron name, HF names, transform) of every parameter, layers expanded."""
    for mname, hnames, transform in FAMILIES[family]:
        layers = range(num_layers) if "{i}" in mname else [None]
        for i in layers:
            fmt = (lambda n: n.format(i=i)) if i is not None else (lambda n: n)
            yield fmt(mname), tuple(fmt(h) for h in hnames), transform


def megatron_to_hf(state: Dict[str, torch.Tensor], family: str, shape: Shape
                   ) -> Dict[str, torch.Tensor]:
    """A GPTModel state dict (local spec, TP=1 PP=1) -> the HF model's state dict.

    Parameters the model does not have (biases of a bias-free model, the output layer of
    a tied one) are skipped; any megatron parameter without a row is an error, so no
    weight is silently dropped.
    """
    out: Dict[str, torch.Tensor] = {}
    used = set()
    for mname, hnames, transform in _rows(family, shape.num_layers):
        if mname not in state:
            continue
        used.add(mname)
        for hname, t in zip(hnames, _to_hf(transform, state[mname], shape)):
            out[hname] = t
    left = [k for k in state if k not in used and not _ignorable(k)]
    if left:
        raise UsageError(f"cannot export to {HF_CLASS[family]}: no mapping for {left[:4]}")
    return out


def hf_to_megatron(state: Dict[str, torch.Tensor], family: str, shape: Shape,
                   expected: Sequence[str]) -> Dict[str, torch.Tensor]:
    """An HF state dict -> the GPTModel state dict whose parameter names are ``expected``.

    Raises:
        UsageError: a parameter the GPTModel needs is missing from the HF state dict.
    """
    out: Dict[str, torch.Tensor] = {}
    wanted = set(expected)
    for mname, hnames, transform in _rows(family, shape.num_layers):
        if mname not in wanted:
            continue
        missing = [h for h in hnames if h not in state]
        if missing:
            raise UsageError(f"the Hugging Face model has no {missing[0]} (needed for {mname})")
        out[mname] = _from_hf(transform, [state[h] for h in hnames], shape)
    left = [k for k in wanted if k not in out and not _ignorable(k)]
    if left:
        raise UsageError(f"cannot import from {HF_CLASS[family]}: no mapping for {left[:4]}")
    return out


def _ignorable(name: str) -> bool:
    """Entries of a state dict that are not weights (extra states, buffers)."""
    return name.endswith("_extra_state") or name.endswith("inv_freq")


def hf_config_fields(model_cfg, family: str, vocab_size: int) -> dict:
    """The HF config (as keyword arguments) of a ModelConfig."""
    m = model_cfg
    fields = {hf: getattr(m, ours) for ours, hf in CONFIG_FIELDS[family]}
    fields.update(vocab_size=vocab_size,
                  tie_word_embeddings=not m.untie_embeddings_and_output_weights,
                  architectures=[HF_CLASS[family]])
    if family == "llama":
        s = shape_of(m)
        fields.update(num_key_value_heads=s.num_query_groups, hidden_act="silu",
                      head_dim=s.head_dim, attention_bias=not m.disable_bias_linear,
                      mlp_bias=not m.disable_bias_linear,
                      rope_parameters={"rope_type": "default", "rope_theta": float(m.rotary_base)})
    else:
        # Megatron's GeLU is the exact (erf) one; GPT-2's default gelu_new is the tanh one.
        fields.update(activation_function="gelu", embd_pdrop=m.hidden_dropout)
    return fields


def model_fields_from_hf(hf_config) -> Tuple[str, dict]:
    """(family, ModelConfig keyword arguments) of an HF config.

    Raises:
        UsageError: the config is not one of the supported architectures, or uses a
            feature megatron_ext's GPT does not have.
    """
    archs = list(getattr(hf_config, "architectures", None) or [])
    family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if family is None:
        model_type = getattr(hf_config, "model_type", None)
        family = {"llama": "llama", "gpt2": "gpt2"}.get(model_type)
    if family is None:
        raise UsageError(f"unsupported Hugging Face architecture {archs or None} "
                         f"(model_type {getattr(hf_config, 'model_type', None)!r}); "
                         f"supported: {', '.join(ARCHITECTURES)}")
    c = hf_config
    fields = {ours: getattr(c, hf) for ours, hf in CONFIG_FIELDS[family]}
    fields["untie_embeddings_and_output_weights"] = not getattr(c, "tie_word_embeddings", True)
    if family == "llama":
        heads, kv = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        if head_dim * heads != c.hidden_size:
            raise UsageError(f"head_dim {head_dim} x {heads} heads != hidden size "
                             f"{c.hidden_size}: not supported")
        if c.attention_bias != c.mlp_bias:
            raise UsageError("attention_bias != mlp_bias: megatron_ext has one bias switch "
                             "(--disable-bias-linear) for both")
        if c.hidden_act != "silu":
            raise UsageError(f"hidden_act {c.hidden_act!r}: only silu (SwiGLU) is supported")
        rope = getattr(c, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise UsageError(f"rope_type {rope.get('rope_type')!r}: only the default RoPE "
                             "is supported")
        theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        if float(theta) != int(theta):
            raise UsageError(f"rope_theta {theta} is not an integer (--rotary-base)")
        fields.update(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                      rotary_base=int(theta), disable_bias_linear=not c.attention_bias,
                      group_query_attention=kv != heads, num_query_groups=kv,
                      hidden_dropout=0.0)
    else:
        if c.activation_function not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise UsageError(f"activation_function {c.activation_function!r}: only GeLU")
        if getattr(c, "scale_attn_by_inverse_layer_idx", False) or \
                getattr(c, "reorder_and_upcast_attn", False):
            raise UsageError("scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not "
                             "supported")
        fields["ffn_hidden_size"] = c.n_inner or 4 * c.n_embd
        fields.update(normalization="LayerNorm", swiglu=False,
                      position_embedding_type="learned_absolute", disable_bias_linear=False)
    fields["seq_length"] = fields["max_position_embeddings"]
    return family, fields


def gelu_note(hf_config) -> Optional[str]:
    """A warning when a GPT-2 config's GeLU is the tanh approximation (Megatron: exact)."""
    act = getattr(hf_config, "activation_function", None)
    if act in ("gelu_new", "gelu_pytorch_tanh"):
        return (f"activation_function {act!r} is GeLU's tanh approximation; megatron_ext "
                "uses the exact GeLU (logits differ slightly, ~1e-3)")
    return None
