"""TL-Align tracer for timm's ``ConVit`` (gated positional self-attention, then a class token and plain attention)."""

from __future__ import annotations

import torch
import torch.nn as nn
from timm.models.convit import GPSA, MHSA, ConVit
from timm.models.convit import Block as ConvitBlock

from shared_core.capture import Captures, LabelCapture
from shared_core.tracer import Tracer, check_pool, check_types

__all__ = ['ConViTTracer']


class ConViTTracer(Tracer):
    """Label rules for timm's ``ConVit`` (the TL-Align paper, Eq. 9 and 11, on the attention each block applies):

    - The local blocks' gated positional self-attention (GPSA) mixes its tokens by
      ``A = Norm((1 − σ(λ_h)) softmax(q kᵀ · scale) + σ(λ_h) softmax(positional scores))``, a row-stochastic
      token-to-token attention made of a content and a positional part, gated per head: Eq. 9 reads that ``A``, the
      weights the token path applies to its values (the hook takes it at the attention's dropout, before it, for
      GPSA and the later plain blocks alike), head-averaged.
    - The class token joins after the local blocks (``local_up_to_layer``). It carries no image content, so it
      enters with the mean label of the patch tokens, as a ViT's class token starts (the label state keeps its row
      from the start; the local blocks leave it). From there the blocks are plain attention over it and the patches.
    - MLP and norms per token; the readout is the class token (``global_pool='token'``) or the patches' mean.
    """

    num_prefix_tokens = 1
    needs = ('attn',)
    why_missing = 'its attention did not apply its dropout to the attention weights (a replaced forward?)'

    def __init__(self, model: ConVit):
        check_types(model.blocks, (ConvitBlock,), (GPSA, MHSA), 'ConVit')
        check_pool(model.global_pool, ('token', 'avg'), 'ConVit')
        if model.cls_token is None or model.local_up_to_layer >= len(model.blocks):
            raise ValueError('model: a ConVit whose class token never joins (pruned blocks) has no TL-Align rule')
        super().__init__(model)
        self.readout = 'cls' if model.global_pool == 'token' else 'mean'

    def stages(self):
        L = self.model.local_up_to_layer
        return [('local', list(self.model.blocks[:L])), ('global', list(self.model.blocks[L:]))]

    def drop_path(self, blk: nn.Module):
        return blk.drop_path  # (one module for both branches: its first call is the attention's)

    def watch_model(self, captures: Captures, handles: list) -> None:
        """The patch tokens: ``patch_embed``'s ``(B, N, C)`` output."""
        embed = self.model.patch_embed
        handles.append(embed.register_forward_hook(lambda m, i, o: setattr(captures, 'grid', o.shape[1])))

    def watch(self, blk: nn.Module, cap: LabelCapture, handles: list) -> None:
        """The attention weights as the attention's dropout gets them."""
        handles.append(
            blk.attn.attn_drop.register_forward_pre_hook(lambda m, a, c=cap: setattr(c, 'attn', a[0].detach()))
        )

    def enter(self, stage, Y: torch.Tensor) -> torch.Tensor:
        """The class token joins: its row becomes the patch tokens' mean label."""
        if stage != 'global':
            return Y
        return torch.cat([Y[:, 1:].mean(1, keepdim=True), Y[:, 1:]], 1)

    def branch(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        A = cap.attn.float().mean(1)  # (B, N', N'), head-averaged
        if A.shape[-1] == Y.shape[1]:  # the class token is in
            return A @ Y
        return torch.cat([Y[:, :1], A @ Y[:, 1:]], 1)  # a local block: the patches only

    def class_attention(self, captures: Captures):
        """The class token's attention probabilities in the last block, ``(B, H, 1, T)``."""
        return captures[-1].attn[:, :, :1] if self.readout == 'cls' else None
