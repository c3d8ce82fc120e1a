"""``tokenaug-occlusion``: top-1 / top-5 accuracy vs the fraction of dropped patches (TokenMix, Fig. 5).

TokenMix (the TokenMix paper, Sec. 5.3 "TokenMix enhances the occlusion robustness of vision transformers",
Fig. 4 and Fig. 5) evaluates a converged DeiT-S on ImageNet val while "we gradually drop 10% more
patches and set the pixels inside to zero": top-1 vs drop ratio 0 %, 10 %, ..., 90 %. This is the
random PatchDrop protocol of Naseer et al. 2021, "Intriguing Properties of Vision Transformers" (random
patches of the model's 16 x 16 px patch grid are blanked out). This tool runs that sweep for any timm
classifier and checkpoint::

    tokenaug-occlusion --data-dir DIR [--split val] --model NAME
                       [--checkpoint FILE [--use-ema]] [--model-kwargs k=v ...]
                       [--num-classes N] [--ratios 0 0.1 ... 0.9] [--mode zero|drop]
                       [--fill zero|black] [--patch-size P] [--img-size S] [--seed 0]
                       [--repeats 1] [-b 64] [-j 2] [--device cpu|cuda] [--amp] [--out DIR]

and writes ``OUT/occlusion.csv``, ``OUT/occlusion.md`` and ``OUT/occlusion.png`` (and prints the table).

The protocol: :mod:`timm_plugin.occlusion`.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import Sequence

from timm.data import create_transform

from tokenaug.tool_args import occlusion_parser

from ..annotator import create_annotator
from ..image_data import UnreadableImageError
from ..occlusion import (
    CSV_FIELDS,
    Indexed,
    check_drop_model,
    check_ratios,
    data_config,
    evaluate,
    fill_values,
    patch_grid,
)
from .common import batches_raising_plainly, parse_model_kwargs, resolve_device, split_dataset

__all__ = ['write_results', 'format_table', 'parse_args', 'run', 'main']


# ----------------------------------------------------------------------------------------- output
def shows_top5(num_classes) -> bool:
    """Top-5 says something only with more than 5 classes (with 5 or fewer it is 100 % whatever the model)."""
    return num_classes is None or num_classes > 5


def format_table(rows: Sequence[dict], repeats: int = 1, num_classes=None) -> str:
    """Markdown table of the rows (``± std`` over repeats when there are several); no top-5 column with 5
    classes or fewer."""

    def acc(row: dict, key: str) -> str:
        return f'{row[key]:.2f}' + (f' ± {row[key + "_std"]:.2f}' if repeats > 1 else '')

    top5 = shows_top5(num_classes)
    lines = ['| drop ratio | dropped patches | top-1 (%) |' + (' top-5 (%) |' if top5 else ''), '|---:|---:|---:|']
    lines[1] += '---:|' if top5 else ''
    for row in rows:
        lines.append(
            f'| {row["ratio"]:.0%} | {row["dropped_patches"]}/{row["num_patches"]} | '
            f'{acc(row, "top1")} |' + (f' {acc(row, "top5")} |' if top5 else '')
        )
    return '\n'.join(lines)


def _plot(rows: Sequence[dict], path: Path, title: str, num_classes=None) -> None:
    from shared_core.plotting import pyplot

    plt = pyplot()

    x = [100 * row['ratio'] for row in rows]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    curves = (('top1', 'o-'), ('top5', 's--')) if shows_top5(num_classes) else (('top1', 'o-'),)
    for key, style in curves:
        y, err = [row[key] for row in rows], [row[key + '_std'] for row in rows]
        ax.errorbar(x, y, yerr=err if any(err) else None, fmt=style, capsize=3, label=key.replace('top', 'top-'))
    ax.set_xlabel('drop ratio (% of patches)')
    ax.set_ylabel('accuracy (%)')
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(
    rows: Sequence[dict],
    out: str | Path,
    *,
    header: str,
    repeats: int = 1,
    title: str | None = None,
    num_classes: int | None = None,
) -> dict[str, Path]:
    """``occlusion.csv`` (one row per ratio), ``occlusion.md`` (header + table) and ``occlusion.png`` in ``out``;
    with ``num_classes`` <= 5 the table and the plot leave top-5 out (it is 100 %; the CSV keeps it)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {'csv': out / 'occlusion.csv', 'md': out / 'occlusion.md', 'png': out / 'occlusion.png'}
    with open(paths['csv'], 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    table = format_table(rows, repeats, num_classes)
    paths['md'].write_text(f'# Occlusion robustness\n\n{header}\n\n{table}\n')
    _plot(rows, paths['png'], title or header.splitlines()[0], num_classes)
    return paths


# -------------------------------------------------------------------------------------------- CLI
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = occlusion_parser()
    args = parser.parse_args(argv)
    try:
        args.ratios = check_ratios(args.ratios)
    except ValueError as e:
        parser.error(str(e))
    checks = {
        'seed': args.seed >= 0,
        'repeats': args.repeats >= 1,
        'batch_size': args.batch_size >= 1,
        'workers': args.workers >= 0,
        'patch_size': args.patch_size is None or args.patch_size >= 1,
        'img_size': args.img_size is None or args.img_size >= 1,
    }
    for name, ok in checks.items():
        if not ok:
            parser.error(
                f'--{name.replace("_", "-")}: got {getattr(args, name)}, expected '
                f'{">= 0" if name in ("seed", "workers") else ">= 1"}'
            )
    if args.crop_pct is not None and not 0.0 < args.crop_pct <= 1.0:  # NaN too; 0 would be read as the default
        parser.error(f'--crop-pct: got {args.crop_pct}, expected a fraction in (0, 1]')
    return args


def run(args: argparse.Namespace) -> list[dict]:
    """The whole CLI run: model, data, sweep, files; returns the rows."""
    device = resolve_device(args.device)
    model = create_annotator(
        args.model,
        checkpoint=args.checkpoint,
        num_classes=args.num_classes,
        model_kwargs=parse_model_kwargs(args.model_kwargs),
        use_ema=args.use_ema,
    )
    if args.mode == 'drop':
        check_drop_model(model)
    model.to(device)
    config = data_config(model, args.img_size, args.crop_pct)
    grid, patch = patch_grid(model, config['input_size'][-2:], args.patch_size, args.mode)
    transform = create_transform(**config, is_training=False)
    images, root = split_dataset(args.data_dir, args.split, transform)
    if len(images) == 0:
        raise FileNotFoundError(f'--data-dir {args.data_dir} / --split {args.split!r}: no images under {root}')
    dataset = Indexed(images)
    loader = batches_raising_plainly(
        dataset,
        (UnreadableImageError,),
        batch_size=args.batch_size,
        shuffle=False,
        num_workers=args.workers,
        pin_memory=device.type == 'cuda',
    )
    fill = fill_values(args.fill, config['mean'], config['std'])
    rows = evaluate(
        model,
        loader,
        grid=grid,
        patch=patch,
        ratios=args.ratios,
        mode=args.mode,
        fill=fill,
        seed=args.seed,
        repeats=args.repeats,
        device=device,
        amp=args.amp,
        progress=not args.no_progress,
    )
    weights = f'{args.checkpoint}{" (EMA)" if args.use_ema else ""}' if args.checkpoint else 'random weights'
    header = (
        f'{args.model} ({weights}), mode {args.mode}' + (f' (fill {args.fill})' if args.mode == 'zero' else '') + '\n\n'
        f'data {args.data_dir} / {args.split or "."}: {len(dataset)} images at '
        f'{config["input_size"][1]}x{config["input_size"][2]}, {grid[0]}x{grid[1]} patches of '
        f'{patch[0]}x{patch[1]} px; seed {args.seed}, {args.repeats} repeat(s)'
    )
    title = f'{args.model} ({Path(args.checkpoint).name if args.checkpoint else "random weights"}), mode {args.mode}'
    classes = model.num_classes
    if not shows_top5(classes):
        header += f'; top-5 left out: {classes} classes'
    paths = write_results(rows, args.out, header=header, repeats=args.repeats, title=title, num_classes=classes)
    table = format_table(rows, args.repeats, classes)
    print(f'{header}\n\n{table}\n\nwrote {", ".join(str(p) for p in paths.values())}')
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except (ValueError, FileNotFoundError, UnreadableImageError) as e:
        print(f'tokenaug-occlusion: error: {e}', file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main())
