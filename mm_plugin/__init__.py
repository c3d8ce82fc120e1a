"""tokenaug's OpenMMLab adapters. ``import mm_plugin`` (or ``custom_imports=dict(imports=['mm_plugin'])``)
registers our modules in the registries of the OpenMMLab packages that are installed, and nothing else happens
on import:

- always (MMEngine only): the hook :class:`BackboneCheckpointCheck` (strict backbone loading for our mmseg /
  mmdet configs) and :func:`allow_mmengine_checkpoints`;
- with mmseg: the LV-ViT backbone (``type='LVViT'``) and ``PretrainedEncoderDecoder`` (our mmseg configs' model: it
  takes mmseg's ``model.pretrained=PATH`` route too);
- with mmpretrain: the batch augments, data preprocessor, classifiers, heads and token-label transforms.

So a segmentation or detection user needs neither mmpretrain nor (for detection) mmseg. MMEngine's checkpoints
under ``torch.load(weights_only=True)`` are an explicit call, :func:`allow_mmengine_checkpoints` (configs:
``custom_imports`` of :mod:`mm_plugin.enable_safe_load`).

``TA*`` = *token-aware*: the batch augments whose mix (partner, λ, per-token shares) stays known.
"""

import importlib.util

from shared_core import __version__  # noqa: F401  (the distribution's version)

from .backbone_check import BackboneCheckpointCheck
from .mmengine_safe_load import allow_mmengine_checkpoints


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a blocked module (sys.modules[name] = None)
        return False


HAS_MMSEG = _installed('mmseg')
HAS_MMPRETRAIN = _installed('mmpretrain')

__all__ = ['__version__', 'BackboneCheckpointCheck', 'allow_mmengine_checkpoints', 'HAS_MMSEG', 'HAS_MMPRETRAIN']

if HAS_MMSEG:
    from .lvvit import LVViT
    from .segmentors import PretrainedEncoderDecoder

    __all__ += ['LVViT', 'PretrainedEncoderDecoder']

if HAS_MMPRETRAIN:
    from .batch_augments import MixBatchAugment, TACutMix, TAMixToken, TAMixup, TATokenMix
    from .data_preprocessor import TokenAugDataPreprocessor, mix_from_samples
    from .tl_align import TLAlignClassifier, TransMixClassifier
    from .token_label_transforms import (
        LoadTokenLabelMap,
        PackTokenLabelInputs,
        TokenLabelRandAugment,
        TokenLabelRandomResizedCrop,
    )
    from .token_labeling import TokenLabelingClassifier, TokenLabelingHead
    from .tokenmixup import TokenMixupClassifier

    __all__ += [
        'MixBatchAugment',
        'TACutMix',
        'TAMixToken',
        'TAMixup',
        'TATokenMix',
        'TokenAugDataPreprocessor',
        'mix_from_samples',
        'LoadTokenLabelMap',
        'PackTokenLabelInputs',
        'TokenLabelRandAugment',
        'TokenLabelRandomResizedCrop',
        'TLAlignClassifier',
        'TransMixClassifier',
        'TokenLabelingClassifier',
        'TokenLabelingHead',
        'TokenMixupClassifier',
    ]
