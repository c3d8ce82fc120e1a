"""``tokenaug-viz token-labels``: the stored maps and the per-token targets through the training augmentation."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from shared_core.plotting import save_figure, save_png, write_index
from tokenaug.tool_args import parse_viz

from .samples import class_names_of, seed_all, training_split

__all__ = ['token_labels']


def token_labels(argv) -> Path:
    """``tokenaug-viz token-labels``: each image's stored map (top-1 class, confidence) and, for several draws of
    the training augmentation, the augmented image beside its per-token targets (class colours of
    :func:`shared_core.viz.class_colours`): the orientation check by eye. Returns the index page."""
    from timm.data import resolve_data_config

    from shared_core.label_maps import dense_maps
    from shared_core.map_store import LabelMapStore
    from shared_core.viz import class_colours, label_image
    from timm_plugin.recipe import attach_method_modules, build_model
    from timm_plugin.token_grid import token_labeling_stride
    from timm_plugin.token_label_data import TokenLabelCollate
    from timm_plugin.train_data import map_dataset
    from tokenaug.train_args import check_supported

    args = parse_viz('token-labels', argv)
    check_supported(args)
    if args.count < 1 or args.draws < 1:
        raise ValueError(f'--count / --draws: expected >= 1, got {args.count} / {args.draws}')
    if not args.token_label_dir:
        raise ValueError('--token-label-dir is required (the label maps of the training split)')
    store = LabelMapStore.open(args.token_label_dir)
    if args.num_classes is None:
        args.num_classes = store.num_classes
    seed_all(args.viz_seed)
    model = build_model(args, lambda model: attach_method_modules(model, args))  # a checkpoint's aux head too
    data_config = resolve_data_config(vars(args), model=model)
    size = tuple(data_config['input_size'][1:])
    stride = token_labeling_stride(model)  # the grid of the targets, as training builds them (32 px on a CNN)
    grid = (size[0] // stride[0], size[1] // stride[1])
    base, transform = training_split(args, data_config, use_prefetcher=True)  # uint8, as the prefetcher's
    dataset, _ = map_dataset(args, base, store)
    dataset.transform = transform
    count = min(args.count, len(dataset))
    indices = sorted(random.Random(args.viz_seed).sample(range(len(dataset)), count))
    collate = TokenLabelCollate(store.num_classes)
    names = class_names_of(base, store.num_classes)
    colours = class_colours(store.num_classes)
    out = Path(args.viz_dir)
    rows, meta_images, shown = [], [], set()
    for n, idx in enumerate(indices):
        seed_all(args.viz_seed * 1000 + n)
        samples = [dataset[idx] for _ in range(args.draws)]
        x, target = collate(samples)
        probs = target.token_targets(grid, 0.0).dense().reshape(len(samples), *grid, -1)
        shown.update(probs.argmax(-1).unique().tolist())
        pics = label_image(probs, size, stride)
        imgs = x.permute(0, 2, 3, 1).numpy()
        if imgs.shape[-1] == 1:
            imgs = imgs.repeat(3, -1)
        # the stored map on the targets' encoding (the probability-weighted mean of the class colours) of its full
        # distribution (shared_core.label_maps.dense_maps: top-k, the rest spread), 8 px per map cell
        values, idxs = store.row(store.index_of(base.filename(idx)))
        dist = dense_maps(values[None], idxs[None], store.num_classes)[0].permute(1, 2, 0)  # (h, w, C)
        stored = label_image(dist[None], (8 * dist.shape[0], 8 * dist.shape[1]), (8, 8))[0]
        shown.update(dist.argmax(-1).unique().tolist())
        save_png(stored, out / f'image{n}_map.png')
        label = int(target.as_tensor()[0])
        row = [(f'{base.filename(idx, basename=True)}: {names[label]} (stored map)', stored)]
        draws = []
        for d in range(len(samples)):
            files = dict(image=f'image{n}_draw{d}.png', targets=f'image{n}_draw{d}_targets.png')
            save_png(imgs[d], out / files['image'])
            save_png(pics[d], out / files['targets'])
            flip = bool(target.maps.flips[d])
            moved = target.maps.affines is not None and not torch.allclose(target.maps.affines[d], torch.eye(3)[:2])
            tag = ('flip ' if flip else '') + ('+ geometric op' if moved else '')
            row += [(f'draw {d} {tag}', imgs[d]), ('targets', pics[d])]
            draws.append(
                dict(
                    files=files,
                    crop=target.maps.crops[d].tolist(),
                    flip=flip,
                    affines=target.maps.affines[d].tolist() if target.maps.affines is not None else [],
                    top1=probs[d].argmax(-1).tolist(),
                    confidence=probs[d].max(-1).values.tolist(),
                )
            )
        rows.append(row)
        meta_images.append(dict(index=idx, file=base.filename(idx), label=label, map=f'image{n}_map.png', draws=draws))
    title = 'token labels: the stored map, then each draw after the training transforms and its targets'
    names = list(names) + [str(c) for c in range(len(names), store.num_classes)]
    legend = [(names[c], colours[c]) for c in sorted(shown)[:30]]  # the classes some token shows as its top-1
    save_figure(rows, out / 'token_labels.png', title=title, legend=legend)
    meta = dict(
        command='token-labels',
        store=str(args.token_label_dir),
        grid=list(grid),
        input_size=list(size),
        patch_size=list(stride),
        classes=names,
        class_colours=colours.tolist(),
        geometric_aa=args.geometric_aa,
        aa_order=args.aa_order,
        images=meta_images,
    )
    return write_index(out, 'tokenaug-viz token-labels', [('token labels', 'token_labels.png')], meta)
