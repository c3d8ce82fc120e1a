"""The documentation site (``make docs``, Sphinx): it builds with warnings as errors and every reference resolved
(``-W -n``: a broken link, a reference to a name that does not exist or a malformed docstring fails it), and its
API reference has a page for every public module of the four packages."""

from __future__ import annotations

import importlib
import pkgutil
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

#: the docs lane (make test-docs); make test runs every lane
pytestmark = pytest.mark.docs

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ('tokenaug', 'shared_core', 'timm_plugin', 'mm_plugin')
#: monospace columns a code block shows in furo's content column without cutting a line (about 93 at 1400 and at
#: 1920 px wide; the rest is a margin for other fonts)
CODE_COLUMNS = 88


def wide_code_lines(html_root: Path) -> list[str]:
    """``page: line`` for every line of a code block on the site's pages, the API reference's pages included (its
    docstrings' literal blocks), that is wider than :data:`CODE_COLUMNS` (the highlighted source listings and
    diffs excepted: diffs of timm's ``train.py`` keep timm's lines and wrap by the site's stylesheet,
    ``docs/_static/tokenaug.css``)."""
    import html
    import re

    found = []
    for page in sorted(html_root.rglob('*.html')):
        rel = page.relative_to(html_root).as_posix()
        if rel.startswith(('_modules/', '_sources/')):
            continue
        text = page.read_text()
        for block in re.finditer(
            r'<div class="highlight-(?P<lang>[\w-]+) [^"]*"><div class="highlight"><pre>(.*?)</pre>', text, re.S
        ):
            if block['lang'] == 'diff':
                continue
            for line in html.unescape(re.sub(r'<[^>]+>', '', block[2])).splitlines():
                if len(line) > CODE_COLUMNS:
                    found.append(f'{rel}: {line}')
    return found


def public_modules() -> list[str]:
    """Every module of the four packages whose path has no private (``_``) part."""
    names = []
    for pkg in PACKAGES:
        names.append(pkg)
        for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + '.'):
            if not any(part.startswith('_') for part in info.name.split('.')[1:]):
                names.append(info.name)
    return names


@pytest.mark.slow
def test_docs_build_with_warnings_as_errors_and_document_every_public_module(tmp_path):
    # built from the repository's docs/ (its pages include bench/*.md and CHANGELOG.md by relative path), into a
    # fresh output and doctree folder; autosummary writes docs/api/generated (ignored by git) as make docs does
    out = tmp_path / 'html'
    sphinx = Path(sys.executable).parent / 'sphinx-build'
    res = subprocess.run(
        [str(sphinx), '-W', '-n', '--keep-going', '-q', '-E', '-d', str(tmp_path / 'doctrees'), '-b', 'html']
        + [str(REPO / 'docs'), str(out)],
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
    # no code line is cut at the content column's edge; diffs wrap by the stylesheet the pages load
    wide = wide_code_lines(out)
    assert not wide, f'{len(wide)} code lines wider than {CODE_COLUMNS} columns:\n' + '\n'.join(wide[:40])
    assert 'div.highlight-diff pre' in (out / '_static' / 'tokenaug.css').read_text()
    assert '_static/tokenaug.css' in (out / 'guides' / 'timm.html').read_text()


def test_a_code_line_too_wide_for_the_column_is_found(tmp_path):
    """The width check of the built site: a code line one column too wide is reported with its page; a diff's is
    not (diffs wrap), nor one that fits."""
    fits, wide = 'x' * CODE_COLUMNS, 'y' * (CODE_COLUMNS + 1)

    def block(lang, line):
        return f'<div class="highlight-{lang} notranslate"><div class="highlight"><pre><span></span>{line}\n</pre>'

    (tmp_path / 'guides').mkdir()
    (tmp_path / 'guides' / 'page.html').write_text(block('bash', fits) + block('python', wide) + block('diff', wide))
    (tmp_path / 'api' / 'generated').mkdir(parents=True)  # a docstring's literal block on an API page counts too
    (tmp_path / 'api' / 'generated' / 'mod.html').write_text(block('default', wide))
    (tmp_path / '_modules').mkdir()  # the highlighted source listings do not
    (tmp_path / '_modules' / 'mod.html').write_text(block('python', wide))
    assert wide_code_lines(tmp_path) == [f'api/generated/mod.html: {wide}', f'guides/page.html: {wide}']


def test_a_broken_link_or_reference_fails_the_build(tmp_path):
    """The site's configuration turns a link to a missing page, a missing heading anchor and a reference to a name
    that does not exist into errors (a small project with the site's conf.py, without the API pages)."""
    src = tmp_path / 'src'
    src.mkdir()
    (src / 'conf.py').write_text((REPO / 'docs' / 'conf.py').read_text())
    shutil.copytree(REPO / 'docs' / '_static', src / '_static')  # the stylesheet conf.py names
    (src / 'other.md').write_text('# Other\n\n## A heading\n\ntext\n')
    good = '# Index\n\n```{toctree}\nother\n```\n\n[ok](other.md#a-heading), {py:func}`shared_core.mix.mix_target`\n'
    sphinx = Path(sys.executable).parent / 'sphinx-build'

    def build(index: str) -> subprocess.CompletedProcess:
        (src / 'index.md').write_text(index)
        return subprocess.run(
            [str(sphinx), '-W', '-n', '--keep-going', '-q', '-E', '-b', 'html', str(src), str(tmp_path / 'out')],
            capture_output=True,
            text=True,
            timeout=300,
        )

    res = build(good)
    # the API pages are not in this project, so the reference to mix_target is what fails here...
    assert res.returncode != 0 and 'shared_core.mix.mix_target' in res.stderr
    res = build(good.replace(', {py:func}`shared_core.mix.mix_target`', ''))
    assert res.returncode == 0, res.stderr  # ...and without it the project builds
    for broken, named in (
        ('[gone](missing.md)', 'missing.md'),
        ('[gone](other.md#no-such-heading)', 'no-such-heading'),
        ('{py:class}`timm_plugin.NoSuchClass`', 'timm_plugin.NoSuchClass'),
    ):
        res = build(good.replace(', {py:func}`shared_core.mix.mix_target`', ', ' + broken))
        assert res.returncode != 0 and named in res.stderr, (broken, res.stderr)
