"""Token labeling + MixToken on timm (``token-labeling.md``): data, model wrapper, loss.

Data. :class:`TokenLabelDataset` wraps a timm ``ImageDataset`` and a :class:`~shared_core.map_store.LabelMapStore`
(written by ``tokenaug-maps generate``). timm's ``create_loader`` sets its ``transform`` as for any
dataset; the dataset splits it into the geometry it must record and the rest:

- ``RandomResizedCropAndInterpolation`` runs as timm built it; its crop ``(i, j, h, w)`` is recorded as
  the normalised box ``(x0, y0, x1, y1)`` of the full image;
- ``RandomHorizontalFlip(p)`` is applied here and recorded;
- RandAugment loses its geometric ops (``Rotate``, ``ShearX/Y``, ``TranslateX/Y(Rel)``): a label map
  cannot follow them through ``roi_align``, and applying them to the image only (what the public code
  does) shifts the image away from its labels by up to 45 % of its size. Colour ops stay;
  ``keep_geometric_aa=True`` restores the public behaviour. AutoAugment policies and AugMix, whose
  geometric ops cannot be removed the same way, are refused, as are vertical flips and other crop modes;
- everything after (colour jitter, RandAugment's other ops, to-tensor, normalise, random erasing) as built.

Each sample is ``(image, (label, values, indices, box, flip))``; :class:`TokenLabelCollate` stacks
them into ``(images, TokenLabelTarget)``, which also works with timm's fast-collate prefetcher (uint8
images, the target's ``.to`` moves the map rows). The per-token targets are built on the training
device in one batched call, kept sparse (:func:`shared_core.label_maps.token_targets_sparse`).

Model. :class:`TokenLabeling` wraps a timm ViT (class token or average pooling, any patch embedding
whose output is the ``(B, N, D)`` or ``(B, gh, gw, D)`` token grid — ViT/DeiT, LV-ViT). In training it
mixes the patch tokens of sample pairs inside a box right after patch embedding (MixToken, Eq. 5),
returns the class logits, the *un-mixed* per-token logits of the aux head, and the mix. The aux head
is ``model.aux_head`` (LV-ViT has one; :func:`attach_aux_head` adds a linear one to any ViT, as a
submodule of the model so the optimizer, EMA and checkpoints hold it). In eval it returns
``cls + 0.5 · max_tokens(aux)`` (the public code's inference rule, ``head_rule='cls+aux'``) or the plain
class head (``head_rule='cls'``).

Loss. :class:`TokenLabelingLoss` = class-token CE + ``dense_weight`` · mean token CE (Eq. 3-4).
"""
from __future__ import annotations

import random
from typing import NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
from timm.data.auto_augment import AugMixAugment, AutoAugment, RandAugment
from timm.data.transforms import RandomResizedCropAndInterpolation
from timm.layers import trunc_normal_
from torchvision import transforms as T
from torchvision.transforms import functional as TF

from shared_core.label_maps import (SparseTokenTargets, check_boxes, check_map_row, crop_box, crop_targets,
                                    token_targets_sparse)
from shared_core.mixing import Mix, MixSampler, check_labels, mix_tokens, one_hot
from shared_core.token_labeling import (CLS_TARGETS, check_pairwise_swap, class_target, mix_class_target,
                                        token_labeling_loss, unmix_tokens)

from .mixup import CarrierTensor

__all__ = ['GEOMETRIC_RAND_OPS', 'HEAD_RULES', 'TokenLabelTarget', 'TokenLabelDataset', 'TokenLabelCollate',
           'attach_aux_head', 'TokenLabeling', 'TokenLabelingOutput', 'TokenLabelingLoss', 'split_train_transform']

#: RandAugment ops that move pixels (removed under token labeling unless ``keep_geometric_aa``)
GEOMETRIC_RAND_OPS = ('Rotate', 'ShearX', 'ShearY', 'TranslateX', 'TranslateY', 'TranslateXRel', 'TranslateYRel')
#: inference rules of a model with an aux head
HEAD_RULES = ('cls+aux', 'cls')


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------

class TokenLabelTarget(CarrierTensor):
    """The class indices ``(B,)`` of a batch carrying its map rows ``.values (B, k, h, w)`` (fp16
    probabilities), ``.indices (B, k, h, w)`` (int64 classes), the crops ``.boxes (B, 4)`` (normalised
    ``x0, y0, x1, y1``), ``.flips (B,)`` and ``.num_classes``."""
    _carried = ('values', 'indices', 'boxes', 'flips', 'num_classes')

    @staticmethod
    def wrap(labels: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, boxes: torch.Tensor,
             flips: torch.Tensor, num_classes: int) -> 'TokenLabelTarget':
        return TokenLabelTarget._wrap(labels, dict(values=values, indices=indices, boxes=boxes, flips=flips,
                                                   num_classes=num_classes))

    def token_targets(self, grid: Tuple[int, int], smoothing: float = 0.) -> SparseTokenTargets:
        """Per-token targets (row-major token order; ``.dense()`` is ``(B, gh * gw, C)``, rows summing to 1)."""
        return token_targets_sparse(self.values, self.indices, self.num_classes, self.boxes, self.flips, grid,
                                    smoothing)

    def crop_targets(self, smoothing: float = 0.) -> torch.Tensor:
        """``(B, C)`` the annotator's pooled label over each crop (ReLabel)."""
        return crop_targets(self.values, self.indices, self.num_classes, self.boxes, smoothing)


def split_train_transform(transform, keep_geometric_aa: bool = False):
    """timm's training transform as ``(crop, hflip_p, rest)``: the ``RandomResizedCropAndInterpolation``,
    the horizontal-flip probability, and a ``Compose`` of what follows (see the module docstring)."""
    tfs = list(transform.transforms) if isinstance(transform, T.Compose) else [transform]
    if not tfs or not isinstance(tfs[0], (RandomResizedCropAndInterpolation, T.RandomResizedCrop)):
        raise ValueError('transform: token labeling needs a training transform that starts with a random resized '
                         f'crop (timm train_crop_mode "rrc"), got {tfs[:1]}')
    crop, rest, hflip = tfs[0], [], 0.
    for t in tfs[1:]:
        if isinstance(t, T.RandomHorizontalFlip):
            hflip = float(t.p)
        elif isinstance(t, T.RandomVerticalFlip):
            if t.p > 0:
                raise ValueError('transform: vertical flips are not supported with token labels (--vflip 0)')
        elif isinstance(t, (AutoAugment, AugMixAugment)):
            raise ValueError(f'transform: {type(t).__name__} has geometric ops the label maps cannot follow; '
                             'use RandAugment (--aa rand-...), whose geometric ops are removed')
        elif isinstance(t, RandAugment) and not keep_geometric_aa:
            keep = [i for i, op in enumerate(t.ops) if op.name not in GEOMETRIC_RAND_OPS]
            weights = t.choice_weights
            if weights is not None:  # weighted policies ('...-tweights', 't3aw'): drop and renormalise theirs too
                weights = np.asarray(weights, dtype=np.float64)[keep]
                weights = weights / weights.sum()
            rest.append(RandAugment([t.ops[i] for i in keep], t.num_layers, weights))
        else:
            rest.append(t)
    return crop, hflip, T.Compose(rest)


class _RecordParams:
    """Wraps a crop's ``get_params`` (a static method) to remember the last ``(i, j, h, w)`` it drew."""

    def __init__(self, fn):
        self.fn, self.last = fn, None

    def __call__(self, *args, **kwargs):
        self.last = self.fn(*args, **kwargs)
        return self.last


class TokenLabelDataset(torch.utils.data.Dataset):
    """A timm ``ImageDataset`` whose samples carry their label-map rows and recorded crop/flip.

    Args:
        dataset: the image dataset (``filename(i)`` is the key into the store: the image path relative
            to the split root, as ``tokenaug-maps generate`` wrote it).
        store: the :class:`~shared_core.map_store.LabelMapStore` of that split.
        keep_geometric_aa: keep RandAugment's geometric ops (the public code's behaviour; the maps
            do not follow them).
    """

    def __init__(self, dataset, store, keep_geometric_aa: bool = False):
        self.dataset, self.store, self.keep_geometric_aa = dataset, store, keep_geometric_aa
        self.num_classes = int(store.num_classes)
        self._transform = self._crop = self._rest = None
        self._hflip = 0.
        dataset.transform = None  # we load the PIL image and transform it here

    @property
    def transform(self):
        return self._transform

    @transform.setter
    def transform(self, transform):
        self._transform = transform
        if transform is None:
            self._crop = self._rest = None
            return
        crop, self._hflip, self._rest = split_train_transform(transform, self.keep_geometric_aa)
        crop.get_params = _RecordParams(type(crop).get_params)
        self._crop = crop

    def __len__(self) -> int:
        return len(self.dataset)

    def filename(self, index: int, basename: bool = False, absolute: bool = False):
        return self.dataset.filename(index, basename, absolute)

    def __getitem__(self, index: int):
        img, label = self.dataset[index]
        rel = self.dataset.filename(index)
        values, indices = self.store.lookup(rel)
        if self._crop is None:
            raise RuntimeError('TokenLabelDataset: no training transform set (create_loader sets it)')
        W, H = TF.get_image_size(img)
        img = self._crop(img)
        box = crop_box(*self._crop.get_params.last, H, W)
        flip = random.random() < self._hflip
        if flip:
            img = TF.hflip(img)
        img = self._rest(img)
        return img, (int(label), values, indices, box, flip)


class TokenLabelCollate:
    """Stacks ``(image, (label, values, indices, box, flip))`` samples into ``(images, TokenLabelTarget)``:
    uint8 images stay uint8 (timm's fast-collate prefetcher normalises them on the device)."""

    def __init__(self, num_classes: int, check: bool = True):
        self.num_classes, self.check = int(num_classes), check

    def __call__(self, batch):
        imgs = [torch.as_tensor(np.asarray(b[0])) if not torch.is_tensor(b[0]) else b[0] for b in batch]
        x = torch.stack(imgs)
        labels = torch.tensor([b[1][0] for b in batch], dtype=torch.int64)
        check_labels(labels, self.num_classes)
        if self.check:
            for b in batch:
                check_map_row(b[1][1], b[1][2], self.num_classes)
        values = torch.from_numpy(np.stack([b[1][1] for b in batch]))
        indices = torch.from_numpy(np.stack([b[1][2] for b in batch]).astype(np.int64))
        boxes = torch.tensor([b[1][3] for b in batch], dtype=torch.float32)
        check_boxes(boxes)
        flips = torch.tensor([b[1][4] for b in batch], dtype=torch.bool)
        return x, TokenLabelTarget.wrap(labels, values, indices, boxes, flips, self.num_classes)


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------

def attach_aux_head(model: nn.Module, num_classes: Optional[int] = None) -> nn.Module:
    """Give a timm ViT an aux head (``model.aux_head``, linear on each patch token) if it has none;
    initialised as timm initialises ViT heads. Returns the model."""
    if getattr(model, 'aux_head', None) is not None:
        return model
    dim = getattr(model, 'num_features', None) or getattr(model, 'embed_dim', None)
    if dim is None:
        raise ValueError(f'model: {type(model).__name__} has no num_features/embed_dim for an aux head')
    head = nn.Linear(dim, num_classes or model.num_classes)
    trunc_normal_(head.weight, std=.02)
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
            ``forward_head(pre_logits=True)``, ``head``); LV-ViT included.
        mix_token: MixToken on (Eq. 5); the box on the token grid as in CutMix, ``λ ~ Beta(beta, beta)``.
        beta: the Beta parameter of the box (1.0, as CutMix).
        prob: probability of mixing a batch.
        mode: ``'batch'`` (one box per batch, the public code) or ``'pair'`` (one per sample pair).
        aux: use the aux head (dense token targets); ``False`` for ReLabel / plain MixToken.
        head_rule: eval output, ``'cls+aux'`` (``cls + 0.5 · max_tokens(aux)``) or ``'cls'``.
        generator: RNG of the box sampler.
    """

    def __init__(self, model: nn.Module, *, mix_token: bool = True, beta: float = 1.0, prob: float = 1.0,
                 mode: str = 'batch', aux: bool = True, head_rule: str = 'cls+aux',
                 generator: Optional[torch.Generator] = None):
        super().__init__()
        for name in ('patch_embed', 'forward_features', 'forward_head', 'head'):
            if not hasattr(model, name):
                raise ValueError(f'model: token labeling needs a timm ViT-like model with {name!r}; '
                                 f'{type(model).__name__} has none')
        if head_rule not in HEAD_RULES:
            raise ValueError(f'head_rule: expected one of {HEAD_RULES}, got {head_rule!r}')
        if mode not in ('batch', 'pair'):
            raise ValueError(f"mode: MixToken un-mixes pairwise swaps, expected 'batch' or 'pair', got {mode!r}")
        if aux and getattr(model, 'aux_head', None) is None:
            raise ValueError('model: no aux_head; call attach_aux_head(model) before building the optimizer')
        self.model, self.aux, self.head_rule, self.generator = model, aux, head_rule, generator
        self.num_prefix_tokens = int(getattr(model, 'num_prefix_tokens', 1))
        self.sampler = MixSampler('token_box', mixup_alpha=0., cutmix_alpha=beta, prob=prob if mix_token else 0.,
                                  mode=mode, patch_size=self.token_stride())

    def token_stride(self) -> Tuple[int, int]:
        """Pixels per token along (h, w) of the model's first token grid."""
        pe = self.model.patch_embed
        s = getattr(pe, 'token_stride', None) or getattr(pe, 'patch_size', None)
        if s is None:
            raise ValueError('model: patch_embed has no patch_size/token_stride')
        return tuple(s) if isinstance(s, (tuple, list)) else (int(s), int(s))

    def _grid(self, x: torch.Tensor) -> Tuple[int, int]:
        sh, sw = self.token_stride()
        return x.shape[-2] // sh, x.shape[-1] // sw

    def _logits(self, x: torch.Tensor, mix: Optional[Mix]):
        handle = None
        if mix is not None:
            def hook(module, inputs, out):
                if out.dim() == 4:  # NHWC token grid (dynamic image size)
                    B, gh, gw, D = out.shape
                    return mix_tokens(out.reshape(B, gh * gw, D), mix).view(B, gh, gw, D)
                return mix_tokens(out, mix)
            handle = self.model.patch_embed.register_forward_hook(hook)
        try:
            feats = self.model.forward_features(x)
        finally:
            if handle is not None:
                handle.remove()
        cls = self.model.head(self.model.forward_head(feats, pre_logits=True))
        aux = None
        if self.aux:  # per token, through the norm the class head's input gets (fc_norm of avg-pooled ViTs)
            tokens = feats[:, self.num_prefix_tokens:]
            fc_norm = getattr(self.model, 'fc_norm', None)
            aux = self.model.aux_head(fc_norm(tokens) if fc_norm is not None else tokens)
        return cls, aux

    def forward(self, x: torch.Tensor):
        if not self.training:
            cls, aux = self._logits(x, None)
            if self.head_rule == 'cls+aux' and aux is not None:
                return cls + 0.5 * aux.max(1).values
            return cls
        grid = self._grid(x)
        mix = self.sampler.sample(x.shape[0], tuple(x.shape[-2:]), generator=self.generator) \
            if self.sampler.mix_prob > 0 and self.sampler.mixup_enabled else None
        if mix is not None and mix.kind == 'none':
            mix = None
        if mix is not None:  # drawn and checked on the CPU, then copied without stalling the device
            check_pairwise_swap(mix)
            mix = mix.pin_memory().to(x.device, non_blocking=True) if x.is_cuda else mix.to(x.device)
        cls, aux = self._logits(x, mix)
        if aux is not None and aux.shape[1] != grid[0] * grid[1]:
            raise ValueError(f'model: {aux.shape[1]} patch tokens for a {grid[0]}x{grid[1]} token grid')
        if aux is not None and mix is not None:
            aux = unmix_tokens(aux, mix)
        return TokenLabelingOutput(cls, aux, mix, grid)


class TokenLabelingLoss(nn.Module):
    """Class-token CE + ``dense_weight`` · mean token CE (``token-labeling.md`` Eq. 3-4).

    Args:
        num_classes: C.
        dense_weight: β (0.5 in the paper); 0 turns the dense term off (ReLabel, plain MixToken).
        cls_target: ``'gt'`` (the paper), ``'annotator'`` (the annotator's pooled label over the crop, the
            public code's default) or ``'mix'`` (``cls_target_mix · annotator + (1 - cls_target_mix) · gt``).
        smoothing: label smoothing of the class and the token targets.
    """

    def __init__(self, num_classes: int, dense_weight: float = 0.5, cls_target: str = 'gt',
                 cls_target_mix: float = 0.5, smoothing: float = 0.1):
        super().__init__()
        if cls_target not in CLS_TARGETS:
            raise ValueError(f'cls_target: expected one of {CLS_TARGETS}, got {cls_target!r}')
        if dense_weight < 0:
            raise ValueError(f'dense_weight: expected >= 0, got {dense_weight}')
        self.num_classes, self.dense_weight = int(num_classes), float(dense_weight)
        self.cls_target, self.cls_target_mix, self.smoothing = cls_target, float(cls_target_mix), float(smoothing)

    def targets(self, output: TokenLabelingOutput, target: torch.Tensor):
        """``(class target (B, C), per-token targets or None)``, both summing to 1 per row (the token targets
        as :class:`SparseTokenTargets`; ``.dense()`` gives ``(B, N, C)``)."""
        labels = target.as_tensor() if isinstance(target, CarrierTensor) else target
        check_labels(labels, self.num_classes)
        maps = target if isinstance(target, TokenLabelTarget) else None
        if maps is None and (self.dense_weight or self.cls_target != 'gt'):
            raise ValueError('target: token labeling needs the label maps (a TokenLabelTarget from '
                             'TokenLabelCollate); got plain labels')
        gt = one_hot(labels, self.num_classes, self.smoothing)
        annot = maps.crop_targets(self.smoothing) if maps is not None and self.cls_target != 'gt' else None
        y_cls = mix_class_target(class_target(gt, annot, self.cls_target, self.cls_target_mix), output.mix)
        dense = maps.token_targets(output.grid, self.smoothing) if self.dense_weight else None
        return y_cls, dense

    def forward(self, output: TokenLabelingOutput, target: torch.Tensor) -> torch.Tensor:
        y_cls, dense = self.targets(output, target)
        return token_labeling_loss(output.cls, y_cls, output.aux, dense, self.dense_weight)
