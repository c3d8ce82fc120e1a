"""TL-Align tracers for timm's plain transformers: ViT / DeiT (recomputing, :class:`ViTTracer`, and shared with
the token path's attention, :class:`SharedAttentionViT`), DeiT distilled, CaiT and tokenaug's CCT."""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn as nn
from timm.layers import Attention
from timm.models.cait import Cait, ClassAttn, LayerScaleBlock, LayerScaleBlockClassAttn, TalkingHeadAttn
from timm.models.vision_transformer import Block, VisionTransformer

from shared_core.label_attention import LabelColumns, shared_attention, use_fused_label_attn, use_label_kernel
from shared_core.tl_align import (
    LabelCapture,
    attention_labels,
    residual_labels,
    self_attention_labels,
    talking_heads_labels,
)

from ._blocks import (
    VIT_BLOCK_PARTS,
    RestoreForward,
    check_block_parts,
    check_captured,
    hook_drop_path,
    hook_first_drop_path,
)


class ViTTracer:
    """Label rules for timm's ``VisionTransformer`` (pre-norm blocks: attention residual, MLP residual)."""

    #: the last block mixes its tokens by a self-attention (TransMix reads it)
    attends = True

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
            hook_drop_path(blk, cap, handles)
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


#: the widest label state the shared attention carries as extra value columns (compact states are 1 wide;
#: dense ones, ``TLAlign.trace``, take the recomputing path)
SHARED_MAX_WIDTH = 8


class SharedAttentionViT:
    """:class:`ViTTracer`'s rules with the label path run inside the token path's attention: each
    aligned block's ``Attention.forward`` is, for this forward only, timm's own forward with its attention call
    replaced by :func:`shared_core.label_attention.shared_attention` (one attention for tokens and labels: ``V' =
    [V | labels]`` fused, or the attention materialised once), and a hook after the block applies Eq. 11 to the
    state. The token path computes what timm's does, up to the float rounding of another kernel."""

    def __init__(self, base: ViTTracer, labels: torch.Tensor, layers, residual: bool, drop_path: str, history=None):
        self.base, self.layers, self.residual, self.drop_path = base, layers, residual, drop_path
        self.num_prefix_tokens, self.attends = base.num_prefix_tokens, base.attends
        self._state = labels.detach().float()  # the unfused path's state (the attention materialised once)
        self.columns: Optional[LabelColumns] = None  # the fused path's state, built at the first aligned block
        self.history = history  # a list to append the state after each aligned block to (tokenaug-viz)

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
            handles.append(RestoreForward(blk.attn))
            # Eq. 11 right after the attention call (no hook per block: a launch-bound step pays for each), or,
            # where stochastic depth may drop the branch ('kept'), once its drop path has said for which samples
            after_drop_path = self.drop_path == 'kept' and hook_drop_path(
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
                    kernel = use_label_kernel(x.device)  # the Triton kernel (CUDA), else an SDPA call
                    self.columns = LabelColumns(self.labels, attn.num_heads, attn.head_dim, qkv.dtype, kernel)
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


# ---------------------------------------------------------------------------------------------- CaiT


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
    attends = False
    why_no_attention = (
        "its last blocks are class attention (the class token alone attends), which TransMix's rule, written for "
        "a ViT's self-attention, does not cover"
    )

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
            hook_first_drop_path(blk, cap, handles)
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


# ---------------------------------------------------------------------------------------------- CCT


class CCTTracer:
    """Label rules for tokenaug's CCT (:mod:`timm_plugin.cct`): timm ``Attention`` blocks whose residual stream is
    renormalised after the attention residual (a point-wise norm: labels unchanged, Table 9), so the ViT rule per
    block (Eq. 9/11, the MLP residual leaves labels); no class token. The classifier reads SeqPool's weighted
    mean ``Σ_t w_t x_t`` with ``w = softmax(attention_pool(x))``: the target is ``Σ_t w_t Y_t`` with the weights
    the token path computed (a hook on ``attention_pool``). The pooled label is returned as a leading token of
    the propagated state, which :meth:`readout` reads."""

    num_prefix_tokens = 0
    #: the last block mixes its tokens by a self-attention (TransMix reads it)
    attends = True

    def __init__(self, model):
        from ..cct import CCTBlock

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
