"""What the tracers of :mod:`timm_plugin.tl_align` share: the exact block parts the label rules assume,
the capture checks, the stochastic-depth hooks, staged blocks, and label pooling with a conv's geometry."""

from __future__ import annotations

from typing import List

import torch
import torch.nn as nn
from timm.layers import DropPath, GluMlp, LayerNorm, LayerScale, Mlp, RmsNorm, SwiGLU

from shared_core.tl_align import (  # noqa: F401  (check_captured: the tracers import it from here)
    LabelCapture,
    check_captured,
    conv_pool_labels,
    kept_samples,
)

#: the parts of a timm ViT ``Block`` the label rules assume (attention mixes tokens, everything else is per token:
#: the TL-Align paper, Table 9) and the exact types that are per token; anything else (a wrapped MLP, a token-mixing
#: norm) would need its own rule
NORMS = (nn.LayerNorm, LayerNorm, RmsNorm, nn.Identity)


VIT_BLOCK_PARTS = {
    'norm1': NORMS,
    'norm2': NORMS,
    'mlp': (Mlp, GluMlp, SwiGLU),  # SwiGLUPacked is a GluMlp
    'ls1': (LayerScale, nn.Identity),
    'ls2': (LayerScale, nn.Identity),
    'drop_path1': (DropPath, nn.Identity),
    'drop_path2': (DropPath, nn.Identity),
    'attn.q_norm': NORMS,
    'attn.k_norm': NORMS,
    'attn.norm': NORMS,
    'attn.proj': (nn.Linear,),
}


def check_block_parts(blocks, parts: dict, first: int = 0) -> None:
    """Refuse blocks whose parts are not of the exact types the label rules assume (``parts``: dotted
    attribute -> allowed types; a part a timm version lacks is skipped), naming the block (numbered from
    ``first``), the part and its type."""
    for i, blk in enumerate(blocks, first):
        for name, types in parts.items():
            obj = blk
            for attr in name.split('.'):
                obj = getattr(obj, attr, None)
            if obj is not None and type(obj) not in types:
                raise ValueError(
                    f"model: block {i}.{name} is a {type(obj).__module__}.{type(obj).__name__}; TL-Align's rules "
                    f'assume {", ".join(t.__name__ for t in types)} there (per-token: the labels pass it '
                    'unchanged); a part that mixes tokens needs its own label rule'
                )


def hook_drop_path(blk: nn.Module, cap: LabelCapture, handles: list, kept=None) -> bool:
    """Where stochastic depth may drop the attention branch of ``blk`` in this forward, a hook on its drop path
    that gives the samples whose branch ran (:func:`kept_samples`) to ``kept(keep)`` (default: kept as
    ``cap.keep``); whether it did."""
    if not (isinstance(blk.drop_path1, DropPath) and blk.drop_path1.drop_prob > 0 and blk.training):
        return False
    kept = kept or (lambda keep: setattr(cap, 'keep', keep))
    handles.append(blk.drop_path1.register_forward_hook(lambda m, i, o: kept(kept_samples(i[0], o))))
    return True


def watch_blocks(blocks, captures: List[LabelCapture], mode, attention=lambda blk: blk.attn) -> list:
    """One capture per block: the call of its attention module (``attention(blk)``; ``None``: no attention) recorded
    by ``mode`` (:class:`shared_core.capture.SdpaCapture` or ``SoftmaxCapture``), and the samples its attention
    branch's drop path kept. Returns the handles, the mode's among them."""
    handles: list = []
    for blk in blocks:
        cap = LabelCapture()
        captures.append(cap)
        module = attention(blk)
        if module is not None:
            mode.watch(module, cap, handles)
        hook_drop_path(blk, cap, handles)
    mode.start(handles)
    return handles


class StagedBlocks:
    """The blocks of a staged model (``model.<_stages>[i].blocks``) in order, which ``layers`` indexes."""

    _stages = 'stages'

    def _blocks(self):
        return [blk for stage in getattr(self.model, self._stages) for blk in stage.blocks]

    @property
    def depth(self) -> int:
        return len(self._blocks())


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


def hook_first_drop_path(blk: nn.Module, cap: LabelCapture, handles: list) -> None:
    """Blocks with one ``drop_path`` module (CaiT, MLP-Mixer and ResMLP call it twice: the token-mixing branch,
    then the MLP branch; gMLP and ConvNeXt once): the kept samples of its first call are the token-mixing
    residual's."""

    def hook(m, i, o, c=cap):
        if c.keep is None:
            c.keep = kept_samples(i[0], o)

    if isinstance(blk.drop_path, DropPath) and blk.drop_path.drop_prob > 0 and blk.training:
        handles.append(blk.drop_path.register_forward_hook(hook))


def pool_like(labels: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """:func:`~shared_core.tl_align.conv_pool_labels` with the geometry of ``conv``."""
    if tuple(conv.dilation) != (1, 1) or isinstance(conv.padding, str):
        raise ValueError(f'model: TL-Align pools labels for undilated, explicitly padded convs, got {conv}')
    return conv_pool_labels(labels, conv.kernel_size, conv.stride, conv.padding)
