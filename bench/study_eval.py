"""The study's test evaluation: a ``tokenaug-train`` run's final checkpoint on a larger held-out split, in process.

``bench/study.py`` trains on a small world and evaluates each run on its 500 val images, whose binomial standard
error (about 1.9 points at 75 %) is as large as the effects the study looks for. Its table reads instead the top-1
of each final checkpoint on the *test world* (the same generator, seed and classes with 500 val images per class:
its first val images are the world's own). This module rebuilds each run's model as ``tokenaug-train`` built it
(``args.yaml``: :func:`timm_plugin.recipe.build_model`; the aux head of token labeling and the ScoreNets of
TokenMixup's HTM from the checkpoint's keys, :func:`timm_plugin.recipe.attach_modules_in`), loads the checkpoint
strictly, and
predicts as the training's validation does (token labeling: ``cls + 0.5 · max_tokens(aux)`` by ``--head-rule``;
HTM: the plain forward, the ScoreNets only act in training). Each split is decoded and transformed once, with
timm's eval transform of the model's data config (as ``tokenaug-train``'s validation and ``tokenaug-occlusion``),
so a run costs one forward pass over the split.

Before a run's test top-1 counts, :func:`evaluate_run` checks the evaluator against the training: the same
checkpoint on the world's val split must give the run's own final val top-1 (``results.json``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml
from timm.data import create_transform

from shared_core.checkpoint_io import load_checkpoint_file
from timm_plugin.occlusion import data_config
from timm_plugin.recipe import attach_modules_in, build_model
from timm_plugin.tasks import TokenLabelingEval
from timm_plugin.token_labeling import TokenLabeling
from timm_plugin.tools.common import split_dataset

_SPLITS: dict = {}  # (root, split, transform repr) -> (images, targets)


def load_split(root: Path, split: str, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Every image of ``root/split`` through timm's eval transform of ``config``, stacked ``(N, 3, H, W)``, and its
    class indices; decoded once per (split, transform) in this process."""
    transform = create_transform(**config, is_training=False)
    key = (str(root), split, repr(transform))
    if key not in _SPLITS:
        dataset, split_root = split_dataset(str(root), split, transform)
        if len(dataset) == 0:
            raise FileNotFoundError(f'{split_root}: no images')
        images, targets = zip(*(dataset[i] for i in range(len(dataset))))
        _SPLITS[key] = torch.stack(images), torch.tensor(targets)
    return _SPLITS[key]


def run_model(run_dir: Path, device: torch.device | str = 'cpu') -> torch.nn.Module:
    """The eval-mode predictor of a ``tokenaug-train`` run (``args.yaml`` and ``last.pth.tar`` under ``run_dir``) on
    ``device``: the model, or for token labeling the training's own eval wrapper (``.model`` is the model)."""
    args = argparse.Namespace(**yaml.safe_load((run_dir / 'args.yaml').read_text()))
    args.pretrained, args.pretrained_path, args.initial_checkpoint = False, None, ''
    model = build_model(args)
    state = load_checkpoint_file(run_dir / 'last.pth.tar')['state_dict']  # weights only; a bad file named
    aux = any(k.startswith('aux_head.') for k in state)  # token labeling (LV-ViT's own aux head too)
    attach_modules_in(model, state)
    model.load_state_dict(state)  # strict: every key of the checkpoint, and only those
    model.to(device).eval()
    if not aux:
        return model
    return TokenLabelingEval(model, TokenLabeling(model, mix_token=False, head_rule=args.head_rule))


def model_split(model: torch.nn.Module, root: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``root/val`` through the eval transform of ``model``'s data config (a wrapper's ``.model``)."""
    return load_split(root, 'val', data_config(getattr(model, 'model', model), None, None))


def top1(model: torch.nn.Module, images: torch.Tensor, targets: torch.Tensor, device='cpu') -> float:
    """Top-1 accuracy in % of ``model`` (on ``device``) on the stacked split."""
    return 100.0 * int((predictions(model, images, device).cpu() == targets).sum()) / len(images)


@torch.inference_mode()
def predictions(model: torch.nn.Module, images: torch.Tensor, device='cpu', batch_size: int = 250) -> torch.Tensor:
    """The predicted class of every image of a stacked split (``model`` on ``device``)."""
    return torch.cat([model(chunk.to(device)).argmax(-1) for chunk in images.split(batch_size)])


def evaluate_run(run_dir: Path, test_root: Path, val_root: Path, val_top1: float, tolerance: float = 0.2) -> dict:
    """``{'top1': test top-1, 'images': N, 'val_top1': the check}`` of the run's final checkpoint on
    ``test_root/val``, after checking that the evaluator gives the run's own final val top-1 (``val_top1``) on
    ``val_root/val`` within ``tolerance`` points (on the CPU they agree exactly; another device's kernels at
    another batch size may flip a borderline image)."""
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    model = run_model(run_dir, device)
    check = top1(model, *model_split(model, val_root), device)
    if abs(check - val_top1) > tolerance:
        raise RuntimeError(
            f'{run_dir}: the study evaluator gives {check:.2f} on the val split, the training reported {val_top1}; '
            "the test top-1 would not be the training's evaluation"
        )
    images, targets = model_split(model, test_root)
    return dict(top1=round(top1(model, images, targets, device), 2), images=len(images), val_top1=round(check, 2))


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
