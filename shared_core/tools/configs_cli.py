"""The console commands over the installed configs: ``tokenaug-config`` (list, path, copy; :mod:`shared_core.configs`)
and ``tokenaug-mim`` (an OpenMMLab package's own ``tools/train.py`` / ``test.py``, as ``mim train`` / ``mim test``)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from ..configs import KINDS, TOOL_PACKAGES, config_path, copy_config, list_configs, upstream_tool

__all__ = ['main', 'mim_main']


def mim_main(argv=None) -> int:
    """``tokenaug-mim {train,test} PACKAGE CONFIG [ARGS...]``: what ``mim train/test PACKAGE CONFIG`` does, run the
    upstream tool that the package's wheel ships, with ``CONFIG`` a file or one of our installed configs
    (``mmpretrain/deit-tiny_world_tl-align.py``). openmim itself does not install beside these pins without
    downgrades (docs: the MMPretrain guide)."""
    p = argparse.ArgumentParser(
        prog='tokenaug-mim',
        description="run an OpenMMLab package's own tools/train.py or test.py (as mim train / mim test)",
    )
    p.add_argument('tool', choices=('train', 'test'))
    p.add_argument('package', choices=TOOL_PACKAGES)
    p.add_argument('config', help='a config file, or an installed tokenaug config name (tokenaug-config list)')
    p.add_argument('args', nargs=argparse.REMAINDER, help="the tool's own arguments (--work-dir, --cfg-options, ...)")
    a = p.parse_args(argv)
    try:
        tool = upstream_tool(a.package, a.tool)
        config = a.config if Path(a.config).is_file() else str(config_path(a.config))
    except (ValueError, OSError) as e:
        print(f'tokenaug-mim: error: {e}', file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(tool), config, *a.args])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog='tokenaug-config',
        description="tokenaug's installed configs: list them, print one's path, or copy one with its _base_ files",
    )
    sub = p.add_subparsers(dest='command', required=True)
    s = sub.add_parser('list', help='the config names')
    s.add_argument('--kind', choices=KINDS, help='only this folder')
    s.add_argument('--bases', action='store_true', help='also the _base_ files')
    s = sub.add_parser('path', help="print a config's installed path (for _base_ or tools/train.py)")
    s.add_argument('name', help='e.g. mmpretrain/deit-tiny_world_tl-align.py or timm/world_vit-tiny.yaml')
    s = sub.add_parser('copy', help='copy a config with the local files of its _base_ chain')
    s.add_argument('name')
    s.add_argument('dest', nargs='?', default='.', help='folder to copy into, keeping the kind folders (default: .)')
    s.add_argument('--force', action='store_true', help='replace files that exist and differ')
    a = p.parse_args(argv)
    try:
        if a.command == 'list':
            print('\n'.join(list_configs(a.kind, a.bases)))
        elif a.command == 'path':
            print(config_path(a.name))
        else:
            print(copy_config(a.name, a.dest, a.force))
    except (ValueError, OSError) as e:
        print(f'tokenaug-config: error: {e}', file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
