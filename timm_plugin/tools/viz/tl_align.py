"""``tokenaug-viz tl-align``: TL-Align's Fig. 6 (the label embedding before and after the blocks)."""

from __future__ import annotations

from pathlib import Path

import torch

from shared_core.plotting import save_figure, save_png, write_index
from shared_core.viz import images_uint8, share_image
from tokenaug.tool_args import parse_viz

from .samples import branch, check_count, class_names_of, drawn, mixed_batch, pin_branch

__all__ = ['tl_align']


BLOCKS_PER_ROW = 6


def tl_align(argv) -> Path:
    """``tokenaug-viz tl-align``: TL-Align's Fig. 6 for a model and checkpoint (``--model``,
    ``--initial-checkpoint``): inputs, mixed image, the initial label embedding (partner share per token) and the
    aligned one after the last block (or after each block), the area λ against the aligned λ."""
    from shared_core.tl_align import compact_labels
    from timm_plugin.tl_align import TLAlign

    args = parse_viz('tl-align', argv)
    count = check_count(args.count)
    pin_branch(args)
    model, data_config, dataset, indices, x, y, xm, target, method, mix_kind, kwargs = mixed_batch(args, count)
    model.eval()
    m = target.mix
    wrapped = TLAlign(model)
    P = wrapped.num_prefix_tokens
    labels0 = compact_labels(m, P)
    with torch.no_grad():  # the label path of training, observed after each block
        _, share, observed = wrapped.label_states(xm, target)
    aligned = share[:, 0]  # the partner's share of what the classifier reads
    # the partner share after each block on its grid (a ViT's: the mix's patch grid; later stages: coarser)
    states = []
    for labels, grid in observed:
        grid = grid or (m.grid_size if labels.shape[1] == P + m.num_tokens else None)
        if grid is None:
            raise ValueError(
                f'--model: tokenaug-viz tl-align draws label states on a token grid; {type(model).__name__} '
                'keeps its tokens in another order (TLAlign.label_states gives them as rows)'
            )
        states.append(labels[:, P:, 0].reshape(-1, *grid))
    initial_state = labels0[:, P:, 0].reshape(-1, *m.grid_size)

    def picture(state):  # each grid over the whole image (Swin's later stages: coarser tokens)
        gh, gw = state.shape[1:]
        return share_image(state, m.img_size, (m.img_size[0] // gh, m.img_size[1] // gw))

    mean, std = data_config['mean'], data_config['std']
    own, mixed = images_uint8(x, mean, std), images_uint8(xm, mean, std)
    names = class_names_of(dataset, args.num_classes)
    initial, final = picture(initial_state), picture(states[-1])
    branches = [branch(m, i, mix_kind) for i in range(count)]
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
    title = f"TL-Align on {args.model} ({drawn(branches)}; red: the partner's label)"
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
        drawn=drawn(branches),
        patch_size=list(m.patch_size),
        img_size=list(m.img_size),
        block_grids=[list(h.shape[1:]) for h in states],
        samples=meta_samples,
    )
    return write_index(out, f'tokenaug-viz tl-align: {args.model}', pages, meta)
