"""TL-Align tracers for timm's plain transformers: ViT / DeiT (recomputing, :class:`ViTTracer`, and shared with
the token path's attention, :class:`SharedAttentionViT`), DeiT distilled, CaiT and tokenaug's CCT."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from timm.layers import Attention
from timm.models.cait import Cait, ClassAttn, LayerScaleBlock, LayerScaleBlockClassAttn, TalkingHeadAttn
from timm.models.vision_transformer import Block, VisionTransformer

from shared_core.capture import Captures, LabelCapture, hook_drop_path
from shared_core.label_attention import LabelBackend, LabelColumns, LabelPath, shared_attention
from shared_core.tl_align import attention_labels, residual_labels, talking_heads_labels
from shared_core.tracer import Tracer, check_block_parts, check_pool

from ..lvvit import LVBlock
from ._blocks import VIT_BLOCK_PARTS, RestoreForward


def watch_qk_norm(blk: nn.Module, cap: LabelCapture, handles: list) -> None:
    """Hooks on a timm ``Attention``'s ``q_norm`` / ``k_norm`` (identity modules unless qk-norm is on): the detached
    ``q``, ``k`` its fused attention was fed."""
    handles.append(blk.attn.q_norm.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'q', o.detach())))
    handles.append(blk.attn.k_norm.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'k', o.detach())))


#: the ViT blocks the rules cover: timm's pre-norm ``Block``, and LV-ViT's (:class:`~timm_plugin.lvvit.LVBlock`:
#: ``x + F(x) / skip_lam``, a scalar on each branch, which leaves the labels as layer scale does: Eq. 11 averages
#: the shortcut's and the branch's labels whatever the branch's scale)
VIT_BLOCKS = (Block, LVBlock)


class ViTTracer(Tracer):
    """Label rules for timm's ``VisionTransformer`` (pre-norm blocks: attention residual, MLP residual), LV-ViT's
    included (:data:`VIT_BLOCKS`; its conv stem is not traced: the labels start on its patch grid)."""

    needs = ('q', 'k')
    why_missing = 'its attention did not run q_norm / k_norm (a replaced forward?)'

    def __init__(self, model: VisionTransformer):
        bad = [i for i, b in enumerate(model.blocks) if type(b) not in VIT_BLOCKS or type(b.attn) is not Attention]
        if bad:
            raise ValueError(
                f'model: TL-Align traces timm ViT blocks of type Block or LVBlock with Attention; blocks {bad} '
                f'are {type(model.blocks[bad[0]]).__name__}'
            )
        check_block_parts(model.blocks, VIT_BLOCK_PARTS)
        if getattr(model, 'attn_pool', None) is not None:
            raise ValueError("model: global_pool='map' (attention pooling) has no TL-Align rule; use 'token' or 'avg'")
        check_pool(model.global_pool, ('token', 'avg'), type(model).__name__)
        if getattr(model.patch_drop, 'prob', 0.0) > 0:
            raise ValueError('model: patch dropout changes the token set; TL-Align does not trace it')
        super().__init__(model)
        self.num_prefix_tokens = model.num_prefix_tokens
        self.readout = 'cls' if model.global_pool == 'token' else 'mean_all' if model.pool_include_prefix else 'mean'

    def blocks(self):
        return self.model.blocks

    def watch(self, blk: nn.Module, cap: LabelCapture, handles: list) -> None:
        watch_qk_norm(blk, cap, handles)

    def tokens(self, captures: Captures) -> int:
        return captures[0].q.shape[2]

    def branch(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        return attention_labels(cap.q, cap.k, Y, scale=blk.attn.scale)  # Eq. 9

    def class_attention(self, captures: Captures):
        if self.model.global_pool != 'token':
            return None
        last = captures[-1]
        return last.q[:, :, :1], last.k, self.model.blocks[-1].attn.scale


class NaFlexViTTracer(ViTTracer):
    """:class:`ViTTracer`'s rules on timm's ``NaFlexVit`` fed image batches (its standard mode: every patch of a
    full grid, row-major after the class and register tokens, no attention mask). A NaFlex batch (patches with
    coordinates and a validity mask) is refused at the forward: the mask drops keys, which Eq. 9's weights here
    do not see."""

    def watch(self, blk: nn.Module, cap: LabelCapture, handles: list) -> None:
        super().watch(blk, cap, handles)

        def no_mask(m, args, kwargs):
            if kwargs.get('attn_mask') is not None or len(args) > 1:
                raise ValueError(
                    'x: TL-Align reads NaFlexVit on image batches (a full grid of patches); a NaFlex batch with '
                    'an attention mask (variable patch counts) is not traced'
                )

        handles.append(blk.register_forward_pre_hook(no_mask, with_kwargs=True))


#: the widest label state the shared attention carries as extra value columns (compact states are 1 wide;
#: dense ones, ``TLAlign.trace``, take the recomputing path)
SHARED_MAX_WIDTH = 8


class SharedAttentionViT:
    """:class:`ViTTracer`'s rules with the label path run inside the token path's attention, for one forward: the
    watcher :meth:`shared_core.tracer.Tracer.capture` registers instead of the tracer's hooks, whose
    :meth:`state` the driver reads out (``Tracer.label_path(..., state=...)``). Each aligned block's
    ``Attention.forward`` is, for this forward only, timm's own forward with its attention call replaced by
    :func:`shared_core.label_attention.shared_attention` (one attention for tokens and labels: ``V' = [V | labels]``
    fused, or the attention materialised once), and Eq. 11 follows the call (or the drop path, where stochastic
    depth may drop the branch). The token path computes what timm's does, up to the float rounding of another
    kernel."""

    def __init__(
        self,
        base: ViTTracer,
        labels: torch.Tensor,
        layers,
        residual: bool,
        drop_path: str,
        path: LabelPath,
        backend: Optional[LabelBackend] = None,
        observe=None,
    ):
        self.base, self.layers, self.residual, self.drop_path = base, layers, residual, drop_path
        self.path, self.backend = path, backend  # how the labels ride (the wrapper's backend chose it)
        self.num_prefix_tokens = base.num_prefix_tokens
        self._state = labels.detach().float()  # the unfused path's state (the attention materialised once)
        self.columns: Optional[LabelColumns] = None  # the fused path's state, built at the first aligned block
        self.observe = observe  # the driver's observer: observe(index, labels, grid) after each block

    @property
    def labels(self) -> torch.Tensor:
        """The label state ``(B, T, K)`` fp32 after the blocks run so far."""
        return self.columns.state if self.columns is not None else self._state

    @staticmethod
    def applies(base, labels: torch.Tensor, layers) -> bool:
        """Whether the shared path covers this model and state (:meth:`why_not` says nothing against it)."""
        return SharedAttentionViT.why_not(base, labels, layers) is None

    @staticmethod
    def why_not(base, labels: torch.Tensor, layers) -> Optional[str]:
        """Why the shared path does not cover this model and state, or ``None`` where it does: a plain timm ViT
        (not the CCT adapter) whose attention forwards are timm's own (not replaced), a compact state, and no
        attention dropout active in the blocks it aligns (it would drop label columns too)."""
        if type(base) not in (ViTTracer, DistilledViTTracer):
            return (
                f'it runs in the shared attention of timm ViTs and DeiTs; {type(base.model).__name__} is traced by '
                f'{type(base).__name__}, which computes the labels apart from the token path'
            )
        if labels.shape[-1] > SHARED_MAX_WIDTH:
            return (
                f'a label state {labels.shape[-1]} wide (dense labels) takes the recomputing path; the shared '
                f'attention carries at most {SHARED_MAX_WIDTH} label columns'
            )
        blocks = [(i, b) for i, b in enumerate(base.model.blocks) if layers is None or i in layers]
        for i, b in blocks:
            if 'forward' in b.attn.__dict__ or type(b.attn).forward is not Attention.forward:
                # a replaced attention forward is the user's: keep it (the recomputing path checks it)
                return f"block {i}'s attention forward is replaced (not timm's own), so the recomputing path runs"
        for i, b in blocks:
            if b.attn.attn_drop.p > 0 and b.attn.training:
                return (
                    f"block {i}'s attention dropout (p={b.attn.attn_drop.p}) is active in training: the kernel has "
                    'no dropout and dropping its label columns would change the labels, so the recomputing path '
                    'runs (exact under dropout); use fused=True or False, or attn_drop_rate=0'
                )
        return None

    def register(self, captures: Captures) -> list:
        handles = []
        for idx, blk in enumerate(self.base.model.blocks):
            cap = LabelCapture()
            captures.append(cap)
            if self.layers is not None and idx not in self.layers:
                if self.observe is not None:  # the labels pass the block unchanged
                    handles.append(blk.register_forward_hook(lambda m, i, o, j=idx: self._observe(j)))
                continue
            handles.append(RestoreForward(blk.attn))
            # Eq. 11 right after the attention call (no hook per block: a launch-bound step pays for each), or,
            # where stochastic depth may drop the branch ('kept'), once its drop path has said for which samples
            after_drop_path = self.drop_path == 'kept' and hook_drop_path(
                blk.drop_path1, cap, handles, lambda keep, c=cap, j=idx: self._update(c, j, keep)
            )
            blk.attn.forward = self._attention(blk.attn, cap, idx, update=not after_drop_path)
        return handles

    def _attention(self, attn: Attention, cap: LabelCapture, idx: int, update: bool):
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
            if self.path.shared != 'materialised':  # one call: [q | 0], [k | 0], [v | labels], or the kernel
                if not (isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity)):
                    q, k, v = qkv.unbind(0)
                    qkv = torch.stack([attn.q_norm(q), attn.k_norm(k), v])
                if self.columns is None:
                    heads, dim = attn.num_heads, attn.head_dim
                    self.columns = LabelColumns(self.labels, heads, dim, qkv.dtype, self.path, self.backend)
                out, cap.attn = self.columns.attend(qkv, attn.scale, attn_mask)
            else:  # the attention materialised once for both paths
                q, k, v = qkv.unbind(0)
                q, k = attn.q_norm(q), attn.k_norm(k)
                out, cap.attn = shared_attention(q, k, v, self._state, attn.scale, attn_mask, fused=False)
            if update:
                self._update(cap, idx)
            x = out.transpose(1, 2).reshape(B, N, getattr(attn, 'attn_dim', C))
            x = attn.norm(x)
            if gate is not None:
                x = x * gate
            return attn.proj_drop(attn.proj(x))

        return forward

    def _update(self, cap: LabelCapture, idx: int, keep: Optional[torch.Tensor] = None) -> None:  # Eq. 11
        if self.columns is not None:
            self.columns.update(cap.attn, keep, self.residual)
        else:
            self._state = residual_labels(self._state, cap.attn, keep, self.residual)
        cap.attn, cap.tokens = None, True
        self._observe(idx)

    def _observe(self, idx: int) -> None:
        if self.observe is not None:
            self.observe(idx, self.labels.clone(), None)

    def state(self, captures: Captures) -> torch.Tensor:
        """The label state after the blocks, once every aligned block ran its attention for the label path."""
        ran = [c.tokens for i, c in enumerate(captures) if self.layers is None or i in self.layers]
        if not all(ran):
            raise ValueError('model: a block did not run its attention for the label path (a replaced forward?)')
        return self.labels


class DistilledViTTracer(ViTTracer):
    """DeiT distilled: the class head reads token 0, the distillation head token 1. In distilled training
    (two outputs) the target is the class token's (the distillation head learns from the teacher);
    otherwise the two heads are averaged, and so are the two tokens' labels."""

    def __init__(self, model: VisionTransformer):
        super().__init__(model)
        self.readout = 'cls_dist'


# ---------------------------------------------------------------------------------------------- CaiT


class CaitTracer(Tracer):
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
    attends = False
    why_no_attention = (
        "its last blocks are class attention (the class token alone attends), which TransMix's rule, written for "
        "a ViT's self-attention, does not cover"
    )

    def __init__(self, model: Cait):
        check_pool(model.global_pool, ('token', 'avg'), 'CaiT')
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
        super().__init__(model)
        self.readout = 'cls' if model.global_pool == 'token' else 'mean'

    def blocks(self):
        return list(self.model.blocks) + list(self.model.blocks_token_only)

    def drop_path(self, blk: nn.Module) -> nn.Module:
        return blk.drop_path  # called for the attention branch, then the MLP's

    def watch_model(self, captures: Captures, handles: list) -> None:
        """The number of patch tokens (``captures.grid``) from ``patch_embed``."""
        handles.append(
            self.model.patch_embed.register_forward_hook(lambda m, i, o: setattr(captures, 'grid', o.shape[1]))
        )

    def watch(self, blk: nn.Module, cap: LabelCapture, handles: list) -> None:
        if type(blk) is LayerScaleBlock:  # talking heads: the attention that multiplies v
            handles.append(blk.attn.proj_w.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'attn', o.detach())))
        else:  # class attention: its projections
            handles.append(blk.attn.q.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'q', o.detach())))
            handles.append(blk.attn.k.register_forward_hook(lambda m, i, o, c=cap: setattr(c, 'k', o.detach())))

    def branch(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        """Self-attention blocks mix the patch tokens (the class token keeps its label: the branch gives it its own,
        and Eq. 11 leaves it); class-attention blocks mix the class token alone."""
        cls, patches = Y[:, :1], Y[:, 1:]
        if type(blk) is LayerScaleBlock:
            return torch.cat([cls, talking_heads_labels(cap.attn, patches)], 1)
        a = blk.attn
        B, T, D = cap.k.shape
        q = cap.q.reshape(B, 1, a.num_heads, D // a.num_heads).transpose(1, 2)
        k = cap.k.reshape(B, T, a.num_heads, D // a.num_heads).transpose(1, 2)
        return torch.cat([attention_labels(q, k, Y, scale=a.scale), patches], 1)  # (B, 1, K): the class token's


# ---------------------------------------------------------------------------------------------- CCT


class CCTTracer(Tracer):
    """Label rules for tokenaug's CCT (:mod:`timm_plugin.cct`): timm ``Attention`` blocks whose residual stream is
    renormalised after the attention residual (a point-wise norm: labels unchanged, Table 9), so the ViT rule per
    block (Eq. 9/11, the MLP residual leaves labels); no class token. The classifier reads SeqPool's weighted
    mean ``Σ_t w_t x_t`` with ``w = softmax(attention_pool(x))``: the target is ``Σ_t w_t Y_t`` with the weights
    the token path computed (a hook on ``attention_pool``; readout ``'pool'``)."""

    readout = 'pool'
    needs = ViTTracer.needs
    why_missing = ViTTracer.why_missing

    def __init__(self, model):
        from ..cct import CCTBlock

        bad = [i for i, b in enumerate(model.blocks) if type(b) is not CCTBlock or type(b.attn) is not Attention]
        if bad:
            raise ValueError(f'model: TL-Align traces CCT blocks of type CCTBlock with Attention; blocks {bad} are not')
        super().__init__(model)

    def blocks(self):
        return self.model.blocks

    def watch(self, blk: nn.Module, cap: LabelCapture, handles: list) -> None:
        watch_qk_norm(blk, cap, handles)

    def watch_model(self, captures: Captures, handles: list) -> None:
        pool = self.model.attention_pool
        handles.append(pool.register_forward_hook(lambda m, i, o: setattr(captures, 'pool', o.detach())))

    tokens = ViTTracer.tokens
    branch = ViTTracer.branch
