"""What the wheel ships and how a user without a checkout gets at the configs (``tokenaug-config``), in
this environment (``tests/end_to_end/test_wheel.py`` does the same from a wheel in a fresh virtual environment)."""

from pathlib import Path

import pytest
import tomllib
from setuptools import find_packages

from shared_core.configs import (
    ConfigNotFoundError,
    config_closure,
    config_path,
    config_root,
    copy_config,
    list_configs,
)
from shared_core.tools.configs_cli import main

REPO = Path(__file__).resolve().parents[2]


def test_the_package_list_holds_every_package_and_the_configs():
    meta = tomllib.loads((REPO / 'pyproject.toml').read_text())['tool']['setuptools']
    found = find_packages(str(REPO), include=['tokenaug*', 'shared_core*', 'timm_plugin*', 'mm_plugin*'])
    assert sorted(meta['packages']) == sorted(found + ['tokenaug_configs'])
    assert meta['package-dir'] == {'tokenaug_configs': 'configs'}


def test_every_config_is_listed_and_found():
    root = config_root()
    on_disk = sorted(
        p.relative_to(REPO / 'configs').as_posix()
        for p in (REPO / 'configs').rglob('*')
        if p.suffix in ('.py', '.yaml') and p.name != '__init__.py' and '_base_' not in p.parts
    )
    assert list_configs() == on_disk and len(on_disk) >= 40
    for name in on_disk:
        assert config_path(name) == (root / name).resolve()
        assert config_path('tokenaug::' + name) == (root / name).resolve()
    assert config_path('world_vit-tiny.yaml') == (root / 'timm' / 'world_vit-tiny.yaml').resolve()


def test_bad_names_are_refused_with_what_exists():
    with pytest.raises(ConfigNotFoundError, match='tokenaug-config list'):
        config_path('mmpretrain/deit-tiny_world_tl-algn.py')
    with pytest.raises(ConfigNotFoundError):
        config_path('../pyproject.toml')  # outside the config folder
    with pytest.raises(ValueError, match='config name'):
        config_path('')


def test_copy_brings_the_base_chain_and_a_user_config_inherits_it(tmp_path):
    """The copied tree loads as the installed one does; the user's config inherits it by a relative path,
    MMEngine's supported way."""
    from mmengine.config import Config

    name = 'mmpretrain/deit-tiny_world_token-labeling.py'  # _base_ -> _base_/..._label-maps.py -> world_deit-tiny.py
    chain = config_closure(name)
    assert len(chain) == 3 and chain[0] == config_path(name)
    copied = copy_config(name, tmp_path / 'configs')
    assert copied == tmp_path / 'configs' / name
    for src in chain:
        assert (tmp_path / 'configs' / src.relative_to(config_root())).read_bytes() == src.read_bytes()
    mine = tmp_path / 'my_token_labeling.py'
    mine.write_text(f"_base_ = ['./configs/{name}']\ntrain_cfg = dict(max_epochs=1)\n")
    cfg, ref = Config.fromfile(str(mine)), Config.fromfile(str(config_path(name)))
    assert cfg.train_cfg.max_epochs == 1 and cfg.model == ref.model and cfg.train_dataloader == ref.train_dataloader
    # again: identical files are fine; a changed one is refused (nothing copied) unless forced
    copy_config(name, tmp_path / 'configs')
    copied.write_text(copied.read_text() + '\n# edited\n')
    with pytest.raises(FileExistsError, match='--force'):
        copy_config(name, tmp_path / 'configs')
    copy_config(name, tmp_path / 'configs', force=True)
    assert copied.read_bytes() == chain[0].read_bytes()


def test_cli(tmp_path, capsys):
    assert main(['list', '--kind', 'timm']) == 0
    listed = capsys.readouterr().out.split()
    assert 'timm/world_vit-tiny.yaml' in listed and all(n.startswith('timm/') for n in listed)
    assert main(['path', 'timm/world_vit-tiny.yaml']) == 0
    assert Path(capsys.readouterr().out.strip()) == config_path('timm/world_vit-tiny.yaml')
    assert main(['copy', 'mmseg/upernet_vit-tiny_world.py', str(tmp_path)]) == 0
    assert (tmp_path / 'mmseg' / '_base_' / 'world_ade20k.py').is_file()
    assert main(['path', 'nope.py']) == 2
    assert 'not a tokenaug config' in capsys.readouterr().err


def test_tokenaug_train_reads_an_installed_timm_config():
    from tokenaug.train_args import parse_args

    args = parse_args(['-c', 'tokenaug::timm/world_vit-tiny.yaml', '--data-dir', '/x'])
    assert args.config == str(config_path('timm/world_vit-tiny.yaml'))
    assert args.model == 'vit_tiny_patch16_224' and args.opt == 'adamw'


def test_every_registered_class_documents_its_arguments():
    """As mmpretrain documents its registered classes: an ``Args:`` section on each class we register with an
    OpenMMLab registry (augments, transforms, hooks, models), so the docs and ``help()`` show a config's keys."""
    import ast

    missing = []
    for path in sorted((REPO / 'mm_plugin').glob('*.py')):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any('register_module' in ast.unparse(d) for d in node.decorator_list):
                if 'Args:' not in (ast.get_docstring(node) or ''):
                    missing.append(f'{path.name}:{node.name}')
    assert not missing, missing


def test_the_long_description_has_no_relative_links():
    """A package index shows the long description without the repository's files: no image or link that points
    at a path in the tree."""
    import re

    readme = re.search(r'^readme = "([^"]+)"', (REPO / 'pyproject.toml').read_text(), re.M).group(1)
    text = (REPO / readme).read_text()
    targets = re.findall(r'\]\(([^)]+)\)', text)
    assert all(t.startswith(('https://', 'http://')) for t in targets), targets
