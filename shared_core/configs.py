"""The configs that ship with tokenaug (package ``tokenaug_configs``, the repo's ``configs/``), for users who
installed the wheel and have no checkout; the console commands ``tokenaug-config`` and ``tokenaug-mim`` are
:mod:`shared_core.tools.configs_cli`.

MMEngine resolves ``_base_ = ['pkg::...']`` only for OpenMMLab's own packages (a fixed table in
``mmengine.config.utils``), so a tokenaug config cannot be inherited as ``tokenaug::...``. What MMEngine does
support is a path, so there are two ways:

- ``tokenaug-config copy mmpretrain/deit-tiny_world_tl-align.py configs/`` copies the config with every local
  file of its ``_base_`` chain, keeping their relative layout, into a folder of the user's project; their own
  config then inherits it with a relative ``_base_`` (``mim download --config`` does the same for OpenMMLab
  packages). The copy is theirs to read, pin and edit.
- ``tokenaug-config path mmpretrain/deit-tiny_world_tl-align.py`` prints the installed file's absolute path,
  for ``_base_ = ['/that/path']`` or ``tools/train.py /that/path`` (it follows the installed version).

timm YAML configs are flat (no inheritance): ``tokenaug-train -c tokenaug::timm/world_vit-tiny.yaml`` reads the
installed one, ``tokenaug-config copy timm/world_vit-tiny.yaml .`` copies it.
"""

from __future__ import annotations

import ast
import filecmp
import shutil
from pathlib import Path

#: the prefix that names an installed config where tokenaug reads a config path (``tokenaug-train -c``)
PREFIX = 'tokenaug::'
KINDS = ('mmpretrain', 'mmseg', 'mmdet', 'timm')


class ConfigNotFoundError(FileNotFoundError):
    pass


def config_root() -> Path:
    """The folder of the installed configs (in a checkout: its ``configs/``)."""
    try:
        from importlib.resources import files

        root = Path(str(files('tokenaug_configs')))
    except ModuleNotFoundError:  # a checkout on sys.path without an install
        root = Path(__file__).resolve().parents[1] / 'configs'
    if not (root / 'timm').is_dir():
        raise ConfigNotFoundError(f'tokenaug configs: no configs under {root} (a broken install?)')
    return root


def list_configs(kind: str | None = None, bases: bool = False) -> list[str]:
    """The configs' names (paths relative to :func:`config_root`), e.g. ``mmpretrain/deit-tiny_world_tl-align.py``."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f'kind: expected one of {KINDS}, got {kind!r}')
    root = config_root()
    out = []
    for path in sorted(root.rglob('*')):
        rel = path.relative_to(root)
        if path.suffix not in ('.py', '.yaml') or path.name == '__init__.py' or rel.parts[0] not in KINDS:
            continue
        if (kind is None or rel.parts[0] == kind) and (bases or '_base_' not in rel.parts):
            out.append(rel.as_posix())
    return out


def config_path(name: str) -> Path:
    """The installed file of a config: ``mmpretrain/x.py``, ``tokenaug::mmpretrain/x.py`` or a file name that
    only one kind has (``x.py``)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f'config name: expected a name such as "timm/world_vit-tiny.yaml", got {name!r}')
    name = name[len(PREFIX) :] if name.startswith(PREFIX) else name
    root = config_root()
    candidates = [name] if '/' in name else [n for n in list_configs(bases=True) if n.rsplit('/', 1)[-1] == name]
    for rel in candidates:
        path = (root / rel).resolve()
        if root.resolve() in path.parents and path.is_file():
            if len(candidates) > 1:
                raise ValueError(f'config {name!r} is ambiguous: {candidates}; give the folder too')
            return path
    stem = name.rsplit('/', 1)[-1].split('.')[0]
    near = [n for n in list_configs() if stem.split('_')[0] in n][:8]
    hint = f'; close: {near}' if near else ''
    raise ConfigNotFoundError(f'config {name!r}: not a tokenaug config (tokenaug-config list shows them{hint})')


def resolve_config_arg(value: str) -> str:
    """A config argument as a path: ``tokenaug::NAME`` is the installed config, anything else is left as is."""
    return str(config_path(value)) if value.startswith(PREFIX) else value


def local_bases(path: Path) -> list[Path]:
    """The files a config's ``_base_`` names by a relative path (``pkg::`` bases are the packages' own), read
    as MMEngine reads them (the literal of the ``_base_`` assignment)."""
    if path.suffix != '.py':
        return []
    tree = ast.parse(path.read_text(encoding='utf-8'), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id == '_base_':
            value = ast.literal_eval(node.value)
            names = value if isinstance(value, list) else [value]
            return [(path.parent / n).resolve() for n in names if '::' not in n]
    return []


def config_closure(name: str) -> list[Path]:
    """A config and every local file of its ``_base_`` chain (each once, the config first)."""
    todo, seen = [config_path(name)], []
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        if not path.is_file():
            raise ConfigNotFoundError(f'config {name!r}: its _base_ names {path}, which is not installed')
        seen.append(path)
        todo += local_bases(path)
    return seen


def copy_config(name: str, dest: str | Path, force: bool = False) -> Path:
    """Copy a config with its local ``_base_`` files into ``dest``, keeping their layout under the config
    root (``dest/mmpretrain/x.py``, ``dest/mmpretrain/_base_/y.py``); returns the copied config's path.
    A different file already at a target is refused unless ``force`` (nothing is copied then)."""
    root = config_root().resolve()
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise NotADirectoryError(f'dest: {dest} exists and is not a folder')
    files = config_closure(name)
    targets = [(src, dest / src.relative_to(root)) for src in files]
    clash = [str(t) for s, t in targets if t.exists() and not filecmp.cmp(s, t, shallow=False)]
    if clash and not force:
        raise FileExistsError(f'dest: these files exist and differ from the installed ones: {clash} (--force replaces)')
    for src, target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
    return targets[0][1]


#: the OpenMMLab packages whose wheels ship their tools (``<package>/.mim/tools/<tool>.py``), as mim runs them
TOOL_PACKAGES = ('mmpretrain', 'mmseg', 'mmdet')


def upstream_tool(package: str, tool: str) -> Path:
    """``<package>/.mim/tools/<tool>.py`` of the installed package (found without importing it)."""
    import importlib.util

    if package not in TOOL_PACKAGES:
        raise ValueError(f'package: expected one of {TOOL_PACKAGES}, got {package!r}')
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigNotFoundError(f'package: {package} is not installed (pip install "tokenaug[mm]")')
    path = Path(list(spec.submodule_search_locations)[0]) / '.mim' / 'tools' / f'{tool}.py'
    if not path.is_file():
        raise ConfigNotFoundError(f'tool: {package} has no {tool}.py at {path}')
    return path
