"""Every Python and shell snippet of the documentation is run, or says who runs it, or why it is not run
(``tests/snippets.py`` has the marks). The ``run`` snippets run here, page by page in the page's order, as a reader
would type them: shell snippets in bash (stopping at the first failure) with the venv's console scripts on PATH, in
one working folder per page that holds a small synthetic world in ``data/world``; Python snippets in one namespace
per page, in that folder.

Pages repeat a command where a reader starting on that page needs it (``tokenaug-train ... --mixup-type tl_align``
on four pages). A shell snippet whose text and whose folder's content, file by file, equal those of one already run
here is not run again: what that run added or changed is copied into the folder. The commands are deterministic
given their folder (same seeds, same files), so this is what the rerun would write, up to a run folder's time stamp
and the absolute paths some logs record; every distinct snippet in every distinct folder still runs."""

from __future__ import annotations

import hashlib
import json
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


def _files(folder: Path) -> dict[str, str]:
    """Every file under ``folder``: its path relative to it -> the SHA-256 of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob('*'))
        if p.is_file() and not p.is_symlink()
    }


class SnippetMemo:
    """The shell snippets run in this module, by their text and their folder's files before them: the files each
    run added or changed (copies under ``root``) and those it removed."""

    def __init__(self, root: Path):
        self.root, self.runs = root, {}

    @staticmethod
    def key(snippet, before: dict[str, str]) -> str:
        return hashlib.sha256(json.dumps([snippet.code, sorted(before.items())]).encode()).hexdigest()

    def replay(self, key: str, cwd: Path) -> bool:
        """The run of ``key`` written into ``cwd``; ``False`` if there was none."""
        if key not in self.runs:
            return False
        written, removed = self.runs[key]
        for rel in written:
            (cwd / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(self.root / key / rel, cwd / rel)
        for rel in removed:
            (cwd / rel).unlink()
        return True

    def record(self, key: str, cwd: Path, before: dict[str, str]) -> None:
        after = _files(cwd)
        written = [rel for rel, digest in after.items() if before.get(rel) != digest]
        for rel in written:
            (self.root / key / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(cwd / rel, self.root / key / rel)
        self.runs[key] = (written, [rel for rel in before if rel not in after])


@pytest.fixture(scope='module')
def memo(tmp_path_factory):
    return SnippetMemo(tmp_path_factory.mktemp('snippet_runs'))


def _run_bash(snippet, cwd, env, memo):
    before = _files(cwd)
    key = memo.key(snippet, before)
    if memo.replay(key, cwd):
        return
    try:
        run_tool(['bash', '-c', 'set -eo pipefail\n' + snippet.code], env, timeout=900, cwd=cwd)
    except AssertionError as exc:
        raise AssertionError(f'{snippet.where}\n{snippet.code}\n{exc}') from None
    memo.record(key, cwd, before)


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
def test_page_snippets_run(page, small_world, memo, tmp_path, monkeypatch):
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
            _run_bash(snippet, work, env, memo)
        else:
            _run_python(snippet, namespace)
