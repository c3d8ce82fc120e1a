"""Token labeling's data path for MMPretrain (the Token Labeling paper, Sec. 3.2): pipeline transforms that
carry each image's label-map row, crop and flip, and :func:`token_label_batch`, which stacks them on the
training device. The head and classifier are :mod:`mm_plugin.token_labeling`.

Data (registered in mmpretrain's ``TRANSFORMS``). The map of an image covers the *whole* image as read
from disk; the crop and the flip the image gets are recorded and applied to the map on the training
device (:func:`shared_core.label_maps.token_targets_sparse`, one batched call)::

    LoadImageFromFile -> LoadTokenLabelMap -> TokenLabelRandomResizedCrop
        -> RandomFlip (horizontal) -> TokenLabelRandAugment -> RandomErasing
        -> PackTokenLabelInputs

- :class:`LoadTokenLabelMap` reads the image's row (key: ``img_path`` relative to the split root);
- :class:`TokenLabelRandomResizedCrop` is mmpretrain's ``RandomResizedCrop`` that records its crop as
  ``crop_box`` = normalised ``(x0, y0, x1, y1)``; it must be the first geometric op, or come after
  ``RandomFlip`` and ``TokenLabelRandAugment`` only (the public Token Labeling order: flip and RandAugment on
  the whole image, then the crop; :func:`shared_core.label_maps.crop_after_ops` records that geometry)::

      LoadImageFromFile -> LoadTokenLabelMap -> RandomFlip (horizontal)
          -> TokenLabelRandAugment -> TokenLabelRandomResizedCrop -> RandomErasing
          -> PackTokenLabelInputs

- mmcv's ``RandomFlip`` records ``flip`` / ``flip_direction``; only horizontal flips are allowed;
- :class:`TokenLabelRandAugment` is mmpretrain's ``RandAugment`` whose geometric policies (``Rotate``,
  ``Shear``, ``Translate``) record the affine they applied in ``results['token_affines']``
  (``geometric='follow'``, the default and the public code's behaviour: the labels follow them, fill
  outside the image a uniform label); ``geometric='drop'`` removes them instead. It
  must come after ``RandomFlip``, before or after the crop. The stock ``RandAugment`` / ``AutoAugment`` must not
  be used with token labels (a pipeline cannot see what they did);
- :class:`PackTokenLabelInputs` is ``PackInputs`` that also packs ``token_label_values``,
  ``token_label_indices``, ``crop_box`` and ``token_affines`` (``flip`` / ``flip_direction`` are default
  meta keys) and refuses a vertical or diagonal flip. ``PackInputs(algorithm_keys=TOKEN_LABEL_KEYS)`` works too (the
  classifier repeats the flip check).
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence, Union

import cv2
import mmcv
import numpy as np
from mmcv.transforms import BaseTransform
from mmengine.hooks import Hook
from mmengine.registry import HOOKS
from mmpretrain.datasets.transforms import PackInputs, RandAugment, RandomResizedCrop, Rotate, Shear, Translate
from mmpretrain.datasets.transforms.auto_augment import RANDAUG_POLICIES
from mmpretrain.registry import TRANSFORMS
from mmpretrain.structures import DataSample

from shared_core.label_maps import (
    CropMaps,
    check_map_row,
    crop_after_ops,
    crop_box,
    normalised_affine,
)
from shared_core.map_format import MissingLabelMapError
from shared_core.map_store import LabelMapStore

__all__ = [
    'GEOMETRIC',
    'GEOMETRIC_RAND_POLICIES',
    'TOKEN_LABEL_KEYS',
    'LoadTokenLabelMap',
    'TokenLabelRandomResizedCrop',
    'TokenLabelRandAugment',
    'TokenLabelRotate',
    'TokenLabelShear',
    'TokenLabelTranslate',
    'PackTokenLabelInputs',
    'token_label_batch',
    'TokenLabelStoreCheck',
    'check_dataset_maps',
]

#: mmpretrain RandAugment policies that move pixels (recorded, or removed, by :class:`TokenLabelRandAugment`)
GEOMETRIC_RAND_POLICIES = ('Rotate', 'Shear', 'Translate')
#: what :class:`TokenLabelRandAugment` does with them: the labels follow (the public code), or drop them (ours)
GEOMETRIC = ('follow', 'drop')
#: the data-sample fields a token-labeling batch needs (plus the ``flip`` / ``flip_direction`` metainfo)
TOKEN_LABEL_KEYS = ('token_label_values', 'token_label_indices', 'crop_box')
#: the optional field of the geometric ops' affine chain (``(L, 2, 3)``, see :mod:`shared_core.label_maps`)
AFFINE_KEY = 'token_affines'
#: the field of the store's class count (:class:`LoadTokenLabelMap`), checked against the head's
CLASSES_KEY = 'token_label_classes'
_BEFORE_FLIP = '_token_label_aa_before_flip'
_FLIP_AT_CROP = '_token_label_flip_before_crop'


# ----------------------------------------------------------------------------------------------
# Data: transforms
# ----------------------------------------------------------------------------------------------


def _image_name(results: dict) -> str:
    return repr(results.get('img_path', '<image without img_path>'))


@TRANSFORMS.register_module()
class LoadTokenLabelMap(BaseTransform):
    """Reads the image's label-map row into ``results['token_label_values']`` ``(k, h, w)`` float16 and
    ``results['token_label_indices']`` ``(k, h, w)`` int64 (numpy: they travel pickled, not as shared
    tensors, from the dataloader workers).

    Args:
        store: the store directory of the split (or an open :class:`LabelMapStore`). It is opened and
            validated here; it pickles to a few hundred bytes and each worker process reopens its
            memory maps on first use.
        split_root: the directory the store's keys are relative to (``<data_root>/train`` for an
            ImageFolder-style split): the key of an image is ``relpath(img_path, split_root)``.
        check: refuse corrupt rows (:func:`shared_core.label_maps.check_map_row`).

    A missing row raises the store's :class:`~shared_core.map_format.MissingLabelMapError` naming the image.
    """

    def __init__(
        self, store: Union[str, os.PathLike, LabelMapStore], split_root: Union[str, os.PathLike], check: bool = True
    ):
        if not isinstance(store, LabelMapStore):
            if not isinstance(store, (str, os.PathLike)):
                raise ValueError(f'store: expected a label-map store directory, got {store!r}')
            store = LabelMapStore.open(store)
        if not isinstance(split_root, (str, os.PathLike)) or not os.fspath(split_root):
            raise ValueError(
                f"split_root: expected the directory the store's image paths are relative to, got {split_root!r}"
            )
        self.store, self.split_root, self.check = store, os.path.abspath(os.fspath(split_root)), bool(check)

    def key(self, img_path: str) -> str:
        """The store key of an image: its path relative to ``split_root``."""
        rel = os.path.relpath(os.path.abspath(img_path), self.split_root)
        if rel == os.curdir or rel.split(os.sep)[0] == os.pardir:
            raise ValueError(
                f'img_path: {img_path!r} is not inside split_root {self.split_root!r} '
                f'(the label-map store {self.store.root} is keyed by paths relative to it)'
            )
        return rel

    def transform(self, results: dict) -> dict:
        if 'img_path' not in results:
            raise KeyError("results: LoadTokenLabelMap needs the image's img_path (a file-based dataset)")
        rel = self.key(results['img_path'])
        values, indices = self.store.lookup(rel)
        if self.check:
            check_map_row(values, indices, self.store.num_classes, name=f'label map of {rel!r} in {self.store.root}')
        results['token_label_values'] = values
        results['token_label_indices'] = indices
        results[CLASSES_KEY] = int(self.store.num_classes)
        return results

    def __repr__(self) -> str:
        return f'{type(self).__name__}(store={str(self.store.root)!r}, split_root={self.split_root!r})'


def _check_uncropped(results: dict, name: str) -> None:
    """The crop's box is in the coordinates of the image the map covers: the image as loaded (flipped and augmented
    by recorded ops at most, the public order)."""
    if 'crop_box' in results:
        raise ValueError(
            f'{name}: the image {_image_name(results)} was already cropped by a crop that records '
            'its box; use one TokenLabelRandomResizedCrop per pipeline'
        )
    ori = results.get('ori_shape')
    now = tuple(results['img'].shape[:2])
    shape = tuple(results.get('img_shape', now)[:2])
    if ori is not None and (tuple(ori[:2]) != now or shape != now):
        raise ValueError(
            f'{name}: the image {_image_name(results)} was resized or cropped before '
            f'(ori_shape {tuple(ori[:2])}, img_shape {shape}); the token-label map covers the image '
            'as loaded, so the recorded crop must be the first transform after LoadImageFromFile that resizes '
            '(only RandomFlip and TokenLabelRandAugment may come before it: the public order)'
        )


@TRANSFORMS.register_module()
class TokenLabelRandomResizedCrop(RandomResizedCrop):
    """mmpretrain's ``RandomResizedCrop`` that records its crop: ``results['crop_box']`` is the
    normalised ``(x0, y0, x1, y1)`` of the crop in the image it received (0 = left/top edge, 1 =
    right/bottom edge), which must be the image as loaded (the map's coordinates). Args: as
    ``RandomResizedCrop``."""

    def transform(self, results: dict) -> dict:
        _check_uncropped(results, type(self).__name__)
        img = results['img']
        img_h, img_w = img.shape[:2]
        top, left, h, w = self.rand_crop_params(img)
        # the parent's crop and resize, with the drawn parameters kept
        img = mmcv.imcrop(img, bboxes=np.array([left, top, left + w - 1, top + h - 1]))
        img = mmcv.imresize(img, tuple(self.scale[::-1]), interpolation=self.interpolation, backend=self.backend)
        results['img'] = img
        results['img_shape'] = img.shape
        box = crop_box(top, left, h, w, img_h, img_w)
        if 'flip' in results or len(results.get(AFFINE_KEY, ())):  # the public order: flip, RandAugment, crop
            box, results[AFFINE_KEY] = crop_after_ops(box, bool(results.get('flip')), results.get(AFFINE_KEY, ()))
            results[_FLIP_AT_CROP] = bool(results.get('flip'))
        results['crop_box'] = box
        return results


def _opencv_forward(t, value: float, height: int, width: int) -> np.ndarray:
    """The ``2x3`` matrix (input to output, OpenCV pixel coordinates) mmcv warps with for ``t`` at its drawn
    signed ``value`` (mmcv's ``imrotate`` / ``imshear`` / ``imtranslate``)."""
    if isinstance(t, Rotate):
        center = t.center if t.center is not None else ((width - 1) * 0.5, (height - 1) * 0.5)
        return cv2.getRotationMatrix2D(center, -value, t.scale)
    horizontal = t.direction == 'horizontal'
    if isinstance(t, Shear):
        return np.float32([[1, value, 0], [0, 1, 0]] if horizontal else [[1, 0, 0], [value, 1, 0]])
    offset = value * (width if horizontal else height)
    return np.float32([[1, 0, offset], [0, 1, 0]] if horizontal else [[1, 0, 0], [0, 1, offset]])


class _RecordsAffine:
    """For mmpretrain's ``Rotate`` / ``Shear`` / ``Translate``: runs as the parent and appends the normalised
    affine it applied to ``results['token_affines']`` (the signed magnitude it drew is the one value its
    ``random_negative`` returned)."""

    def random_negative(self, value):
        self._drawn = super().random_negative(value)
        return self._drawn

    def transform(self, results):
        self._drawn = None
        h, w = results['img'].shape[:2]
        out = super().transform(results)
        if self._drawn is not None:
            m = normalised_affine(_opencv_forward(self, self._drawn, h, w), w, h, 'input_to_output', corner=-0.5)
            chain = results.get(AFFINE_KEY, np.zeros((0, 2, 3), np.float32))
            out[AFFINE_KEY] = np.concatenate([chain, m[None].astype(np.float32)])
        return out


@TRANSFORMS.register_module()
class TokenLabelRotate(_RecordsAffine, Rotate):
    """mmpretrain's ``Rotate`` that records its affine for token labels (see :class:`TokenLabelRandAugment`).

    Args:
        angle (float, optional): the rotation in degrees; None: from ``magnitude_level``.
        center (tuple, optional): the centre of rotation; None: the image centre.
        scale (float): isotropic scale. Defaults to 1.0.
        pad_val (int | sequence): fill of the uncovered pixels. Defaults to 128.
        prob (float): probability of applying it. Defaults to 0.5.
        random_negative_prob (float): probability of negating the angle. Defaults to 0.5.
        interpolation (str): as mmpretrain's ``Rotate``. Defaults to ``'nearest'``.
        **kwargs: mmpretrain's ``BaseAugTransform`` arguments (``magnitude_level``, ``magnitude_range``,
            ``magnitude_std``, ``total_level``).
    """


@TRANSFORMS.register_module()
class TokenLabelShear(_RecordsAffine, Shear):
    """mmpretrain's ``Shear`` that records its affine for token labels (see :class:`TokenLabelRandAugment`).

    Args:
        magnitude (float, optional): the shear factor (mmpretrain's ``Shear``); None: from ``magnitude_level``.
        pad_val (int | sequence): fill of the uncovered pixels. Defaults to 128.
        prob (float): probability of applying it. Defaults to 0.5.
        random_negative_prob (float): probability of negating the magnitude. Defaults to 0.5.
        interpolation (str): as mmpretrain's ``Shear``.
        **kwargs: mmpretrain's ``BaseAugTransform`` arguments (``magnitude_level``, ``magnitude_range``,
            ``magnitude_std``, ``total_level``); ``direction``: ``'horizontal'`` or ``'vertical'``.
    """


@TRANSFORMS.register_module()
class TokenLabelTranslate(_RecordsAffine, Translate):
    """mmpretrain's ``Translate`` that records its affine for token labels (see :class:`TokenLabelRandAugment`).

    Args:
        magnitude (float, optional): the shift as a fraction of the image side (mmpretrain's ``Translate``);
            None: from ``magnitude_level``.
        pad_val (int | sequence): fill of the uncovered pixels. Defaults to 128.
        prob (float): probability of applying it. Defaults to 0.5.
        random_negative_prob (float): probability of negating the magnitude. Defaults to 0.5.
        interpolation (str): as mmpretrain's ``Translate``.
        **kwargs: mmpretrain's ``BaseAugTransform`` arguments (``magnitude_level``, ``magnitude_range``,
            ``magnitude_std``, ``total_level``); ``direction``: ``'horizontal'`` or ``'vertical'``.
    """


_RECORDING = {'Rotate': 'TokenLabelRotate', 'Shear': 'TokenLabelShear', 'Translate': 'TokenLabelTranslate'}


@TRANSFORMS.register_module()
class TokenLabelRandAugment(RandAugment):
    """mmpretrain's ``RandAugment`` for token labels: its geometric policies (:data:`GEOMETRIC_RAND_POLICIES`)
    record the affine they applied, and the targets follow it (as the public code; the timm side does the
    same), or they are removed.

    Args:
        geometric: ``'follow'`` (default) or ``'drop'`` (:data:`GEOMETRIC`).

    The other arguments: as ``RandAugment`` (``policies`` a preset name such as ``'timm_increasing'`` or a list).

    It must come after ``RandomFlip`` (the recorded ops act on the flipped image), after the crop (timm's order) or
    before it (the public order).
    """

    def __init__(
        self,
        policies: Union[str, List[dict]],
        num_policies: int,
        magnitude_level: int,
        geometric: str = 'follow',
        **kwargs,
    ):
        if geometric not in GEOMETRIC:
            raise ValueError(f'geometric: expected one of {GEOMETRIC}, got {geometric!r}')
        if isinstance(policies, str):
            if policies not in RANDAUG_POLICIES:
                raise ValueError(f'policies: expected one of {list(RANDAUG_POLICIES)} or a list, got {policies!r}')
            policies = RANDAUG_POLICIES[policies]
        if not isinstance(policies, (list, tuple)) or not all(isinstance(p, dict) and 'type' in p for p in policies):
            raise ValueError(f'policies: expected a list of policy dicts with a "type", got {policies!r}')
        kind = [str(p['type']).split('.')[-1] for p in policies]
        if geometric == 'drop':
            policies = [p for p, t in zip(policies, kind) if t not in GEOMETRIC_RAND_POLICIES]
            if not policies:
                raise ValueError(
                    'policies: only geometric policies given; nothing is left once '
                    f'{GEOMETRIC_RAND_POLICIES} are removed'
                )
        else:
            policies = [dict(p, type=_RECORDING[t]) if t in _RECORDING else p for p, t in zip(policies, kind)]
        self.geometric = geometric
        super().__init__(list(policies), num_policies, magnitude_level, **kwargs)

    def transform(self, results: dict) -> dict:
        results.setdefault(AFFINE_KEY, np.zeros((0, 2, 3), np.float32))
        results[_BEFORE_FLIP] = 'flip' not in results
        return super().transform(results)


def _check_flip(flip: bool, direction: Optional[str], image: str) -> None:
    if flip and direction != 'horizontal':
        raise ValueError(
            f'flip_direction: the image {image} was flipped {direction!r}; token labels follow '
            "horizontal flips only (RandomFlip(direction='horizontal'))"
        )


@TRANSFORMS.register_module()
class PackTokenLabelInputs(PackInputs):
    """``PackInputs`` that also packs :data:`TOKEN_LABEL_KEYS` into the data sample (the map row and the
    crop box; ``flip`` and ``flip_direction`` are default meta keys), after checking that they are
    there and that the image was flipped horizontally if at all. Args: as ``PackInputs``."""

    def __init__(
        self,
        input_key: str = 'img',
        algorithm_keys: Sequence[str] = (),
        meta_keys: Sequence[str] = PackInputs.DEFAULT_META_KEYS,
    ):
        missing = {'flip', 'flip_direction'} - set(meta_keys)
        if missing:
            raise ValueError(f'meta_keys: token labeling needs {sorted(missing)} in the data samples')
        own = tuple(TOKEN_LABEL_KEYS) + (AFFINE_KEY, CLASSES_KEY)
        keys = own + tuple(k for k in algorithm_keys if k not in own)
        super().__init__(input_key=input_key, algorithm_keys=keys, meta_keys=meta_keys)

    def transform(self, results: dict) -> dict:
        image = _image_name(results)
        if 'token_label_values' not in results or 'token_label_indices' not in results:
            raise KeyError(f'results: no token-label map for image {image}; put LoadTokenLabelMap in the pipeline')
        if 'crop_box' not in results:
            raise KeyError(
                f'results: no crop box for image {image}; crop it with TokenLabelRandomResizedCrop '
                '(the first geometric transform)'
            )
        _check_flip(bool(results.get('flip', False)), results.get('flip_direction'), image)
        if results.pop(_BEFORE_FLIP, False) and 'flip' in results:
            raise ValueError(
                f'pipeline: the image {image} was flipped after TokenLabelRandAugment; put RandomFlip '
                'before it (the recorded geometric ops act on the flipped crop)'
            )
        if _FLIP_AT_CROP in results and results.pop(_FLIP_AT_CROP) != bool(results.get('flip', False)):
            raise ValueError(
                f'pipeline: the image {image} was flipped before TokenLabelRandomResizedCrop and again after it; '
                'flip once: before the crop (the public order) or after it'
            )
        results.setdefault(AFFINE_KEY, np.zeros((0, 2, 3), np.float32))
        return super().transform(results)


# ----------------------------------------------------------------------------------------------
# Data: the batch's maps
# ----------------------------------------------------------------------------------------------


def token_label_batch(data_samples: Sequence[DataSample], num_classes: int, device=None) -> CropMaps:
    """Stack the samples' packed map rows, crops and flips (see :class:`PackTokenLabelInputs`); refuse
    samples without them, vertical flips and class indices outside ``[0, num_classes)``."""
    missing = [
        s.metainfo.get('img_path', f'sample {i}')
        for i, s in enumerate(data_samples)
        if not all(k in s for k in TOKEN_LABEL_KEYS)
    ]
    if missing:
        raise ValueError(
            f'data_samples: no token-label map or crop box for {len(missing)} of {len(data_samples)} '
            f'images (first: {missing[0]!r}); the train pipeline needs LoadTokenLabelMap, '
            'TokenLabelRandomResizedCrop and PackTokenLabelInputs'
        )
    for i, s in enumerate(data_samples):
        _check_flip(
            bool(s.metainfo.get('flip', False)),
            s.metainfo.get('flip_direction'),
            repr(s.metainfo.get('img_path', f'sample {i}')),
        )
    stores = sorted({int(s.get(CLASSES_KEY)) for s in data_samples if CLASSES_KEY in s})
    if stores and stores != [num_classes]:
        raise ValueError(
            f'token_label_classes: the label maps are for {stores[0] if len(stores) == 1 else stores} classes, the '
            f'head for num_classes={num_classes}; a store of this dataset is needed (TOKENAUG_MAPS / '
            'LoadTokenLabelMap.store)'
        )
    indices = [np.asarray(s.token_label_indices) for s in data_samples]
    every = np.concatenate([i.ravel() for i in indices])
    lo, hi = (int(every.min()), int(every.max())) if every.size else (0, 0)
    if lo < 0 or hi >= num_classes:
        raise ValueError(
            f'token_label_indices: the maps hold class indices in [{lo}, {hi}], the head has '
            f'num_classes={num_classes}; was the store made for this dataset?'
        )
    maps = CropMaps.stack(
        [s.token_label_values for s in data_samples],
        indices,
        [s.crop_box for s in data_samples],
        [s.metainfo.get('flip', False) for s in data_samples],
        [np.asarray(s.get(AFFINE_KEY)) if AFFINE_KEY in s else None for s in data_samples],
        num_classes,
    )
    return maps.to(device, non_blocking=True) if device is not None else maps


# ----------------------------------------------------------------------------------------------
# Run: every training image has a map, checked before the first iteration
# ----------------------------------------------------------------------------------------------


def _base_datasets(dataset):
    """The datasets under mmengine's wrappers (Repeat / ClassBalanced: ``.dataset``; Concat: ``.datasets``)."""
    if hasattr(dataset, 'datasets'):
        return [b for d in dataset.datasets for b in _base_datasets(d)]
    if hasattr(dataset, 'dataset'):
        return _base_datasets(dataset.dataset)
    return [dataset]


def check_dataset_maps(dataset) -> int:
    """Refuse a dataset whose pipeline loads token-label maps (:class:`LoadTokenLabelMap`) when its store lacks the
    map of any of its images (paths only: fast); the error counts and names the first ones. Returns the number of
    images checked."""
    checked = 0
    for ds in _base_datasets(dataset):
        transforms = getattr(getattr(ds, 'pipeline', None), 'transforms', [])
        loaders = [t for t in transforms if isinstance(t, LoadTokenLabelMap)]
        if not loaders or not hasattr(ds, 'get_data_info'):
            continue
        load = loaders[0]
        missing = []
        for i in range(len(ds)):
            key = load.key(ds.get_data_info(i)['img_path'])
            if key not in load.store:
                missing.append(key)
        checked += len(ds)
        if missing:
            raise MissingLabelMapError(
                missing[0],
                load.store.root,
                f'{len(missing)} of the {len(ds)} training images have no map, e.g. {missing[:3]}; '
                'was the store generated for this split?',
            )
    return checked


@HOOKS.register_module()
class TokenLabelStoreCheck(Hook):
    """``custom_hooks = [dict(type='TokenLabelStoreCheck')]``: before training, every image of the training set
    must have a map in the store its :class:`LoadTokenLabelMap` reads (:func:`check_dataset_maps`), instead of
    a failure when the sample is first drawn mid-epoch.

    Args:
        (none): it reads the store and the split from the training dataset's ``LoadTokenLabelMap``; its
            priority is ``'VERY_HIGH'`` (it runs before the other ``before_train`` hooks).
    """

    priority = 'VERY_HIGH'

    def before_train(self, runner) -> None:
        check_dataset_maps(runner.train_dataloader.dataset)
