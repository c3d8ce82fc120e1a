"""``tokenaug-viz mix``: training samples, their partners, the mixed images and each token's partner share."""

from __future__ import annotations

from pathlib import Path

from shared_core.plotting import save_figure, save_png, write_index
from shared_core.viz import grey_image, images_uint8, overlay, share_image
from tokenaug.tool_args import parse_viz

from .samples import branch, check_count, class_names_of, drawn, mixed_batch, top_classes

__all__ = ['mix']


def mix(argv) -> Path:
    """``tokenaug-viz mix``: see the module docstring. Returns the index page."""
    args = parse_viz('mix', argv)
    count = check_count(args.count)
    model, data_config, dataset, indices, x, y, xm, target, method, mix_kind, kwargs = mixed_batch(args, count)
    m = target.mix
    mean, std = data_config['mean'], data_config['std']
    own, mixed = images_uint8(x, mean, std), images_uint8(xm, mean, std)
    partner = own[m.partner.numpy()]
    shares = share_image(m.token_share, m.img_size, m.patch_size)
    tinted = overlay(mixed, shares)
    names = class_names_of(dataset, args.num_classes)
    out = Path(args.viz_dir)
    rows, meta_samples = [], []
    soft = target.as_tensor() if hasattr(target, 'as_tensor') else target
    labels = y.as_tensor() if hasattr(y, 'as_tensor') else y
    branches = [branch(m, i, mix_kind) for i in range(count)]
    maps = act_lam = None
    if args.activation_map_dir:  # the teacher's map of each image's own class on the token grid (Eq. 2's A)
        from shared_core.label_maps import class_maps
        from shared_core.tokenmix import activation_lam

        maps = class_maps(y.maps, labels, m.grid_size)
        act_lam = activation_lam(maps, m)
        map_pics = grey_image(maps, m.img_size, m.patch_size, value_range=(0.0, 1.0))
    for i in range(count):
        p = int(m.partner[i])
        lam = float(m.lam[i])
        files = {kind: f'sample{i}_{kind}.png' for kind in ('own', 'partner', 'mixed', 'share', 'overlay')}
        for kind, arr in zip(files, (own[i], partner[i], mixed[i], shares[i], tinted[i])):
            save_png(arr, out / files[kind])
        row = [
            (f'{i}: {names[int(labels[i])]}', own[i]),
            (f'partner {p}: {names[int(labels[p])]}', partner[i]),
            (f'{branches[i]}, λ={lam:.2f}', mixed[i]),
            ('target: ' + top_classes(soft[i], names), tinted[i]),
            ('partner share', shares[i]),
        ]
        sample = dict(index=indices[i], label=int(labels[i]), partner=p, lam=lam, branch=branches[i])
        sample['token_share'] = m.token_share[i].tolist()
        if maps is not None:
            files['map'] = f'sample{i}_map.png'
            save_png(map_pics[i], out / files['map'])
            row.insert(2, (f"partner's map ({names[int(labels[p])]})", map_pics[p]))
            row.insert(1, (f'teacher map ({names[int(labels[i])]})', map_pics[i]))
            row[4] = (f"{branches[i]}, area λ={lam:.2f}, λ'={float(act_lam[i]):.2f}", mixed[i])
            sample.update(activation_map=maps[i].tolist(), activation_lam=float(act_lam[i]))
        rows.append(row)
        meta_samples.append(dict(sample, target=soft[i].tolist(), files=files))
    shown = f'{method} over {mix_kind}' if method else mix_kind
    if args.activation_map_dir:
        shown += f' with {args.activation_target} activation-map targets'
    if set(branches) != {mix_kind}:  # the switch (or λ = 1) drew another branch for some samples: say so
        shown += f' (this draw: {drawn(branches)})'
    scales = [('share', 'partner share of each token (blue: the own image, red: the partner)')]
    if maps is not None:
        scales.append(('grey', "teacher's probability of the image's own class", (0.0, 1.0)))
    save_figure(
        rows, out / 'mix.png', title=f'{shown} (what tokenaug-train mixes; red: from the partner)', scales=scales
    )
    meta = dict(
        command='mix',
        mixing=shown,
        patch_size=list(m.patch_size),
        img_size=list(m.img_size),
        mixer=dict(kwargs, mix_kind=mix_kind),
        samples=meta_samples,
    )
    return write_index(out, f'tokenaug-viz mix: {shown}', [('samples', 'mix.png')], meta)
