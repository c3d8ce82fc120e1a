"""``tokenaug-viz tokenmix``: the masks of each sampler at a λ, side by side."""

from __future__ import annotations

from pathlib import Path

import torch

from shared_core.plotting import save_figure, save_png, write_index
from shared_core.samplers import MixSampler
from shared_core.viz import share_image
from tokenaug.tool_args import parse_viz

from .samples import check_count

__all__ = ['tokenmix']


def tokenmix(argv) -> Path:
    """``tokenaug-viz tokenmix``: the masks of each sampler at a λ. Returns the index page."""
    a = parse_viz('tokenmix', argv)
    count = check_count(a.count)
    if not 0.0 <= a.lam <= 1.0:
        raise ValueError(f'--lam: expected a share in [0, 1], got {a.lam}')
    img, patch = tuple(a.img_size), tuple(a.patch_size)
    g = torch.Generator().manual_seed(a.viz_seed)
    kinds = {
        'tokenmix_block': dict(tokenmix_lam=a.lam, tokenmix_rule=a.tokenmix_rule),
        'tokenmix_random': dict(tokenmix_lam=a.lam),
        'token_box': dict(cutmix_alpha=a.cutmix),
        'cutmix': dict(cutmix_alpha=a.cutmix),
    }
    out, columns, meta = Path(a.viz_dir), [], {}
    for kind, kw in kinds.items():
        sampler = MixSampler(kind, mixup_alpha=0.0, mode='elem', patch_size=patch, **kw)
        draws = 512 if 'tokenmix_lam' not in kw else count  # box kinds: the draws nearest λ
        mixes = sampler.sample(draws, img, generator=g)
        order = torch.argsort((mixes.lam - a.lam).abs(), stable=True)[:count]
        share = mixes.token_share[order]
        pics = share_image(share, img, patch)
        files = []
        for j in range(count):
            files.append(f'{kind}_{j}.png')
            save_png(pics[j], out / files[-1])
        lam = mixes.lam[order].tolist()
        columns.append([(f'{kind} λ={v:.3f}', pics[j]) for j, v in enumerate(lam)])
        meta[kind] = dict(lam=lam, token_share=share.tolist(), files=files, **{k: v for k, v in kw.items()})
    rows = [list(r) for r in zip(*columns)]
    save_figure(
        rows,
        out / 'tokenmix.png',
        title=f'token masks at λ = {a.lam} (red: from the partner)',
        scales=[('share', 'partner share of each token (blue: the own image, red: the partner)')],
    )
    meta = dict(command='tokenmix', img_size=list(img), patch_size=list(patch), lam=a.lam, samplers=meta)
    return write_index(out, 'tokenaug-viz tokenmix', [('masks per sampler', 'tokenmix.png')], meta)
