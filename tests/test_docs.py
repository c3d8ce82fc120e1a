"""The documentation site (``make docs``, Sphinx): it builds with warnings as errors and every reference resolved
(``-W -n``: a broken link, a reference to a name that does not exist or a malformed docstring fails it), and its
API reference has a page for every public module of the three packages."""

from __future__ import annotations

import importlib
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ('shared_core', 'timm_plugin', 'mm_plugin')


def public_modules() -> list[str]:
    """Every module of the three packages whose path has no private (``_``) part."""
    names = []
    for pkg in PACKAGES:
        names.append(pkg)
        for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + '.'):
            if not any(part.startswith('_') for part in info.name.split('.')[1:]):
                names.append(info.name)
    return names


@pytest.mark.slow
def test_docs_build_with_warnings_as_errors_and_document_every_public_module(tmp_path):
    src = tmp_path / 'docs'
    shutil.copytree(REPO / 'docs', src, ignore=shutil.ignore_patterns('_build', 'generated'))
    out = tmp_path / 'html'
    sphinx = Path(sys.executable).parent / 'sphinx-build'
    res = subprocess.run(
        [str(sphinx), '-W', '-n', '--keep-going', '-q', '-b', 'html', str(src), str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stderr[-6000:]
    assert (out / 'index.html').is_file()
    pages = {p.stem for p in (out / 'api' / 'generated').glob('*.html')}
    missing = [m for m in public_modules() if m not in pages]
    assert not missing, f'public modules without an API page: {missing}'
    # a page documents its module's own names: the recipe's entry point and the core's map batch type
    recipe = (out / 'api' / 'generated' / 'timm_plugin.recipe.html').read_text()
    assert 'id="timm_plugin.recipe.build_training"' in recipe
    maps = (out / 'api' / 'generated' / 'shared_core.label_maps.html').read_text()
    assert 'id="shared_core.label_maps.CropMaps"' in maps
