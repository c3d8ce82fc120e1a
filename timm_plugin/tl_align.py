"""TL-Align for timm models: a wrapper that traces token labels beside the token path.

``TLAlign(model)`` wraps a supported timm model. In training, ``logits, target = wrapped(x, mix_target)``
with ``mix_target`` the :class:`timm_plugin.MixTarget` from a token-aware mixer: the logits are the model's
(exactly on the recomputing path; on timm ViTs' shared attention up to another kernel's float rounding), and
``target`` is the aligned ``(B, C)`` soft target (TL-Align paper Eq. 12). In eval mode (or without a target)
it is the plain model call: same logits, no extra work.

How the labels are traced: forward hooks on each attention's ``q_norm`` / ``k_norm`` (identity modules
unless qk-norm is on) keep the detached ``q``, ``k`` the token path fed to its fused attention (autograd
holds them anyway), and a hook on ``drop_path1`` notes which samples' attention branch stochastic
depth dropped. After the forward, the label state (compact ``(B, T, 1)`` partner shares, or dense
``(B, T, C)`` for :meth:`TLAlign.trace`) goes through the blocks with the rules of
:mod:`shared_core.tl_align`; the attention is recomputed for the labels by a fused
``scaled_dot_product_attention`` call with the labels as values (on accelerators; on the CPU a
transient softmax is faster), and the token path is untouched: still the model's fused attention.

On timm ``VisionTransformer`` / DeiT the default is :class:`SharedAttentionViT`: the labels travel through
the token path's own attention call as extra value columns (one fused attention per block for both, on every
device; ``fused=False`` materialises the attention once for both; ``TLAlign(model, shared=False)`` keeps the
recomputing path described above).

Supported: timm ``VisionTransformer`` (ViT / DeiT, class token or ``global_pool='avg'``, register
tokens), ``VisionTransformerDistilled`` (DeiT distilled), ``SwinTransformer`` (shifted windows,
patch merging, average pooling), ``Cait`` (talking-heads self-attention over the patches, then class
attention) and ``PyramidVisionTransformerV2`` (overlapping patch embeddings, spatial-reduction
attention, average pooling), ``MlpMixer`` (MLP-Mixer, ResMLP, gMLP), ``ConvNeXt`` and ``ResNet`` (TL-Align
Appendix A's rules beyond ViTs); see :class:`CaitTracer`, :class:`PvtV2Tracer`, :class:`MlpMixerTracer`,
:class:`ConvNeXtTracer` and :class:`ResNetTracer` for their rules.
Others raise an error listing these.
"""

from __future__ import annotations

from typing import Iterable, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Attention, DropPath, GluMlp, LayerNorm, LayerScale, Mlp, RmsNorm, SwiGLU
from timm.models.cait import Cait, ClassAttn, LayerScaleBlock, LayerScaleBlockClassAttn, TalkingHeadAttn
from timm.models.convnext import ConvNeXt, ConvNeXtBlock, ConvNeXtStage
from timm.models.deit import VisionTransformerDistilled
from timm.models.mlp_mixer import Affine, MixerBlock, MlpMixer, ResBlock, SpatialGatingBlock, SpatialGatingUnit
from timm.models.pvt_v2 import (
    Attention as PvtAttention,
)
from timm.models.pvt_v2 import (
    Block as PvtBlock,
)
from timm.models.pvt_v2 import (
    OverlapPatchEmbed,
    PyramidVisionTransformerStage,
    PyramidVisionTransformerV2,
)
from timm.models.resnet import BasicBlock, Bottleneck, ResNet
from timm.models.swin_transformer import (
    PatchMerging,
    SwinTransformer,
    SwinTransformerBlock,
    WindowAttention,
)
from timm.models.vision_transformer import Block, VisionTransformer

from shared_core.compiling import guard_module_hooks
from shared_core.mix import Mix
from shared_core.tl_align import (
    TRANSMIX_MODES,
    LabelCapture,
    LabelColumns,
    aligned_target,
    attention_labels,
    capture_forward,
    check_drop_path,
    check_layers,
    compact_labels,
    conv_pool_labels,
    conv_stencil_labels,
    dense_labels,
    fused_label_attn,
    kept_samples,
    linear_token_mixing,
    residual_labels,
    self_attention_labels,
    shared_attention,
    swin_labels,
    talking_heads_labels,
    trace_labels,
    tracer_for,
    transmix_share,
    use_fused_label_attn,
    window_labels,
)

from .carrier import MixTarget
from .cct import CCT

__all__ = ['TLAlign', 'TransMix', 'SUPPORTED_MODELS', 'timm_tracer']


#: the parts of a timm ViT ``Block`` the label rules assume (attention mixes tokens, everything else is per token:
#: the TL-Align paper, Table 9) and the exact types that are per token; anything else (a wrapped MLP, a token-mixing
#: norm) would need its own rule
_NORMS = (nn.LayerNorm, LayerNorm, RmsNorm, nn.Identity)
VIT_BLOCK_PARTS = {
    'norm1': _NORMS,
    'norm2': _NORMS,
    'mlp': (Mlp, GluMlp, SwiGLU),  # SwiGLUPacked is a GluMlp
    'ls1': (LayerScale, nn.Identity),
    'ls2': (LayerScale, nn.Identity),
    'drop_path1': (DropPath, nn.Identity),
    'drop_path2': (DropPath, nn.Identity),
    'attn.q_norm': _NORMS,
    'attn.k_norm': _NORMS,
    'attn.norm': _NORMS,
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


def check_captured(captures: List[LabelCapture], fields, why: str) -> None:
    """Refuse a forward after which a block's capture lacks a field the rule reads (``why``: the likely cause)."""
    for i, c in enumerate(captures):
        if any(getattr(c, f) is None for f in fields):
            raise ValueError(f'model: block {i} left no {"/".join(fields)} for the label path: {why}')


def _hook_drop_path(blk: nn.Module, cap: LabelCapture, handles: list, kept=None) -> bool:
    """Where stochastic depth may drop the attention branch of ``blk`` in this forward, a hook on its drop path
    that gives the samples whose branch ran (:func:`kept_samples`) to ``kept(keep)`` (default: kept as
    ``cap.keep``); whether it did."""
    if not (isinstance(blk.drop_path1, DropPath) and blk.drop_path1.drop_prob > 0 and blk.training):
        return False
    kept = kept or (lambda keep: setattr(cap, 'keep', keep))
    handles.append(blk.drop_path1.register_forward_hook(lambda m, i, o: kept(kept_samples(i[0], o))))
    return True


class ViTTracer:
    """Label rules for timm's ``VisionTransformer`` (pre-norm blocks: attention residual, MLP residual)."""

    def __init__(self, model: VisionTransformer):
        bad = [i for i, b in enumerate(model.blocks) if type(b) is not Block or type(b.attn) is not Attention]
        if bad:
            raise ValueError(
                f'model: TL-Align traces timm ViT blocks of type Block with Attention; blocks {bad} '
                f'are {type(model.blocks[bad[0]]).__name__}'
            )
        check_block_parts(model.blocks, VIT_BLOCK_PARTS)
        if getattr(model, 'attn_pool', None) is not None:
            raise ValueError("model: global_pool='map' (attention pooling) has no TL-Align rule; use 'token' or 'avg'")
        if model.global_pool not in ('token', 'avg'):
            raise ValueError(f"model: global_pool={model.global_pool!r} has no TL-Align rule; use 'token' or 'avg'")
        if getattr(model.patch_drop, 'prob', 0.0) > 0:
            raise ValueError('model: patch dropout changes the token set; TL-Align does not trace it')
        self.model = model
        self.num_prefix_tokens = model.num_prefix_tokens

    @property
    def depth(self) -> int:
        return len(self.model.blocks)

    def register(self, captures: List[LabelCapture]) -> list:
        handles = []
        for blk in self.model.blocks:
            cap = LabelCapture()
            captures.append(cap)
            handles.append(blk.attn.q_norm.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'q', o.detach())))
            handles.append(blk.attn.k_norm.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'k', o.detach())))
            _hook_drop_path(blk, cap, handles)
        return handles

    def num_tokens(self, captures: List[LabelCapture]) -> int:
        check_captured(captures, ('q', 'k'), 'its attention did not run q_norm / k_norm (a replaced forward?)')
        return captures[0].q.shape[2]

    def propagate(
        self, captures: List[LabelCapture], labels: torch.Tensor, layers: Optional[set], residual: bool
    ) -> torch.Tensor:
        blocks = ((c.q, c.k, blk.attn.scale, c.keep) for blk, c in zip(self.model.blocks, captures))
        return self_attention_labels(blocks, labels, layers, residual)  # Eq. 9, 11

    def class_attention(self, captures: List[LabelCapture]):
        if self.model.global_pool != 'token':
            return None
        last = captures[-1]
        return last.q[:, :, :1], last.k, self.model.blocks[-1].attn.scale

    def readout(self, labels: torch.Tensor, output) -> torch.Tensor:
        """The label of what the classifier reads."""
        if self.model.global_pool == 'token':
            return labels[:, 0]
        tokens = labels if self.model.pool_include_prefix else labels[:, self.num_prefix_tokens :]
        return tokens.mean(1)


class _StagedBlocks:
    """The blocks of a staged model (``model.<_stages>[i].blocks``) in order, which ``layers`` indexes."""

    _stages = 'stages'

    def _blocks(self):
        return [blk for stage in getattr(self.model, self._stages) for blk in stage.blocks]

    @property
    def depth(self) -> int:
        return len(self._blocks())


class _RestoreForward:
    """A handle that removes an instance-level ``forward`` override (and puts back one that was there)."""

    def __init__(self, module: nn.Module):
        self.module, self.prior = module, module.__dict__.get('forward')

    def remove(self) -> None:
        if self.prior is None:
            self.module.__dict__.pop('forward', None)
        else:
            self.module.forward = self.prior


#: the widest label state the shared attention carries as extra value columns (compact states are 1 wide;
#: dense ones, ``TLAlign.trace``, take the recomputing path)
SHARED_MAX_WIDTH = 8


class SharedAttentionViT:
    """:class:`ViTTracer`'s rules with the label path run inside the token path's attention (issue 12): each
    aligned block's ``Attention.forward`` is, for this forward only, timm's own forward with its attention call
    replaced by :func:`shared_core.tl_align.shared_attention` (one attention for tokens and labels: ``V' =
    [V | labels]`` fused, or the attention materialised once), and a hook after the block applies Eq. 11 to the
    state. The token path computes what timm's does, up to the float rounding of another kernel."""

    def __init__(self, base: ViTTracer, labels: torch.Tensor, layers, residual: bool, drop_path: str, history=None):
        self.base, self.layers, self.residual, self.drop_path = base, layers, residual, drop_path
        self.num_prefix_tokens = base.num_prefix_tokens
        self._state = labels.detach().float()  # the unfused path's state (the attention materialised once)
        self.columns: Optional[LabelColumns] = None  # the fused path's state, built at the first aligned block
        self.history = history  # a list to append the state after each aligned block to (tokenaug-viz)

    @property
    def labels(self) -> torch.Tensor:
        """The label state ``(B, T, K)`` fp32 after the blocks run so far."""
        return self.columns.state if self.columns is not None else self._state

    @staticmethod
    def applies(base, labels: torch.Tensor, layers) -> bool:
        """Whether the shared path covers this model and state: a plain timm ViT (not the CCT adapter) whose
        attention forwards are timm's own (not replaced), a compact state, and no attention dropout active in the
        blocks it aligns (it would drop label columns too)."""
        if type(base) not in (ViTTracer, DistilledViTTracer) or labels.shape[-1] > SHARED_MAX_WIDTH:
            return False
        blocks = [b for i, b in enumerate(base.model.blocks) if layers is None or i in layers]
        if any('forward' in b.attn.__dict__ or type(b.attn).forward is not Attention.forward for b in blocks):
            return False  # a replaced attention forward is the user's: keep it (the recomputing path checks it)
        return not any(b.attn.attn_drop.p > 0 and b.attn.training for b in blocks)

    @property
    def depth(self) -> int:
        return self.base.depth

    def register(self, captures: List[LabelCapture]) -> list:
        handles = []
        for idx, blk in enumerate(self.base.model.blocks):
            cap = LabelCapture()
            captures.append(cap)
            if self.layers is not None and idx not in self.layers:
                continue
            handles.append(_RestoreForward(blk.attn))
            # Eq. 11 right after the attention call (no hook per block: a launch-bound step pays for each), or,
            # where stochastic depth may drop the branch ('kept'), once its drop path has said for which samples
            after_drop_path = self.drop_path == 'kept' and _hook_drop_path(
                blk, cap, handles, lambda keep, c=cap: self._update(c, keep)
            )
            blk.attn.forward = self._attention(blk.attn, cap, update=not after_drop_path)
        return handles

    def _attention(self, attn: Attention, cap: LabelCapture, update: bool):
        """timm 1.0.31's ``Attention.forward`` with the shared attention call (``update``: then Eq. 11)."""

        def forward(x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False):
            if is_causal:
                raise ValueError('model: causal attention has no TL-Align rule')
            B, N, C = x.shape
            if N != self._state.shape[1]:  # as trace_labels says it after the recomputing path's forward
                raise ValueError(
                    f'labels: {self.labels.shape[1]} token labels for {N} tokens (prefix {self.num_prefix_tokens} '
                    '+ patches): the patch grid of x does not match'
                )
            gate = attn.gate(x).sigmoid() if getattr(attn, 'gate', None) is not None else None
            qkv = attn.qkv(x).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
            if use_fused_label_attn(x.device, shared=True):  # one call: [q | 0], [k | 0], [v | labels]
                if not (isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity)):
                    q, k, v = qkv.unbind(0)
                    qkv = torch.stack([attn.q_norm(q), attn.k_norm(k), v])
                if self.columns is None:
                    self.columns = LabelColumns(self.labels, attn.num_heads, attn.head_dim, qkv.dtype)
                out, cap.attn = self.columns.attend(qkv, attn.scale, attn_mask)
            else:  # the attention materialised once for both paths
                q, k, v = qkv.unbind(0)
                q, k = attn.q_norm(q), attn.k_norm(k)
                out, cap.attn = shared_attention(q, k, v, self._state, attn.scale, attn_mask, fused=False)
            if update:
                self._update(cap)
            x = out.transpose(1, 2).reshape(B, N, getattr(attn, 'attn_dim', C))
            x = attn.norm(x)
            if gate is not None:
                x = x * gate
            return attn.proj_drop(attn.proj(x))

        return forward

    def _update(self, cap: LabelCapture, keep: Optional[torch.Tensor] = None) -> None:  # Eq. 11
        if self.columns is not None:
            self.columns.update(cap.attn, keep, self.residual)
        else:
            self._state = residual_labels(self._state, cap.attn, keep, self.residual)
        cap.attn, cap.tokens = None, True
        if self.history is not None:
            self.history.append(self.labels.clone())

    def num_tokens(self, captures: List[LabelCapture]) -> int:
        ran = [c.tokens for i, c in enumerate(captures) if self.layers is None or i in self.layers]
        if not all(ran):
            raise ValueError('model: a block did not run its attention for the label path (a replaced forward?)')
        return self._state.shape[1]

    def propagate(self, captures, labels, layers, residual) -> torch.Tensor:
        return self.labels  # already through every block, during the forward

    def readout(self, labels: torch.Tensor, output) -> torch.Tensor:
        return self.base.readout(labels, output)

    def class_attention(self, captures):
        return None


class DistilledViTTracer(ViTTracer):
    """DeiT distilled: the class head reads token 0, the distillation head token 1. In distilled training
    (two outputs) the target is the class token's (the distillation head learns from the teacher);
    otherwise the two heads are averaged, and so are the two tokens' labels."""

    def readout(self, labels: torch.Tensor, output) -> torch.Tensor:
        if isinstance(output, (tuple, list)):
            return labels[:, 0]
        return (labels[:, 0] + labels[:, 1]) / 2


class SwinTracer(_StagedBlocks):
    """Label rules for timm's ``SwinTransformer``: per block, the labels take the block's cyclic shift,
    window partition, head-mean window attention (relative-position bias and shift mask included: the
    attention the token path used), window reverse and shift back, then the residual average; each
    stage's ``PatchMerging`` (timm puts it at the start of a stage) averages the 2x2 labels it merges
    (sum, then Norm); the target is the mean label (global average pooling).

    timm's ``WindowAttention`` materialises its softmax unless fused attention is switched on: the
    hook then takes the attention probabilities the token path computed; with fused attention it takes
    ``q``, ``k`` and the shift mask and recomputes the label attention (fused on accelerators)."""

    num_prefix_tokens = 0
    history: Optional[list] = None  # a list to append each block's (B, H', W', K) state to (tokenaug-viz)

    def __init__(self, model: SwinTransformer):
        if model.global_pool != 'avg':
            raise ValueError(f"model: Swin with global_pool={model.global_pool!r} has no TL-Align rule; use 'avg'")
        for stage in model.layers:
            if not isinstance(stage.downsample, (nn.Identity, PatchMerging)):
                raise ValueError(f'model: Swin downsample {type(stage.downsample).__name__} has no TL-Align rule')
            for blk in stage.blocks:
                if type(blk) is not SwinTransformerBlock or type(blk.attn) is not WindowAttention:
                    raise ValueError(
                        f'model: TL-Align traces timm SwinTransformerBlock/WindowAttention, got {type(blk).__name__}'
                    )
        self.model = model

    _stages = 'layers'

    def register(self, captures: List[LabelCapture]) -> list:
        handles = []
        for blk in self._blocks():
            cap = LabelCapture()
            captures.append(cap)
            handles.append(
                blk.register_forward_pre_hook(lambda m, i, c=cap: setattr(c, 'tokens', tuple(i[0].shape[1:3])))
            )
            if blk.attn.fused_attn:
                handles.append(
                    blk.attn.register_forward_pre_hook(
                        lambda m, a, kw, c=cap: setattr(c, 'mask', kw.get('mask', a[1] if len(a) > 1 else None)),
                        with_kwargs=True,
                    )
                )
                handles.append(
                    blk.attn.qkv.register_forward_hook(
                        lambda m, i, o, c=cap, a=blk.attn: _set_qk(c, o.detach(), a.num_heads)
                    )
                )
            else:
                handles.append(
                    blk.attn.softmax.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'attn', o.detach()))
                )
            _hook_drop_path(blk, cap, handles)
        return handles

    def num_tokens(self, captures: List[LabelCapture]) -> int:
        H, W = captures[0].tokens
        return H * W

    def _window_labels(self, blk: SwinTransformerBlock, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        if cap.attn is not None:  # the token path's own attention probabilities
            return window_labels(Y, blk.window_size, blk.shift_size, attn=cap.attn)
        a = blk.attn
        N = a.window_area
        bias = a._get_rel_pos_bias()
        if cap.mask is not None:  # the shift mask, combined as WindowAttention combines it
            nw = cap.mask.shape[0]
            mask = cap.mask.view(1, nw, 1, N, N).expand(cap.q.shape[0] // nw, -1, a.num_heads, -1, -1)
            bias = bias + mask.reshape(-1, a.num_heads, N, N)
        return window_labels(Y, blk.window_size, blk.shift_size, q=cap.q, k=cap.k, bias=bias, scale=a.scale)

    def propagate(
        self, captures: List[LabelCapture], labels: torch.Tensor, layers: Optional[set], residual: bool
    ) -> torch.Tensor:
        blocks = self._blocks()
        stages = [(len(stage.blocks), isinstance(stage.downsample, PatchMerging)) for stage in self.model.layers]
        return swin_labels(
            labels,
            captures[0].tokens,
            stages,
            lambda idx, Y: self._window_labels(blocks[idx], captures[idx], Y),
            [c.keep for c in captures],
            merge_at='start',
            layers=layers,
            residual=residual,
            history=self.history,
        )

    def readout(self, labels: torch.Tensor, output) -> torch.Tensor:
        return labels.mean(1)

    def class_attention(self, captures: List[LabelCapture]):
        return None


def _set_qk(cap: LabelCapture, qkv: torch.Tensor, num_heads: int) -> None:
    B_, N, _ = qkv.shape
    q, k, _ = qkv.reshape(B_, N, 3, num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
    cap.q, cap.k = q, k


# ---------------------------------------------------------------------------------------------- CaiT


def _hook_first_drop_path(blk: nn.Module, cap: LabelCapture, handles: list) -> None:
    """Blocks with one ``drop_path`` module (CaiT, MLP-Mixer and ResMLP call it twice: the token-mixing branch,
    then the MLP branch; gMLP and ConvNeXt once): the kept samples of its first call are the token-mixing
    residual's."""

    def hook(m, i, o, c=cap):
        if c.keep is None:
            c.keep = kept_samples(i[0], o)

    if isinstance(blk.drop_path, DropPath) and blk.drop_path.drop_prob > 0 and blk.training:
        handles.append(blk.drop_path.register_forward_hook(hook))


class CaitTracer:
    """Label rules for timm's ``Cait`` (the TL-Align paper, Eq. 9/11 and Table 9).

    Label state ``(B, 1 + N, K)``: the class token's label is carried as prefix token 0 from the start
    (the area label, as for a ViT), although CaiT concatenates its class token only before the class
    attention stage: it passes the self-attention stage unchanged.

    - Self-attention stage (``blocks``, ``LayerScaleBlock`` + ``TalkingHeadAttn``, patch tokens only):
      talking-heads attention mixes heads before the softmax (``proj_l``) and after it (``proj_w``); the
      per-head attention that multiplies ``v`` is ``proj_w``'s output, which the token path materialises
      anyway (it has no fused form). A forward hook on ``attn.proj_w`` keeps it (pre attention dropout,
      as the ViT rule ignores SDPA's dropout); the patch labels take ``Norm(|mean_h A'_h|)`` (see
      :func:`talking_heads_labels`), then the residual average. ``fused`` does not apply here: the
      token path's own attention is used, which is exact and cheaper than any recomputation.
    - Class-attention stage (``blocks_token_only``, ``ClassAttn``): the class token attends over
      ``[cls; patches]``; hooks on ``attn.q`` / ``attn.k`` keep the projections, the class label takes
      ``Norm(y_cls + mean_h softmax(q_cls kᵀ · scale) · [y_cls; Y])`` (fused SDPA on accelerators, as
      ViT). The patch tokens are not updated in that stage, nor are their labels.
    - Stochastic depth: the block's single ``drop_path`` module runs twice; its first call (the
      attention branch) decides which samples keep their labels.
    - Target: the class label (``global_pool='token'``), or the mean patch label (``'avg'``).

    Block indices for ``layers``: ``blocks`` first, then ``blocks_token_only``."""

    num_prefix_tokens = 1

    def __init__(self, model: Cait):
        if model.global_pool not in ('token', 'avg'):
            raise ValueError(
                f"model: CaiT with global_pool={model.global_pool!r} has no TL-Align rule; use 'token' or 'avg'"
            )
        if model.blocks_token_only is None or model.cls_token is None:
            raise ValueError('model: CaiT without its class-attention stage (pruned) has no TL-Align rule')
        if model.global_pool == 'token' and not len(model.blocks_token_only):
            raise ValueError(
                "model: CaiT with global_pool='token' and no class-attention block reads a class "
                'token nothing attended with; TL-Align has no rule for it'
            )
        for b in model.blocks:
            if type(b) is not LayerScaleBlock or type(b.attn) is not TalkingHeadAttn:
                raise ValueError(
                    f'model: TL-Align traces CaiT LayerScaleBlock/TalkingHeadAttn blocks, got '
                    f'{type(b).__name__}/{type(b.attn).__name__}'
                )
        for b in model.blocks_token_only:
            if type(b) is not LayerScaleBlockClassAttn or type(b.attn) is not ClassAttn:
                raise ValueError(
                    f'model: TL-Align traces CaiT LayerScaleBlockClassAttn/ClassAttn blocks, got '
                    f'{type(b).__name__}/{type(b.attn).__name__}'
                )
        self.model = model

    @property
    def depth(self) -> int:
        return len(self.model.blocks) + len(self.model.blocks_token_only)

    def register(self, captures: List[LabelCapture]) -> list:
        """One capture per block (``blocks``, then ``blocks_token_only``); the first also keeps the
        number of patch tokens (``tokens``) from ``patch_embed``."""
        handles = []
        for i, blk in enumerate(list(self.model.blocks) + list(self.model.blocks_token_only)):
            cap = LabelCapture()
            captures.append(cap)
            if i < len(self.model.blocks):
                handles.append(
                    blk.attn.proj_w.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'attn', o.detach()))
                )
            else:
                handles.append(blk.attn.q.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'q', o.detach())))
                handles.append(blk.attn.k.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'k', o.detach())))
            _hook_first_drop_path(blk, cap, handles)
        if not captures:
            captures.append(LabelCapture())
        handles.append(
            self.model.patch_embed.register_forward_hook(
                lambda m, i, o, c=captures[0]: setattr(c, 'tokens', o.shape[1])
            )
        )
        return handles

    def num_tokens(self, captures: List[LabelCapture]) -> int:
        return 1 + captures[0].tokens

    def propagate(
        self, captures: List[LabelCapture], labels: torch.Tensor, layers: Optional[set], residual: bool
    ) -> torch.Tensor:
        labels = labels.float()
        cls, patches = labels[:, :1], labels[:, 1:]
        n_sa = len(self.model.blocks)
        for idx, cap in enumerate(captures[:n_sa]):
            if layers is not None and idx not in layers:
                continue
            patches = residual_labels(patches, talking_heads_labels(cap.attn, patches), cap.keep, residual)
        for j, blk in enumerate(self.model.blocks_token_only):
            idx, cap, a = n_sa + j, captures[n_sa + j], blk.attn
            if layers is not None and idx not in layers:
                continue
            B, T, D = cap.k.shape
            q = cap.q.reshape(B, 1, a.num_heads, D // a.num_heads).transpose(1, 2)
            k = cap.k.reshape(B, T, a.num_heads, D // a.num_heads).transpose(1, 2)
            branch = attention_labels(q, k, torch.cat([cls, patches], 1), scale=a.scale)  # (B, 1, K)
            cls = residual_labels(cls, branch, cap.keep, residual)
        return torch.cat([cls, patches], 1)

    def readout(self, labels: torch.Tensor, output) -> torch.Tensor:
        return labels[:, 0] if self.model.global_pool == 'token' else labels[:, 1:].mean(1)

    def class_attention(self, captures: List[LabelCapture]):
        return None  # TransMix is not defined for CaiT (refused by TransMix)


# ---------------------------------------------------------------------------------------------- PVT v2


def _pool_like(labels: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """:func:`~shared_core.tl_align.conv_pool_labels` with the geometry of ``conv``."""
    if tuple(conv.dilation) != (1, 1) or isinstance(conv.padding, str):
        raise ValueError(f'model: TL-Align pools labels for undilated, explicitly padded convs, got {conv}')
    return conv_pool_labels(labels, conv.kernel_size, conv.stride, conv.padding)


class PvtV2Tracer(_StagedBlocks):
    """Label rules for timm's ``PyramidVisionTransformerV2`` (the TL-Align paper, Eq. 9/11 and Table 9).

    - Initial labels: one per token of the first (overlapping, 7x7 stride-4) patch embedding, from the
      partner share of its 4x4 stride cell: give the mixer ``patch_size=4`` (the stride), so the token
      grid is the mix grid. The 7x7 receptive field overlaps the neighbouring cells; that is not traced.
    - Overlapping patch embedding between stages (3x3 conv, stride 2, padding 1): spatial aggregation,
      Table 9's ``Norm(Σ Y_i)`` over the tokens each output token concatenates, i.e. average pooling of
      the labels with the conv's own window geometry (kernel 3, stride 2, padding 1, padded positions
      not counted): each output label is the mean of the in-grid labels of its (overlapping) 3x3 window.
      This is exact for the conv's geometry, where an area (adaptive) pooling would ignore the overlap.
    - Attention with spatial-reduction keys: queries are all tokens; the keys' labels are the labels
      pooled the way the keys were: ``sr`` conv (kernel = stride = sr_ratio) → average pooling with
      that geometry; the ``linear`` variant (``AdaptiveAvgPool2d(7)`` then a 1x1 conv) → adaptive
      average pooling to 7x7. ``Y ← Norm(Y + mean_h softmax(q kᵀ · scale) · Y_keys)`` (Eq. 9/11) with the
      captured ``q`` (hook on ``attn.q``) and ``k`` (hook on ``attn.kv``), fused on accelerators.
    - MLP: left unchanged, as the paper's Eq. 11 does for the (channel) MLP. Simplification: PVT v2's
      MLP has a 3x3 depthwise conv, a static spatial mixing for which Table 9 would give
      ``Y ← Norm(W^s) · Y``; it is not traced (it would blur labels by at most one token per block).
    - Stage norms are point-wise; the target is the mean label of the last stage (global average pooling).
    """

    num_prefix_tokens = 0

    def __init__(self, model: PyramidVisionTransformerV2):
        if model.global_pool != 'avg':
            raise ValueError(f"model: PVT v2 with global_pool={model.global_pool!r} has no TL-Align rule; use 'avg'")
        for stage in model.stages:
            if type(stage) is not PyramidVisionTransformerStage:
                raise ValueError(
                    f'model: TL-Align traces PVT v2 PyramidVisionTransformerStage, got {type(stage).__name__}'
                )
            if stage.downsample is not None and type(stage.downsample) is not OverlapPatchEmbed:
                raise ValueError(f'model: PVT v2 downsample {type(stage.downsample).__name__} has no TL-Align rule')
            for b in stage.blocks:
                if type(b) is not PvtBlock or type(b.attn) is not PvtAttention:
                    raise ValueError(f'model: TL-Align traces PVT v2 Block/Attention, got {type(b).__name__}')
        self.model = model

    def register(self, captures: List[LabelCapture]) -> list:
        """``captures[0]`` keeps the first token grid (``patch_embed``'s output), then one per block
        (its ``feat_size``, ``q``, the ``kv`` projection and the kept samples)."""
        stem = LabelCapture()
        captures.append(stem)
        handles = [
            self.model.patch_embed.register_forward_hook(
                lambda m, i, o, c=stem: setattr(c, 'tokens', tuple(o.shape[1:3]))
            )
        ]
        for blk in self._blocks():
            cap = LabelCapture()
            captures.append(cap)
            handles.append(
                blk.register_forward_pre_hook(
                    lambda m, a, kw, c=cap: setattr(c, 'tokens', tuple(kw['feat_size'] if 'feat_size' in kw else a[1])),
                    with_kwargs=True,
                )
            )
            handles.append(blk.attn.q.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'q', o.detach())))
            handles.append(blk.attn.kv.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'k', o.detach())))
            _hook_drop_path(blk, cap, handles)
        return handles

    def num_tokens(self, captures: List[LabelCapture]) -> int:
        H, W = captures[0].tokens
        return H * W

    @staticmethod
    def _key_labels(a: PvtAttention, Y: torch.Tensor) -> torch.Tensor:
        """The labels of the keys, pooled as the keys were: ``(B, K, H, W)`` → ``(B, N_k, K)``."""
        if a.pool is not None:  # linear variant: AdaptiveAvgPool2d(7), then a 1x1 conv
            Y = _pool_like(F.adaptive_avg_pool2d(Y, a.pool.output_size), a.sr)
        elif a.sr is not None:  # spatial reduction: conv with kernel = stride = sr_ratio
            Y = _pool_like(Y, a.sr)
        return Y.flatten(2).transpose(1, 2)

    def propagate(
        self, captures: List[LabelCapture], labels: torch.Tensor, layers: Optional[set], residual: bool
    ) -> torch.Tensor:
        H, W = captures[0].tokens
        B, _, K = labels.shape
        with torch.autocast(device_type=labels.device.type, enabled=False):
            Y = labels.float().transpose(1, 2).reshape(B, K, H, W)  # channels first, for the pooling ops
            idx = 0
            for stage in self.model.stages:
                if stage.downsample is not None:
                    Y = _pool_like(Y, stage.downsample.proj)
                for blk in stage.blocks:
                    cap, a = captures[1 + idx], blk.attn
                    if cap.tokens != tuple(Y.shape[-2:]):
                        raise ValueError(
                            f'model: PVT v2 block {idx} ran on a {cap.tokens} grid, the labels are '
                            f'on {tuple(Y.shape[-2:])}'
                        )
                    if layers is None or idx in layers:
                        N, Nk = Y.shape[-2] * Y.shape[-1], cap.k.shape[1]
                        q = cap.q.reshape(B, N, a.num_heads, a.head_dim).transpose(1, 2)
                        k = cap.k.reshape(B, Nk, 2, a.num_heads, a.head_dim)[:, :, 0].transpose(1, 2)
                        flat = Y.flatten(2).transpose(1, 2)
                        branch = attention_labels(q, k, self._key_labels(a, Y), scale=a.scale)
                        flat = residual_labels(flat, branch, cap.keep, residual)  # MLP residual: Y
                        Y = flat.transpose(1, 2).reshape(B, K, *Y.shape[-2:])
                    idx += 1
        return Y.flatten(2).transpose(1, 2)

    def readout(self, labels: torch.Tensor, output) -> torch.Tensor:
        return labels.mean(1)

    def class_attention(self, captures: List[LabelCapture]):
        return None


# ---------------------------------------------------------------------------------------------- CCT


class CCTTracer:
    """Label rules for tokenaug's CCT (:mod:`timm_plugin.cct`): timm ``Attention`` blocks whose residual stream is
    renormalised after the attention residual (a point-wise norm: labels unchanged, Table 9), so the ViT rule per
    block (Eq. 9/11, the MLP residual leaves labels); no class token. The classifier reads SeqPool's weighted
    mean ``Σ_t w_t x_t`` with ``w = softmax(attention_pool(x))``: the target is ``Σ_t w_t Y_t`` with the weights
    the token path computed (a hook on ``attention_pool``). The pooled label is returned as a leading token of
    the propagated state, which :meth:`readout` reads."""

    num_prefix_tokens = 0

    def __init__(self, model):
        from .cct import CCTBlock

        bad = [i for i, b in enumerate(model.blocks) if type(b) is not CCTBlock or type(b.attn) is not Attention]
        if bad:
            raise ValueError(f'model: TL-Align traces CCT blocks of type CCTBlock with Attention; blocks {bad} are not')
        self.model = model

    @property
    def depth(self) -> int:
        return len(self.model.blocks)

    def register(self, captures: List[LabelCapture]) -> list:
        handles = ViTTracer.register(self, captures)
        pool = LabelCapture()
        captures.append(pool)
        handles.append(
            self.model.attention_pool.register_forward_hook(lambda m, i, o, c=pool: setattr(c, 'attn', o.detach()))
        )
        return handles

    def num_tokens(self, captures: List[LabelCapture]) -> int:
        check_captured(captures[:-1], ('q', 'k'), 'its attention did not run q_norm / k_norm (a replaced forward?)')
        return captures[0].q.shape[2]

    def propagate(
        self, captures: List[LabelCapture], labels: torch.Tensor, layers: Optional[set], residual: bool
    ) -> torch.Tensor:
        blocks = ((c.q, c.k, blk.attn.scale, c.keep) for blk, c in zip(self.model.blocks, captures))
        state = self_attention_labels(blocks, labels, layers, residual)
        w = captures[-1].attn.float().softmax(1)  # (B, N, 1): SeqPool's weights
        return torch.cat([(w * state).sum(1, keepdim=True), state], 1)

    def readout(self, labels: torch.Tensor, output) -> torch.Tensor:
        return labels[:, 0]

    def class_attention(self, captures: List[LabelCapture]):
        return None


# ---------------------------------------------------------------------------------------------- MLP-Mixer family


class MlpMixerTracer:
    """Label rules for timm's ``MlpMixer`` family, where the token mixing is a learnt linear map over the tokens
    (TL-Align Appendix A, Table 9: spatial mixing ``Y ← Norm(W^s) · Y``, point-wise and channel ops leave labels,
    residual ``Y ← Norm(Y + g(Y))``, global average pooling reads the mean label):

    - ResMLP (``ResBlock``): one ``linear_tokens`` ``W`` ``(N, N)``: ``g(Y) = Norm(|W|) · Y``.
    - MLP-Mixer (``MixerBlock``): the token MLP ``fc2(act(fc1(·)))`` over the tokens is two spatial mixings with a
      point-wise activation between them; Table 9 applied op by op gives ``g(Y) = Norm(|W_2|) · Norm(|W_1|) · Y``
      (the hidden units of ``fc1`` get labels as tokens would: convex combinations of the input labels). We
      chose this over linearising through the activation (a per-sample Jacobian): it is Table 9 exactly for
      each op, static (one ``(N, N)`` matrix per block for the whole batch) and needs nothing from the forward.
    - gMLP (``SpatialGatingBlock``): the channel MLP's spatial gating unit multiplies ``u`` (this token's
      channels: label ``Y``) by ``proj(v)`` over the tokens (label ``Norm(|W|) · Y``); the product combines two
      tokens' information like an aggregation, so ``g(Y) = Norm(Y + Norm(|W|) · Y) = (Y + Norm(|W|) · Y) / 2``.

    ``Norm(|W|)``: the weights are signed and a signed row sum can vanish, so their magnitudes are normalised
    (:func:`shared_core.tl_align.abs_row_norm`, as for CaiT's talking heads); equal to ``Norm(W)`` where ``W ≥ 0``.
    Biases (ResMLP's ``Affine``, the gate's bias) are point-wise. The initial labels are those of the stem's patch
    grid (give the mixer the stem's ``patch_size``). Stochastic depth: a sample whose token-mixing branch was
    dropped keeps its labels (the blocks' shared ``drop_path`` is read at its first call, the token branch).
    """

    num_prefix_tokens = 0
    BLOCKS = (MixerBlock, ResBlock, SpatialGatingBlock)

    def __init__(self, model: MlpMixer):
        if model.global_pool != 'avg':
            raise ValueError(f"model: MlpMixer with global_pool={model.global_pool!r} has no TL-Align rule; use 'avg'")
        for i, b in enumerate(model.blocks):
            if type(b) not in self.BLOCKS:
                raise ValueError(
                    f'model: TL-Align traces MlpMixer blocks of type {", ".join(t.__name__ for t in self.BLOCKS)}; '
                    f'block {i} is {type(b).__name__}'
                )
            if type(b) is MixerBlock:
                parts = {'norm1': _NORMS, 'norm2': _NORMS, 'mlp_tokens': (Mlp,), 'mlp_tokens.fc1': (nn.Linear,)}
                parts |= {'mlp_tokens.fc2': (nn.Linear,), 'mlp_tokens.norm': _NORMS, 'mlp_channels': (Mlp,)}
            elif type(b) is ResBlock:
                parts = {'norm1': (Affine,), 'norm2': (Affine,), 'linear_tokens': (nn.Linear,), 'mlp_channels': (Mlp,)}
            else:
                parts = {'norm': _NORMS, 'mlp_channels.gate': (SpatialGatingUnit,)}
                parts |= {'mlp_channels.gate.proj': (nn.Linear,), 'mlp_channels.gate.norm': _NORMS}
            check_block_parts([b], parts | {'drop_path': (DropPath, nn.Identity)}, first=i)
        self.model = model

    @property
    def depth(self) -> int:
        return len(self.model.blocks)

    def register(self, captures: List[LabelCapture]) -> list:
        """``captures[0]`` keeps the stem's token count, then one per block (the kept samples)."""
        stem = LabelCapture()
        captures.append(stem)
        handles = [self.model.stem.register_forward_hook(lambda m, i, o, c=stem: setattr(c, 'tokens', o.shape[1]))]
        for blk in self.model.blocks:
            cap = LabelCapture()
            captures.append(cap)
            _hook_first_drop_path(blk, cap, handles)
        return handles

    def num_tokens(self, captures: List[LabelCapture]) -> int:
        check_captured(captures[:1], ('tokens',), 'the stem did not run (a replaced forward?)')
        return captures[0].tokens

    @staticmethod
    def mixing(blk: nn.Module) -> torch.Tensor:
        """The block's token-mixing branch as an ``(N, N)`` label matrix (rows sum to 1)."""
        if type(blk) is ResBlock:
            return linear_token_mixing(blk.linear_tokens.weight)
        if type(blk) is MixerBlock:
            return linear_token_mixing(blk.mlp_tokens.fc1.weight, blk.mlp_tokens.fc2.weight)
        A = linear_token_mixing(blk.mlp_channels.gate.proj.weight)
        return (A + torch.eye(A.shape[0], device=A.device)) / 2

    def propagate(
        self, captures: List[LabelCapture], labels: torch.Tensor, layers: Optional[set], residual: bool
    ) -> torch.Tensor:
        for idx, (blk, cap) in enumerate(zip(self.model.blocks, captures[1:])):
            if layers is None or idx in layers:
                labels = residual_labels(labels, self.mixing(blk) @ labels, cap.keep, residual)
        return labels

    def readout(self, labels: torch.Tensor, output) -> torch.Tensor:
        return labels.mean(1)

    def class_attention(self, captures: List[LabelCapture]):
        return None


# ---------------------------------------------------------------------------------------------- ConvNeXt


class _ConvLabelGrid(_StagedBlocks):
    """What the CNN tracers share: the label state starts on the grid one module reports (:meth:`_grid_hook`), one
    capture per block keeps the samples its (first) drop path kept, convs mix labels by their fixed stencil
    ``mean |K|`` over the channel dims, and global average pooling reads the mean label."""

    num_prefix_tokens = 0
    _grid_module = 'the stem'

    def _grid_hook(self, cap: LabelCapture):
        """A hook that sets ``cap.tokens`` to the ``(H, W)`` grid the label state starts on; returns its handle."""
        raise NotImplementedError

    def register(self, captures: List[LabelCapture]) -> list:
        """``captures[0]`` keeps the first grid, then one per block (the samples its drop_path kept)."""
        stem = LabelCapture()
        captures.append(stem)
        handles = [self._grid_hook(stem)]
        for blk in self._blocks():
            cap = LabelCapture()
            captures.append(cap)
            _hook_first_drop_path(blk, cap, handles)
        return handles

    def num_tokens(self, captures: List[LabelCapture]) -> int:
        check_captured(captures[:1], ('tokens',), f'{self._grid_module} did not run (a replaced forward?)')
        H, W = captures[0].tokens
        return H * W

    @staticmethod
    def _label_map(captures: List[LabelCapture], labels: torch.Tensor) -> torch.Tensor:
        """The ``(B, N, K)`` labels as a channels-first ``(B, K, H, W)`` map on the first grid, for the conv ops."""
        H, W = captures[0].tokens
        return labels.transpose(1, 2).reshape(labels.shape[0], labels.shape[2], H, W)

    @staticmethod
    def stencil(conv: nn.Conv2d) -> torch.Tensor:
        """``S = mean |K|`` ``(k, k)`` fp32 over a conv's output and input channel dims (a depthwise conv: over its
        channels' kernels)."""
        return conv.weight.detach().float().abs().mean((0, 1))

    def readout(self, labels: torch.Tensor, output) -> torch.Tensor:
        return labels.mean(1)

    def class_attention(self, captures: List[LabelCapture]):
        return None


class ConvNeXtTracer(_ConvLabelGrid):
    """Label rules for timm's ``ConvNeXt`` (TL-Align Appendix A, Table 9; ConvNeXt is the appendix's example of
    spatial mixing by a convolution, ``W^s = T(K)``):

    - Initial labels: one per token of the patchify stem (``Conv2d`` with kernel = stride, 4 for ConvNeXt): give
      the mixer ``patch_size`` = that stride (``tokenaug-train`` does), so the stem's grid is the mix grid.
    - Block (``conv_dw``, norm, MLP, layer scale, residual): the depthwise ``k x k`` conv is the block's only
      spatial mixing, but each channel has its own signed kernel ``K_c`` while the labels are shared by the
      channels. We use one fixed stencil per layer, ``S = mean_c |K_c|``, and mix the labels with
      ``Norm(T(S))`` (:func:`~shared_core.tl_align.conv_stencil_labels`: the conv's equivalent matrix with
      rows normalised, padding positions not counted): magnitudes because the signed kernels' sums can vanish
      (as for CaiT and the MLP family), the channel mean because one label map has to stand for all channels
      and each channel's kernel moves its information by that kernel's weights. The norm, MLP and layer scale
      are point-wise or channel mixing (labels unchanged); the residual is Eq. 11, ``Y ← Norm(Y + g(Y))``, for
      the samples whose branch stochastic depth kept.
    - Downsampling between stages (norm, then a 2x2 stride-2 conv): spatial aggregation, ``Norm(Σ Y_i)`` over
      each output's window (average pooling with the conv's geometry).
    - Global average pooling (the head): the mean label.

    Refused (a clear error): overlapping stems, ConvNeXt V2's global response norm (it rescales every token by
    statistics of all tokens), dilated or strided depthwise convs, a head pooling other than ``avg``.
    """

    def __init__(self, model: ConvNeXt, pooled_outside: bool = False):
        pool = getattr(getattr(model.head, 'global_pool', None), 'pool_type', None)
        if pool != 'avg' and not pooled_outside:
            raise ValueError(f"model: ConvNeXt with head pooling {pool!r} has no TL-Align rule; use 'avg'")
        stem = model.stem[0] if isinstance(model.stem, nn.Sequential) and len(model.stem) == 2 else None
        if type(stem) is not nn.Conv2d or stem.kernel_size != stem.stride or stem.padding != (0, 0):
            raise ValueError(
                "model: TL-Align traces ConvNeXt's patchify stem (stem_type='patch'); an overlapping stem has no "
                'token grid of its own'
            )
        for i, stage in enumerate(model.stages):
            if type(stage) is not ConvNeXtStage:
                raise ValueError(f'model: TL-Align traces ConvNeXtStage stages, stage {i} is {type(stage).__name__}')
            if not isinstance(stage.downsample, nn.Identity):
                conv = stage.downsample[-1]
                if type(conv) is not nn.Conv2d or conv.kernel_size != conv.stride:
                    raise ValueError(f'model: ConvNeXt stage {i} downsample {conv} has no TL-Align rule')
            for j, b in enumerate(stage.blocks):
                dw = b.conv_dw
                ok = type(b) is ConvNeXtBlock and type(dw) is nn.Conv2d and dw.groups == dw.in_channels
                if not ok or dw.stride != (1, 1) or dw.dilation != (1, 1) or isinstance(dw.padding, str):
                    raise ValueError(
                        f'model: TL-Align traces ConvNeXtBlock with an undilated stride-1 depthwise conv_dw; stage '
                        f'{i} block {j} is {type(b).__name__} with {dw}'
                    )
                if type(b.mlp) is not Mlp or not isinstance(b.shortcut, nn.Identity):
                    raise ValueError(
                        f'model: ConvNeXt stage {i} block {j}: mlp {type(b.mlp).__name__} / shortcut '
                        f'{type(b.shortcut).__name__} has no TL-Align rule (ConvNeXt V2 global response norm '
                        'mixes all tokens)'
                    )
        self.model = model

    def _grid_hook(self, cap: LabelCapture):
        return self.model.stem.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'tokens', tuple(o.shape[-2:])))

    def propagate(
        self, captures: List[LabelCapture], labels: torch.Tensor, layers: Optional[set], residual: bool
    ) -> torch.Tensor:
        Y = self._label_map(captures, labels)
        caps = iter(captures[1:])
        idx = 0
        for stage in self.model.stages:
            if not isinstance(stage.downsample, nn.Identity):
                Y = _pool_like(Y, stage.downsample[-1])
            for blk in stage.blocks:
                keep = next(caps).keep
                if layers is None or idx in layers:
                    dw = blk.conv_dw
                    branch = conv_stencil_labels(Y, self.stencil(dw), dw.padding)
                    Y = residual_labels(Y, branch, keep, residual)
                idx += 1
        return Y.flatten(2).transpose(1, 2)


# ---------------------------------------------------------------------------------------------- ResNet


class ResNetTracer(_ConvLabelGrid):
    """Label rules for timm's ``ResNet`` with ``BasicBlock`` / ``Bottleneck`` blocks (ResNet, ResNet-D, ResNeXt, wide
    ResNets; TL-Align Appendix A, Table 9 applied to a plain CNN):

    - Initial labels: one per cell of the grid the first stage runs on (stride 4: the stem's stride-2 conv and
      stride-2 max pool), from the partner share of that 4x4 cell: give the mixer ``patch_size=4``
      (``tokenaug-train`` does for TL-Align on a ResNet). The stem's overlapping 7x7 / 3x3 windows reach into
      the neighbouring cells; that is not traced (as PVT v2's overlapping patch embedding).
    - 3x3 convolutions (``Bottleneck.conv2``; ``BasicBlock.conv1`` and ``conv2``): spatial mixing with one fixed
      stencil per layer, ``S = mean_{o,i} |K_{o,i}|`` over the output and input channels (grouped convs: over the
      groups' kernels), mixed as ``Norm(T(S))`` (:func:`~shared_core.tl_align.conv_stencil_labels`, in-grid
      positions only). A stride-2 3x3 conv mixes and aggregates at once: the same stencil read at stride 2.
      Why the channel mean of magnitudes: as ConvNeXt's depthwise kernels, one label map stands for every
      channel, and a signed kernel's sum can vanish.
    - 1x1 convolutions, batch norms, activations: channel mixing / point-wise, labels unchanged.
    - Shortcut: identity, or the downsample's geometry: a strided 1x1 conv reads one position of each 2x2 cell
      (:func:`~shared_core.tl_align.conv_pool_labels` with its window), ResNet-D's 2x2 average pool (ceil mode) is
      the mean of its window.
    - Residual (Eq. 11): ``Y ← Norm(Y_shortcut + Y_branch)``; a sample whose branch stochastic depth dropped keeps
      its shortcut labels. Global average pooling reads the mean label.

    Refused with a clear error: attention / SE layers and anti-aliased downsampling (``attn_layer``, ``aa_layer``:
    the SE gate comes from every position, like ConvNeXt V2's GRN), ResNeSt's split attention, dilated convs,
    and pooling other than ``avg``.
    """

    def __init__(self, model: ResNet, pooled_outside: bool = False):
        if model.global_pool.pool_type != 'avg' and not pooled_outside:
            raise ValueError(
                f"model: ResNet with global_pool={model.global_pool.pool_type!r} has no TL-Align rule; use 'avg'"
            )
        self.model = model
        for i, blk in enumerate(self._blocks()):
            convs = self._spatial_convs(blk)
            if type(blk) not in (BasicBlock, Bottleneck) or convs is None:
                raise ValueError(
                    f'model: TL-Align traces ResNet BasicBlock / Bottleneck blocks; block {i} is {type(blk).__name__} '
                    '(ResNeSt split attention has no rule)'
                )
            extras = [n for n in ('se', 'aa') if not isinstance(getattr(blk, n), (type(None), nn.Identity))]
            bad = [c for c in convs if type(c) is not nn.Conv2d or c.dilation != (1, 1) or isinstance(c.padding, str)]
            if extras or bad:
                raise ValueError(
                    f'model: ResNet block {i}: {", ".join(extras + [str(c) for c in bad])} has no TL-Align rule '
                    '(attention/SE gates read every position; dilated or anti-aliased convs are not traced)'
                )
            self._shortcut(blk)  # checks the downsample

    _grid_module = 'layer1'

    def _blocks(self) -> list:
        m = self.model
        return [b for layer in (m.layer1, m.layer2, m.layer3, m.layer4) for b in layer]

    @staticmethod
    def _spatial_convs(blk):
        """The block's k x k convs in order (``None`` for a block type without a rule)."""
        if type(blk) is Bottleneck:
            return [blk.conv2]
        if type(blk) is BasicBlock:
            return [blk.conv1, blk.conv2]
        return None

    @staticmethod
    def _shortcut(blk):
        """The shortcut's label op: ``None`` (identity), or a function of the ``(B, K, H, W)`` labels."""
        ds = blk.downsample
        if ds is None or isinstance(ds, nn.Identity):
            return None
        parts = (
            [m for m in ds if not isinstance(m, (nn.BatchNorm2d, nn.Identity))] if isinstance(ds, nn.Sequential) else []
        )
        if len(parts) == 1 and type(parts[0]) is nn.Conv2d:
            conv = parts[0]
            return lambda Y: _pool_like(Y, conv)
        if len(parts) == 2 and type(parts[0]) is nn.AvgPool2d and type(parts[1]) is nn.Conv2d:
            pool, conv = parts
            if conv.kernel_size != (1, 1) or conv.stride != (1, 1):
                raise ValueError(f'model: ResNet downsample {ds} has no TL-Align rule')
            return lambda Y: F.avg_pool2d(
                Y, pool.kernel_size, pool.stride, pool.padding, pool.ceil_mode, count_include_pad=False
            )
        raise ValueError(f'model: ResNet downsample {ds} has no TL-Align rule')

    def _grid_hook(self, cap: LabelCapture):
        return self.model.layer1.register_forward_pre_hook(
            lambda m, a, c=cap: setattr(c, 'tokens', tuple(a[0].shape[-2:]))
        )

    def propagate(
        self, captures: List[LabelCapture], labels: torch.Tensor, layers: Optional[set], residual: bool
    ) -> torch.Tensor:
        Y = self._label_map(captures, labels)
        for idx, (blk, cap) in enumerate(zip(self._blocks(), captures[1:])):
            shortcut = self._shortcut(blk)
            short = Y if shortcut is None else shortcut(Y)
            if layers is None or idx in layers:
                branch = Y
                for conv in self._spatial_convs(blk):
                    branch = conv_stencil_labels(branch, self.stencil(conv), conv.padding, conv.stride)
                Y = residual_labels(short, branch, cap.keep, residual)
            else:
                Y = short
        return Y.flatten(2).transpose(1, 2)


# most specific class first
SUPPORTED_MODELS = {
    CCT: CCTTracer,
    VisionTransformerDistilled: DistilledViTTracer,
    VisionTransformer: ViTTracer,
    SwinTransformer: SwinTracer,
    Cait: CaitTracer,
    PyramidVisionTransformerV2: PvtV2Tracer,
    MlpMixer: MlpMixerTracer,
    ConvNeXt: ConvNeXtTracer,
    ResNet: ResNetTracer,
}


#: the timm CNNs whose unpooled feature map another framework may pool (``TIMMBackbone`` + a global average neck)
POOLED_OUTSIDE = {ConvNeXt: ConvNeXtTracer, ResNet: ResNetTracer}


def timm_tracer(model: nn.Module, pooled_outside: bool = False, name: str = 'model'):
    """The TL-Align tracer of a supported timm model (:data:`SUPPORTED_MODELS`). ``pooled_outside``: the model's own
    head pooling is off (mmpretrain's ``TIMMBackbone`` resets it) and its final map is average-pooled outside it
    (a ``GlobalAveragePooling`` neck): the timm CNNs of :data:`POOLED_OUTSIDE`, read out by the mean label."""
    if not pooled_outside:
        return tracer_for(model, SUPPORTED_MODELS, name)
    for cls, tracer in POOLED_OUTSIDE.items():
        if isinstance(model, cls):
            return tracer(model, pooled_outside=True)
    return tracer_for(model, POOLED_OUTSIDE, name)  # no tracer: the error that lists the supported classes


class TLAlign(nn.Module):
    """Token-label alignment around a timm model (see the module docstring); the label path is
    :func:`shared_core.tl_align.trace_labels` with this model's tracer. :class:`timm_plugin.TLAlignTask` is
    the same as a timm ``TrainingTask``.

    Args:
        model: a supported timm model.
        layers: align only at these block indices (Table 8 ablation); ``None``: every block.
        residual: ``False`` drops the residual from the label path (Table 8, "normalization disabled").
        fused: the label attention as a fused SDPA call (``True``) or a transient softmax (``False``) for this
            wrapper; default :func:`shared_core.tl_align.use_fused_label_attn` (``$TOKENAUG_FUSED_LABEL_ATTN``,
            else the shared path fused on every device, the recomputing path fused on accelerators). With
            ``shared=False`` the token path is the model's own either way.
        drop_path: ``'kept'`` (a sample whose attention branch stochastic depth dropped keeps its labels) or
            ``'public'`` (the public code: they update anyway).
        shared: timm ViTs: one attention per block for tokens and labels (:class:`SharedAttentionViT`);
            ``False`` keeps the model's own attention and recomputes it for the labels (the reference path).
    """

    method = 'tl_align'

    def __init__(
        self,
        model: nn.Module,
        layers: Optional[Iterable[int]] = None,
        residual: bool = True,
        fused: Optional[bool] = None,
        drop_path: str = 'kept',
        shared: bool = True,
    ):
        super().__init__()
        self.tracer = timm_tracer(model)
        guard_module_hooks()  # per-call hooks under torch.compile
        self.shared = shared
        self.model = model
        self.layers = check_layers(layers, self.tracer.depth)
        self.residual = residual
        self.fused = fused
        self.drop_path = check_drop_path(drop_path)

    @property
    def num_prefix_tokens(self) -> int:
        return self.tracer.num_prefix_tokens

    @property
    def depth(self) -> int:
        return self.tracer.depth

    def _check_mix(self, target) -> Mix:
        return check_mix_target(target, self.method, type(self).__name__)

    def _run(self, x: torch.Tensor, labels: torch.Tensor, forward=None):
        labels = labels.to(x.device)
        tracer = self.tracer
        if self.shared and SharedAttentionViT.applies(tracer, labels, self.layers):
            tracer = SharedAttentionViT(tracer, labels, self.layers, self.residual, self.drop_path)
        with fused_label_attn(self.fused):
            output, captures = capture_forward(tracer, forward or (lambda: self.model(x)))
            return output, trace_labels(tracer, captures, output, labels, self.layers, self.residual, self.drop_path)

    def forward(self, x: torch.Tensor, target: Optional[torch.Tensor] = None):
        """``model(x)`` without a target; with one, :meth:`align`'s ``(output, aligned target)`` in train and eval
        mode alike (in eval mode stochastic depth and dropout are off, so every block counts)."""
        if target is None:
            return self.model(x)
        return self.align(x, target)

    def _check_batch(self, x: torch.Tensor, mix: Mix) -> None:
        if not torch.is_tensor(x) or x.dim() != 4:
            raise ValueError(f'x: expected a (B, C, H, W) image batch, got {getattr(x, "shape", type(x).__name__)}')
        if x.shape[0] != mix.batch_size:
            raise ValueError(
                f'x: a batch of {x.shape[0]} images for a target (mix) of {mix.batch_size}; '
                'pass the images the mixer returned with its target'
            )

    def align(self, x: torch.Tensor, target: torch.Tensor, forward=None):
        """``(output, aligned (B, C) target)``; ``forward`` (default ``self.model(x)``) runs the token path."""
        mix = self._check_mix(target)
        self._check_batch(x, mix)
        classes = getattr(self.model, 'num_classes', None)
        if isinstance(classes, int) and classes > 0 and target.num_classes != classes:
            raise ValueError(
                f'target: the mixer made {target.num_classes}-class targets for a model with {classes} classes '
                "(create_mixer(num_classes=...) must be the model's)"
            )
        output, share = self._run(x, compact_labels(mix, self.num_prefix_tokens), forward)
        return output, aligned_target(share[:, 0], target.labels, mix, target.num_classes, target.smoothing)

    def trace(self, x: torch.Tensor, token_labels: torch.Tensor, cls_label: Optional[torch.Tensor] = None):
        """Reference entry point: dense per-patch labels ``(B, N_patches, C)`` (rows sum to 1, row-major
        over the patch grid of ``x``) through the model; returns ``(output, label)`` with ``label`` the
        aligned ``(B, C)`` label of what the classifier reads. ``cls_label`` (default: the mean of
        ``token_labels``) starts every prefix token."""
        return self._run(x, dense_labels(token_labels, cls_label, self.num_prefix_tokens))


def check_mix_target(target, method: str, who: str) -> Mix:
    """The :class:`Mix` a :class:`MixTarget` carries; a clear error for a plain target."""
    if not isinstance(target, MixTarget):
        raise ValueError(
            f'target: {who} needs the MixTarget of a mixer with carry_mix '
            f'(create_mixer(..., carry_mix=True) / --mixup-type {method}), got a plain tensor'
        )
    return target.mix


class TransMix(TLAlign):
    """TransMix (Chen et al., "TransMix: Attend to Mix for Vision Transformers"), the baseline TL-Align
    compares with: the partner share of the target is read from the last block's attention over the
    mixed region instead of the area (:func:`shared_core.tl_align.transmix_share`).

    ``mode='paper'``: the attention share alone, each patch weighted by its fractional share of a pixel box;
    ``'average'``: the public TransMix code, the mean of the attention share over its nearest-neighbour patch
    mask (top-left pixel inside the box) and the area share. Default ``'paper'``: the papers are this project's
    specification.
    DeiT distilled: the class token's attention. Models without a class token (``global_pool='avg'`` ViTs,
    Swin, PVT v2; our extension): the pooled compact label after the last block's attention alone.
    """

    method = 'transmix'
    MODES = TRANSMIX_MODES

    def __init__(self, model: nn.Module, mode: str = 'paper', fused: Optional[bool] = None):
        super().__init__(model, fused=fused)
        if mode not in self.MODES:
            raise ValueError(f'mode must be one of {self.MODES}, got {mode!r}')
        if isinstance(self.tracer, (CaitTracer, MlpMixerTracer, ConvNeXtTracer, ResNetTracer)):
            raise ValueError(
                'model: TransMix is defined on the class token of a self-attention ViT (DeiT '
                f'family; our extension: class-free ViT, Swin, PVT v2); {type(model).__name__} has no rule here '
                '(CaiT: class attention; MLP-Mixer, ConvNeXt, ResNet: no attention to read; use tl_align)'
            )
        self.mode = mode

    def align(self, x: torch.Tensor, target: torch.Tensor, forward=None):
        mix = self._check_mix(target)
        self._check_batch(x, mix)
        output, captures = capture_forward(self.tracer, forward or (lambda: self.model(x)))
        with fused_label_attn(self.fused):
            share = transmix_share(self.tracer, captures, output, mix.to(x.device), self.mode)
        return output, aligned_target(share, target.labels, mix, target.num_classes, target.smoothing)
