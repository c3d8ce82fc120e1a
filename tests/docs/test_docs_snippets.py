"""Every Python and shell snippet of the documentation is run, or says who runs it, or why it is not run
(``tests/snippets.py`` has the marks). The ``run`` snippets run here, page by page in the page's order, as a reader
would type them: shell snippets in bash (stopping at the first failure) with the venv's console scripts on PATH, in
one working folder per page that holds a small synthetic world in ``data/world``; Python snippets in one namespace
per page, in that folder."""

from __future__ import annotations

import os
import shutil
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from shared_core.tools.world import generate_world

from ..helpers import run_tool
from ..snippets import REPO, all_snippets

#: the docs lane (make test-docs); make test runs every lane
pytestmark = pytest.mark.docs

VENV_BIN = Path(sys.executable).parent
SNIPPETS = all_snippets()
BY_PAGE = defaultdict(list)
for _s in SNIPPETS:
    if _s.kind[0] in ('run', 'config'):
        BY_PAGE[_s.page].append(_s)


def test_every_snippet_is_marked():
    """Each snippet is run here, run as written by a named test that reads it from its page, or says why not."""
    assert len(SNIPPETS) > 20
    bad = []
    for s in SNIPPETS:
        kind, arg = s.kind
        if kind == 'config' and s.lang != 'python':
            bad.append(f'{s.where}: a config snippet is Python')
        elif kind == 'test' and f"run_by('{arg}')" not in ((REPO / arg).read_text() if (REPO / arg).is_file() else ''):
            bad.append(f'{s.where}: {arg} does not read its snippets (run_by)')
        elif kind == 'not run' and len(arg) < 20:
            bad.append(f'{s.where}: say why it is not run')
        elif kind is None:
            bad.append(f'{s.where}: no mark (<!-- run -->, <!-- run: tests/... -->, <!-- not run: why -->)')
    assert not bad, '\n'.join(bad)


@pytest.fixture(scope='module')
def small_world(tmp_path_factory):
    """The quick start's world: ``tokenaug-data --train-per-class 4 --val-per-class 2``."""
    out = tmp_path_factory.mktemp('docs_world') / 'world'
    generate_world(out, seed=0, train_per_class=4, val_per_class=2)
    return out


def _run_bash(snippet, cwd, env):
    try:
        run_tool(['bash', '-c', 'set -eo pipefail\n' + snippet.code], env, timeout=900, cwd=cwd)
    except AssertionError as exc:
        raise AssertionError(f'{snippet.where}\n{snippet.code}\n{exc}') from None


def _run_python(snippet, namespace):
    try:
        exec(compile(snippet.code, snippet.where, 'exec'), namespace)
    except Exception as exc:
        raise AssertionError(f'{snippet.where}\n{snippet.code}') from exc


def _load_config(snippet, cwd, env):
    from mmengine.config import Config

    rel = snippet.kind[1]
    path = cwd / rel
    if rel.startswith('configs/') and not path.exists():  # one of ours: its bases come along
        run_tool(['tokenaug-config', 'copy', rel.removeprefix('configs/'), 'configs/'], env, cwd=cwd)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(snippet.code)
    cfg = Config.fromfile(str(path))
    assert cfg.model, f'{snippet.where}: the config has no model'


@pytest.mark.slow
@pytest.mark.parametrize('page', sorted(BY_PAGE))
def test_page_snippets_run(page, small_world, tmp_path, monkeypatch):
    work = tmp_path / 'work'
    (work / 'data').mkdir(parents=True)
    shutil.copytree(small_world, work / 'data' / 'world')
    env = dict(os.environ)
    env['PATH'] = f'{VENV_BIN}{os.pathsep}{env.get("PATH", "")}'
    env.pop('PYTHONPATH', None)  # the installed package, as a reader has it
    monkeypatch.chdir(work)
    namespace = {'__name__': '__main__'}
    for snippet in BY_PAGE[page]:
        if snippet.kind[0] == 'config':
            _load_config(snippet, work, env)
        elif snippet.lang == 'bash':
            _run_bash(snippet, work, env)
        else:
            _run_python(snippet, namespace)
