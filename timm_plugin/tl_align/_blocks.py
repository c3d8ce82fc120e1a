"""What the timm tracers of :mod:`timm_plugin.tl_align` share beyond :class:`shared_core.tracer.Tracer`: the exact
timm block parts the label rules assume, an instance-forward handle and the q/k split of a fused qkv (a conv's labels
and a label map's first grid are :mod:`shared_core`'s: the mm tracers share them)."""

from __future__ import annotations

import torch
import torch.nn as nn
from timm.layers import DropPath, GluMlp, LayerNorm, LayerScale, Mlp, RmsNorm, SwiGLU
from timm.models.vitamin import GeGluMlp

from shared_core.capture import LabelCapture

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
