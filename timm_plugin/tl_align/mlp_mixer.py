"""TL-Align tracer for timm's ``MlpMixer`` family (MLP-Mixer, ResMLP, gMLP): static token-mixing label rules
(TL-Align Appendix A)."""

from __future__ import annotations

import torch
import torch.nn as nn
from timm.layers import DropPath, Mlp
from timm.models.mlp_mixer import Affine, MixerBlock, MlpMixer, ResBlock, SpatialGatingBlock, SpatialGatingUnit

from shared_core.capture import Captures, LabelCapture
from shared_core.tl_align import linear_token_mixing
from shared_core.tracer import Tracer, check_block_parts, check_pool

from ._blocks import NORMS

# ---------------------------------------------------------------------------------------------- MLP-Mixer family


class MlpMixerTracer(Tracer):
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

    BLOCKS = (MixerBlock, ResBlock, SpatialGatingBlock)
    grid_module = 'the stem'
    attends = False
    why_no_attention = 'its blocks mix tokens by an MLP across the tokens (fixed weights, Table 9)'

    def __init__(self, model: MlpMixer):
        check_pool(model.global_pool, ('avg',), 'MlpMixer')
        for i, b in enumerate(model.blocks):
            if type(b) not in self.BLOCKS:
                raise ValueError(
                    f'model: TL-Align traces MlpMixer blocks of type {", ".join(t.__name__ for t in self.BLOCKS)}; '
                    f'block {i} is {type(b).__name__}'
                )
            if type(b) is MixerBlock:
                parts = {'norm1': NORMS, 'norm2': NORMS, 'mlp_tokens': (Mlp,), 'mlp_tokens.fc1': (nn.Linear,)}
                parts |= {'mlp_tokens.fc2': (nn.Linear,), 'mlp_tokens.norm': NORMS, 'mlp_channels': (Mlp,)}
            elif type(b) is ResBlock:
                parts = {'norm1': (Affine,), 'norm2': (Affine,), 'linear_tokens': (nn.Linear,), 'mlp_channels': (Mlp,)}
            else:
                parts = {'norm': NORMS, 'mlp_channels.gate': (SpatialGatingUnit,)}
                parts |= {'mlp_channels.gate.proj': (nn.Linear,), 'mlp_channels.gate.norm': NORMS}
            check_block_parts([b], parts | {'drop_path': (DropPath, nn.Identity)}, first=i)
        super().__init__(model)

    def blocks(self):
        return self.model.blocks

    def drop_path(self, blk: nn.Module) -> nn.Module:
        return blk.drop_path  # called for the token-mixing branch, then the MLP's

    def watch_model(self, captures: Captures, handles: list) -> None:
        """The stem's token count (``captures.grid``)."""
        handles.append(self.model.stem.register_forward_hook(lambda m, i, o: setattr(captures, 'grid', o.shape[1])))

    @staticmethod
    def mixing(blk: nn.Module) -> torch.Tensor:
        """The block's token-mixing branch as an ``(N, N)`` label matrix (rows sum to 1)."""
        if type(blk) is ResBlock:
            return linear_token_mixing(blk.linear_tokens.weight)
        if type(blk) is MixerBlock:
            return linear_token_mixing(blk.mlp_tokens.fc1.weight, blk.mlp_tokens.fc2.weight)
        A = linear_token_mixing(blk.mlp_channels.gate.proj.weight)
        return (A + torch.eye(A.shape[0], device=A.device)) / 2

    def branch(self, blk: nn.Module, cap: LabelCapture, Y: torch.Tensor) -> torch.Tensor:
        return self.mixing(blk) @ Y
