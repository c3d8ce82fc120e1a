"""The console commands: every console script tokenaug installs is a function of this module. The six that run
the methods answer ``-h`` / ``--help`` from their parsers in this package, with neither torch, timm nor OpenMMLab
imported (a fraction of a second where importing them takes seconds), and otherwise run the module that does the
work:

========================= ==========================================================================
command                   runs the ``main`` of
========================= ==========================================================================
``tokenaug-train``        :mod:`timm_plugin.train`
``tokenaug-maps``         ``info``: :mod:`shared_core.tools.maps_info` (numpy and json only); the other
                          commands: :mod:`timm_plugin.tools.maps_cli`
``tokenaug-occlusion``    :mod:`timm_plugin.tools.occlusion_cli`
``tokenaug-viz``          :mod:`timm_plugin.tools.viz_cli`
``tokenaug-convert``      :mod:`mm_plugin.convert_cli`
``tokenaug-study``        :mod:`timm_plugin.tools.study_cli`
========================= ==========================================================================

The four light ones run their module's own parser (numpy and the standard library only): ``tokenaug-data``
(:mod:`shared_core.tools.world`), ``tokenaug-config`` and ``tokenaug-mim`` (:mod:`shared_core.tools.configs_cli`)
and ``tokenaug-mmcv-wheel`` (:mod:`shared_core.tools.mmcv_wheel`, which also runs as a plain script before
tokenaug is installed).
"""

from __future__ import annotations

import sys
from importlib import import_module
from typing import Callable, Sequence

from .tool_args import (
    VIZ_COMMANDS,
    VIZ_USAGE,
    convert_parser,
    maps_parser,
    occlusion_parser,
    parse_viz,
    study_parser,
)
from .train_args import parse_args

__all__ = ['train', 'maps', 'occlusion', 'viz', 'convert', 'study', 'data', 'config', 'mim', 'mmcv_wheel']

#: the flags that ask for help
HELP_FLAGS = ('-h', '--help')


def _argv(argv: Sequence[str] | None) -> list[str]:
    return list(sys.argv[1:] if argv is None else argv)


def _run(module: str, argv: list[str], function: str = 'main') -> int:
    """``module.function(argv)`` (imported now), as an exit status."""
    return getattr(import_module(module), function)(argv) or 0


def _command(module: str, show_help: Callable[[list[str]], object], doc: str):
    def command(argv: Sequence[str] | None = None) -> int:
        argv = _argv(argv)
        if any(flag in argv for flag in HELP_FLAGS):
            show_help(argv)  # argparse prints the help and exits; a '-h' that is an option's value falls through
        return _run(module, argv)

    command.__doc__ = doc
    return command


train = _command(
    'timm_plugin.train', parse_args, '``tokenaug-train``: timm training with token-aware mixing and targets.'
)
occlusion = _command(
    'timm_plugin.tools.occlusion_cli',
    lambda argv: occlusion_parser().parse_args(argv),
    '``tokenaug-occlusion``: accuracy against the fraction of dropped patches.',
)
study = _command(
    'timm_plugin.tools.study_cli',
    lambda argv: study_parser().parse_args(argv),
    '``tokenaug-study``: paired seeds and intervals of each method against a baseline on any ImageFolder.',
)
convert = _command(
    'mm_plugin.convert_cli',
    lambda argv: convert_parser().parse_args(argv),
    '``tokenaug-convert``: a classification checkpoint to the backbone checkpoint mmseg / mmdet / timm load.',
)


def maps(argv: Sequence[str] | None = None) -> int:
    """``tokenaug-maps``: ``info`` reads a store with numpy and json only; ``generate``, ``import`` and ``merge``
    run the annotation tools."""
    argv = _argv(argv)
    if argv[:1] != ['info'] and not any(flag in argv for flag in HELP_FLAGS):
        return _run('timm_plugin.tools.maps_cli', argv)
    args = maps_parser().parse_args(argv)  # help: printed here, and exits
    if args.command != 'info':
        return _run('timm_plugin.tools.maps_cli', argv)
    from shared_core.map_format import LabelMapError
    from shared_core.tools.maps_info import print_info

    try:
        print_info(args.path, args.json)
    except (LabelMapError, ValueError, FileNotFoundError) as e:
        print(f'tokenaug-maps info: error: {e}', file=sys.stderr)
        return 2
    return 0


def viz(argv: Sequence[str] | None = None) -> int:
    """``tokenaug-viz COMMAND ...``: pictures of what the methods do."""
    argv = _argv(argv)
    if argv[:1] and argv[0] in HELP_FLAGS:
        print(VIZ_USAGE)
        return 0
    if argv[:1] and argv[0] in VIZ_COMMANDS and any(flag in argv[1:] for flag in HELP_FLAGS):
        parse_viz(argv[0], argv[1:])
    return _run('timm_plugin.tools.viz_cli', argv)


def _light(module: str, function: str, doc: str):
    """A light command: ``module.function(argv)`` (its own parser answers ``--help``), as an exit status."""

    def command(argv: Sequence[str] | None = None) -> int:
        return _run(module, _argv(argv), function)

    command.__doc__ = doc
    return command


data = _light(
    'shared_core.tools.world', 'main', '``tokenaug-data``: the synthetic world (classification, ADE20K, COCO).'
)
config = _light('shared_core.tools.configs_cli', 'main', "``tokenaug-config``: tokenaug's installed configs.")
mim = _light(
    'shared_core.tools.configs_cli', 'mim_main', "``tokenaug-mim``: an OpenMMLab package's own train.py / test.py."
)
mmcv_wheel = _light(
    'shared_core.tools.mmcv_wheel', 'main', '``tokenaug-mmcv-wheel``: an mmcv 2.1.0 wheel for this Python.'
)
