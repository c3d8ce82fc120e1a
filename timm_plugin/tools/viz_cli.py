"""``tokenaug-viz``: pictures of what the methods do, as PNGs with an HTML index (``index.html``) and the
numbers behind them (``meta.json``). The commands and their flags: ``tokenaug-viz --help``
(:data:`tokenaug.tool_args.VIZ_USAGE`, parsed by :func:`tokenaug.tool_args.parse_viz`).

- ``mix``: training samples as ``tokenaug-train`` builds them (its parser, model, data config, training
  transform and mixer, from the same flags), each with its partner, the mixed image and the partner share of
  every token (two-colour scale of :mod:`shared_core.viz`, over the image and alone); with
  ``--activation-map-dir`` (TokenMix's activation-map targets for each pair) also the teacher's map of each
  image's own class and of its partner's (grey, 0 to 1, after the crop and flip) and the area λ beside Eq. 2's λ';
- ``tl-align``: TL-Align's Fig. 6 for a timm ViT / DeiT or Swin and a checkpoint: the two inputs, the mixed
  image, the initial label embedding (each token's partner share) and the aligned one after the last block
  (``--per-block``: after each; Swin's on each stage's grid), with the area λ and the aligned λ of what the
  classifier reads; the cut branch of the MixUp/CutMix switch by default, where the two λ differ (``--branch``);
- ``token-labels``: each image's stored label map (top-1 class, its confidence as saturation) and, for several
  draws of the training augmentation (crop, flip, RandAugment with ``--geometric-aa``), the augmented image
  beside its per-token targets in class colours: whether the labels follow the image, checked by eye;
- ``tokenmix``: the masks of each sampler at a λ side by side: TokenMix blocks and random tokens (λ fixed),
  a token-grid box and timm's CutMix pixel box (the draws of Beta(--cutmix) nearest λ among 512); the
  activation-map targets of pairs are ``mix --mixup-type tokenmix_block --activation-map-dir MAPS``;
- ``tokenmixup``: one batch at the first HTM block: each sample's token saliency (grey, min to max), the partner
  HTM matched it with, the tokens swapped and the same swap in image space (a sample not easy enough under τ
  swaps nothing: raise ``--tokenmixup-tau`` to see the matching of an untrained ScoreNet).

Every ``*_share.png`` / mask PNG is exact (one colour per token, pixel for pixel): ``shared_core.viz.
share_from_colour`` reads a share back from it. The pictures' library functions are :mod:`shared_core.viz`
(arrays) and :mod:`shared_core.plotting` (files), for use in a notebook.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np
import torch

from shared_core.plotting import save_figure, save_png, write_index
from shared_core.samplers import MixSampler
from shared_core.viz import grey_image, images_uint8, overlay, share_image, token_plane
from tokenaug.tool_args import VIZ_COMMANDS, VIZ_USAGE, parse_viz


def _seed(seed: int) -> None:
    """Every random stream the training transforms draw from: Python's (crops, RandAugment magnitudes), numpy's
    (timm's RandAugment picks its ops with ``np.random.choice``) and torch's (flips, erasing, mixing)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _check_count(count: int) -> int:
    if count < 2 or count % 2:
        raise ValueError(f'--count: expected an even number >= 2 (mixing pairs samples), got {count}')
    return count


def _training_split(args, data_config: dict, use_prefetcher: bool = False):
    """The training split with ``tokenaug-train``'s training transform (uint8 images with ``use_prefetcher``, as
    its prefetcher loader; else normalised tensors)."""
    from timm.data import create_dataset

    from timm_plugin.train_data import training_transform

    data_dir = args.data_dir or args.data
    if not data_dir:
        raise ValueError('--data-dir is required (the training split is drawn from)')
    dataset = create_dataset(
        args.dataset,
        root=data_dir,
        split=args.train_split,
        is_training=True,
        class_map=args.class_map,
        input_img_mode=args.input_img_mode or ('RGB' if data_config['input_size'][0] == 3 else 'L'),
        download=args.dataset_download,
    )
    return dataset, training_transform(args, data_config, use_prefetcher)


def _mixed_batch(args, count: int):
    """What ``tokenaug-train`` would mix from these flags: ``(model, data_config, dataset, indices, x, y, xm,
    target, method, mix_kind, mixer kwargs)`` for ``count`` samples of the training split."""
    from timm.data import resolve_data_config

    from timm_plugin.recipe import build_training, uses_token_labeling
    from timm_plugin.train_data import map_dataset
    from tokenaug.train_args import check_supported

    check_supported(args)
    if uses_token_labeling(args):
        raise ValueError('--mixup-type mixtoken / --token-label-dir: token labeling mixes inside the model')
    _seed(args.viz_seed)
    recipe = build_training(args)  # what tokenaug-train builds from the same flags
    if recipe.mixing is None:
        raise ValueError('nothing mixes: set --mixup and/or --cutmix > 0 (as for tokenaug-train)')
    model, method, mix_kind, kwargs = recipe.model, recipe.method, recipe.mix_kind, recipe.mixing
    data_config = resolve_data_config(vars(args), model=model)
    dataset, transform = _training_split(args, data_config)
    base = dataset
    dataset, store = map_dataset(args, dataset)  # as tokenaug-train: the samples carry their teacher map rows
    dataset.transform = transform
    if len(dataset) < count:
        raise ValueError(f'--count: {count} samples asked, the training split has {len(dataset)}')
    indices = sorted(random.Random(args.viz_seed).sample(range(len(dataset)), count))
    samples = [dataset[i] for i in indices]
    if store is not None:
        from timm_plugin.token_label_data import TokenLabelCollate

        x, y = TokenLabelCollate(args.num_classes)(samples)
        dataset = base
    else:
        x = torch.stack([s[0] for s in samples])
        y = torch.as_tensor([int(s[1]) for s in samples])
    mixer = recipe.mixer(carry_mix=True, generator=torch.Generator().manual_seed(args.viz_seed))
    xm, target = mixer(x, y)
    return model, data_config, dataset, indices, x, y, xm, target, method, mix_kind, kwargs


def _names(dataset, num_classes):
    from timm_plugin.image_data import class_names

    return class_names(dataset) or [str(i) for i in range(num_classes)]


def _top(soft, names, k=2):
    top = soft.topk(min(k, soft.shape[-1]))
    return ', '.join(f'{names[int(c)]} {float(v):.2f}' for v, c in zip(top.values, top.indices))


def mix(argv) -> Path:
    """``tokenaug-viz mix``: see the module docstring. Returns the index page."""
    args = parse_viz('mix', argv)
    count = _check_count(args.count)
    model, data_config, dataset, indices, x, y, xm, target, method, mix_kind, kwargs = _mixed_batch(args, count)
    m = target.mix
    mean, std = data_config['mean'], data_config['std']
    own, mixed = images_uint8(x, mean, std), images_uint8(xm, mean, std)
    partner = own[m.partner.numpy()]
    shares = share_image(m.token_share, m.img_size, m.patch_size)
    tinted = overlay(mixed, shares)
    names = _names(dataset, args.num_classes)
    out = Path(args.viz_dir)
    rows, meta_samples = [], []
    soft = target.as_tensor() if hasattr(target, 'as_tensor') else target
    labels = y.as_tensor() if hasattr(y, 'as_tensor') else y
    branches = [_branch(m, i, mix_kind) for i in range(count)]
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
            ('target: ' + _top(soft[i], names), tinted[i]),
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
        shown += f' (this draw: {_drawn(branches)})'
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


def _branch(m, i: int, mix_kind: str) -> str:
    """What the sampler drew for sample ``i``: ``'unmixed'`` (λ = 1), ``'mixup'`` (a blend: no box, the same partner
    share on every token: the MixUp branch of a MixUp/CutMix switch), else the mixing kind asked for."""
    lam = float(m.lam[i])
    if lam >= 1.0:
        return 'unmixed'
    boxed = m.boxes is not None and (m.box_valid is None or bool(m.box_valid[i]))
    share = m.token_share[i]
    if not boxed and mix_kind != 'mixup' and bool(torch.allclose(share, torch.full_like(share, 1.0 - lam))):
        return 'mixup'
    return mix_kind


#: label states per row of ``tl_align_blocks.png`` (``--per-block``)
BLOCKS_PER_ROW = 6


def _pin_branch(args: argparse.Namespace) -> None:
    """Make the mixer draw ``args.branch`` of the MixUp/CutMix switch (``'switch'``: as configured)."""
    cut = args.cutmix > 0 or args.cutmix_minmax is not None
    if args.branch == 'cut':
        if not cut or args.mixup_type == 'mixup':
            raise ValueError(
                f'--branch cut: --mixup-type {args.mixup_type} with --cutmix {args.cutmix} has no cut branch; '
                'set --cutmix > 0 (and a kind with boxes or masks) or pass --branch mixup'
            )
        args.mixup_switch_prob = 1.0
    elif args.branch == 'mixup':
        if args.mixup <= 0:
            raise ValueError(f'--branch mixup: --mixup {args.mixup} draws no blend; set --mixup > 0')
        args.mixup_switch_prob = 0.0


def _drawn(branches: list[str]) -> str:
    """``'cutmix for 8 of 8'``, ``'mixup for 3, cutmix for 5 of 8'``: the branches a draw took."""
    counts = ', '.join(f'{b} for {branches.count(b)}' for b in sorted(set(branches)))
    return f'{counts} of {len(branches)}'


def tl_align(argv) -> Path:
    """``tokenaug-viz tl-align``: TL-Align's Fig. 6 for a model and checkpoint (``--model``,
    ``--initial-checkpoint``): inputs, mixed image, the initial label embedding (partner share per token) and the
    aligned one after the last block (or after each block), the area λ against the aligned λ."""
    from shared_core.tl_align import capture_forward, compact_labels
    from timm_plugin.tl_align import SharedAttentionViT, SwinTracer, TLAlign

    args = parse_viz('tl-align', argv)
    count = _check_count(args.count)
    _pin_branch(args)
    model, data_config, dataset, indices, x, y, xm, target, method, mix_kind, kwargs = _mixed_batch(args, count)
    model.eval()
    m = target.mix
    wrapped = TLAlign(model)
    P = wrapped.num_prefix_tokens
    labels0 = compact_labels(m, P)
    history = []  # the label state after each block: (B, T, K) for a ViT, (B, H', W', K) for Swin
    if SharedAttentionViT.applies(wrapped.tracer, labels0, None):
        tracer = SharedAttentionViT(wrapped.tracer, labels0, None, True, 'kept', history=history)
        with torch.no_grad():
            output, _ = capture_forward(tracer, lambda: model(xm))
        aligned = wrapped.tracer.readout(tracer.labels[..., :1], output)[:, 0]  # partner share of what is read
        states = [h[:, P:, 0].reshape(-1, *m.grid_size) for h in history]
    elif isinstance(wrapped.tracer, SwinTracer):  # the label path of training (window attention, 2x2 merges)
        wrapped.tracer.history = history
        try:
            with torch.no_grad():
                _, share = wrapped._run(xm, labels0)
        finally:
            wrapped.tracer.history = None
        aligned = share[:, 0]
        states = [h[..., 0] for h in history]
    else:
        raise ValueError(
            f'--model: tokenaug-viz tl-align draws timm ViT / DeiT and Swin models, got {type(model).__name__}'
        )
    initial_state = labels0[:, P:, 0].reshape(-1, *m.grid_size)

    def picture(state):  # each grid over the whole image (Swin's later stages: coarser tokens)
        gh, gw = state.shape[1:]
        return share_image(state, m.img_size, (m.img_size[0] // gh, m.img_size[1] // gw))

    mean, std = data_config['mean'], data_config['std']
    own, mixed = images_uint8(x, mean, std), images_uint8(xm, mean, std)
    names = _names(dataset, args.num_classes)
    initial, final = picture(initial_state), picture(states[-1])
    branches = [_branch(m, i, mix_kind) for i in range(count)]
    blocks = [picture(h) for h in states] if args.per_block else []
    out = Path(args.viz_dir)
    rows, block_rows, meta_samples = [], [], []
    for i in range(count):
        p = int(m.partner[i])
        area, al = float(m.lam[i]), 1.0 - float(aligned[i])
        files = dict(initial=f'sample{i}_initial.png', aligned=f'sample{i}_aligned.png')
        save_png(initial[i], out / files['initial'])
        save_png(final[i], out / files['aligned'])
        row = [
            (f'{i}: {names[int(y[i])]}', own[i]),
            (f'partner: {names[int(y[p])]}', own[p]),
            ('mixed', mixed[i]),
            (f'{branches[i]}: initial labels, λ={area:.2f}', initial[i]),
            (f'aligned labels, λ={al:.2f}', final[i]),
        ]
        panels = []
        for b, pic in enumerate(blocks):
            files[f'block{b}'] = f'sample{i}_block{b}.png'
            save_png(pic[i], out / files[f'block{b}'])
            panels.append((f'{i}: after block {b}', pic[i]))
        block_rows += [panels[k : k + BLOCKS_PER_ROW] for k in range(0, len(panels), BLOCKS_PER_ROW)]
        rows.append(row)
        meta_samples.append(
            dict(
                index=indices[i],
                label=int(y[i]),
                partner=p,
                branch=branches[i],
                area_lam=area,
                aligned_lam=al,
                initial=initial_state[i].tolist(),
                aligned=states[-1][i].tolist(),
                files=files,
            )
        )
    title = f"TL-Align on {args.model} ({_drawn(branches)}; red: the partner's label)"
    scales = [('share', "the partner's share of each token's label")]
    save_figure(rows, out / 'tl_align.png', title=title, scales=scales)
    pages = [('TL-Align', 'tl_align.png')]
    if block_rows:  # a figure of its own, BLOCKS_PER_ROW states a row: readable at any depth
        save_figure(
            block_rows, out / 'tl_align_blocks.png', title=f'{title}: the label state after each block', scales=scales
        )
        pages.append(('the label state after each block', 'tl_align_blocks.png'))
    meta = dict(
        command='tl-align',
        model=args.model,
        checkpoint=args.initial_checkpoint,
        mix_kind=mix_kind,
        branch=args.branch,
        drawn=_drawn(branches),
        patch_size=list(m.patch_size),
        img_size=list(m.img_size),
        block_grids=[list(h.shape[1:]) for h in states],
        samples=meta_samples,
    )
    return write_index(out, f'tokenaug-viz tl-align: {args.model}', pages, meta)


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
    _seed(args.viz_seed)
    model = build_model(args, lambda model: attach_method_modules(model, args))  # a checkpoint's aux head too
    data_config = resolve_data_config(vars(args), model=model)
    size = tuple(data_config['input_size'][1:])
    stride = token_labeling_stride(model)  # the grid of the targets, as training builds them (32 px on a CNN)
    grid = (size[0] // stride[0], size[1] // stride[1])
    base, transform = _training_split(args, data_config, use_prefetcher=True)  # uint8, as the prefetcher's
    dataset, _ = map_dataset(args, base, store)
    dataset.transform = transform
    count = min(args.count, len(dataset))
    indices = sorted(random.Random(args.viz_seed).sample(range(len(dataset)), count))
    collate = TokenLabelCollate(store.num_classes)
    names = _names(base, store.num_classes)
    colours = class_colours(store.num_classes)
    out = Path(args.viz_dir)
    rows, meta_images, shown = [], [], set()
    for n, idx in enumerate(indices):
        _seed(args.viz_seed * 1000 + n)
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
            flip = bool(target.flips[d])
            moved = target.affines is not None and not torch.allclose(target.affines[d], torch.eye(3)[:2])
            tag = ('flip ' if flip else '') + ('+ geometric op' if moved else '')
            row += [(f'draw {d} {tag}', imgs[d]), ('targets', pics[d])]
            draws.append(
                dict(
                    files=files,
                    crop=target.crops[d].tolist(),
                    flip=flip,
                    affines=target.affines[d].tolist() if target.affines is not None else [],
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


def _load_with_scorenets(model, state: dict, checkpoint: str):
    """Load ``state`` into ``model`` (with its ScoreNets attached) strictly; a checkpoint of a run without
    TokenMixup has no ScoreNets: then everything else loads strictly, the ScoreNets stay as initialised, and the
    returned note (printed, in meta.json and the title) says so. Any other mismatch is an error naming the keys."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    other = [k for k in missing if not k.startswith('tokenmixup_scorenet.')]
    if other or unexpected:
        raise ValueError(
            f'--initial-checkpoint: {checkpoint} does not fit {type(model).__name__}: missing {other[:8]}, '
            f'unexpected {unexpected[:8]}'
        )
    if not missing:
        return None
    note = (
        f'{checkpoint} has no ScoreNet (a run without TokenMixup): the ScoreNet is untrained, so which samples HTM '
        "counts as easy is arbitrary; the saliency, the matching and the swapped tokens are the model's own"
    )
    print(f'tokenaug-viz tokenmixup: note: {note}', flush=True)
    return note


def tokenmixup(argv) -> Path:
    """``tokenaug-viz tokenmixup``: one batch at the first HTM block of a model (``--tokenmixup-htm-layers``,
    ``--initial-checkpoint`` with its ScoreNets): each sample's token saliency, the partner HTM matched it with
    and the tokens it swapped (shown in image space: the partner's patches pasted where tokens were swapped).
    Returns the index page."""
    from timm.data import resolve_data_config

    from timm_plugin.checkpoints import read_state_dict
    from timm_plugin.recipe import build_model
    from timm_plugin.tokenmixup import TokenMixup
    from tokenaug.train_args import check_supported

    args = parse_viz('tokenmixup', argv)
    check_supported(args)
    count = _check_count(args.count)
    if not args.tokenmixup_htm_layers:
        raise ValueError('--tokenmixup-htm-layers: name the HTM block(s) to draw (as for tokenaug-train)')
    _seed(args.viz_seed)
    checkpoint, args.initial_checkpoint = args.initial_checkpoint, ''
    model = build_model(args)
    if args.num_classes is None:
        args.num_classes = model.num_classes
    tm = TokenMixup(
        model,
        htm_layers=args.tokenmixup_htm_layers,
        rho=args.tokenmixup_rho,
        tau=args.tokenmixup_tau,
        saliency=args.tokenmixup_saliency,
        scorenet=args.tokenmixup_scorenet,
    )
    scorenet_note = None
    if checkpoint:  # after the ScoreNets are attached: a checkpoint of a TokenMixup run holds them
        state = read_state_dict(checkpoint, '--initial-checkpoint')  # the reader of every entry point
        scorenet_note = _load_with_scorenets(model, state, checkpoint)
    data_config = resolve_data_config(vars(args), model=model)
    dataset, dataset.transform = _training_split(args, data_config)
    if len(dataset) < count:
        raise ValueError(f'--count: {count} samples asked, the training split has {len(dataset)}')
    indices = sorted(random.Random(args.viz_seed).sample(range(len(dataset)), count))
    samples = [dataset[i] for i in indices]
    x = torch.stack([s[0] for s in samples])
    y = torch.as_tensor([int(s[1]) for s in samples])
    record = {}
    tm.hooks.record = record
    tm.train()
    with torch.no_grad():
        _, target = tm(x, y)
    tm.hooks.record = None
    layer = tm.hooks.htm_layers[0]
    mix = target.mixes[0]
    S, easy = record[layer]['saliency'], record[layer]['easy']
    N = S.shape[1]
    side = round(N**0.5)
    if side * side != N:
        raise ValueError(f'--model: {N} patch tokens do not form a square grid to draw')
    H, W = data_config['input_size'][1:]
    grid, patch = (side, side), (H // side, W // side)
    swap = mix.token_share.view(-1, side, side)
    mean, std = data_config['mean'], data_config['std']
    own = images_uint8(x, mean, std)
    partner = own[mix.partner.cpu().numpy()]
    shares = share_image(swap, (H, W), patch)
    pasted = np.where(token_plane(swap.bool().numpy(), (H, W), patch)[..., None], partner, own)
    heat = grey_image(S.view(-1, *grid), (H, W), patch)
    names = _names(dataset, args.num_classes)
    out = Path(args.viz_dir)
    rows, meta_samples = [], []
    for i in range(count):
        p = int(mix.partner[i])
        files = dict(
            image=f'sample{i}_image.png',
            saliency=f'sample{i}_saliency.png',
            swapped=f'sample{i}_swapped.png',
            pasted=f'sample{i}_pasted.png',
        )
        save_png(own[i], out / files['image'])
        save_png(heat[i], out / files['saliency'])
        save_png(shares[i], out / files['swapped'])
        save_png(pasted[i], out / files['pasted'])
        n_swapped = int(swap[i].sum())
        rows.append(
            [
                (f'{i}: {names[int(y[i])]}' + (' (easy)' if bool(easy[i]) else ''), own[i]),
                (f'saliency, block {layer}', heat[i]),
                (f'partner {p}: {names[int(y[p])]}', partner[i]),
                (f'{n_swapped} tokens swapped, λ={float(mix.lam[i]):.2f}', shares[i]),
                ('swapped in image space', pasted[i]),
            ]
        )
        meta_samples.append(
            dict(
                index=indices[i],
                label=int(y[i]),
                easy=bool(easy[i]),
                partner=p,
                lam=float(mix.lam[i]),
                saliency=S[i].view(*grid).tolist(),
                swapped=swap[i].tolist(),
                target=target.as_subclass(torch.Tensor)[i].tolist(),
                files=files,
            )
        )
    title = f'HTM at block {layer} (tau {tm.tau}, rho {args.tokenmixup_rho})'
    if scorenet_note:
        title += '; ScoreNet untrained: which samples count as easy is arbitrary'
    scales = [
        ('grey', 'saliency (each sample: its own min -> max)', None),
        ('share', 'swapped: from the partner (red)'),
    ]
    save_figure(rows, out / 'tokenmixup.png', title=title, scales=scales)
    meta = dict(
        command='tokenmixup',
        model=args.model,
        checkpoint=checkpoint or None,
        scorenet_note=scorenet_note,
        layer=layer,
        grid=list(grid),
        patch_size=list(patch),
        tau=tm.tau,
        rho=args.tokenmixup_rho,
        samples=meta_samples,
    )
    return write_index(out, f'tokenaug-viz tokenmixup: {args.model}', [('HTM', 'tokenmixup.png')], meta)


def tokenmix(argv) -> Path:
    """``tokenaug-viz tokenmix``: the masks of each sampler at a λ. Returns the index page."""
    a = parse_viz('tokenmix', argv)
    count = _check_count(a.count)
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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = VIZ_USAGE
    if argv[:1] in (['-h'], ['--help']):
        print(usage)
        return 0
    if not argv or argv[0] not in VIZ_COMMANDS:
        print(usage, file=sys.stderr)
        print(f'tokenaug-viz: error: the first argument is one of {VIZ_COMMANDS}', file=sys.stderr)
        return 2
    try:
        commands = {
            'mix': mix,
            'tl-align': tl_align,
            'token-labels': token_labels,
            'tokenmix': tokenmix,
            'tokenmixup': tokenmixup,
        }
        index = commands[argv[0]](argv[1:])
    except (ValueError, FileNotFoundError) as e:
        print(f'tokenaug-viz {argv[0]}: error: {e}', file=sys.stderr)
        return 2
    print(index)
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
