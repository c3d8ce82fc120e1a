#!/usr/bin/env python3
"""The size study: where token-aware targets pay off, against the share of the image the object covers.

The papers' argument for token-aware targets is that a CutMix box's area is a wrong label when the object is small
or off-centre: a box that covers 40 % of the image may show all of a small object, or none of it. The world lets us
turn exactly that knob. This runner builds one world per object-size range (``SIZES``: the main object covers 3-10,
8-35 (``tokenaug-data``'s default) or 30-70 % of the image; the same generator seed, classes, split sizes and extra
objects), and on each runs ``tokenaug-study`` (``bench/study.py``'s preset: its data layout, recipe and seeds) on
CutMix, TL-Align, TransMix and TokenMix blocks with activation-map targets (``SIZE_RUNS``, tokenaug-study's names):
the annotator and its ``tokenaug-maps`` per world, the trainings and their test evaluations.

It writes under ``--out``, besides each size's own study folder (``OUT/<size>/``, the layout of ``bench/study.py``,
with tokenaug-study's ``results.md``):

- ``study_size.md``: the knob (per size, the share of CutMix boxes whose area label is off by more than 0.2 from
  the share of the objects the mixed image shows: :func:`area_label_error`), each run's test top-1 per size, each
  method's paired difference to CutMix per size with its 95 % interval, and TL-Align against CutMix at the size
  where the area labels are most wrong, over ``--tl-align-seeds`` seeds;
- ``study_size.json`` (every step's record) and ``study_size.png`` (the differences against size, and the knob).

Resumable as ``tokenaug-study`` (each step keeps its command; a rerun skips what is done). The order is chosen so
that a stopped study leaves whole results behind: every world and its knob first, then each size's grid (seed by
seed, as tokenaug-study runs it) and its test evaluations, then TL-Align's extra seeds (a second tokenaug-study on
that size's folder, which skips the seeds the grid trained).

    .venv/bin/python bench/study_size.py [--preset cpu_small] [--out study_size_out] [--seeds 5]
        [--tl-align-seeds 16] [--sizes small medium large] [--runs cutmix tl_align ...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / 'bench')]
from study import LABELS, PRESETS, Tally, area_range, data_dir, timm_study, world_step

from shared_core.study import Step, interval, mean_sd, paired
from shared_core.study import verdict as shared_verdict

#: the main object's share of the image per world (tokenaug-data --min-area/--max-area). The large range's upper
#: end is reached by the round shapes only: a star, a triangle, an arrow or an L-shape fits at most about 45 % of
#: a square image, so those classes draw from 30-45 %.
SIZES = {'small': (0.03, 0.10), 'medium': (0.08, 0.35), 'large': (0.30, 0.70)}
#: the baseline, and the methods compared with it at every size
BASELINE = 'cutmix'
SIZE_RUNS = ['cutmix', 'tl_align', 'transmix', 'tokenmix_block_maps']
#: the knob's measurement: CutMix pairs drawn per world, and the error beyond which an area label counts as wrong
KNOB_PAIRS, KNOB_SEED, KNOB_OFF = 4000, 0, 0.2


def world_masks(world: Path) -> tuple[list, list]:
    """The train split's main-object masks, ``(H, W)`` bool each, in the ImageNet folders' order, and their classes:
    from the ADE20K label maps the world wrote beside them (``0`` background, ``k + 1`` class ``k``; a scene's extra
    objects are of other classes, so the main object is every pixel of its class)."""
    import numpy as np
    from PIL import Image

    masks, classes = [], []
    for folder in sorted((world / 'imagenet' / 'train').iterdir()):
        k = int(folder.name.split('_')[0])
        for jpg in sorted(folder.glob('*.jpg')):
            label = np.asarray(Image.open(world / 'ade20k' / 'annotations' / 'training' / f'{jpg.stem}.png'))
            mask = label == k + 1
            if not mask.any():
                raise ValueError(f'{jpg}: its ADE20K label map has no pixel of its class {k}')
            masks.append(mask)
            classes.append(k)
    if not masks:
        raise FileNotFoundError(f'{world / "imagenet" / "train"}: no images')
    return masks, classes


def object_share(mask_a, mask_b, box) -> float | None:
    """B's weight in a CutMix of A (outside ``box``) and B (inside) by what the mix shows of each main object:
    ``v_B / (v_A + v_B)``, ``v_A`` the fraction of ``mask_a``'s pixels outside the box, ``v_B`` the fraction of
    ``mask_b``'s inside it; ``None`` where neither object shows. ``box`` is timm's ``(y0, y1, x0, x1)``, ends
    exclusive."""
    y0, y1, x0, x1 = box
    inside_b = mask_b[y0:y1, x0:x1].sum() / mask_b.sum()
    outside_a = 1.0 - mask_a[y0:y1, x0:x1].sum() / mask_a.sum()
    if inside_b + outside_a == 0:
        return None
    return float(inside_b / (inside_b + outside_a))


def area_label_error(world: Path, pairs: int = KNOB_PAIRS, seed: int = KNOB_SEED, off: float = KNOB_OFF) -> dict:
    """How wrong CutMix's area labels are on a world's train scenes.

    ``pairs`` random pairs (A, B) of train scenes, each with a CutMix box drawn as the recipe draws it (timm's
    ``cutmix_bbox_and_lam`` with λ ~ Beta(1, 1) and ``correct_lam``): the mixed image shows A outside the box and B
    inside, and its area label gives B the weight ``1 - λ``, the box's share of the image. The *object share* gives
    B the weight ``v_B / (v_A + v_B)``, where ``v_A`` is the fraction of A's main object outside the box and ``v_B``
    the fraction of B's inside it (the label of a mix whose target follows what each object shows). Returns the
    share of pairs whose two weights differ by more than ``off``, the mean absolute difference, the pairs where no
    object is visible (``v_A = v_B = 0``: no object share; left out of both) and the mean main-object coverage.
    Measured on the full scenes at the world's size, before the training's random crop."""
    import numpy as np
    from timm.data.mixup import cutmix_bbox_and_lam

    masks, _ = world_masks(world)
    h, w = masks[0].shape
    rng = np.random.default_rng(seed)
    state = np.random.get_state()  # timm draws the box from numpy's global generator, as in training
    np.random.seed(seed)
    try:
        errors, invisible = [], 0
        for _ in range(pairs):
            a, b = rng.choice(len(masks), 2, replace=False)
            box, lam = cutmix_bbox_and_lam((h, w), float(np.random.beta(1.0, 1.0)), correct_lam=True)
            share = object_share(masks[a], masks[b], box)
            if share is None:
                invisible += 1
            else:
                errors.append(abs((1.0 - lam) - share))
    finally:
        np.random.set_state(state)
    errors = np.array(errors)
    return dict(
        share_off=round(float((errors > off).mean()), 4),
        mean_error=round(float(errors.mean()), 4),
        invisible=invisible,
        pairs=pairs,
        coverage=round(float(np.mean([m.mean() for m in masks])), 4),
    )


def size_preset(preset: dict, size: str) -> dict:
    """The preset on a size's world: its main-object area, and the world also in the ADE20K layout (its masks)."""
    return dict(preset, area=SIZES[size], world_formats='imagenet,ade20k')


def knob(out: Path, size: str, world: Step, tally: Tally) -> dict:
    """The knob of a size's world (:func:`area_label_error`), kept as a step of the world (computed here)."""
    step = Step(out / size / 'knob', ['area_label_error', KNOB_PAIRS, KNOB_SEED, KNOB_OFF], [world.key])
    rec = step.done()
    if rec is not None:
        print(f'  {size}: area labels: done before, skipped', flush=True)
        return tally.add(f'{size}: area labels', rec, before=True)
    step.start()
    t = time.time()
    rec = step.finish(**area_label_error(world.dir), secs=round(time.time() - t, 1))
    print(f'  {size}: area labels: {rec["share_off"]:.1%} off by > {KNOB_OFF} ({rec["secs"]:.0f} s)', flush=True)
    return tally.add(f'{size}: area labels', rec, before=False)


def render(record: dict, preset_name: str, preset: dict, tl_size: str | None, wall: float, cpu: float) -> str:
    """``study_size.md``: the knob, the per-size runs and differences, and TL-Align's extra seeds."""
    labels = LABELS
    sizes = list(record['knob'])
    vit = preset['vit']
    ranges = ', '.join(f'{s} {area_range(dict(area=SIZES[s]))}' for s in sizes)
    lines = [
        f"Preset `{preset_name}` (`bench/study.py`) on worlds that differ only in the main object's share of the "
        f'image ({ranges}): {preset["train_per_class"]} train / {preset["test_per_class"]} test images per class, '
        f'ViT depth {vit["depth"]}, width {vit["embed_dim"]}, {preset["epochs"]} epochs. Test top-1 of the final '
        f'checkpoints. Steps: {wall / 60:.0f} min of wall time, {cpu / 60:.0f} min of CPU time.',
        '',
        f"The knob: {KNOB_PAIRS} CutMix pairs per world (timm's box, λ ~ Beta(1, 1)); the share whose area label "
        f"(the box's share of the image) is off by more than {KNOB_OFF} from the object share (the fraction of each "
        'main object the mix shows, normalised), and the mean absolute difference:',
        '',
        '| size | main object | mean coverage | area label off by > 0.2 | mean error | pairs with no object visible |',
        '|---|---|---|---|---|---|',
    ]
    for s in sizes:
        k = record['knob'][s]
        lines.append(
            f'| {s} | {area_range(dict(area=SIZES[s]))} | {k["coverage"]:.1%} | {k["share_off"]:.1%} | '
            f'{k["mean_error"]:.3f} | {k["invisible"]} |'
        )
    lines += ['', '| run | ' + ' | '.join(f'{s}: test top-1 mean ± sd (seeds)' for s in sizes) + ' |']
    lines.append('|---' * (len(sizes) + 1) + '|')
    top1 = record['top1']
    runs = [n for n in SIZE_RUNS if any(n in top1[s] for s in sizes)]
    for n in runs:
        cells = []
        for s in sizes:
            values = top1[s].get(n, [])
            m, sd = mean_sd(values) if values else (math.nan, math.nan)
            cells.append(f'{m:.2f} ± {sd:.2f} ({len(values)})' if values else '–')
        lines.append(f'| {labels[n]} | ' + ' | '.join(cells) + ' |')
    lines += ['', f'Paired differences to {labels[BASELINE]} (same seeds; mean and 95 % t interval):', '']
    lines += ['| method | ' + ' | '.join(sizes) + ' |', '|---' * (len(sizes) + 1) + '|']
    for n in runs:
        if n != BASELINE:
            cells = []
            for s in sizes:
                d = record['diffs'][s].get(n)
                cells.append(f'{d["mean"]:+.2f} {interval(d)}' if d else '–')
            lines.append(f'| {labels[n]} | ' + ' | '.join(cells) + ' |')
    tl = record.get('tl_align')
    if tl:
        d = tl['diff']
        verdict = shared_verdict(d)
        lines += [
            '',
            f'TL-Align − CutMix at the size where area labels are most wrong ({tl_size}), over {len(d["diffs"])} '
            f'seeds: **{d["mean"]:+.2f} {interval(d)}**, sd of the paired differences {d["sd"]:.2f}; {verdict}.',
        ]
    return '\n'.join(lines)


def plot(record: dict, path: Path) -> Path:
    """The differences to CutMix against the mean object coverage (95 % intervals as bars), beside the knob."""
    from shared_core.plotting import pyplot

    plt = pyplot()
    labels = LABELS
    sizes = list(record['knob'])
    x = [record['knob'][s]['coverage'] * 100 for s in sizes]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.8), layout='constrained')
    methods = [n for n in SIZE_RUNS if n != BASELINE and any(n in record['diffs'][s] for s in sizes)]
    colors = {}

    def shift(i: int) -> float:  # the i-th method's offset at a size, side by side around it
        return (i - (len(methods) - 1) / 2) * 0.8

    for i, n in enumerate(methods):
        pts = [(xi, record['diffs'][s][n]) for xi, s in zip(x, sizes) if n in record['diffs'][s]]
        xs = [p[0] + shift(i) for p in pts]
        means = [p[1]['mean'] for p in pts]
        halves = [p[1]['half'] if len(p[1]['diffs']) > 1 else 0.0 for p in pts]
        colors[n] = left.errorbar(xs, means, yerr=halves, marker='o', capsize=4, label=labels[n])[0].get_color()
    tl = record.get('tl_align')
    if tl and len(tl['seeds']) > len(record['seeds']):  # TL-Align's extra seeds, to the left of its size's points
        d = tl['diff']
        at = x[sizes.index(tl['size'])] + shift(-1)
        left.errorbar(
            [at], [d['mean']], yerr=[d['half']], marker='s', mfc='white', color=colors.get('tl_align'), capsize=4,
            label=f'{labels["tl_align"]}, {len(tl["seeds"])} seeds',
        )  # fmt: skip
    left.axhline(0, color='grey', lw=0.8)
    left.set_xlabel('mean main-object coverage of the image (%): ' + ', '.join(sizes))
    left.set_ylabel(f'test top-1 − {labels[BASELINE]} (points)')
    left.set_title('Paired difference to CutMix, 95 % interval')
    left.legend(fontsize=8, loc='upper center', bbox_to_anchor=(0.5, -0.16), ncol=2)  # below: the bars fill the axes
    right.bar([str(s) for s in sizes], [record['knob'][s]['share_off'] * 100 for s in sizes], color='tab:grey')
    right.set_ylabel(f'CutMix pairs with area label off by > {KNOB_OFF} (%)')
    right.set_title('The knob: how wrong the area label is')
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None, runner=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--preset', choices=sorted(PRESETS), default='cpu_small')
    p.add_argument('--out', type=Path, default=REPO / 'study_size_out')
    p.add_argument('--seeds', type=int, help="seeds of every run at every size (0, 1, ...); default: the preset's")
    p.add_argument(
        '--tl-align-seeds',
        type=int,
        default=16,
        help='seeds of TL-Align and CutMix at the size whose area labels are most wrong (default 16: the whole '
        'study in about 3 h at 2 min a run on 2 cores; more seeds resume from there)',
    )
    p.add_argument('--sizes', nargs='+', choices=list(SIZES), default=list(SIZES), metavar='SIZE')
    p.add_argument('--runs', nargs='+', choices=SIZE_RUNS, default=SIZE_RUNS, metavar='RUN')
    args = p.parse_args(argv)
    preset = dict(PRESETS[args.preset])
    if args.seeds is not None:
        if args.seeds < 1:
            p.error(f'--seeds must be >= 1, got {args.seeds}')
        preset['seeds'] = args.seeds
    if BASELINE not in args.runs:
        p.error(f'--runs: every comparison is to {BASELINE}, which must be among them')
    if args.tl_align_seeds < preset['seeds'] and 'tl_align' in args.runs:
        p.error(f'--tl-align-seeds must be >= --seeds ({preset["seeds"]}), got {args.tl_align_seeds}')
    seeds = list(range(preset['seeds']))
    out = args.out.resolve()
    sizes = [s for s in SIZES if s in args.sizes]
    runs = [n for n in SIZE_RUNS if n in args.runs]
    t0 = time.time()
    print(f'== size study, preset {args.preset}: sizes {", ".join(sizes)}, runs {", ".join(runs)}, out {out}')
    tally, knobs = Tally(), {}
    for s in sizes:  # every world and its knob first
        world = world_step(out / s, size_preset(preset, s), tally)
        world_step(out / s, size_preset(preset, s), tally, test=True)
        data_dir(out / s)
        knobs[s] = knob(out, s, world, tally)
    tl_size = max(sizes, key=lambda s: knobs[s]['share_off']) if 'tl_align' in runs else None
    results, tests = {}, {}
    for s in sizes:  # then each size's grid, seed by seed, and its test evaluations
        study, results[s], tests[s] = timm_study(out / s, size_preset(preset, s), runs, len(seeds), runner)
        tally.take(study, f'{s} ')
    if tl_size is not None and args.tl_align_seeds > len(seeds):  # then TL-Align's extra seeds
        study, extra, extra_tests = timm_study(
            out / tl_size, size_preset(preset, tl_size), [BASELINE, 'tl_align'], args.tl_align_seeds, runner
        )
        tally.take(study, f'{tl_size} ')
        results[tl_size] |= extra
        tests[tl_size] |= extra_tests
    record = dict(preset=args.preset, settings=preset, sizes={s: SIZES[s] for s in sizes}, seeds=seeds)
    record['knob'] = {s: {k: v for k, v in knobs[s].items() if k not in ('key', 'cmd')} for s in sizes}
    record['top1'] = {
        s: {n: [tests[s][n, i]['top1'] for i in sorted(i for m, i in tests[s] if m == n)] for n in runs} for s in sizes
    }
    record['diffs'] = {
        s: {
            n: paired([tests[s][n, i]['top1'] for i in seeds], [tests[s][BASELINE, i]['top1'] for i in seeds])
            for n in runs
            if n != BASELINE
        }
        for s in sizes
    }
    if tl_size is not None:
        all_seeds = sorted(i for m, i in tests[tl_size] if m == 'tl_align')
        top = [[tests[tl_size][n, i]['top1'] for i in all_seeds] for n in ('tl_align', BASELINE)]
        record['tl_align'] = dict(size=tl_size, seeds=all_seeds, diff=paired(*top))
    record['runs'] = {f'{s} {n} seed {i}': r for s in sizes for (n, i), r in results[s].items()}
    record['test'] = {f'{s} {n} seed {i}': r for s in sizes for (n, i), r in tests[s].items()}
    record['steps_run'], record['steps_skipped'] = len(tally.ran), len(tally.skipped)
    text = render(record, args.preset, preset, tl_size, tally.secs, tally.cpu_secs)
    (out / 'study_size.md').write_text(text + '\n')
    (out / 'study_size.json').write_text(json.dumps(record, indent=1) + '\n')
    plot(record, out / 'study_size.png')
    print('\n' + text)
    print(f'\n({record["steps_run"]} steps run, {record["steps_skipped"]} skipped, {time.time() - t0:.0f} s; {out})')
    return record


if __name__ == '__main__':
    main()
