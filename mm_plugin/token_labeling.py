"""Token labeling + MixToken for MMPretrain (``token-labeling.md`` Sec. 3.2-3.3): transforms, head, classifier.

The objective (Eq. 1-4): besides the class token's cross entropy, every output patch token ``X^i`` is
trained against the annotator's label ``y^i`` of its location (a dense score map, stored offline by
``tokenaug-maps generate`` in a :class:`~shared_core.map_store.LabelMapStore`)::

    L_total = H(X^cls, y^cls) + β · (1/N) Σ_i H(X^i, y^i)              (Eq. 3-4, β = 0.5)

MixToken (Eq. 5-7) swaps the patch tokens of sample pairs inside a box on the token grid, right after
patch embedding::

    T̂ = T_1 ⊙ M + T_2 ⊙ (1 - M)                                       (Eq. 5)
    Ŷ = Y_1 ⊙ M + Y_2 ⊙ (1 - M)                                       (Eq. 6)
    ŷ^cls = M̄ · y_1^cls + (1 - M̄) · y_2^cls                            (Eq. 7)

Eq. 6 is applied by *un-mixing* the dense outputs instead (:func:`shared_core.token_labeling.unmix_tokens`:
for the pairwise swaps of MixToken the same loss, see there), Eq. 7 by
:func:`shared_core.token_labeling.mix_class_target`.

Data (registered in mmpretrain's ``TRANSFORMS``). The map of an image covers the *whole* image as read
from disk; the crop and the flip the image gets are recorded and applied to the map on the training
device (:func:`shared_core.label_maps.token_targets_sparse`, one batched call)::

    LoadImageFromFile -> LoadTokenLabelMap -> TokenLabelRandomResizedCrop -> RandomFlip (horizontal)
        -> TokenLabelRandAugment -> RandomErasing -> PackTokenLabelInputs

- :class:`LoadTokenLabelMap` reads the image's row (key: ``img_path`` relative to the split root);
- :class:`TokenLabelRandomResizedCrop` is mmpretrain's ``RandomResizedCrop`` that records its crop as
  ``crop_box`` = normalised ``(x0, y0, x1, y1)``; it must be the first geometric op;
- mmcv's ``RandomFlip`` records ``flip`` / ``flip_direction``; only horizontal flips are allowed;
- :class:`TokenLabelRandAugment` is mmpretrain's ``RandAugment`` without its geometric policies
  (``Rotate``, ``Shear``, ``Translate``): a map cannot follow them, and applying them to the image only
  (what the public code does) moves the image away from its labels. Colour policies stay;
  ``keep_geometric=True`` restores the public behaviour. The stock ``RandAugment`` / ``AutoAugment``
  must not be used with token labels (a pipeline cannot see what they did);
- :class:`PackTokenLabelInputs` is ``PackInputs`` that also packs ``token_label_values``,
  ``token_label_indices`` and ``crop_box`` (``flip`` / ``flip_direction`` are default meta keys) and
  refuses a vertical or diagonal flip. ``PackInputs(algorithm_keys=TOKEN_LABEL_KEYS)`` works too (the
  classifier repeats the flip check).

Model (registered in mmpretrain's ``MODELS``):

- :class:`TokenLabelingHead`: a linear head on the class token and a linear ``aux_head`` on every patch
  token of the backbone's ``(B, prefix + N, D)`` output; owns the loss (Eq. 3-4, 7) and the inference
  rule ``cls + 0.5 · max_tokens(aux)`` (``head_rule='cls+aux'``, the public code) or ``'cls'``; with
  ``relabel=True`` the class target is the annotator's label pooled over the crop (ReLabel, Table 2),
  without dense term and aux head.
- :class:`TokenLabelingClassifier`: an ``ImageClassifier`` that draws the MixToken box (λ ~ Beta(β, β)
  on the token grid, one box per batch as the public code, or per pair), mixes the tokens by a forward
  hook on the backbone's patch embedding and hands the mix to the head. Backbones: mmpretrain's
  ``VisionTransformer`` with ``out_type='raw'`` (its final norm is applied to every token) and
  ``TIMMBackbone`` around a timm ViT (``forward_features`` tokens; LV-ViT ``lvvit_*`` included).
  Image batch augments (MixUp / CutMix in ``train_cfg``) are refused: MixToken replaces them.
"""
from __future__ import annotations

import os
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import mmcv
import numpy as np
import torch
import torch.nn as nn
from mmcv.transforms import BaseTransform
from mmengine.model import BaseModule
from mmpretrain.datasets.transforms import PackInputs, RandAugment, RandomResizedCrop
from mmpretrain.datasets.transforms.auto_augment import RANDAUG_POLICIES
from mmpretrain.models.backbones import TIMMBackbone, VisionTransformer
from mmpretrain.models.classifiers import ImageClassifier
from mmpretrain.registry import MODELS, TRANSFORMS
from mmpretrain.structures import DataSample

from shared_core.label_maps import check_boxes, check_map_row, crop_box, crop_targets, token_targets_sparse
from shared_core.map_store import LabelMapStore
from shared_core.mixing import (Mix, MixSampler, check_image_size, check_labels, check_pairwise_batch, mix_tokens,
                                one_hot, to_2tuple)
from shared_core.token_labeling import (CLS_TARGETS, check_pairwise_swap, class_target, mix_class_target,
                                        soft_cross_entropy, unmix_tokens)

__all__ = ['GEOMETRIC_RAND_POLICIES', 'TOKEN_LABEL_KEYS', 'HEAD_RULES', 'AUX_WEIGHT', 'LoadTokenLabelMap',
           'TokenLabelRandomResizedCrop', 'TokenLabelRandAugment', 'PackTokenLabelInputs', 'TokenLabelBatch',
           'token_label_batch', 'TokenLabelingHead', 'TokenLabelingClassifier']

#: mmpretrain RandAugment policies that move pixels (removed by :class:`TokenLabelRandAugment`)
GEOMETRIC_RAND_POLICIES = ('Rotate', 'Shear', 'Translate')
#: the data-sample fields a token-labeling batch needs (plus the ``flip`` / ``flip_direction`` metainfo)
TOKEN_LABEL_KEYS = ('token_label_values', 'token_label_indices', 'crop_box')
#: inference rules of :class:`TokenLabelingHead`
HEAD_RULES = ('cls+aux', 'cls')
#: weight of the aux term in the ``'cls+aux'`` rule (public code: ``x_cls + 0.5 * x_aux.max(1)[0]``)
AUX_WEIGHT = 0.5


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

    A missing row raises the store's :class:`~shared_core.map_store.MissingLabelMapError` naming the image.
    """

    def __init__(self, store: Union[str, os.PathLike, LabelMapStore], split_root: Union[str, os.PathLike],
                 check: bool = True):
        if not isinstance(store, LabelMapStore):
            if not isinstance(store, (str, os.PathLike)):
                raise ValueError(f'store: expected a label-map store directory, got {store!r}')
            store = LabelMapStore.open(store)
        if not isinstance(split_root, (str, os.PathLike)) or not os.fspath(split_root):
            raise ValueError(f'split_root: expected the directory the store\'s image paths are relative to, '
                             f'got {split_root!r}')
        self.store, self.split_root, self.check = store, os.path.abspath(os.fspath(split_root)), bool(check)

    def key(self, img_path: str) -> str:
        """The store key of an image: its path relative to ``split_root``."""
        rel = os.path.relpath(os.path.abspath(img_path), self.split_root)
        if rel == os.curdir or rel.split(os.sep)[0] == os.pardir:
            raise ValueError(f'img_path: {img_path!r} is not inside split_root {self.split_root!r} '
                             f'(the label-map store {self.store.root} is keyed by paths relative to it)')
        return rel

    def transform(self, results: dict) -> dict:
        if 'img_path' not in results:
            raise KeyError('results: LoadTokenLabelMap needs the image\'s img_path (a file-based dataset)')
        rel = self.key(results['img_path'])
        values, indices = self.store.lookup(rel)
        if self.check:
            check_map_row(values, indices, self.store.num_classes, name=f'label map of {rel!r} in {self.store.root}')
        results['token_label_values'] = values
        results['token_label_indices'] = indices
        return results

    def __repr__(self) -> str:
        return f'{type(self).__name__}(store={str(self.store.root)!r}, split_root={self.split_root!r})'


def _check_uncropped(results: dict, name: str) -> None:
    """The crop's box is in the coordinates of the image the map covers: the image as loaded."""
    if 'crop_box' in results:
        raise ValueError(f'{name}: the image {_image_name(results)} was already cropped by a crop that records '
                         'its box; use one TokenLabelRandomResizedCrop per pipeline')
    if results.get('flip'):
        raise ValueError(f'{name}: the image {_image_name(results)} was flipped before the crop; put RandomFlip '
                         'after TokenLabelRandomResizedCrop')
    ori = results.get('ori_shape')
    now = tuple(results['img'].shape[:2])
    shape = tuple(results.get('img_shape', now)[:2])
    if ori is not None and (tuple(ori[:2]) != now or shape != now):
        raise ValueError(f'{name}: the image {_image_name(results)} was resized or cropped before '
                         f'(ori_shape {tuple(ori[:2])}, img_shape {shape}); the token-label map covers the image '
                         'as loaded, so the recorded crop must be the first geometric transform after '
                         'LoadImageFromFile')


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
        results['crop_box'] = crop_box(top, left, h, w, img_h, img_w)
        return results


@TRANSFORMS.register_module()
class TokenLabelRandAugment(RandAugment):
    """mmpretrain's ``RandAugment`` without its geometric policies (:data:`GEOMETRIC_RAND_POLICIES`),
    so that the token labels stay aligned with the image (the timm side removes the same ops).

    Args:
        keep_geometric: keep them (the public code's behaviour: the labels do not follow them).
        Other args: as ``RandAugment`` (``policies`` a preset name such as ``'timm_increasing'`` or a list).
    """

    def __init__(self, policies: Union[str, List[dict]], num_policies: int, magnitude_level: int,
                 keep_geometric: bool = False, **kwargs):
        if isinstance(policies, str):
            if policies not in RANDAUG_POLICIES:
                raise ValueError(f'policies: expected one of {list(RANDAUG_POLICIES)} or a list, got {policies!r}')
            policies = RANDAUG_POLICIES[policies]
        if not isinstance(policies, (list, tuple)) or not all(isinstance(p, dict) and 'type' in p for p in policies):
            raise ValueError(f'policies: expected a list of policy dicts with a "type", got {policies!r}')
        if not keep_geometric:
            policies = [p for p in policies if p['type'] not in GEOMETRIC_RAND_POLICIES]
            if not policies:
                raise ValueError('policies: only geometric policies given; nothing is left once '
                                 f'{GEOMETRIC_RAND_POLICIES} are removed')
        self.keep_geometric = bool(keep_geometric)
        super().__init__(list(policies), num_policies, magnitude_level, **kwargs)


def _check_flip(flip: bool, direction: Optional[str], image: str) -> None:
    if flip and direction != 'horizontal':
        raise ValueError(f'flip_direction: the image {image} was flipped {direction!r}; token labels follow '
                         "horizontal flips only (RandomFlip(direction='horizontal'))")


@TRANSFORMS.register_module()
class PackTokenLabelInputs(PackInputs):
    """``PackInputs`` that also packs :data:`TOKEN_LABEL_KEYS` into the data sample (the map row and the
    crop box; ``flip`` and ``flip_direction`` are default meta keys), after checking that they are
    there and that the image was flipped horizontally if at all. Args: as ``PackInputs``."""

    def __init__(self, input_key: str = 'img', algorithm_keys: Sequence[str] = (),
                 meta_keys: Sequence[str] = PackInputs.DEFAULT_META_KEYS):
        missing = {'flip', 'flip_direction'} - set(meta_keys)
        if missing:
            raise ValueError(f'meta_keys: token labeling needs {sorted(missing)} in the data samples')
        keys = tuple(TOKEN_LABEL_KEYS) + tuple(k for k in algorithm_keys if k not in TOKEN_LABEL_KEYS)
        super().__init__(input_key=input_key, algorithm_keys=keys, meta_keys=meta_keys)

    def transform(self, results: dict) -> dict:
        image = _image_name(results)
        if 'token_label_values' not in results or 'token_label_indices' not in results:
            raise KeyError(f'results: no token-label map for image {image}; put LoadTokenLabelMap in the pipeline')
        if 'crop_box' not in results:
            raise KeyError(f'results: no crop box for image {image}; crop it with TokenLabelRandomResizedCrop '
                           '(the first geometric transform)')
        _check_flip(bool(results.get('flip', False)), results.get('flip_direction'), image)
        return super().transform(results)


# ----------------------------------------------------------------------------------------------
# Data: the batch's maps
# ----------------------------------------------------------------------------------------------

class TokenLabelBatch(NamedTuple):
    """The map rows of a batch on one device: ``values (B, k, h, w)`` float16, ``indices (B, k, h, w)``
    int64, ``boxes (B, 4)`` normalised crops, ``flips (B,)`` bool."""
    values: torch.Tensor
    indices: torch.Tensor
    boxes: torch.Tensor
    flips: torch.Tensor


def token_label_batch(data_samples: Sequence[DataSample], num_classes: int, device=None) -> TokenLabelBatch:
    """Stack the samples' packed map rows, crops and flips (see :class:`PackTokenLabelInputs`); refuse
    samples without them, vertical flips and class indices outside ``[0, num_classes)``."""
    missing = [s.metainfo.get('img_path', f'sample {i}') for i, s in enumerate(data_samples)
               if not all(k in s for k in TOKEN_LABEL_KEYS)]
    if missing:
        raise ValueError(f'data_samples: no token-label map or crop box for {len(missing)} of {len(data_samples)} '
                         f'images (first: {missing[0]!r}); the train pipeline needs LoadTokenLabelMap, '
                         'TokenLabelRandomResizedCrop and PackTokenLabelInputs')
    for i, s in enumerate(data_samples):
        _check_flip(bool(s.metainfo.get('flip', False)), s.metainfo.get('flip_direction'),
                    repr(s.metainfo.get('img_path', f'sample {i}')))
    values = torch.from_numpy(np.stack([np.asarray(s.token_label_values) for s in data_samples]))
    indices = torch.from_numpy(np.stack([np.asarray(s.token_label_indices) for s in data_samples]).astype(np.int64))
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= num_classes):
        raise ValueError(f'token_label_indices: the maps hold class indices in [{int(indices.min())}, '
                         f'{int(indices.max())}], the head has num_classes={num_classes}; was the store made '
                         'for this dataset?')
    boxes = torch.tensor(np.array([np.asarray(s.crop_box, np.float32) for s in data_samples]).reshape(-1, 4))
    check_boxes(boxes)  # on the CPU (no device sync)
    flips = torch.tensor([bool(s.metainfo.get('flip', False)) for s in data_samples])
    return TokenLabelBatch(*(t.to(device, non_blocking=True) for t in (values, indices, boxes, flips)))


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
        label_smoothing: ε of the class and the token targets (``(1 - ε) · p + ε / C``).
        relabel: ReLabel: class target = the annotator's pooled label, no dense term, no aux head.
        head_rule: inference, ``'cls+aux'`` (``cls + 0.5 · max_tokens(aux)``; default with a dense
            term) or ``'cls'`` (default without).
        num_prefix_tokens: leading non-patch tokens of the backbone output (the class token first);
            :class:`TokenLabelingClassifier` sets it from its backbone.
        init_cfg: as timm initialises ViT heads (truncated normal, std 0.02, zero bias).
    """

    def __init__(self, num_classes: int, in_channels: int, dense_weight: Optional[float] = None,
                 cls_target: Optional[str] = None, cls_target_mix: float = 0.5, label_smoothing: float = 0.1,
                 relabel: bool = False, head_rule: Optional[str] = None, num_prefix_tokens: int = 1,
                 init_cfg: Optional[dict] = dict(type='TruncNormal', layer='Linear', std=.02, bias=0.)):
        super().__init__(init_cfg=init_cfg)
        if not isinstance(num_classes, int) or num_classes <= 0:
            raise ValueError(f'num_classes: expected a positive int, got {num_classes!r}')
        if relabel and dense_weight:
            raise ValueError(f'dense_weight: ReLabel (relabel=True) has no dense term, got {dense_weight}')
        if relabel and cls_target not in (None, 'annotator'):
            raise ValueError(f"cls_target: ReLabel's class target is the annotator's, got {cls_target!r}")
        dense_weight = (0. if relabel else 0.5) if dense_weight is None else float(dense_weight)
        cls_target = ('annotator' if relabel else 'gt') if cls_target is None else cls_target
        head_rule = ('cls+aux' if dense_weight else 'cls') if head_rule is None else head_rule
        if dense_weight < 0:
            raise ValueError(f'dense_weight: expected >= 0, got {dense_weight}')
        if cls_target not in CLS_TARGETS:
            raise ValueError(f'cls_target: expected one of {CLS_TARGETS}, got {cls_target!r}')
        if not 0. <= cls_target_mix <= 1.:
            raise ValueError(f'cls_target_mix: expected a weight in [0, 1], got {cls_target_mix}')
        if not 0. <= label_smoothing < 1.:
            raise ValueError(f'label_smoothing: expected [0, 1), got {label_smoothing}')
        if head_rule not in HEAD_RULES:
            raise ValueError(f'head_rule: expected one of {HEAD_RULES}, got {head_rule!r}')
        if head_rule == 'cls+aux' and not dense_weight:
            raise ValueError("head_rule: 'cls+aux' reads an aux head that dense_weight=0 never trains; use 'cls'")
        self.num_classes, self.in_channels = num_classes, int(in_channels)
        self.dense_weight, self.cls_target, self.cls_target_mix = dense_weight, cls_target, float(cls_target_mix)
        self.label_smoothing, self.relabel, self.head_rule = float(label_smoothing), bool(relabel), head_rule
        self.num_prefix_tokens = int(num_prefix_tokens)
        self.head = nn.Linear(self.in_channels, num_classes)
        self.aux_head = None if relabel else nn.Linear(self.in_channels, num_classes)

    @property
    def needs_maps(self) -> bool:
        """Whether the loss reads the label maps (dense term or an annotator class target)."""
        return bool(self.dense_weight) or self.cls_target != 'gt'

    def tokens(self, feats: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The backbone's last output: ``(B, prefix + N, D)`` tokens."""
        x = feats[-1] if isinstance(feats, (tuple, list)) else feats
        if not torch.is_tensor(x) or x.dim() != 3 or x.shape[1] <= self.num_prefix_tokens or \
                x.shape[-1] != self.in_channels:
            raise ValueError(f'feats: expected (B, {self.num_prefix_tokens} + N, {self.in_channels}) tokens (class '
                             f'token first; mmpretrain VisionTransformer with out_type=\'raw\'), got '
                             f'{tuple(x.shape) if torch.is_tensor(x) else type(x).__name__}')
        return x

    def pre_logits(self, feats: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The class token ``(B, D)``."""
        return self.tokens(feats)[:, 0]

    def logits(self, feats: Tuple[torch.Tensor, ...], mix: Optional[Mix] = None
               ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Class logits ``(B, C)`` and per-token logits ``(B, N, C)`` (``None`` without aux head),
        un-mixed when the tokens were mixed by ``mix``."""
        x = self.tokens(feats)
        cls = self.head(x[:, 0])
        if self.aux_head is None:
            return cls, None
        aux = self.aux_head(x[:, self.num_prefix_tokens:])
        return cls, (aux if mix is None else unmix_tokens(aux, mix))

    def forward(self, feats: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Inference logits: ``cls + 0.5 · max_tokens(aux)`` or ``cls`` (``head_rule``)."""
        cls, aux = self.logits(feats)
        if self.head_rule == 'cls+aux' and aux is not None:
            return cls + AUX_WEIGHT * aux.max(1).values
        return cls

    def targets(self, data_samples: Sequence[DataSample], mix: Optional[Mix], grid: Tuple[int, int],
                device=None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(class target (B, C), per-token targets or None)``, every row summing to 1 (the token targets as
        :class:`~shared_core.label_maps.SparseTokenTargets`; ``.dense()`` gives ``(B, N, C)``)."""
        C, eps = self.num_classes, self.label_smoothing
        labels = torch.cat([s.gt_label for s in data_samples]).to(device)
        if labels.numel() != len(data_samples):
            raise ValueError('data_samples: token labeling needs exactly one gt_label per sample')
        check_labels(labels, C, 'gt_label')
        maps = token_label_batch(data_samples, C, device) if self.needs_maps else None
        annotator = None
        if self.cls_target != 'gt':  # ReLabel: the map's mean over the crop
            annotator = crop_targets(maps.values, maps.indices, C, maps.boxes, eps)
        y_cls = class_target(one_hot(labels, C, eps), annotator, self.cls_target, self.cls_target_mix)
        y_cls = mix_class_target(y_cls, mix)  # Eq. 7
        dense = None
        if self.dense_weight:  # sparse per-token targets (.dense(): (B, N, C), row-major tokens)
            dense = token_targets_sparse(maps.values, maps.indices, C, maps.boxes, maps.flips, grid, eps)
        return y_cls, dense

    def loss(self, feats: Tuple[torch.Tensor, ...], data_samples: Sequence[DataSample], mix: Optional[Mix] = None,
             grid: Optional[Tuple[int, int]] = None) -> dict:
        """``loss_cls = H(cls, ŷ^cls)`` (Eq. 1, 7) and ``loss_token = β · mean_i H(aux_i, y^i)`` (Eq. 2-4);
        their sum is :func:`shared_core.token_labeling.token_labeling_loss`. ``grid``: the token grid
        ``(gh, gw)`` (default: square)."""
        cls, aux = self.logits(feats, mix)
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

    def predict(self, feats: Tuple[torch.Tensor, ...], data_samples: Optional[List[Optional[DataSample]]] = None
                ) -> List[DataSample]:
        """Softmax of the inference logits as ``pred_score``, their argmax as ``pred_label``."""
        scores = self(feats).softmax(dim=1)
        labels = scores.argmax(dim=1, keepdim=True).detach()
        samples = data_samples if data_samples is not None else [None] * len(scores)
        return [(s if s is not None else DataSample()).set_pred_score(p).set_pred_label(y)
                for s, p, y in zip(samples, scores, labels)]


# ----------------------------------------------------------------------------------------------
# Classifier
# ----------------------------------------------------------------------------------------------

def backbone_tokens(backbone: nn.Module) -> Tuple[nn.Module, int]:
    """``(patch embedding, number of prefix tokens)`` of a supported backbone whose output is every token."""
    if isinstance(backbone, VisionTransformer):
        if backbone.out_type != 'raw':
            raise ValueError(f"backbone: token labeling reads every output token; set out_type='raw' on "
                             f"mmpretrain's VisionTransformer (got {backbone.out_type!r})")
        if not backbone.with_cls_token:
            raise ValueError('backbone: token labeling needs a class token (with_cls_token=True)')
        if max(backbone.out_indices) != backbone.num_layers - 1:
            raise ValueError(f'backbone: token labeling reads the last layer (out_indices containing '
                             f'{backbone.num_layers - 1}), got {backbone.out_indices}')
        return backbone.patch_embed, int(backbone.num_extra_tokens)
    if isinstance(backbone, TIMMBackbone):
        model = backbone.timm_model
        for name in ('patch_embed', 'num_prefix_tokens', 'forward_features'):
            if not hasattr(model, name):
                raise ValueError(f'backbone: token labeling needs a timm ViT (no features_only) with {name!r}; '
                                 f'{type(model).__name__} has none')
        if not getattr(model, 'has_class_token', False) or model.num_prefix_tokens < 1:
            raise ValueError(f'backbone: token labeling needs a class token; {type(model).__name__} has none')
        return model.patch_embed, int(model.num_prefix_tokens)
    raise ValueError(f'backbone: token labeling supports mmpretrain.models.VisionTransformer (out_type=\'raw\') and '
                     f'TIMMBackbone around a timm ViT; got {type(backbone).__module__}.{type(backbone).__name__}')


def token_stride(patch_embed: nn.Module) -> Tuple[int, int]:
    """Pixels per token along (h, w): LV-ViT's ``token_stride``, timm's ``patch_size``, mm's conv stride."""
    s = getattr(patch_embed, 'token_stride', None) or getattr(patch_embed, 'patch_size', None)
    if s is None and hasattr(patch_embed, 'projection'):  # mmcv PatchEmbed (its corner padding adds nothing
        s = patch_embed.projection.stride                   # to an image of whole tokens)
    if s is None:
        raise ValueError(f'backbone: {type(patch_embed).__name__} has no token_stride/patch_size/projection stride')
    return to_2tuple(tuple(s) if isinstance(s, (tuple, list)) else int(s), 'patch size')


def _mix_patch_tokens(out, mix: Mix):
    """Eq. 5 on a patch embedding's output: mm's ``(tokens (B, N, D), hw_shape)``, timm's ``(B, N, D)``
    or ``(B, gh, gw, D)``."""
    if isinstance(out, tuple):
        return (mix_tokens(out[0], mix),) + tuple(out[1:])
    if out.dim() == 4:
        B, gh, gw, D = out.shape
        return mix_tokens(out.reshape(B, gh * gw, D), mix).view(B, gh, gw, D)
    return mix_tokens(out, mix)


@MODELS.register_module()
class TokenLabelingClassifier(ImageClassifier):
    """``ImageClassifier`` trained by token labeling with MixToken (module docstring).

    Args:
        mix_token: MixToken on (Eq. 5-7).
        mix_beta: λ ~ Beta(β, β) of the box (1.0, as CutMix).
        mix_prob: probability of mixing a batch.
        mix_mode: ``'batch'`` (one box per batch, the public code) or ``'pair'`` (one per pair i, B-1-i).
        Other args: as ``ImageClassifier``; ``head`` must be a :class:`TokenLabelingHead`, ``neck`` None,
        and ``train_cfg`` without image batch augments.
    """

    def __init__(self, *args, mix_token: bool = True, mix_beta: float = 1.0, mix_prob: float = 1.0,
                 mix_mode: str = 'batch', **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.head, TokenLabelingHead):
            raise ValueError(f'head: token labeling needs a TokenLabelingHead, got {type(self.head).__name__}')
        if self.neck is not None:
            raise ValueError('neck: token labeling reads the backbone\'s tokens; set neck=None')
        if getattr(self.data_preprocessor, 'batch_augments', None) is not None:
            raise ValueError('train_cfg: image batch augments (MixUp/CutMix) mix pixels that the token labels do '
                             'not follow; MixToken is in the model; remove train_cfg.augments')
        if mix_mode not in ('batch', 'pair'):
            raise ValueError(f"mix_mode: MixToken un-mixes pairwise swaps, expected 'batch' or 'pair', "
                             f"got {mix_mode!r}")
        if mix_token and not mix_beta > 0:
            raise ValueError(f'mix_beta: expected > 0, got {mix_beta}')
        patch_embed, self.head.num_prefix_tokens = backbone_tokens(self.backbone)
        self.token_stride = token_stride(patch_embed)
        self.sampler = MixSampler('token_box', mixup_alpha=0., cutmix_alpha=mix_beta, prob=mix_prob, mode=mix_mode,
                                  patch_size=self.token_stride) if mix_token else None
        self.generator: Optional[torch.Generator] = None  # MixToken's RNG (None: torch's default)

    def token_grid(self, inputs: torch.Tensor) -> Tuple[int, int]:
        """The token grid of a batch of images (their size must be a whole number of tokens)."""
        H, W = inputs.shape[-2:]
        check_image_size((H, W), self.token_stride, 'inputs')
        return H // self.token_stride[0], W // self.token_stride[1]

    def sample_mix(self, inputs: torch.Tensor) -> Optional[Mix]:
        """The batch's MixToken box, ``None`` when MixToken is off or this batch is not mixed."""
        if self.sampler is None or not self.sampler.mix_prob:
            return None
        check_pairwise_batch(inputs.shape[0], 'inputs')
        mix = self.sampler.sample(inputs.shape[0], tuple(inputs.shape[-2:]), generator=self.generator)
        if not bool((mix.lam < 1).any()):  # the mix is on the CPU: no device sync
            return None
        check_pairwise_swap(mix)  # here, on the CPU; unmix_tokens does not repeat it on the device
        return mix.pin_memory().to(inputs.device, non_blocking=True) if inputs.is_cuda else mix.to(inputs.device)

    def extract_feat_mixed(self, inputs: torch.Tensor):
        """``(feats, mix or None, grid)``: the backbone run with the patch tokens mixed by MixToken."""
        grid = self.token_grid(inputs)
        mix = self.sample_mix(inputs)
        if mix is None:
            return self.extract_feat(inputs), None, grid
        patch_embed = backbone_tokens(self.backbone)[0]  # not kept as an attribute: it would register twice
        handle = patch_embed.register_forward_hook(lambda m, i, out: _mix_patch_tokens(out, mix))
        try:
            feats = self.extract_feat(inputs)
        finally:
            handle.remove()
        return feats, mix, grid

    def loss(self, inputs: torch.Tensor, data_samples: List[DataSample]) -> dict:
        feats, mix, grid = self.extract_feat_mixed(inputs)
        return self.head.loss(feats, data_samples, mix=mix, grid=grid)
