"""mmpretrain's ``MultiheadAttention`` read from outside: its queries and keys from the ``qkv`` output, and its
scale. Used by the methods that read a block's attention (TL-Align's and TokenMixup's mm adapters)."""

from __future__ import annotations

from typing import Optional

import torch
from mmpretrain.models.utils.attention import MultiheadAttention

__all__ = ['split_qk', 'attention_scale']


def split_qk(attn: MultiheadAttention, qkv: torch.Tensor):
    """``(q, k)``, each ``(B, H, T, d)``, from a ``MultiheadAttention``'s ``qkv`` output."""
    B, N, _ = qkv.shape
    q, k, _ = qkv.reshape(B, N, 3, attn.num_heads, attn.head_dims).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k


def attention_scale(attn: MultiheadAttention) -> Optional[float]:
    """mmpretrain's ``qk_scale`` binds ``scale`` into its SDPA partial; default ``head_dims ** -0.5``."""
    fn = attn.scaled_dot_product_attention
    return getattr(fn, 'keywords', {}).get('scale', attn.head_dims**-0.5)
