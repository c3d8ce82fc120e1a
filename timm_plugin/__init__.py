"""tokenaug's timm adapters: timm-Mixup-compatible mixers and collators, TL-Align, the training entry.
``import timm_plugin`` registers the LV-ViT models (``lvvit_t/s/m/l``) with timm."""
from . import compat
from .mixup import METHOD_TYPES, MIXUP_TYPES, FastCollateTokenMixup, MixTarget, TokenMixer, create_mixer
from .tl_align import TLAlign, TransMix
from .lvvit import LVViT

compat.apply()  # timm RandAugment Posterize vs Pillow >= 11 (see timm_plugin.compat)

__all__ = ['METHOD_TYPES', 'MIXUP_TYPES', 'FastCollateTokenMixup', 'MixTarget', 'TokenMixer', 'create_mixer',
           'TLAlign', 'TransMix', 'LVViT']
