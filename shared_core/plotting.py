"""Where the pictures of :mod:`shared_core.viz` become files: exact PNGs of single panels (PIL, pixel for
pixel, so they can be read back), matplotlib figures that lay panels out with titles, and an HTML index page.
matplotlib is imported here only, when a figure is drawn (headless: the Agg backend)."""

from __future__ import annotations

import html
import json
import os
import textwrap
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image

__all__ = ['save_png', 'draw_figure', 'save_figure', 'write_index']

Panel = Tuple[str, np.ndarray]  # (title, (H, W, 3) uint8)


def save_png(array: np.ndarray, path, scale: int = 1) -> Path:
    """One ``(H, W, 3)`` uint8 picture as a PNG, enlarged ``scale`` times by pixel repetition (exact colours)."""
    array = np.asarray(array)
    if array.ndim != 3 or array.shape[-1] != 3 or array.dtype != np.uint8:
        raise ValueError(f'array: expected (H, W, 3) uint8, got {array.shape} {array.dtype}')
    if scale > 1:
        array = array.repeat(scale, 0).repeat(scale, 1)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)
    return path


def pyplot():
    """``matplotlib.pyplot`` on the headless Agg backend; without matplotlib, an error naming the extra."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError('the pictures need matplotlib: pip install "tokenaug[viz]"') from None
    matplotlib.use('Agg', force=False)
    import matplotlib.pyplot as plt

    return plt


#: a colour bar under a figure: ``('share', label)`` for the OWN -> PARTNER partner-share scale of
#: :func:`shared_core.viz.share_colours`, ``('grey', label, (lo, hi))`` for grey levels (``(lo, hi)`` the values
#: of black and white; ``None``: each sample's own minimum and maximum)
Scale = Tuple


def _fit_titles(fig, axes) -> None:
    """Break each panel title over as many lines as it needs to stay within its panel's width, so the titles of
    neighbouring panels never run into each other (matplotlib's ``wrap=True`` wraps at the figure's edge only)."""
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    for ax in axes:
        title, text = ax.title, ax.title.get_text()
        width, chars = ax.get_window_extent(renderer).width, len(text)
        while chars > 6 and title.get_window_extent(renderer).width > width:
            chars = int(chars * 0.9)
            title.set_text(textwrap.fill(text, chars, break_long_words=False, break_on_hyphens=False))


def draw_figure(
    rows: Sequence[Sequence[Panel]],
    title: Optional[str] = None,
    panel_inches: float = 2.3,
    scales: Sequence[Scale] = (),
    legend: Sequence[Tuple[str, Sequence[int]]] = (),
):
    """A grid of titled panels (rows of ``(title, image)``; a missing panel is ``None``) as a matplotlib figure,
    laid out by constrained layout (titles never over the row above, each within its panel's width: a long one
    takes more lines); under it a colour bar per ``scales`` entry and a legend of ``legend``'s ``(name, rgb)``
    colours (e.g. the class colours). :func:`save_figure` writes it as a PNG."""
    from shared_core.viz import OWN, PARTNER

    plt = pyplot()
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import LinearSegmentedColormap, Normalize
    from matplotlib.patches import Patch

    nrows, ncols = len(rows), max(len(r) for r in rows)
    extra = 0.45 * len(scales) + (0.3 * (1 + (len(legend) - 1) // 5) if legend else 0.0)
    fig, axes = plt.subplots(
        nrows,
        ncols,
        figsize=(ncols * panel_inches, nrows * (panel_inches + 0.25) + 0.5 + extra),
        squeeze=False,
        layout='constrained',
    )
    titled = []
    for i in range(nrows):
        for j in range(ncols):
            ax = axes[i][j]
            panel = rows[i][j] if j < len(rows[i]) else None
            if panel is None:
                ax.axis('off')
                continue
            name, img = panel
            ax.imshow(img, interpolation='nearest')
            ax.set_xticks([])
            ax.set_yticks([])
            for spine in ax.spines.values():  # a thin frame: white panel areas stay apart from the page
                spine.set_linewidth(0.5)
                spine.set_color('0.6')
            ax.set_title(name, fontsize=7)
            titled.append(ax)
    for scale in scales:
        kind, label = scale[0], scale[1]
        if kind == 'share':
            cmap = LinearSegmentedColormap.from_list('share', [np.asarray(OWN) / 255, np.asarray(PARTNER) / 255])
            lo, hi, ticks = 0.0, 1.0, None
        elif kind == 'grey':
            cmap, bounds = 'gray', scale[2] if len(scale) > 2 else None
            lo, hi = (0.0, 1.0) if bounds is None else bounds
            ticks = ['min', 'max'] if bounds is None else None
        else:
            raise ValueError(f"scales: expected ('share', label) or ('grey', label, range), got {scale!r}")
        bar = fig.colorbar(
            ScalarMappable(Normalize(lo, hi), cmap),
            ax=axes,
            orientation='horizontal',
            fraction=0.9 / (nrows * panel_inches + 1),
            aspect=60,
            pad=0.01,
        )
        bar.set_label(label, fontsize=7)
        bar.ax.tick_params(labelsize=6)
        if ticks:
            bar.set_ticks([lo, hi], labels=ticks)
    if legend:
        handles = [Patch(color=np.asarray(rgb) / 255, label=name) for name, rgb in legend]
        fig.legend(handles=handles, loc='outside lower center', ncol=min(5, len(handles)), fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    _fit_titles(fig, titled)
    return fig


def save_figure(rows: Sequence[Sequence[Panel]], path, title: Optional[str] = None, **kwargs) -> Path:
    """:func:`draw_figure` of ``rows`` (``title``, and its ``panel_inches``, ``scales``, ``legend``) as a PNG at
    ``path``."""
    plt = pyplot()
    fig = draw_figure(rows, title, **kwargs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_index(out_dir, title: str, entries: Iterable[Tuple[str, str]], meta: Optional[dict] = None) -> Path:
    """``index.html`` in ``out_dir`` showing the PNGs ``entries`` (``(caption, file relative to out_dir)``),
    and ``meta`` (the settings that made them) as JSON beside it (``meta.json``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    items: List[str] = []
    for caption, rel in entries:
        src = html.escape(os.fspath(rel))
        items.append(f'<figure><img src="{src}"><figcaption>{html.escape(caption)}</figcaption></figure>')
    body = '\n'.join(items)
    page = (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        '<style>body{font-family:sans-serif} img{max-width:100%;image-rendering:pixelated}</style></head>'
        f'<body><h1>{html.escape(title)}</h1>\n{body}\n</body></html>\n'
    )
    (out_dir / 'index.html').write_text(page)
    if meta is not None:
        (out_dir / 'meta.json').write_text(json.dumps(meta, indent=1, default=str) + '\n')
    return out_dir / 'index.html'
