"""tokenaug: the Python API and the command line.

``import tokenaug`` imports neither torch, timm nor OpenMMLab. The timm side's API is here under its own names,
each imported on first use from :mod:`timm_plugin` (``tokenaug.TLAlign`` is :class:`timm_plugin.TLAlign`,
``tokenaug.create_mixer`` is :func:`timm_plugin.create_mixer`, ...: :data:`API`); the MMPretrain side is
:mod:`mm_plugin`'s registry classes, which configs name (``custom_imports=dict(imports=['mm_plugin'])``).

The console commands are :mod:`tokenaug.commands`, their argument parsers :mod:`tokenaug.train_args` (for
``tokenaug-train``) and :mod:`tokenaug.tool_args` (the tools); building a parser or asking a command for ``--help``
loads neither torch, timm nor OpenMMLab either.
"""

from importlib import import_module

from shared_core import __version__  # (the distribution's version)

#: the names ``tokenaug.X`` gives, each :mod:`timm_plugin`'s (imported on first access)
API = (
    'CCT',
    'CarrierTensor',
    'FastCollateTokenMixup',
    'LVViT',
    'MIX_KINDS',
    'MixTarget',
    'TARGET_METHODS',
    'TLAlign',
    'TLAlignTask',
    'TokenAwareMixup',
    'TokenLabelCollate',
    'TokenLabelDataset',
    'TokenLabelTarget',
    'TokenLabeling',
    'TokenLabelingLoss',
    'TokenLabelingTask',
    'TokenMixup',
    'TokenMixupTarget',
    'TokenMixupTask',
    'TransMix',
    'TransMixTask',
    'attach_aux_head',
    'create_mixer',
    'fix_posterize',
    'token_stride',
)

__all__ = ['__version__', *API]


def __getattr__(name: str):
    if name in API:
        value = getattr(import_module('timm_plugin'), name)
        globals()[name] = value
        return value
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
    return sorted(set(globals()) | set(API))
