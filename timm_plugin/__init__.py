"""tokenaug's timm adapters: timm-Mixup-compatible mixers and collators, the training entry."""
from .mixup import MIXUP_TYPES, FastCollateTokenMixup, MixTarget, TokenMixer, create_mixer

__all__ = ['MIXUP_TYPES', 'FastCollateTokenMixup', 'MixTarget', 'TokenMixer', 'create_mixer']
