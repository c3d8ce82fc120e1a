"""Token labeling + MixToken for MMPretrain (the Token Labeling paper, Sec. 3.2-3.3): head and classifier.

The objective (Eq. 1-4: the class token's cross entropy plus β times the mean of every patch token's against
the annotator's label of its location) and MixToken (Eq. 5-7) are written out once, in
:mod:`shared_core.token_labeling`; this module adapts them to mmpretrain's heads, classifiers and data samples.
The maps come from ``tokenaug-maps generate`` (a :class:`~shared_core.map_store.LabelMapStore`).

The data side (transforms that carry each image's map row, crop and flip) is
:mod:`mm_plugin.token_label_transforms`.

Model (registered in mmpretrain's ``MODELS``):

- :class:`TokenLabelingHead`: a linear head on the class token and a linear ``aux_head`` on every patch
  token of the backbone's ``(B, prefix + N, D)`` output; owns the loss (Eq. 3-4, 7) and the inference
  rule :func:`~shared_core.token_labeling.inference_logits` ``cls + 0.5 · max_tokens(aux)``
  (``head_rule='cls+aux'``, the public code) or ``'cls'``; with ``relabel=True`` the class target is the
  annotator's label pooled over the crop (ReLabel, Table 2),
  without dense term and aux head.
- :class:`TokenLabelingClassifier`: an ``ImageClassifier`` that draws the MixToken box (λ ~ Beta(β, β)
  on the token grid, one box per batch as the public code, or per pair), mixes the tokens by a forward
  hook on the backbone's patch embedding and hands the mix to the head. Backbones: mmpretrain's
  ``VisionTransformer`` with ``out_type='raw'`` (its final norm is applied to every token) and
  ``TIMMBackbone`` around a timm ViT (``forward_features`` tokens; LV-ViT ``lvvit_*`` included).
  Image batch augments (MixUp / CutMix in ``train_cfg``) are refused: MixToken replaces them.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from mmengine.model import BaseModule
from mmpretrain.models.backbones import TIMMBackbone, VisionTransformer
from mmpretrain.models.classifiers import ImageClassifier
from mmpretrain.registry import MODELS
from mmpretrain.structures import DataSample

from shared_core.checks import check_real
from shared_core.mix import Mix, check_image_size, check_pairwise_batch, to_2tuple
from shared_core.token_labeling import (
    AUX_WEIGHT,
    HEAD_RULES,
    TokenSwap,
    TokenTargetSpec,
    check_head_rule,
    draw_mixtoken,
    inference_logits,
    mixtoken_applied,
    mixtoken_sampler,
    soft_cross_entropy,
    token_labeling_targets,
    unmix_tokens,
)

from .token_label_transforms import token_label_batch

__all__ = [
    'HEAD_RULES',
    'AUX_WEIGHT',
    'TokenLabelingHead',
    'TokenLabelingClassifier',
    'backbone_tokens',
    'patch_embed_stride',
]

# ----------------------------------------------------------------------------------------------
# Head
# ----------------------------------------------------------------------------------------------


@MODELS.register_module()
class TokenLabelingHead(BaseModule):
    """Class-token head + per-token ``aux_head`` with token labeling's loss (module docstring).

    Args:
        num_classes: C.
        in_channels: token width D.
        dense_weight: β of Eq. 3 (0.5; 0 under ``relabel``).
        cls_target: the class token's target: ``'gt'`` (the paper, default), ``'annotator'`` (the
            annotator's label pooled over the crop; default under ``relabel``) or ``'mix'``
            (``cls_target_mix · annotator + (1 - cls_target_mix) · gt``).
        cls_target_mix: the weight of ``'mix'``.
        cls_target_pool: how the annotator's class target pools the crop: ``'distributions'`` (their mean,
            ReLabel) or ``'logits'`` (softmax of the mean logits, the public code).
        label_smoothing: ε of the class and the token targets (``(1 - ε) · p + ε / C``).
        relabel: ReLabel: class target = the annotator's pooled label, no dense term, no aux head.
        head_rule: inference, ``'cls+aux'`` (``cls + 0.5 · max_tokens(aux)``; default with a dense
            term) or ``'cls'`` (default without).
        num_prefix_tokens: leading non-patch tokens of the backbone output (the class token first);
            :class:`TokenLabelingClassifier` sets it from its backbone.
        init_cfg: as timm initialises ViT heads (truncated normal, std 0.02, zero bias).
    """

    def __init__(
        self,
        num_classes: int,
        in_channels: int,
        dense_weight: Optional[float] = None,
        cls_target: Optional[str] = None,
        cls_target_mix: float = 0.5,
        label_smoothing: float = 0.1,
        relabel: bool = False,
        head_rule: Optional[str] = None,
        num_prefix_tokens: int = 1,
        init_cfg: Optional[dict] = dict(type='TruncNormal', layer='Linear', std=0.02, bias=0.0),
        cls_target_pool: str = 'distributions',
    ):
        super().__init__(init_cfg=init_cfg)
        if relabel and dense_weight:
            raise ValueError(f'dense_weight: ReLabel (relabel=True) has no dense term, got {dense_weight}')
        if relabel and cls_target not in (None, 'annotator'):
            raise ValueError(f"cls_target: ReLabel's class target is the annotator's, got {cls_target!r}")
        dense_weight = (0.0 if relabel else 0.5) if dense_weight is None else float(dense_weight)
        cls_target = ('annotator' if relabel else 'gt') if cls_target is None else cls_target
        head_rule = ('cls+aux' if dense_weight else 'cls') if head_rule is None else head_rule
        dense_weight = check_real(dense_weight, 'dense_weight', lo=0.0)  # NaN would poison the loss
        self.spec = TokenTargetSpec(
            num_classes,
            label_smoothing,
            cls_target,
            cls_target_mix,
            cls_target_pool,
            dense=bool(dense_weight),
            smoothing_name='label_smoothing',
        )
        check_head_rule(head_rule)
        if head_rule == 'cls+aux' and not dense_weight:
            raise ValueError("head_rule: 'cls+aux' reads an aux head that dense_weight=0 never trains; use 'cls'")
        self.in_channels, self.dense_weight = int(in_channels), dense_weight
        self.relabel, self.head_rule = bool(relabel), head_rule
        self.num_prefix_tokens = int(num_prefix_tokens)
        self.head = nn.Linear(self.in_channels, num_classes)
        self.aux_head = None if relabel else nn.Linear(self.in_channels, num_classes)

    num_classes = property(lambda self: self.spec.num_classes, doc='C (``spec``).')
    label_smoothing = property(lambda self: self.spec.smoothing, doc='ε of the targets (``spec``).')
    cls_target = property(lambda self: self.spec.cls_target, doc="The class token's target (``spec``).")
    cls_target_mix = property(lambda self: self.spec.cls_target_mix, doc="The weight of ``'mix'`` (``spec``).")
    cls_target_pool = property(lambda self: self.spec.cls_target_pool, doc='The crop pooling (``spec``).')

    @property
    def needs_maps(self) -> bool:
        """Whether the loss reads the label maps (dense term or an annotator class target)."""
        return self.spec.needs_maps

    def tokens(self, feats: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The backbone's last output as ``(B, prefix + N, D)`` tokens; a CNN's ``(B, D, h, w)`` map (``TIMMBackbone``
        around a timm ResNet / ConvNeXt) gives one token per position, row-major."""
        x = feats[-1] if isinstance(feats, (tuple, list)) else feats
        if torch.is_tensor(x) and x.dim() == 4 and not self.num_prefix_tokens and x.shape[1] == self.in_channels:
            x = x.flatten(2).transpose(1, 2)
        if (
            not torch.is_tensor(x)
            or x.dim() != 3
            or x.shape[1] <= self.num_prefix_tokens
            or x.shape[-1] != self.in_channels
        ):
            raise ValueError(
                f'feats: expected (B, {self.num_prefix_tokens} + N, {self.in_channels}) tokens (class '
                f"token first; mmpretrain VisionTransformer with out_type='raw'), or a CNN's (B, {self.in_channels}, "
                f'h, w) map, got {tuple(x.shape) if torch.is_tensor(x) else type(x).__name__}'
            )
        return x

    def pre_logits(self, feats: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The class token ``(B, D)``; without prefix tokens (MLP-Mixer, CNNs) the mean of the tokens (their own
        global average pooling)."""
        return self._class_input(self.tokens(feats))

    def _class_input(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 0] if self.num_prefix_tokens else x.mean(1)

    def logits(
        self, feats: Tuple[torch.Tensor, ...], mix: Optional[Union[Mix, TokenSwap]] = None
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Class logits ``(B, C)`` and per-token logits ``(B, N, C)`` (``None`` without aux head),
        un-mixed when the tokens were mixed by ``mix`` (or the step's :class:`TokenSwap` of it)."""
        x = self.tokens(feats)
        cls = self.head(self._class_input(x))
        if self.aux_head is None:
            return cls, None
        aux = self.aux_head(x[:, self.num_prefix_tokens :])
        return cls, (aux if mix is None else unmix_tokens(aux, mix))

    def forward(self, feats: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Inference logits: ``cls + 0.5 · max_tokens(aux)`` or ``cls`` (``head_rule``)."""
        return inference_logits(*self.logits(feats), self.head_rule)

    def targets(
        self, data_samples: Sequence[DataSample], mix: Optional[Mix], grid: Tuple[int, int], device=None
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(class target (B, C), per-token targets or None)``, every row summing to 1 (the token targets as
        :class:`~shared_core.label_maps.SparseTokenTargets`; ``.dense()`` gives ``(B, N, C)``)."""
        labels = torch.cat([s.gt_label for s in data_samples]).to(device)
        if labels.numel() != len(data_samples):
            raise ValueError('data_samples: token labeling needs exactly one gt_label per sample')
        maps = token_label_batch(data_samples, self.num_classes, device) if self.needs_maps else None
        return token_labeling_targets(labels, self.spec, mix, maps, grid, name='gt_label')

    def loss(
        self,
        feats: Tuple[torch.Tensor, ...],
        data_samples: Sequence[DataSample],
        mix: Optional[Mix] = None,
        grid: Optional[Tuple[int, int]] = None,
        swap: Optional[TokenSwap] = None,
    ) -> dict:
        """``loss_cls = H(cls, ŷ^cls)`` (Eq. 1, 7) and ``loss_token = β · mean_i H(aux_i, y^i)`` (Eq. 2-4);
        their sum is :func:`shared_core.token_labeling.token_labeling_loss`. ``grid``: the token grid
        ``(gh, gw)`` (default: square). ``swap``: the :class:`TokenSwap` the patch tokens were mixed with (made
        from ``mix`` when not given)."""
        cls, aux = self.logits(feats, mix if swap is None else swap)
        if grid is None and aux is not None:
            side = int(round(aux.shape[1] ** 0.5))
            grid = (side, side)
        if aux is not None and grid[0] * grid[1] != aux.shape[1]:
            raise ValueError(f'grid: {grid[0]}x{grid[1]} tokens for {aux.shape[1]} patch tokens')
        y_cls, dense = self.targets(data_samples, mix, grid, cls.device)
        losses = {'loss_cls': soft_cross_entropy(cls, y_cls)}
        if dense is not None:
            losses['loss_token'] = self.dense_weight * soft_cross_entropy(aux, dense)
        return losses

    def predict(
        self, feats: Tuple[torch.Tensor, ...], data_samples: Optional[List[Optional[DataSample]]] = None
    ) -> List[DataSample]:
        """Softmax of the inference logits as ``pred_score``, their argmax as ``pred_label``."""
        scores = self(feats).softmax(dim=1)
        labels = scores.argmax(dim=1, keepdim=True).detach()
        samples = data_samples if data_samples is not None else [None] * len(scores)
        return [
            (s if s is not None else DataSample()).set_pred_score(p).set_pred_label(y)
            for s, p, y in zip(samples, scores, labels)
        ]


# ----------------------------------------------------------------------------------------------
# Classifier
# ----------------------------------------------------------------------------------------------


def backbone_tokens(backbone: nn.Module) -> Tuple[Optional[nn.Module], int, Tuple[int, int]]:
    """``(patch embedding, number of prefix tokens, pixels per output token)`` of a supported backbone whose output
    is every token. The patch embedding is ``None`` for a CNN (``TIMMBackbone`` around a timm ResNet / ResNeSt /
    ConvNeXt): MixToken then pastes its box in the images, on whole cells of the final feature map."""
    if isinstance(backbone, VisionTransformer):
        if backbone.out_type != 'raw':
            raise ValueError(
                f"backbone: token labeling reads every output token; set out_type='raw' on "
                f"mmpretrain's VisionTransformer (got {backbone.out_type!r})"
            )
        if not backbone.with_cls_token:
            raise ValueError('backbone: token labeling needs a class token (with_cls_token=True)')
        if max(backbone.out_indices) != backbone.num_layers - 1:
            raise ValueError(
                f'backbone: token labeling reads the last layer (out_indices containing '
                f'{backbone.num_layers - 1}), got {backbone.out_indices}'
            )
        return backbone.patch_embed, int(backbone.num_extra_tokens), patch_embed_stride(backbone.patch_embed)
    if isinstance(backbone, TIMMBackbone):
        # imported here: `import mm_plugin` does not load timm_plugin
        from timm_plugin.token_grid import cnn_classes, cnn_stride, patch_embedding, token_stride

        model = backbone.timm_model
        if isinstance(model, cnn_classes()):
            return None, 0, cnn_stride(model)
        embed = patch_embedding(model)
        if embed is None or not hasattr(model, 'forward_features'):
            raise ValueError(
                f'backbone: token labeling needs a timm ViT / MLP-Mixer (a patch embedding, no features_only) or a '
                f'timm CNN ({", ".join(c.__name__ for c in cnn_classes())}); {type(model).__name__} is neither'
            )
        prefix = int(getattr(model, 'num_prefix_tokens', 0))
        if hasattr(model, 'patch_embed') and (not getattr(model, 'has_class_token', False) or prefix < 1):
            raise ValueError(f'backbone: token labeling needs a class token; {type(model).__name__} has none')
        return embed, prefix, token_stride(model)
    raise ValueError(
        f"backbone: token labeling supports mmpretrain.models.VisionTransformer (out_type='raw') and "
        f'TIMMBackbone around a timm ViT, MLP-Mixer / ResMLP / gMLP, ResNet / ResNeSt or ConvNeXt; got '
        f'{type(backbone).__module__}.{type(backbone).__name__}'
    )


def patch_embed_stride(patch_embed: nn.Module) -> Tuple[int, int]:
    """Pixels per token along (h, w) of an mmpretrain backbone's patch embedding: LV-ViT's ``token_stride``, timm's
    ``patch_size``, mm's conv stride."""
    s = getattr(patch_embed, 'token_stride', None) or getattr(patch_embed, 'patch_size', None)
    if s is None and hasattr(patch_embed, 'projection'):  # mmcv PatchEmbed (its corner padding adds nothing
        s = patch_embed.projection.stride  # to an image of whole tokens)
    if s is None:
        raise ValueError(f'backbone: {type(patch_embed).__name__} has no token_stride/patch_size/projection stride')
    return to_2tuple(tuple(s) if isinstance(s, (tuple, list)) else int(s), 'patch size')


@MODELS.register_module()
class TokenLabelingClassifier(ImageClassifier):
    """``ImageClassifier`` trained by token labeling with MixToken (module docstring).

    Args:
        mix_token: MixToken on (Eq. 5-7).
        mix_beta: λ ~ Beta(β, β) of the box (1.0, as CutMix).
        mix_prob: probability of mixing a batch.
        mix_mode: ``'batch'`` (one box per batch, the public code) or ``'pair'`` (one per pair i, B-1-i).
        mix_box_rounding: ``'timm'`` (today's timm) or ``'public'`` (the public code's ``cut // 2`` box).

    The other arguments: as ``ImageClassifier``; ``head`` must be a :class:`TokenLabelingHead`, ``neck`` None,
    and ``train_cfg`` without image batch augments.
    """

    def __init__(
        self,
        *args,
        mix_token: bool = True,
        mix_beta: float = 1.0,
        mix_prob: float = 1.0,
        mix_mode: str = 'batch',
        mix_box_rounding: str = 'timm',
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if not isinstance(self.head, TokenLabelingHead):
            raise ValueError(f'head: token labeling needs a TokenLabelingHead, got {type(self.head).__name__}')
        if self.neck is not None:
            raise ValueError("neck: token labeling reads the backbone's tokens; set neck=None")
        if getattr(self.data_preprocessor, 'batch_augments', None) is not None:
            raise ValueError(
                'train_cfg: image batch augments (MixUp/CutMix) mix pixels that the token labels do '
                'not follow; MixToken is in the model; remove train_cfg.augments'
            )
        _, self.head.num_prefix_tokens, self.label_stride = backbone_tokens(self.backbone)
        try:
            self.sampler = (
                mixtoken_sampler(mix_beta, mix_prob, mix_mode, self.label_stride, mix_box_rounding)
                if mix_token
                else None
            )
        except ValueError as e:  # name the config keys
            msg = str(e).replace('mode:', 'mix_mode:').replace('beta:', 'mix_beta:')
            raise ValueError(msg.replace('box_rounding:', 'mix_box_rounding:')) from None
        self.generator: Optional[torch.Generator] = None  # MixToken's RNG (None: torch's default)

    def token_grid(self, inputs: torch.Tensor) -> Tuple[int, int]:
        """The token grid of a batch of images (their size must be a whole number of tokens)."""
        H, W = inputs.shape[-2:]
        check_image_size((H, W), self.label_stride, 'inputs')
        return H // self.label_stride[0], W // self.label_stride[1]

    def sample_mix(self, inputs: torch.Tensor) -> Optional[Mix]:
        """The batch's MixToken box, ``None`` when MixToken is off or this batch is not mixed."""
        if self.sampler is None or not self.sampler.mix_prob:
            return None
        check_pairwise_batch(inputs.shape[0], 'inputs')
        return draw_mixtoken(self.sampler, inputs.shape[0], tuple(inputs.shape[-2:]), inputs.device, self.generator)

    def extract_feat_mixed(self, inputs: torch.Tensor):
        """``(feats, mix or None, grid)``: the backbone run with the patch tokens mixed by MixToken (CNNs: the
        images, in a box of whole final-stride cells)."""
        return self._extract_feat_mixed(inputs)[:3]

    def _extract_feat_mixed(self, inputs: torch.Tensor):
        """:meth:`extract_feat_mixed` and the :class:`TokenSwap` of the mix (or None), made once for the
        patch-embedding hook and the head's un-mixing."""
        grid = self.token_grid(inputs)
        mix = self.sample_mix(inputs)
        # not kept as an attribute: it would register twice
        patch_embed = backbone_tokens(self.backbone)[0] if mix is not None else None
        with mixtoken_applied(inputs, mix, patch_embed) as (images, swap):
            feats = self.extract_feat(images)
        return feats, mix, grid, swap

    def loss(self, inputs: torch.Tensor, data_samples: List[DataSample]) -> dict:
        feats, mix, grid, swap = self._extract_feat_mixed(inputs)
        return self.head.loss(feats, data_samples, mix=mix, grid=grid, swap=swap)
