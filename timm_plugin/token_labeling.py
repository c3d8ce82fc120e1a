"""Token labeling + MixToken on timm (the Token Labeling paper): the model side and the loss.

The data side (label-map rows that follow each crop and flip) is :mod:`timm_plugin.token_label_data`; the
maths (targets, MixToken, un-mixing, the inference rule, the loss) is :mod:`shared_core.token_labeling`.

:class:`TokenLabeling` wraps a timm ViT (class token or average pooling, any patch embedding whose output
is the ``(B, N, D)`` or ``(B, gh, gw, D)`` token grid — ViT/DeiT, LV-ViT) or an MLP-Mixer / ResMLP / gMLP (the
``PatchEmbed`` stem's tokens, no prefix token; Token Labeling Table 5) or a timm CNN (ResNet / ResNeSt /
ResNeXt, ConvNeXt: one token per position of the final feature map, the aux head a 1x1 conv there; MixToken's
box on whole cells of that map, pasted in the images). In training it mixes the patch
tokens of sample pairs inside a box right after patch embedding (MixToken, Eq. 5), returns the class
logits, the *un-mixed* per-token logits of the aux head, and the mix. The aux head is ``model.aux_head``
(LV-ViT has one; :func:`attach_aux_head` adds a linear one to any ViT, as a submodule of the model so the
optimizer, EMA and checkpoints hold it). In eval it returns
:func:`~shared_core.token_labeling.inference_logits` (``head_rule``). :class:`TokenLabelingLoss` is
Eq. 3-4 on those outputs; :class:`timm_plugin.tasks.TokenLabelingTask` is the same as a timm ``TrainingTask``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
from timm.layers import trunc_normal_

from shared_core.checks import check_real
from shared_core.compiling import guard_module_hooks
from shared_core.mix import Mix, check_image_size
from shared_core.token_labeling import (
    HEAD_RULES,
    TokenTargetSpec,
    check_head_rule,
    draw_mixtoken,
    inference_logits,
    mixtoken_applied,
    mixtoken_sampler,
    token_labeling_loss,
    token_labeling_targets,
    unmix_tokens,
)

from .carrier import CarrierTensor
from .token_grid import cnn_classes, cnn_features, patch_embedding, token_labeling_stride, token_stride
from .token_label_data import TokenLabelTarget

__all__ = [
    'HEAD_RULES',
    'attach_aux_head',
    'aux_logits',
    'token_stride',
    'TokenLabeling',
    'TokenLabelingOutput',
    'TokenLabelingLoss',
]


def attach_aux_head(model: nn.Module, num_classes: Optional[int] = None) -> nn.Module:
    """Give a timm ViT an aux head (``model.aux_head``, linear on each patch token) if it has none;
    initialised as timm initialises ViT heads. Returns the model."""
    existing = getattr(model, 'aux_head', None)
    if existing is not None:
        want = num_classes or model.num_classes
        if getattr(existing, 'out_features', want) != want:
            raise ValueError(
                f'num_classes: the model already has an aux head for {existing.out_features} classes, asked for '
                f'{want}; replace model.aux_head yourself to change it'
            )
        return model
    dim = getattr(model, 'num_features', None) or getattr(model, 'embed_dim', None)
    if dim is None:
        raise ValueError(f'model: {type(model).__name__} has no num_features/embed_dim for an aux head')
    head = nn.Linear(dim, num_classes or model.num_classes)
    trunc_normal_(head.weight, std=0.02)
    nn.init.zeros_(head.bias)
    model.aux_head = head
    return model


class TokenLabelingOutput(NamedTuple):
    """Training output of :class:`TokenLabeling`: class logits ``(B, C)``, un-mixed per-token logits
    ``(B, N, C)`` (``None`` without an aux head), the MixToken mix (``None`` when off), the token grid."""

    cls: torch.Tensor
    aux: Optional[torch.Tensor]
    mix: Optional[Mix]
    grid: Tuple[int, int]


class TokenLabeling(nn.Module):
    """Token labeling with MixToken around a timm ViT.

    Args:
        model: a timm ViT-like model (``patch_embed``, ``num_prefix_tokens``, ``forward_features``,
            ``forward_head(pre_logits=True)``, ``head``; LV-ViT included), an MLP-Mixer family model, or a timm
            ResNet / ConvNeXt (images a multiple of its final stride, 32 px).
        mix_token: MixToken on (Eq. 5); the box on the token grid as in CutMix, ``λ ~ Beta(beta, beta)``.
        beta: the Beta parameter of the box (1.0, as CutMix).
        prob: probability of mixing a batch.
        mode: ``'batch'`` (one box per batch, the public code) or ``'pair'`` (one per sample pair).
        aux: use the aux head (dense token targets); ``False`` for ReLabel / plain MixToken.
        head_rule: eval output, ``'cls+aux'`` (``cls + 0.5 · max_tokens(aux)``) or ``'cls'``.
        generator: RNG of the box sampler.
        box_rounding: ``'timm'`` (today's timm) or ``'public'`` (the public code's ``cut // 2`` box).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        mix_token: bool = True,
        beta: float = 1.0,
        prob: float = 1.0,
        mode: str = 'batch',
        aux: bool = True,
        head_rule: str = 'cls+aux',
        generator: Optional[torch.Generator] = None,
        box_rounding: str = 'timm',
    ):
        super().__init__()
        self.cnn = cnn_features(model)  # the module whose output forward_features returns (CNNs), else None
        if self.cnn is None:
            missing = [] if patch_embedding(model) is not None else ['patch_embed (or a PatchEmbed stem)']
            missing += [n for n in ('forward_features', 'forward_head', 'head', 'norm') if not hasattr(model, n)]
            if missing:
                raise ValueError(
                    f'model: token labeling supports timm ViT-like models (a token sequence after a patch '
                    f'embedding: ViT/DeiT, LV-ViT, MLP-Mixer/ResMLP/gMLP; these need {missing[0]}) and the CNNs '
                    f'{", ".join(c.__name__ for c in cnn_classes())}; {type(model).__name__} is neither'
                )
        check_head_rule(head_rule)
        guard_module_hooks()  # per-call hooks under torch.compile
        if aux and getattr(model, 'aux_head', None) is None:
            raise ValueError('model: no aux_head; call attach_aux_head(model) before building the optimizer')
        self.model, self.aux, self.head_rule, self.generator = model, aux, head_rule, generator
        # class/distillation tokens before the patches (the MLP-Mixer family and CNNs: none)
        self.num_prefix_tokens = (
            0 if self.cnn is not None else int(getattr(model, 'num_prefix_tokens', int(hasattr(model, 'patch_embed'))))
        )
        self.label_stride = token_labeling_stride(model)
        self.sampler = mixtoken_sampler(beta, prob if mix_token else 0.0, mode, self.label_stride, box_rounding)

    def grid(self, x: torch.Tensor) -> Tuple[int, int]:
        """The token grid of a batch of images (a whole number of tokens)."""
        check_image_size(tuple(x.shape[-2:]), self.label_stride)
        return x.shape[-2] // self.label_stride[0], x.shape[-1] // self.label_stride[1]

    def predict(self, x: torch.Tensor, model: Optional[nn.Module] = None) -> torch.Tensor:
        """The inference output (:func:`~shared_core.token_labeling.inference_logits` by ``head_rule``) of
        ``model`` (default: the wrapped one; an EMA copy works too)."""
        model = self.model if model is None else model
        feats = model.forward_features(x)
        cls = model.forward_head(feats) if self.cnn is not None else model.head(model.forward_head(feats, True))
        aux = (
            aux_logits(model, feats, self.num_prefix_tokens)
            if self.head_rule == 'cls+aux' and getattr(model, 'aux_head', None) is not None
            else None
        )
        return inference_logits(cls, aux, self.head_rule)

    def outputs(self, x: torch.Tensor, forward: Optional[Callable[[torch.Tensor], Any]] = None) -> TokenLabelingOutput:
        """The training forward: MixToken's box drawn on the CPU (:func:`draw_mixtoken`) and applied by a hook on
        the patch embedding (CNNs: to the images, the box on the final feature grid); ``forward(images)`` (default
        ``self.model``; a task passes its DDP-wrapped module) runs the token path, whose class logits it returns;
        a hook on the final norm (CNNs: on the module that gives the final feature map) keeps the features the
        aux head reads; their logits are un-mixed (Eq. 6)."""
        grid = self.grid(x)
        mix = draw_mixtoken(self.sampler, x.shape[0], tuple(x.shape[-2:]), x.device, self.generator)
        kept = {}
        # CNNs: no patch embedding, the images are mixed
        embed = patch_embedding(self.model) if mix is not None and self.cnn is None else None
        with mixtoken_applied(x, mix, embed) as (x, swap):
            handle = None
            if self.aux:
                feats = self.model.norm if self.cnn is None else self.cnn
                handle = feats.register_forward_hook(lambda m, i, o: kept.__setitem__('feats', o))
            try:
                cls = (self.model if forward is None else forward)(x)
            finally:
                if handle is not None:
                    handle.remove()
        if isinstance(cls, (tuple, list)):  # e.g. a distilled model's (cls, dist) training output
            cls = cls[0]
        aux = aux_logits(self.model, kept['feats'], self.num_prefix_tokens) if self.aux else None
        if aux is not None and aux.shape[1] != grid[0] * grid[1]:
            raise ValueError(f'model: {aux.shape[1]} patch tokens for a {grid[0]}x{grid[1]} token grid')
        if aux is not None and mix is not None:
            aux = unmix_tokens(aux, swap)
        return TokenLabelingOutput(cls, aux, mix, grid)

    def forward(self, x: torch.Tensor):
        return self.outputs(x) if self.training else self.predict(x)


def aux_logits(model: nn.Module, feats: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """Per-token logits ``(B, N, C)`` of ``model.aux_head`` on ``forward_features``' patch tokens, through the
    norm the class head's input gets (``fc_norm`` of average-pooled ViTs). A CNN's ``(B, C, h, w)`` map: each
    position is a token (row-major), through the head's norm where it has one (ConvNeXt's ``head.norm``, a
    per-position channel norm), so the aux head is a 1x1 convolution on the final feature map."""
    if feats.dim() == 4:
        norm = getattr(getattr(model, 'head', None), 'norm', None)
        feats = norm(feats) if isinstance(norm, nn.Module) else feats
        return model.aux_head(feats.flatten(2).transpose(1, 2))
    tokens = feats[:, num_prefix_tokens:]
    fc_norm = getattr(model, 'fc_norm', None)
    return model.aux_head(fc_norm(tokens) if isinstance(fc_norm, nn.Module) else tokens)


class TokenLabelingLoss(nn.Module):
    """Class-token CE + ``dense_weight`` · mean token CE (the Token Labeling paper, Eq. 3-4).

    Args:
        num_classes: C.
        dense_weight: β (0.5 in the paper); 0 turns the dense term off (ReLabel, plain MixToken).
        cls_target: ``'gt'`` (the paper), ``'annotator'`` (the annotator's pooled label over the crop, the
            public code's default) or ``'mix'`` (``cls_target_mix · annotator + (1 - cls_target_mix) · gt``).
        smoothing: label smoothing of the class and the token targets.
        cls_target_pool: how the annotator's class target pools the crop: ``'distributions'`` (their mean,
            ReLabel) or ``'logits'`` (softmax of the mean logits, the public code).
    """

    def __init__(
        self,
        num_classes: int,
        dense_weight: float = 0.5,
        cls_target: str = 'gt',
        cls_target_mix: float = 0.5,
        smoothing: float = 0.1,
        cls_target_pool: str = 'distributions',
    ):
        super().__init__()
        dense_weight = check_real(dense_weight, 'dense_weight', lo=0.0)  # NaN would poison the loss
        self.dense_weight = dense_weight
        self.spec = TokenTargetSpec(
            num_classes, smoothing, cls_target, cls_target_mix, cls_target_pool, dense=bool(dense_weight)
        )

    num_classes = property(lambda self: self.spec.num_classes, doc='C (``spec``).')
    smoothing = property(lambda self: self.spec.smoothing, doc='ε of the targets (``spec``).')
    cls_target = property(lambda self: self.spec.cls_target, doc="The class token's target (``spec``).")
    cls_target_mix = property(lambda self: self.spec.cls_target_mix, doc="The weight of ``'mix'`` (``spec``).")
    cls_target_pool = property(lambda self: self.spec.cls_target_pool, doc='The crop pooling (``spec``).')

    def targets(self, output: TokenLabelingOutput, target: torch.Tensor):
        """``(class target (B, C), per-token targets or None)``, both summing to 1 per row (the token targets
        as :class:`SparseTokenTargets`; ``.dense()`` gives ``(B, N, C)``)."""
        labels = target.as_tensor() if isinstance(target, CarrierTensor) else target
        maps = target.maps if isinstance(target, TokenLabelTarget) else None
        if maps is None and self.spec.needs_maps:
            raise ValueError(
                'target: token labeling needs the label maps (a TokenLabelTarget from '
                'TokenLabelCollate); got plain labels'
            )
        return token_labeling_targets(labels, self.spec, output.mix, maps, output.grid, name='target')

    def forward(self, output: TokenLabelingOutput, target: torch.Tensor) -> torch.Tensor:
        y_cls, dense = self.targets(output, target)
        return token_labeling_loss(output.cls, y_cls, output.aux, dense, self.dense_weight)
