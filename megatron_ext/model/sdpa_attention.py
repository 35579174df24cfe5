"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's local :class:`DotProductAttention` materializes the full
``[b, heads, s, s]`` score matrix (baddbmm, softmax, bmm); without Transformer Engine it
is the slow and memory-hungry part of a layer. This module keeps its interface (so it
drops into the local layer spec) and hands the work to torch's SDPA, which picks a
flash or memory-efficient kernel on a GPU and a fused math kernel on the CPU.
"""

from __future__ import annotations

import math
from typing import Optional

import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    """Drop-in core attention for the local spec, computed by torch SDPA."""

    def __init__(self, *args, softmax_scale: Optional[float] = None, **kwargs):
        super().__init__(*args, softmax_scale=softmax_scale, **kwargs)
        if self.config.apply_query_key_layer_scaling:
            raise ValueError("SDPAttention does not support apply_query_key_layer_scaling")
        if self.config.softmax_type != "vanilla" or self.config.window_size is not None:
            raise ValueError("SDPAttention supports vanilla softmax without sliding windows")
        self.scale = softmax_scale if softmax_scale is not None else (
            1.0 / math.sqrt(self.hidden_size_per_attention_head))
        self.dropout_p = (self.config.attention_dropout if kwargs.get("attention_dropout") is None
                          else kwargs["attention_dropout"])

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        """Query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np * hn]."""
        assert packed_seq_params is None and attention_bias is None
        sq, batch = query.shape[0], query.shape[1]
        # [s, b, heads, hn] -> [b, heads, s, hn]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if attention_mask is None:
            mask, causal = None, mask_type == AttnMaskType.causal
        else:
            # megatron-core's masks are True where attention is NOT allowed; SDPA's
            # boolean masks are True where it is.
            mask, causal = ~attention_mask, False
        dropout_p = self.dropout_p if self.training else 0.0
        gqa = q.shape[1] != k.shape[1]

        def attend():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                  is_causal=causal, scale=self.scale,
                                                  enable_gqa=gqa)

        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(sq, batch, self.hidden_size_per_partition)
