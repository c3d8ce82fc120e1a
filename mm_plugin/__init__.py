"""tokenaug's OpenMMLab adapters. ``import mm_plugin`` (or ``custom_imports=dict(imports=['mm_plugin'])``)
registers our modules in mmpretrain's registries and the LV-ViT backbone (``type='LVViT'``) in mmseg's, and
allows MMEngine's own checkpoint types under ``torch.load(weights_only=True)`` (see :mod:`mm_plugin.checkpoint`)."""
from .checkpoint import allow_mmengine_checkpoints
from .batch_augments import MixBatchAugment, TACutMix, TAMixToken, TAMixup, TATokenMix
from .data_preprocessor import TokenAugDataPreprocessor, mix_from_samples
from .tl_align import TLAlignClassifier
from .token_labeling import TokenLabelingClassifier, TokenLabelingHead
from .lvvit import LVViT

allow_mmengine_checkpoints()

__all__ = ['MixBatchAugment', 'TACutMix', 'TAMixToken', 'TAMixup', 'TATokenMix', 'TokenAugDataPreprocessor',
           'mix_from_samples', 'allow_mmengine_checkpoints', 'TLAlignClassifier', 'TokenLabelingClassifier',
           'TokenLabelingHead', 'LVViT']
