"""Per-class test accuracy of a ``bench/study.py`` study's timm runs; the evaluator itself is
:mod:`timm_plugin.tools.study_eval` (re-exported here for the bench scripts).

    .venv/bin/python bench/study_eval.py --out study_out --runs plain cutmix tl_align [--seeds 5]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from timm_plugin.tools.study_eval import evaluate_run, load_split, model_split, predictions, run_model, top1

__all__ = ['evaluate_run', 'load_split', 'model_split', 'predictions', 'run_model', 'top1', 'per_class', 'main']


def per_class(out: Path, runs: list[str], seeds: list[int]) -> str:
    """A markdown table: per run, the test accuracy of each class (mean over ``seeds``) and the most frequent
    confusion (true -> predicted class, the share of the true class's test images, mean over seeds)."""
    test_root = out / 'test_world' / 'imagenet'
    classes = None
    rows = []
    for name in runs:
        accs, confusions = [], []
        for seed in seeds:
            model = run_model(out / 'runs' / name / f'seed{seed}')
            images, targets = model_split(model, test_root)
            pred = predictions(model, images)
            k = int(targets.max()) + 1
            conf = torch.zeros(k, k, dtype=torch.long)
            conf.index_put_((targets, pred), torch.ones_like(pred), accumulate=True)
            share = conf.double() / conf.sum(1, keepdim=True)
            accs.append(share.diagonal().clone())
            confusions.append(share.fill_diagonal_(0))
        acc, conf = torch.stack(accs).mean(0), torch.stack(confusions).mean(0)
        i = int(conf.argmax())
        if classes is None:
            classes = sorted(p.name for p in (test_root / 'val').iterdir())
        worst = f'{classes[i // k]} -> {classes[i % k]} {100 * conf.flatten()[i]:.1f} %'
        rows.append(f'| {name} | ' + ' | '.join(f'{100 * a:.1f}' for a in acc) + f' | {worst} |')
    head = f'| run (mean of seeds {", ".join(map(str, seeds))}) | ' + ' | '.join(c.split('_')[0] for c in classes)
    return '\n'.join([head + ' | most frequent confusion |', '|---' * (k + 2) + '|', *rows])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Per-class test accuracy of a study's timm runs (bench/study.py --out).")
    p.add_argument('--out', type=Path, required=True, help="the study's --out folder")
    p.add_argument('--runs', nargs='+', required=True, help='timm runs of the study (cutmix, tl_align, ...)')
    p.add_argument('--seeds', type=int, default=5, help='seeds 0 .. N-1 (default 5)')
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error(f'--seeds: expected >= 1, got {args.seeds}')
    seeds = list(range(args.seeds))
    missing = [f'{n} seed {s}' for n in args.runs for s in seeds if not (args.out / 'runs' / n / f'seed{s}').is_dir()]
    if missing:
        p.error(f'--runs / --seeds: no run folder under {args.out / "runs"} for {", ".join(missing)}')
    print(per_class(args.out, args.runs, seeds))


if __name__ == '__main__':
    main()
