"""What the timm tracers of :mod:`timm_plugin.tl_align` share beyond :class:`shared_core.tracer.Tracer`: the exact
timm block parts the label rules assume, an instance-forward handle, a conv's labels (its stencil, or its geometry's
pooling), and the hook of a label map's first grid."""

from __future__ import annotations

import torch
import torch.nn as nn
from timm.layers import DropPath, GluMlp, LayerNorm, LayerScale, Mlp, RmsNorm, SwiGLU
from timm.models.vitamin import GeGluMlp

from shared_core.capture import Captures, LabelCapture
from shared_core.tl_align import conv_pool_labels, conv_stencil_labels

#: the parts of a timm ViT ``Block`` the label rules assume (attention mixes tokens, everything else is per token:
#: the TL-Align paper, Table 9) and the exact types that are per token; anything else (a wrapped MLP, a token-mixing
#: norm) would need its own rule
NORMS = (nn.LayerNorm, LayerNorm, RmsNorm, nn.Identity)


VIT_BLOCK_PARTS = {
    'norm1': NORMS,
    'norm2': NORMS,
    # SwiGLUPacked is a GluMlp; ViTamin's GeGluMlp (norm, gelu(w0 x) * w1 x, w2) is per token as the others
    'mlp': (Mlp, GluMlp, SwiGLU, GeGluMlp),
    'ls1': (LayerScale, nn.Identity),
    'ls2': (LayerScale, nn.Identity),
    'drop_path1': (DropPath, nn.Identity),
    'drop_path2': (DropPath, nn.Identity),
    'attn.q_norm': NORMS,
    'attn.k_norm': NORMS,
    'attn.norm': NORMS,
    'attn.proj': (nn.Linear,),
}


class RestoreForward:
    """A handle that removes an instance-level ``forward`` override (and puts back one that was there)."""

    def __init__(self, module: nn.Module):
        self.module, self.prior = module, module.__dict__.get('forward')

    def remove(self) -> None:
        if self.prior is None:
            self.module.__dict__.pop('forward', None)
        else:
            self.module.forward = self.prior


def set_qk(cap: LabelCapture, qkv: torch.Tensor, num_heads: int) -> None:
    B_, N, _ = qkv.shape
    q, k, _ = qkv.reshape(B_, N, 3, num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    cap.q, cap.k = q, k


def pool_like(labels: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """:func:`~shared_core.tl_align.conv_pool_labels` with the geometry of ``conv``."""
    if tuple(conv.dilation) != (1, 1) or isinstance(conv.padding, str):
        raise ValueError(f'model: TL-Align pools labels for undilated, explicitly padded convs, got {conv}')
    return conv_pool_labels(labels, conv.kernel_size, conv.stride, conv.padding)


def kernel_stencil(weight: torch.Tensor) -> torch.Tensor:
    """``S = mean |K|`` ``(k, k)`` fp32 over a kernel's output and input channel dims (a depthwise conv: over its
    channels' kernels): the fixed stencil by which Table 9 mixes labels for a convolution."""
    return weight.detach().float().abs().mean((0, 1))


def stencil(conv: nn.Conv2d) -> torch.Tensor:
    """:func:`kernel_stencil` of a conv module's weight."""
    return kernel_stencil(conv.weight)


def conv_labels(labels: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """Table 9 for a convolution on a ``(B, K, H, W)`` label map: its fixed :func:`stencil`, at its padding and
    stride (:func:`~shared_core.tl_align.conv_stencil_labels`)."""
    return conv_stencil_labels(labels, stencil(conv), conv.padding, conv.stride)


def hook_map_grid(module: nn.Module, captures: Captures, handles: list) -> None:
    """``captures.grid``: the ``(H, W)`` of ``module``'s ``(B, C, H, W)`` output (a stem whose grid the label map
    starts on)."""
    handles.append(module.register_forward_hook(lambda m, i, o: setattr(captures, 'grid', tuple(o.shape[-2:]))))
