"""Every Python and shell snippet of the documentation is run, or says who runs it, or why it is not run
(``tests/snippets.py`` has the marks). The ``run`` snippets run here, page by page in the page's order, as a reader
would type them: shell snippets in bash (stopping at the first failure) with the venv's console scripts on PATH, in
one working folder per page that holds a small synthetic world in ``data/world``; Python snippets in one namespace
per page, in that folder.

A shell snippet whose every line is one plain command (its words only: no operator, redirection, expansion,
variable or assignment, no shell builtin) runs line by line, stopping at the first that fails, as bash would run it
under ``set -e``: a ``tokenaug-*`` command by the function its console script calls, in this process (as
``tests/helpers/processes.py::call_main``: 3-5 s of imports less a command; ``end_to_end/test_commands.py`` checks
that the installed scripts are these functions, and the wheel test runs the install page's first run in bash), any other
command (``tokenaug-mim``, which starts mim and the upstream tool) in bash. Any other snippet runs whole in bash.

Pages repeat a command where a reader starting on that page needs it (``tokenaug-train ... --mixup-type tl_align``
on four pages). A command (or a snippet run whole) whose words and whose folder's content, file by file, equal
those of one already run here is not run again: what that run added or changed is copied into the folder. The
commands are deterministic given their folder (same seeds, same files), so this is what the rerun would write, up to
a run folder's time stamp and the absolute paths some logs record; every distinct command in every distinct folder
still runs."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections import defaultdict
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from shared_core.tools.world import generate_world

from ..helpers.processes import call_main, run_tool
from ..snippets import REPO, all_snippets

#: the docs lane (make test-docs); make test runs every lane
pytestmark = pytest.mark.docs

VENV_BIN = Path(sys.executable).parent
SNIPPETS = all_snippets()
BY_PAGE = defaultdict(list)
for _s in SNIPPETS:
    if _s.kind[0] in ('run', 'config'):
        BY_PAGE[_s.page].append(_s)


#: tokenaug's console scripts that a page's command line runs by their function, in this process; tokenaug-mim runs
#: mim, which runs the upstream tool in a process of its own: in bash, as the reader runs it
IN_PROCESS = {
    ep.name: ep
    for ep in entry_points(group='console_scripts')
    if ep.dist is not None and ep.dist.name == 'tokenaug' and ep.name != 'tokenaug-mim'
}
#: what makes a line more than a plain command: bash's operators and redirections, expansions, globs, quoting
SHELL_CHARS = set('|&;<>()$`*?[]{}~!\\\'"')
#: builtins that change the shell's state for the lines after them
BUILTINS = {'cd', 'pushd', 'popd', 'export', 'unset', 'set', 'source', '.', 'alias', 'eval', 'exec', 'declare'}


def plain_commands(code: str) -> list[list[str]] | None:
    """The words of each command of a shell snippet whose every line is one plain command (comments and blank lines
    aside, continued lines joined); ``None`` if any line is more (:data:`SHELL_CHARS`, a builtin of
    :data:`BUILTINS`, a leading assignment)."""
    commands = []
    for line in code.replace('\\\n', ' ').splitlines():
        text, hash_, _ = line.partition('#')
        if hash_ and text.strip() and not text[-1].isspace():  # a '#' inside a word: not a comment to bash
            return None
        words = text.split()
        if not words:
            continue
        if SHELL_CHARS & set(text) or words[0] in BUILTINS or '=' in words[0]:
            return None
        commands.append(words)
    return commands


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
    """The shell commands (or snippets run whole) run in this module, by their text and their folder's files before
    them: the files each run added or changed (copies under ``root``) and those it removed."""

    def __init__(self, root: Path):
        self.root, self.runs = root, {}

    @staticmethod
    def key(text: str, before: dict[str, str]) -> str:
        return hashlib.sha256(json.dumps([text, sorted(before.items())]).encode()).hexdigest()

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


def _run_console_script(words, capsys):
    """A ``tokenaug-*`` command line by the function its console script calls, in this process."""
    argv0, sys.argv = sys.argv, words  # what the script's parser names itself by
    try:
        code, out, err = call_main(IN_PROCESS[words[0]].load(), words[1:], capsys)
    finally:
        sys.argv = argv0
    assert code == 0, f'exit status {code}\n{out[-3000:]}\n{err[-4000:]}'


def _run_shell(snippet, cwd, env, memo, capsys):
    """The snippet's plain commands one by one (:func:`plain_commands`), or the snippet whole in bash; each replayed
    where :class:`SnippetMemo` has its run."""
    commands = plain_commands(snippet.code)
    for words in [None] if commands is None else commands:
        text = snippet.code if words is None else ' '.join(words)
        before = _files(cwd)
        key = memo.key(text, before)
        if memo.replay(key, cwd):
            continue
        try:
            if words is not None and words[0] in IN_PROCESS:
                _run_console_script(words, capsys)
            else:
                run_tool(['bash', '-c', 'set -eo pipefail\n' + text], env, timeout=900, cwd=cwd)
        except AssertionError as exc:
            raise AssertionError(f'{snippet.where}\n{text}\n{exc}') from None
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
def test_page_snippets_run(page, small_world, memo, tmp_path, monkeypatch, capsys):
    work = tmp_path / 'work'
    (work / 'data').mkdir(parents=True)
    shutil.copytree(small_world, work / 'data' / 'world')
    env = dict(os.environ)
    env['PATH'] = f'{VENV_BIN}{os.pathsep}{env.get("PATH", "")}'
    env.pop('PYTHONPATH', None)  # the installed package, as a reader has it
    monkeypatch.setenv('PATH', env['PATH'])  # the commands run in this process see what those in bash see
    monkeypatch.chdir(work)
    namespace = {'__name__': '__main__'}
    for snippet in BY_PAGE[page]:
        if snippet.kind[0] == 'config':
            _load_config(snippet, work, env)
        elif snippet.lang == 'bash':
            _run_shell(snippet, work, env, memo, capsys)
        else:
            _run_python(snippet, namespace)
