"""tokenaug's timm adapters: timm-``Mixup``-compatible mixers and collators, the methods as model wrappers and
as ``timm.task`` training tasks, LV-ViT, the training entry and the CLI tools.

``import timm_plugin`` registers the LV-ViT models (``lvvit_t/s/m/l``) and CCT (``cct_7_3x1_32[_sine]``) with
timm and nothing else happens on
import (timm's Posterize fix is the explicit :func:`fix_posterize`). The other names load on first use.
"""

from importlib import import_module

from shared_core import __version__  # noqa: F401  (the distribution's version)

from . import cct, lvvit  # noqa: F401  (register cct_* and lvvit_* with timm)
from .lvvit import LVViT

#: public name -> module that defines it (loaded on first access)
_LAZY = {
    'MixTarget': 'carrier',
    'CarrierTensor': 'carrier',
    'TokenAwareMixup': 'mixup',
    'FastCollateTokenMixup': 'mixup',
    'create_mixer': 'mixup',
    'MIX_KINDS': 'mixup',
    'TARGET_METHODS': 'mixup',
    'TLAlign': 'tl_align',
    'TransMix': 'tl_align',
    'TokenLabeling': 'token_labeling',
    'TokenLabelingLoss': 'token_labeling',
    'attach_aux_head': 'token_labeling',
    'token_stride': 'token_grid',
    'TokenLabelTarget': 'token_label_data',
    'TokenLabelDataset': 'token_label_data',
    'TokenLabelCollate': 'token_label_data',
    'TLAlignTask': 'tasks',
    'TransMixTask': 'tasks',
    'TokenLabelingTask': 'tasks',
    'fix_posterize': 'timm_fixes',
    'TokenMixup': 'tokenmixup',
    'TokenMixupTarget': 'tokenmixup',
    'TokenMixupTask': 'tasks',
    'CCT': 'cct',
}

__all__ = ['__version__', 'LVViT'] + sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(f'.{_LAZY[name]}', __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
