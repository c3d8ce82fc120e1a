"""tokenaug's timm adapters: timm-Mixup-compatible mixers and collators, TL-Align, the training entry."""
from .mixup import METHOD_TYPES, MIXUP_TYPES, FastCollateTokenMixup, MixTarget, TokenMixer, create_mixer
from .tl_align import TLAlign, TransMix

__all__ = ['METHOD_TYPES', 'MIXUP_TYPES', 'FastCollateTokenMixup', 'MixTarget', 'TokenMixer', 'create_mixer',
           'TLAlign', 'TransMix']
