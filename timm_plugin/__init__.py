"""tokenaug's timm adapters: timm-Mixup-compatible mixers and collators, TL-Align, the training entry."""
from .mixup import MIXUP_TYPES, FastCollateTokenMixup, MixTarget, TokenMixer, create_mixer
from .tl_align import TLAlign

__all__ = ['MIXUP_TYPES', 'FastCollateTokenMixup', 'MixTarget', 'TokenMixer', 'create_mixer', 'TLAlign']
