"""The studies' test evaluation: a ``tokenaug-train`` run's final checkpoint on a held-out split, in process
(``tokenaug-study``, ``bench/study.py``).

A small val split's binomial standard error (about 1.9 points at 75 % on 500 images) is as large as the effects a
study looks for, so the studies read the top-1 of each final checkpoint on a larger test split. This module
rebuilds each run's model as ``tokenaug-train`` built it
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


def model_split(model: torch.nn.Module, root: Path, split: str = 'val') -> tuple[torch.Tensor, torch.Tensor]:
    """``root/split`` through the eval transform of ``model``'s data config (a wrapper's ``.model``)."""
    return load_split(root, split, data_config(getattr(model, 'model', model), None, None))


def top1(model: torch.nn.Module, images: torch.Tensor, targets: torch.Tensor, device='cpu') -> float:
    """Top-1 accuracy in % of ``model`` (on ``device``) on the stacked split."""
    return 100.0 * int((predictions(model, images, device).cpu() == targets).sum()) / len(images)


@torch.inference_mode()
def predictions(model: torch.nn.Module, images: torch.Tensor, device='cpu', batch_size: int = 250) -> torch.Tensor:
    """The predicted class of every image of a stacked split (``model`` on ``device``)."""
    return torch.cat([model(chunk.to(device)).argmax(-1) for chunk in images.split(batch_size)])


def evaluate_run(
    run_dir: Path,
    test_root: Path,
    val_root: Path,
    val_top1: float,
    tolerance: float = 0.2,
    test_split: str = 'val',
    val_split: str = 'val',
    device=None,
) -> dict:
    """``{'top1': test top-1, 'images': N, 'val_top1': the check}`` of the run's final checkpoint on
    ``test_root/test_split``, after checking that the evaluator gives the run's own final val top-1 (``val_top1``)
    on ``val_root/val_split`` within ``tolerance`` points (on the CPU they agree exactly; another device's kernels
    at another batch size may flip a borderline image)."""
    device = torch.device(device or ('cuda' if torch.cuda.is_available() else 'cpu'))
    model = run_model(run_dir, device)
    check = top1(model, *model_split(model, val_root, val_split), device)
    if abs(check - val_top1) > tolerance:
        raise RuntimeError(
            f'{run_dir}: the study evaluator gives {check:.2f} on the val split, the training reported {val_top1}; '
            "the test top-1 would not be the training's evaluation"
        )
    images, targets = model_split(model, test_root, test_split)
    return dict(top1=round(top1(model, images, targets, device), 2), images=len(images), val_top1=round(check, 2))
