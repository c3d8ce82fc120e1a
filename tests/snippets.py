"""The code snippets of the documentation (``README.md``, ``docs/**/*.md`` and the ``bench/*.md`` pages the site
includes), each with the mark that says who runs it.

A Python or shell snippet is a fenced block whose language is one of :data:`RUNNABLE`; the last non-blank line
before its fence is its mark, an HTML comment (invisible on the rendered page and on GitHub):

- ``<!-- run -->``: ``tests/docs/test_docs_snippets.py`` runs it, in the order of the page (the page's Python snippets
  share one namespace; its shell snippets one working folder, which holds a small synthetic world in
  ``data/world``);
- ``<!-- run: config PATH -->``: a Python snippet that is an MMEngine config: written to ``PATH`` in the page's
  working folder and loaded with ``mmengine.Config.fromfile``. A ``configs/<kind>/<name>.py`` path that the page has
  not made is first copied with its bases by ``tokenaug-config copy`` (the snippet then replaces that file);
- ``<!-- run: tests/test_x.py -->``: that test runs the block as written (it reads it from the page);
- ``<!-- not run: REASON -->``: not run, and why (ImageNet, a GPU, hours of training, ...).
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNNABLE = {'python': 'python', 'py': 'python', 'bash': 'bash', 'sh': 'bash', 'shell': 'bash', 'console': 'bash'}
_FENCE = re.compile(r'^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$')
_MARK = re.compile(r'^\s*<!--\s*(?P<mark>.*?)\s*-->\s*$')


_KINDS = re.compile(r'^(?:(?P<run>run)(?::\s*(?P<what>config\s+|tests/)?(?P<arg>.+))?|not run:\s*(?P<why>.*))$')


@dataclass(frozen=True)
class Snippet:
    page: str  #: the page, relative to the repository
    line: int  #: 1-based line of the opening fence
    lang: str  #: ``python`` or ``bash``
    code: str
    mark: str | None  #: the comment's text, or None when unmarked

    @property
    def where(self) -> str:
        return f'{self.page}:{self.line}'

    @property
    def kind(self) -> tuple[str | None, str | None]:
        """``('run', None)``, ``('config', PATH)``, ``('test', 'tests/test_x.py')``, ``('not run', REASON)``, or
        ``(None, None)`` for a missing or unknown mark."""
        m = _KINDS.match(self.mark or '')
        if not m:
            return None, None
        if m['why'] is not None:
            return 'not run', m['why']
        if m['arg'] is None:
            return 'run', None
        if m['what'] == 'tests/':
            return 'test', 'tests/' + m['arg']
        return ('config', m['arg']) if m['what'] else (None, None)


def pages() -> list[Path]:
    """The documentation's Markdown files: the README, the site's sources and the bench pages it includes."""
    docs = [
        p for p in sorted((REPO / 'docs').rglob('*.md')) if not {'_build', 'generated'} & set(p.relative_to(REPO).parts)
    ]
    return [REPO / 'README.md', *docs, REPO / 'bench' / 'RESULTS.md', REPO / 'bench' / 'STUDY.md']


def snippets(path: Path) -> list[Snippet]:
    """The runnable snippets of one page, in order (fences inside other fences are code, not snippets)."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent, info = m['fence'], m['indent'], m['info'].strip()
        end = i + 1
        while end < len(lines) and not re.match(rf'^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$', lines[end]):
            end += 1
        lang = info.split()[0].lower() if info else ''
        if lang in RUNNABLE:
            prev = next((ln for ln in reversed(lines[:i]) if ln.strip()), '')
            mark = _MARK.match(prev)
            body = [ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1 : end]]
            found.append(
                Snippet(
                    page=str(path.relative_to(REPO)),
                    line=i + 1,
                    lang=RUNNABLE[lang],
                    code=textwrap.dedent('\n'.join(body)) + '\n',
                    mark=mark['mark'] if mark else None,
                )
            )
        i = end + 1
    return found


def all_snippets() -> list[Snippet]:
    return [s for p in pages() for s in snippets(p)]


def run_by(test_file: str) -> list[Snippet]:
    """The snippets marked as run by ``test_file`` (``tests/test_x.py``), in page order."""
    return [s for s in all_snippets() if s.kind == ('test', test_file)]
