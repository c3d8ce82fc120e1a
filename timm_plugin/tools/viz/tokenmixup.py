"""``tokenaug-viz tokenmixup``: HTM's plan at its first block (saliency, partner, swapped tokens)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from shared_core.plotting import save_figure, save_png, write_index
from shared_core.viz import grey_image, images_uint8, share_image, token_plane
from tokenaug.tool_args import parse_viz

from .samples import check_count, class_names_of, seed_all, training_split

__all__ = ['tokenmixup']


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
    count = check_count(args.count)
    if not args.tokenmixup_htm_layers:
        raise ValueError('--tokenmixup-htm-layers: name the HTM block(s) to draw (as for tokenaug-train)')
    seed_all(args.viz_seed)
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
    dataset, dataset.transform = training_split(args, data_config)
    if len(dataset) < count:
        raise ValueError(f'--count: {count} samples asked, the training split has {len(dataset)}')
    indices = sorted(random.Random(args.viz_seed).sample(range(len(dataset)), count))
    samples = [dataset[i] for i in indices]
    x = torch.stack([s[0] for s in samples])
    y = torch.as_tensor([int(s[1]) for s in samples])
    record = {}

    def observe(idx, saliency, easy, difficulty):
        record[idx] = dict(saliency=saliency, easy=easy, difficulty=difficulty)

    tm.train()
    with torch.no_grad(), tm.hooks.observing(observe):
        _, target = tm(x, y)
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
    names = class_names_of(dataset, args.num_classes)
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
