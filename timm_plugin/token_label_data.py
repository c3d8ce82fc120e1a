"""Token labeling's data path on timm (the Token Labeling paper, Sec. 3.2): samples that carry their label-map rows.

:class:`TokenLabelDataset` wraps a timm ``ImageDataset`` and a :class:`~shared_core.map_store.LabelMapStore`
(written by ``tokenaug-maps generate``). timm's ``create_loader`` sets its ``transform`` as for any
dataset; the dataset splits it into the geometry it must record and the rest:

- ``RandomResizedCropAndInterpolation`` runs as timm built it; its crop ``(i, j, h, w)`` is recorded as
  the normalised box ``(x0, y0, x1, y1)`` of the full image;
- ``RandomHorizontalFlip(p)`` is applied here and recorded;
- RandAugment's geometric ops (``Rotate``, ``ShearX/Y``, ``TranslateX/Y(Rel)``) run as timm built them
  and each records the affine it applied (``geometric_aa='follow'``, the default and the public code's
  behaviour): the targets follow the image through them (:mod:`shared_core.label_maps`, fill outside
  the image a uniform label). AutoAugment policies record theirs the same way. ``geometric_aa='drop'``
  removes these ops instead (AutoAugment is then refused). AugMix (blends of
  several chains) is refused, as are vertical flips and other crop modes;
- everything after (colour jitter, RandAugment's other ops, to-tensor, normalise, random erasing) as built.

``aa_order='public'`` runs the public code's order instead: the flip and RandAugment (or AutoAugment; without them,
ColorJitter) on the whole image, then the crop, then the rest. The labels follow either way; the orders differ in
how much of a crop the ops' fill covers (:func:`shared_core.label_maps.crop_after_ops` writes the public order's
geometry).

Each sample is ``(image, (label, values, indices, box, flip, affines))``; :class:`TokenLabelCollate` stacks
them into ``(images, TokenLabelTarget)``, which also works with timm's fast-collate prefetcher (uint8
images, the target's ``.to`` moves the map rows). The per-token targets are built on the training
device in one batched call, kept sparse (:func:`shared_core.label_maps.token_targets_sparse`).
"""

from __future__ import annotations

import copy
import math
from typing import NamedTuple, Optional, Tuple

import numpy as np
import torch
from timm.data.auto_augment import AugMixAugment, AutoAugment, RandAugment
from timm.data.transforms import RandomResizedCropAndInterpolation
from torchvision import transforms as T
from torchvision.transforms import functional as TF

from shared_core.label_maps import (
    CropMaps,
    SparseTokenTargets,
    check_map_row,
    crop_after_ops,
    crop_box,
    crop_targets,
    normalised_affine,
    register_center_square,
    token_targets_sparse,
)
from shared_core.map_format import CENTER_SQUARE, MissingLabelMapError
from shared_core.mix import check_labels
from shared_core.options import AA_ORDERS, GEOMETRIC_AA, MAP_REGIONS

from .carrier import CarrierTensor
from .image_data import read_image, readable

__all__ = [
    'AA_ORDERS',
    'GEOMETRIC_AA',
    'GEOMETRIC_RAND_OPS',
    'AffineRecorder',
    'TokenLabelTarget',
    'TokenLabelDataset',
    'TokenLabelCollate',
    'TrainTransform',
    'pil_op_affine',
    'split_train_transform',
    'check_store_covers',
]

#: timm augmentation ops that move pixels (their affines are recorded, or with ``geometric_aa='drop'`` they
#: are removed)
GEOMETRIC_RAND_OPS = ('Rotate', 'ShearX', 'ShearY', 'TranslateX', 'TranslateY', 'TranslateXRel', 'TranslateYRel')


class TokenLabelTarget(CarrierTensor):
    """The class indices ``(B,)`` of a batch carrying its label maps as ``.maps``, a
    :class:`~shared_core.label_maps.CropMaps` (the map rows, the crops, the flips, the geometric ops after them and,
    where the collate built them, the sparse token targets): ``target.maps.crops``, ... (a tensor's own
    ``.values`` and ``.indices`` stay the tensor's). See :class:`~timm_plugin.carrier.CarrierTensor`."""

    _carried = ('maps',)

    @staticmethod
    def of(labels: torch.Tensor, maps: CropMaps) -> 'TokenLabelTarget':
        """``labels`` carrying ``maps``."""
        if maps.batch_size != labels.shape[0]:
            raise ValueError(f'maps: {maps.batch_size} map rows for {labels.shape[0]} labels')
        return TokenLabelTarget._wrap(labels, dict(maps=maps))

    def token_targets(self, grid: Tuple[int, int], smoothing: float = 0.0) -> SparseTokenTargets:
        """Per-token targets (row-major token order; ``.dense()`` is ``(B, gh * gw, C)``, rows summing to 1),
        built from the map rows (not the ones the collate may carry)."""
        return token_targets_sparse(self.maps, grid, smoothing)

    def with_token_targets(self, grid: Tuple[int, int], smoothing: float = 0.0) -> 'TokenLabelTarget':
        """This target carrying its sparse token targets for ``grid`` at ``smoothing`` (:meth:`token_targets`), as
        ``TokenLabelCollate(label_stride=...)`` hands a batch over; the loss then reads them instead of building
        them."""
        return TokenLabelTarget.of(self.as_tensor(), self.maps.with_tokens(grid, smoothing))

    def crop_targets(self, smoothing: float = 0.0) -> torch.Tensor:
        """``(B, C)`` the annotator's pooled label over each crop (ReLabel)."""
        return crop_targets(self.maps, smoothing)


def pil_op_affine(name: str, size: Tuple[int, int], args: tuple) -> np.ndarray:
    """The normalised ``(2, 3)`` affine (:func:`~shared_core.label_maps.normalised_affine`) of timm's
    geometric op ``name`` called with level ``args`` on a PIL image of ``size = (W, H)``: the matrix its
    ``Image.transform`` / ``Image.rotate`` call uses (output to input, pixel ``i`` spanning ``[i, i + 1]``)."""
    W, H = size
    if name == 'Rotate':  # PIL's Image.rotate: counter-clockwise by `degrees` about (W / 2, H / 2)
        a = -math.radians(args[0] % 360.0)
        c, s = round(math.cos(a), 15), round(math.sin(a), 15)
        cx, cy = W / 2, H / 2
        m = (c, s, c * -cx + s * -cy + cx, -s, c, -s * -cx + c * -cy + cy)
    elif name == 'ShearX':
        m = (1, args[0], 0, 0, 1, 0)
    elif name == 'ShearY':
        m = (1, 0, 0, args[0], 1, 0)
    elif name in ('TranslateXRel', 'TranslateX'):
        m = (1, 0, args[0] * W if name == 'TranslateXRel' else args[0], 0, 1, 0)
    elif name in ('TranslateYRel', 'TranslateY'):
        m = (1, 0, 0, 0, 1, args[0] * H if name == 'TranslateYRel' else args[0])
    else:
        raise ValueError(f'name: expected one of {GEOMETRIC_RAND_OPS}, got {name!r}')
    return normalised_affine(np.reshape(m, (2, 3)), W, H, 'output_to_input', corner=0.0)


class AffineRecorder:
    """The normalised affines of the geometric ops applied to the current sample, in order (``chain``);
    the dataset resets it before each sample's augmentation."""

    def __init__(self):
        self.chain = []

    def reset(self) -> None:
        self.chain = []

    def affines(self) -> np.ndarray:
        return np.asarray(self.chain, np.float32).reshape(-1, 2, 3)


class _RecordingOp:
    """A timm op function (``AugmentOp.aug_fn``) that records its affine, then runs as it was."""

    def __init__(self, name: str, fn, recorder: AffineRecorder):
        self.name, self.fn, self.recorder = name, fn, recorder

    def __call__(self, img, *args, **kwargs):
        self.recorder.chain.append(pil_op_affine(self.name, img.size, args))
        return self.fn(img, *args, **kwargs)


def _recording(op, recorder: AffineRecorder):
    if op.name not in GEOMETRIC_RAND_OPS:
        return op
    op = copy.copy(op)
    op.aug_fn = _RecordingOp(op.name, op.aug_fn, recorder)
    return op


class TrainTransform(NamedTuple):
    """timm's training transform split for token labels: the crop, the flip probability, the rest, and
    the recorder of the rest's geometric ops (``None`` with ``geometric_aa='drop'``)."""

    crop: object
    hflip: float
    rest: T.Compose
    recorder: Optional[AffineRecorder]


def split_train_transform(transform, geometric_aa: str = 'follow') -> TrainTransform:
    """timm's training transform as a :class:`TrainTransform`: the ``RandomResizedCropAndInterpolation``,
    the horizontal-flip probability, a ``Compose`` of what follows (see the module docstring) and the
    recorder its geometric ops write their affines to."""
    if geometric_aa not in GEOMETRIC_AA:
        raise ValueError(f'geometric_aa: expected one of {GEOMETRIC_AA}, got {geometric_aa!r}')
    tfs = list(transform.transforms) if isinstance(transform, T.Compose) else [transform]
    if not tfs or not isinstance(tfs[0], (RandomResizedCropAndInterpolation, T.RandomResizedCrop)):
        raise ValueError(
            'transform: token labeling needs a training transform that starts with a random resized '
            f'crop (timm train_crop_mode "rrc"), got {tfs[:1]}'
        )
    follow = geometric_aa == 'follow'
    recorder = AffineRecorder() if follow else None
    crop, rest, hflip = tfs[0], [], 0.0
    recorded = False  # a transform whose affines are recorded came already
    for t in tfs[1:]:
        if isinstance(t, T.RandomHorizontalFlip):
            if recorded:
                raise ValueError(
                    'transform: the horizontal flip must come before the augmentation whose geometric ops '
                    "the labels follow (timm's order: crop, flip, then RandAugment)"
                )
            hflip = float(t.p)
        elif isinstance(t, T.RandomVerticalFlip):
            if t.p > 0:
                raise ValueError('transform: vertical flips are not supported with token labels (--vflip 0)')
        elif isinstance(t, AugMixAugment) or (isinstance(t, AutoAugment) and not follow):
            raise ValueError(
                f'transform: {type(t).__name__} has geometric ops the label maps cannot follow '
                f'{"(it blends several chains)" if isinstance(t, AugMixAugment) else "once they are dropped"}; '
                'use RandAugment (--aa rand-...)'
            )
        elif isinstance(t, AutoAugment):
            t = copy.copy(t)
            t.policy = [[_recording(op, recorder) for op in sub] for sub in t.policy]
            rest.append(t)
            recorded = True
        elif isinstance(t, RandAugment) and follow:
            rest.append(RandAugment([_recording(op, recorder) for op in t.ops], t.num_layers, t.choice_weights))
            recorded = True
        elif isinstance(t, RandAugment):
            keep = [i for i, op in enumerate(t.ops) if op.name not in GEOMETRIC_RAND_OPS]
            weights = t.choice_weights
            if weights is not None:  # weighted policies ('...-tweights', 't3aw'): drop and renormalise theirs too
                weights = np.asarray(weights, dtype=np.float64)[keep]
                weights = weights / weights.sum()
            rest.append(RandAugment([t.ops[i] for i in keep], t.num_layers, weights))
        else:
            rest.append(t)
    return TrainTransform(crop, hflip, T.Compose(rest), recorder)


class _RecordParams:
    """Wraps a crop's ``get_params`` (a static method) to remember the last ``(i, j, h, w)`` it drew."""

    def __init__(self, fn):
        self.fn, self.last = fn, None

    def __call__(self, *args, **kwargs):
        self.last = self.fn(*args, **kwargs)
        return self.last


def check_store_covers(store, dataset) -> None:
    """Refuse a store that lacks the map of any image of ``dataset`` (its ``filenames()``: paths relative to
    the split root), before training starts (paths only: fast); the error counts and names the first ones."""
    names = getattr(dataset, 'filenames', None)
    if names is None:
        return
    missing = [f for f in names() if f not in store]
    if missing:
        raise MissingLabelMapError(
            missing[0],
            store.root,
            f'{len(missing)} of the {len(dataset)} images of this split have no map, e.g. {missing[:3]}; '
            'was the store generated for this split?',
        )


class TokenLabelDataset(torch.utils.data.Dataset):
    """A timm ``ImageDataset`` whose samples carry their label-map rows and recorded crop/flip.

    Args:
        dataset: the image dataset (``filename(i)`` is the key into the store: the image path relative
            to the split root, as ``tokenaug-maps generate`` wrote it). A timm ``ImageDataset`` is read with
            :func:`~timm_plugin.image_data.read_image`: an unreadable image is skipped for the next one (a
            warning names it) and the sample carries the map of the image actually read.
        store: the :class:`~shared_core.map_store.LabelMapStore` of that split.
        geometric_aa: ``'follow'`` (default; the public code): the targets follow RandAugment's (and
            AutoAugment's) geometric ops; ``'drop'``: those ops are removed (ours, earlier).
        aa_order: ``'timm'`` (default): crop, flip, then RandAugment, as timm built the transform;
            ``'public'``: flip and RandAugment (or ColorJitter without it) on the whole image, then the crop (the
            public code's order).
        map_region: ``'full_image'`` (default; the public code): each map registered on the whole image;
            ``'recorded'``: on the region the store records the annotator saw (the released maps cover the
            centre square: :func:`~shared_core.label_maps.register_center_square`).
    """

    def __init__(self, dataset, store, geometric_aa: str = 'follow', aa_order: str = 'timm', map_region='full_image'):
        if geometric_aa not in GEOMETRIC_AA:
            raise ValueError(f'geometric_aa: expected one of {GEOMETRIC_AA}, got {geometric_aa!r}')
        if aa_order not in AA_ORDERS:
            raise ValueError(f'aa_order: expected one of {AA_ORDERS}, got {aa_order!r}')
        if map_region not in MAP_REGIONS:
            raise ValueError(f'map_region: expected one of {MAP_REGIONS}, got {map_region!r}')
        self.dataset, self.store, self.geometric_aa, self.aa_order = dataset, store, geometric_aa, aa_order
        # registered on the centre square only where asked and where the store records it
        self.center_square = map_region == 'recorded' and store.meta.get('region') == CENTER_SQUARE
        self.num_classes = int(store.num_classes)
        check_store_covers(store, dataset)
        self._transform = self._crop = self._rest = self._recorder = None
        self._augment, self._after = None, None  # aa_order='public': the augmentation, and what follows the crop
        self._hflip = 0.0
        dataset.transform = None  # we load the PIL image and transform it here

    @property
    def transform(self):
        return self._transform

    @transform.setter
    def transform(self, transform):
        self._transform = transform
        if transform is None:
            self._crop = self._rest = self._recorder = None
            return
        crop, self._hflip, self._rest, self._recorder = split_train_transform(transform, self.geometric_aa)
        crop.get_params = _RecordParams(type(crop).get_params)
        self._crop = crop
        rest = list(self._rest.transforms)
        # the public code's secondary transforms: RandAugment / AutoAugment, or ColorJitter without them
        augment = [t for t in rest if isinstance(t, (RandAugment, AutoAugment, T.ColorJitter))]
        self._augment = augment[0] if augment else None
        self._after = T.Compose([t for t in rest if t is not self._augment])

    def __len__(self) -> int:
        return len(self.dataset)

    def _recorded(self) -> np.ndarray:
        return self._recorder.affines() if self._recorder is not None else np.zeros((0, 2, 3), np.float32)

    def filename(self, index: int, basename: bool = False, absolute: bool = False):
        return self.dataset.filename(index, basename, absolute)

    def __getitem__(self, index: int):
        if readable(self.dataset):  # the map of the image actually read (timm skips unreadable ones)
            img, label, index = read_image(self.dataset, index)
        else:
            img, label = self.dataset[index]
        rel = self.dataset.filename(index)
        row = self.store.index_of(rel)
        values, indices = self.store.row(row)
        check_map_row(values, indices, self.num_classes, name=f'label map of {rel!r} (row {row} of {self.store.root})')
        if self._crop is None:
            raise RuntimeError('TokenLabelDataset: no training transform set (create_loader sets it)')
        if self._recorder is not None:
            self._recorder.reset()
        if self.aa_order == 'public':  # flip and augment the whole image, then crop (crop_after_ops)
            flip = bool(torch.rand(()) < self._hflip)  # torch's RNG: seeded per DataLoader worker
            if flip:
                img = TF.hflip(img)
            if self._augment is not None:
                img = self._augment(img)
            W, H = TF.get_image_size(img)
            img = self._crop(img)
            box, affines = crop_after_ops(crop_box(*self._crop.get_params.last, H, W), flip, self._recorded())
            return self._after(img), self._target(label, values, indices, box, flip, affines, (W, H))
        W, H = TF.get_image_size(img)
        img = self._crop(img)
        box = crop_box(*self._crop.get_params.last, H, W)
        flip = bool(torch.rand(()) < self._hflip)
        if flip:
            img = TF.hflip(img)
        img = self._rest(img)
        return img, self._target(label, values, indices, box, flip, self._recorded(), (W, H))

    def _target(self, label, values, indices, box, flip, affines, size) -> tuple:
        if self.center_square:
            box, flip, affines = register_center_square(box, flip, affines, size)
        return int(label), values, indices, box, flip, affines


class TokenLabelCollate:
    """Stacks ``(image, (label, values, indices, box, flip[, affines]))`` samples into ``(images,
    TokenLabelTarget)``: uint8 images stay uint8 (timm's fast-collate prefetcher normalises them on the
    device); the affine chains are padded with identities to the batch's longest.

    ``label_stride`` (the model's, ``(sh, sw)`` or one int; :func:`~timm_plugin.token_grid.token_labeling_stride`):
    the sparse token targets are built here too, on the batch's token grid at label smoothing ``smoothing`` (the
    loss's), so the DataLoader's workers build them instead of the training step (they do not depend on MixToken's
    mix: the aux logits are un-mixed instead). The loss checks that they are for its grid and smoothing."""

    def __init__(self, num_classes: int, check: bool = True, label_stride=None, smoothing: float = 0.0):
        self.num_classes, self.check = int(num_classes), check
        if label_stride is not None:  # (smoothing is only read then)
            label_stride = (label_stride, label_stride) if isinstance(label_stride, int) else tuple(label_stride)
            if len(label_stride) != 2 or not all(isinstance(s, int) and s > 0 for s in label_stride):
                raise ValueError(f'label_stride: expected a positive int or (sh, sw), got {label_stride!r}')
            if not 0.0 <= smoothing < 1.0:
                raise ValueError(f'smoothing: expected a label smoothing in [0, 1), got {smoothing}')
        self.label_stride, self.smoothing = label_stride, float(smoothing)

    def __call__(self, batch):
        imgs = [torch.as_tensor(np.asarray(b[0])) if not torch.is_tensor(b[0]) else b[0] for b in batch]
        x = torch.stack(imgs)
        labels = torch.tensor([b[1][0] for b in batch], dtype=torch.int64)
        check_labels(labels, self.num_classes)
        if self.check:
            for b in batch:
                check_map_row(b[1][1], b[1][2], self.num_classes)
        rows = [b[1] for b in batch]
        maps = CropMaps.stack(
            [r[1] for r in rows],
            [r[2] for r in rows],
            [r[3] for r in rows],
            [r[4] for r in rows],
            [r[5] if len(r) > 5 else None for r in rows],
            self.num_classes,
        )
        target = TokenLabelTarget.of(labels, maps)
        if self.label_stride is None:
            return x, target
        size = tuple(x.shape[-2:])
        if any(n % s for n, s in zip(size, self.label_stride)):
            raise ValueError(
                f'label_stride: the images are {size[0]}x{size[1]} px, not a whole number of '
                f'{self.label_stride[0]}x{self.label_stride[1]}-px tokens'
            )
        grid = (size[0] // self.label_stride[0], size[1] // self.label_stride[1])
        return x, target.with_token_targets(grid, self.smoothing)
