"""A ``ClsDataPreprocessor`` that carries the mix to the model.

The stock batch-augment contract ``(inputs, batch_score) -> (inputs, score)`` loses *where* the mix
happened, which token-aware methods need. :class:`TokenAugDataPreprocessor` does what the stock one
does — it *is* the stock one: stack, BGR→RGB, normalise, pad, one-hot scores, and mmpretrain's own
``RandomBatchAugment`` choosing one of ``augments`` by ``probs`` (or none) — with tokenaug's augments
(:mod:`mm_plugin.batch_augments`), which draw a :class:`shared_core.mix.Mix` (from their ``generator``),
apply it to the images and the scores and keep it. The preprocessor then sets on every data sample:

- ``gt_score``: the area target ``λ · y + (1 - λ) · y[partner]`` (sums to 1), as the stock heads expect;
- metainfo ``batch_mix``: the batch's :class:`Mix` (one object shared by the samples) and
  ``mix_index``: the sample's row in it. :func:`mix_from_samples` gets it back.

Training batches that no augment mixed (``probs`` left room for "none") get the identity mix, so a
token-aware head needs no special case; evaluation batches (``training=False``) carry no mix.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from mmengine.logging import MMLogger
from mmpretrain.models.utils.data_preprocessor import ClsDataPreprocessor
from mmpretrain.registry import MODELS

from shared_core.mix import Mix, check_labels, identity_mix, to_2tuple
from shared_core.tokenmix import activation_target

from .batch_augments import MixBatchAugment
from .token_label_transforms import token_label_batch

__all__ = ['TokenAugDataPreprocessor', 'mix_from_samples']


@MODELS.register_module()
class TokenAugDataPreprocessor(ClsDataPreprocessor):
    """``ClsDataPreprocessor`` whose batch augments (tokenaug's token-aware ``TA*`` augments) carry the mix.

    Args:
        patch_size: the backbone's patch size, the one place a config sets it: the augments take it
            (an augment that names another one is an error), and unmixed batches get an identity mix
            on this grid.
        generator: a ``torch.Generator`` for the augments' λ, boxes and masks (default: torch's global RNG;
            the choice among augments is mmpretrain's ``RandomBatchAugment``, on numpy's RNG, which MMEngine's
            ``randomness`` seeds).

    The other arguments: as :class:`mmpretrain.models.ClsDataPreprocessor`; ``num_classes`` is required
    when ``batch_augments`` is set.
    """

    def __init__(self, *args, patch_size=16, generator: Optional[torch.Generator] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.patch_size = to_2tuple(patch_size, 'patch_size')
        if self.batch_augments is None:
            return
        if not self.num_classes:
            raise ValueError('num_classes: TokenAugDataPreprocessor needs num_classes with batch_augments')
        augments = [a for a in self.batch_augments.augments if a is not None]
        bad = [type(a).__name__ for a in augments if not isinstance(a, MixBatchAugment)]
        if bad:
            raise ValueError(
                f"batch_augments: {bad} cannot describe their mix; use tokenaug's TAMixup, "
                f'TACutMix, TAMixToken or TATokenMix (or the stock ClsDataPreprocessor)'
            )
        for a in augments:
            if a.patch_size_given and a.sampler.patch_size != self.patch_size:
                raise ValueError(
                    f'patch_size: {type(a).__name__} names {a.sampler.patch_size}, the data '
                    f'preprocessor {self.patch_size}; set it once, on the data preprocessor'
                )
            a.sampler.patch_size = self.patch_size
            a.generator = generator
        kinds = [f'{type(a).__name__}({a.sampler.mix_kind})' for a in augments]
        MMLogger.get_current_instance().info(
            f'TokenAugDataPreprocessor: mixes with {kinds} '
            f'(probs {self.batch_augments.probs}), patch size {self.patch_size}; the mix goes on the data samples'
        )

    def forward(self, data: dict, training: bool = False) -> dict:
        if not training or self.batch_augments is None:
            return super().forward(data, training)
        samples = data.get('data_samples')
        if samples and 'gt_label' in samples[0]:  # on the CPU, before the one-hot scores are made
            labels = torch.cat([torch.as_tensor(s.gt_label).view(-1) for s in samples])
            if labels.numel() != len(samples):
                raise ValueError('data_samples: token-aware mixing needs exactly one gt_label per sample')
            check_labels(labels, self.num_classes, 'gt_label')
        augments = [a for a in self.batch_augments.augments if a is not None]
        for a in augments:
            a.last_mix = None
        # the stock pipeline: stack, BGR->RGB, normalise, one-hot scores, then mmpretrain's own RandomBatchAugment
        # picks one augment by ``probs`` (or none) and calls it: ours mix images and scores and keep their mix
        out = super().forward(data, training)
        samples = out.get('data_samples')
        if not samples or 'gt_label' not in samples[0]:
            return out
        inputs = out['inputs']
        ran = [a for a in augments if a.last_mix is not None]
        aug = ran[0] if ran else None
        mix = aug.last_mix if aug is not None else identity_mix(len(samples), tuple(inputs.shape[-2:]), self.patch_size)
        mix = mix.to(inputs.device, non_blocking=True)
        if aug is not None and aug.activation_targets:  # TokenMix: targets from the teacher's maps (Eq. 2)
            labels = torch.cat([s.gt_label for s in samples]).to(inputs.device)
            maps = token_label_batch(samples, self.num_classes, inputs.device)
            scores = activation_target(labels, mix, maps, 0.0, aug.activation_targets)
            for sample, score in zip(samples, scores):
                sample.set_gt_score(score)
        for i, sample in enumerate(samples):
            # set_field, not set_metainfo: the latter deep-copies, and every sample must share one Mix
            sample.set_field(mix, 'batch_mix', field_type='metainfo')
            sample.set_field(i, 'mix_index', field_type='metainfo')
        return out


def mix_from_samples(data_samples: List) -> Optional[Mix]:
    """The batch's :class:`Mix` set by :class:`TokenAugDataPreprocessor` (``None`` if there is none).
    The samples must be the whole batch in its order (copies of the samples are fine)."""
    if not data_samples or 'batch_mix' not in data_samples[0].metainfo_keys():
        return None
    mix = data_samples[0].batch_mix
    if [s.mix_index for s in data_samples] != list(range(mix.batch_size)):
        raise ValueError('data_samples: must be the whole mixed batch, in the order it was mixed')
    return mix
