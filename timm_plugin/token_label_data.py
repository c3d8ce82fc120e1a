"""Token labeling's data path on timm (``token-labeling.md`` Sec. 3.2): samples that carry their label-map rows.

:class:`TokenLabelDataset` wraps a timm ``ImageDataset`` and a :class:`~shared_core.map_store.LabelMapStore`
(written by ``tokenaug-maps generate``). timm's ``create_loader`` sets its ``transform`` as for any
dataset; the dataset splits it into the geometry it must record and the rest:

- ``RandomResizedCropAndInterpolation`` runs as timm built it; its crop ``(i, j, h, w)`` is recorded as
  the normalised box ``(x0, y0, x1, y1)`` of the full image;
- ``RandomHorizontalFlip(p)`` is applied here and recorded;
- RandAugment loses its geometric ops (``Rotate``, ``ShearX/Y``, ``TranslateX/Y(Rel)``): a label map
  cannot follow them through ``roi_align``, and applying them to the image only shifts the image away
  from its labels by up to 45 % of its size. Colour ops stay; ``keep_geometric_aa=True`` keeps them (on
  the image only). AutoAugment policies and AugMix, whose geometric ops cannot be removed the same way,
  are refused, as are vertical flips and other crop modes;
- everything after (colour jitter, RandAugment's other ops, to-tensor, normalise, random erasing) as built.

Each sample is ``(image, (label, values, indices, box, flip))``; :class:`TokenLabelCollate` stacks
them into ``(images, TokenLabelTarget)``, which also works with timm's fast-collate prefetcher (uint8
images, the target's ``.to`` moves the map rows). The per-token targets are built on the training
device in one batched call, kept sparse (:func:`shared_core.label_maps.token_targets_sparse`).
"""

from __future__ import annotations

from typing import Tuple

import numpy as np
import torch
from timm.data.auto_augment import AugMixAugment, AutoAugment, RandAugment
from timm.data.transforms import RandomResizedCropAndInterpolation
from torchvision import transforms as T
from torchvision.transforms import functional as TF

from shared_core.label_maps import (
    SparseTokenTargets,
    check_boxes,
    check_map_row,
    crop_box,
    crop_targets,
    token_targets_sparse,
)
from shared_core.mix import check_labels

from .carrier import CarrierTensor

__all__ = ['GEOMETRIC_RAND_OPS', 'TokenLabelTarget', 'TokenLabelDataset', 'TokenLabelCollate', 'split_train_transform']

#: RandAugment ops that move pixels (removed under token labeling unless ``keep_geometric_aa``)
GEOMETRIC_RAND_OPS = ('Rotate', 'ShearX', 'ShearY', 'TranslateX', 'TranslateY', 'TranslateXRel', 'TranslateYRel')


class TokenLabelTarget(CarrierTensor):
    """The class indices ``(B,)`` of a batch carrying its map rows ``.values (B, k, h, w)`` (fp16
    probabilities), ``.indices (B, k, h, w)`` (int64 classes), the crops ``.boxes (B, 4)`` (normalised
    ``x0, y0, x1, y1``), ``.flips (B,)`` and ``.num_classes``."""

    _carried = ('values', 'indices', 'boxes', 'flips', 'num_classes')

    @staticmethod
    def wrap(
        labels: torch.Tensor,
        values: torch.Tensor,
        indices: torch.Tensor,
        boxes: torch.Tensor,
        flips: torch.Tensor,
        num_classes: int,
    ) -> 'TokenLabelTarget':
        return TokenLabelTarget._wrap(
            labels, dict(values=values, indices=indices, boxes=boxes, flips=flips, num_classes=num_classes)
        )

    def token_targets(self, grid: Tuple[int, int], smoothing: float = 0.0) -> SparseTokenTargets:
        """Per-token targets (row-major token order; ``.dense()`` is ``(B, gh * gw, C)``, rows summing to 1)."""
        return token_targets_sparse(
            self.values, self.indices, self.num_classes, self.boxes, self.flips, grid, smoothing
        )

    def crop_targets(self, smoothing: float = 0.0) -> torch.Tensor:
        """``(B, C)`` the annotator's pooled label over each crop (ReLabel)."""
        return crop_targets(self.values, self.indices, self.num_classes, self.boxes, smoothing)


def split_train_transform(transform, keep_geometric_aa: bool = False):
    """timm's training transform as ``(crop, hflip_p, rest)``: the ``RandomResizedCropAndInterpolation``,
    the horizontal-flip probability, and a ``Compose`` of what follows (see the module docstring)."""
    tfs = list(transform.transforms) if isinstance(transform, T.Compose) else [transform]
    if not tfs or not isinstance(tfs[0], (RandomResizedCropAndInterpolation, T.RandomResizedCrop)):
        raise ValueError(
            'transform: token labeling needs a training transform that starts with a random resized '
            f'crop (timm train_crop_mode "rrc"), got {tfs[:1]}'
        )
    crop, rest, hflip = tfs[0], [], 0.0
    for t in tfs[1:]:
        if isinstance(t, T.RandomHorizontalFlip):
            hflip = float(t.p)
        elif isinstance(t, T.RandomVerticalFlip):
            if t.p > 0:
                raise ValueError('transform: vertical flips are not supported with token labels (--vflip 0)')
        elif isinstance(t, (AutoAugment, AugMixAugment)):
            raise ValueError(
                f'transform: {type(t).__name__} has geometric ops the label maps cannot follow; '
                'use RandAugment (--aa rand-...), whose geometric ops are removed'
            )
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
        self._hflip = 0.0
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
        flip = bool(torch.rand(()) < self._hflip)  # torch's RNG: seeded per DataLoader worker
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
