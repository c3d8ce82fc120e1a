"""What the scripts that generate a docs page share: write the page, or with ``--check`` exit 1 where the page on
disk differs from what the script gives now (the test that calls it keeps the page from drifting)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable


def write_or_check(page: Path, text: Callable[[], str], description: str, script: str) -> None:
    """The command line of a page script: ``page`` from ``text()`` (``--check``: compare, write nothing)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument('--check', action='store_true', help='exit 1 if the page differs from what the script gives')
    args = p.parse_args()
    repo = Path(script).resolve().parents[1]
    content, name = text(), page.relative_to(repo)
    if args.check:
        if not page.exists() or page.read_text() != content:
            print(f'{name} is out of date: run scripts/{Path(script).name}', file=sys.stderr)
            sys.exit(1)
        print(f'{name} is up to date')
        return
    page.write_text(content)
    print(f'wrote {name}')
