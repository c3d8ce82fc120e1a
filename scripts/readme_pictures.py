#!/usr/bin/env python3
"""The documentation's pictures (``docs/img/*.png``, shown on the method pages) from a finished ``make demo``:
``tokenaug-viz`` on the demo's runs (two samples each, :func:`demo.pictures`), each figure shrunk to 900 px wide
and stored with a 64-colour palette so the repository keeps them small.

    .venv/bin/python scripts/readme_pictures.py [--demo-out demo_out]
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from pathlib import Path

from PIL import Image

REPO = Path(__file__).resolve().parents[1]
FIGURES = {'mix': 'mix.png', 'tl_align': 'tl_align.png', 'tl_align_swin': 'tl_align.png'}
FIGURES.update(token_labels='token_labels.png')
FIGURES.update(activation_maps='mix.png', tokenmix='tokenmix.png', tokenmixup='tokenmixup.png')


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--demo-out', type=Path, default=REPO / 'demo_out')
    p.add_argument('--dest', type=Path, default=REPO / 'docs' / 'img')
    a = p.parse_args()
    spec = importlib.util.spec_from_file_location('demo', REPO / 'scripts' / 'demo.py')
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    out = a.demo_out.resolve()
    a.dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, page in demo.pictures(out / 'world', out, count=2, viz=Path(tmp)):
            img = Image.open(page.parent / FIGURES[name]).convert('RGB')
            if img.width > 900:
                img = img.resize((900, round(img.height * 900 / img.width)), Image.LANCZOS)
            img.quantize(64).save(a.dest / f'{name}.png', optimize=True)
            print(a.dest / f'{name}.png', (a.dest / f'{name}.png').stat().st_size // 1024, 'KiB')


if __name__ == '__main__':
    main()
