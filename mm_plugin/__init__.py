"""tokenaug's OpenMMLab adapters. ``import mm_plugin`` (or ``custom_imports=dict(imports=['mm_plugin'])``)
registers our modules in mmpretrain's registries and the LV-ViT backbone (``type='LVViT'``) in mmseg's; nothing
else happens on import. MMEngine's checkpoints under ``torch.load(weights_only=True)`` are an explicit call,
:func:`allow_mmengine_checkpoints` (configs: ``custom_imports`` of :mod:`mm_plugin.enable_safe_load`).

``TA*`` = *token-aware*: the batch augments whose mix (partner, λ, per-token shares) stays known.
"""

from .backbone_check import BackboneCheckpointCheck
from .batch_augments import MixBatchAugment, TACutMix, TAMixToken, TAMixup, TATokenMix
from .data_preprocessor import TokenAugDataPreprocessor, mix_from_samples
from .lvvit import LVViT
from .mmengine_safe_load import allow_mmengine_checkpoints
from .tl_align import TLAlignClassifier, TransMixClassifier
from .token_label_transforms import (
    LoadTokenLabelMap,
    PackTokenLabelInputs,
    TokenLabelRandAugment,
    TokenLabelRandomResizedCrop,
)
from .token_labeling import TokenLabelingClassifier, TokenLabelingHead
from .tokenmixup import TokenMixupClassifier

__all__ = [
    'BackboneCheckpointCheck',
    'MixBatchAugment',
    'TACutMix',
    'TAMixToken',
    'TAMixup',
    'TATokenMix',
    'TokenAugDataPreprocessor',
    'mix_from_samples',
    'allow_mmengine_checkpoints',
    'LoadTokenLabelMap',
    'PackTokenLabelInputs',
    'TokenLabelRandAugment',
    'TokenLabelRandomResizedCrop',
    'TLAlignClassifier',
    'TransMixClassifier',
    'TokenLabelingClassifier',
    'TokenLabelingHead',
    'TokenMixupClassifier',
    'LVViT',
]
