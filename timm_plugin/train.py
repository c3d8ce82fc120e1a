#!/usr/bin/env python3
"""``tokenaug-train``: ImageNet-style training with timm's library and token-aware mixing.

Built from timm's parts (``create_model``, ``create_dataset`` / ``create_loader`` with the fast-collate
prefetcher, ``create_optimizer_v2``, ``create_scheduler_v2``, ``ModelEmaV3``, ``CheckpointSaver``,
native AMP, ``torchrun`` DDP through ``init_distributed_device``) with timm ``train.py``'s flag names
and ``-c/--config`` YAML files, plus ``--mixup-type`` (see :mod:`timm_plugin.mixup`).

Without ``--mixup-type`` the mixing follows timm: ``--cutmix > 0`` gives ``cutmix`` (switching with
MixUp when ``--mixup > 0``), ``--mixup > 0`` alone gives ``mixup``.

Checkpoints (``last.pth.tar``, ``model_best.pth.tar``, ``checkpoint-N.pth.tar``) hold only tensors and
plain Python values, so both ``torch.load(..., weights_only=True)`` and
``timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=...), num_classes=...)``
load them; the full arguments are also written to ``args.yaml`` beside them.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import math
import os
import shutil
import sys
import time
from collections import OrderedDict
from contextlib import suppress
from functools import partial
from typing import NamedTuple

import torch
import torchvision
import yaml
from timm import utils
from timm.data import resolve_data_config
from timm.layers import convert_sync_batchnorm, set_fast_norm
from timm.models import resume_checkpoint, safe_model_name
from timm.optim import create_optimizer_v2, optimizer_kwargs
from timm.scheduler import create_scheduler_v2, scheduler_kwargs
from timm.utils import NativeScaler
from timm.utils.model import get_state_dict

from shared_core.checkpoint_io import (
    atomic_output,
    load_checkpoint_file,
    remove_stale_temporaries,
    save_checkpoint_file,
)
from shared_core.map_format import MissingLabelMapError
from shared_core.mix import check_labels
from tokenaug.train_args import DIVERGED, check_numbers, check_supported, parse_args

from .image_data import UnreadableImageError
from .recipe import build_training
from .timm_fixes import fix_posterize
from .train_data import TrainingData, build_data, check_split_folder

_logger = logging.getLogger('tokenaug.train')

# run-time keys, and --overwrite: a config made from args.yaml must not replace a run without being asked
RUNTIME_KEYS = (
    'config',
    'data',
    'distributed',
    'prefetcher',
    'rank',
    'world_size',
    'local_rank',
    'device',
    'overwrite',
)


def plain_args(args) -> dict:
    """The arguments as YAML/JSON-safe values (what goes into checkpoints and args.yaml; the latter is a
    valid ``-c`` config: run-time keys are left out)."""
    out = {}
    for k, v in vars(args).items():
        if k in RUNTIME_KEYS:
            continue
        if isinstance(v, (str, int, float, bool, type(None))):
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(i, (str, int, float, bool)) for i in v):
            out[k] = list(v)
        elif isinstance(v, dict):
            out[k] = json.loads(json.dumps(v, default=str))
        else:
            out[k] = str(v)
    return out


class PlainCheckpointSaver(utils.CheckpointSaver):
    """timm's ``CheckpointSaver`` writing only weights-only-loadable values: ``args`` is stored as a
    dict of plain values instead of an ``argparse.Namespace`` (which ``torch.load(weights_only=True)``,
    used by ``timm.create_model(pretrained=True, ...)`` and ``resume_checkpoint``, refuses), each file
    written whole or not at all (:func:`shared_core.checkpoint_io.save_checkpoint_file`)."""

    def _save(self, save_path, epoch, metric=None):
        save_state = {
            'epoch': epoch,
            'arch': self.args.model,
            'args': plain_args(self.args),
            'optimizer': self.optimizer.state_dict(),
            'version': 2,
            'state_dict': get_state_dict(self.model, self.unwrap_fn),
        }
        if self.amp_scaler is not None:
            save_state[self.amp_scaler.state_dict_key] = self.amp_scaler.state_dict()
        if self.model_ema is not None:
            save_state['state_dict_ema'] = get_state_dict(self.model_ema, self.unwrap_fn)
        if metric is not None:
            save_state['metric'] = float(metric)
        save_state['saver'] = self.state_dict(epoch, metric)
        # written whole or not at all: a full disk is reported as such and leaves no partial file behind
        save_checkpoint_file(save_state, save_path, name='checkpoint')


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of an epoch's random streams (``utils.random_seed`` adds the rank): distinct per epoch."""
    return int(seed) + 100_003 * int(epoch)


def has_wandb() -> bool:
    return importlib.util.find_spec('wandb') is not None


def start_wandb(args, exp_name: str, resume_path: str) -> None:
    """As timm's train.py: a wandb run of the experiment, or a warning when wandb is not installed."""
    if not has_wandb():
        _logger.warning(
            "You've requested to log metrics to wandb but package not found. "
            'Metrics not being logged to wandb, try `pip install wandb`'
        )
        return
    import wandb

    if args.wandb_resume_id and not resume_path:
        raise ValueError('--wandb-resume-id: continues a wandb run, so it needs --resume')
    wandb.init(
        project=args.wandb_project,
        name=exp_name,
        config=plain_args(args),
        tags=args.wandb_tags,
        resume='must' if args.wandb_resume_id else None,
        id=args.wandb_resume_id or None,
    )


#: what a run writes into its --experiment folder (timm's CheckpointSaver names and ours)
RUN_FILES = ('args.yaml', 'summary.csv', 'last.pth.tar', 'model_best.pth.tar', 'results.json')


def carry_best_checkpoint(saver, resume_path: str, output_dir: str) -> None:
    """A run resumed into another ``--experiment`` folder takes the best checkpoint its saver state names along
    (``model_best.pth.tar`` of the resumed run's folder, when it is of that epoch), so that its folder holds the
    file its ``results.json`` names; where it is not there, the best is this run's own from now on."""
    src = os.path.dirname(os.path.abspath(resume_path))
    if os.path.samefile(src, output_dir) or saver.best_epoch is None:
        return
    best, dst = os.path.join(src, 'model_best.pth.tar'), os.path.join(output_dir, 'model_best.pth.tar')
    if os.path.exists(dst):
        return
    if os.path.isfile(best) and load_checkpoint_file(best, 'model_best.pth.tar', mmap=True).get('epoch') == (
        saver.best_epoch
    ):
        shutil.copy2(best, dst)
        _logger.info(f'Copied the best checkpoint so far (epoch {saver.best_epoch}) from {src}')
        return
    _logger.warning(f"{src} has no best checkpoint of epoch {saver.best_epoch}: the best is this run's own from here")
    saver.best_epoch = saver.best_metric = None


def drop_summary_rows(path: str, from_epoch: int) -> None:
    """Remove the rows of epochs ``>= from_epoch`` from a ``summary.csv`` (rewritten whole or not at all): a run
    killed after an epoch's row but before its checkpoint resumes at that epoch and writes its row again."""
    with open(path, newline='') as f:
        rows = list(csv.reader(f))
    if len(rows) < 2 or 'epoch' not in rows[0]:
        return
    col = rows[0].index('epoch')
    keep = [rows[0]] + [r for r in rows[1:] if r and int(float(r[col])) < from_epoch]
    if len(keep) == len(rows):
        return
    with atomic_output(path, 'summary.csv') as tmp, open(tmp, 'w', newline='') as f:
        csv.writer(f).writerows(keep)
    _logger.info(f'{path}: the rows of epochs {from_epoch} on are removed (the resumed run writes them again)')


def _run_file(name: str) -> bool:
    """A file a run writes into its folder: :data:`RUN_FILES`, the saver's ``checkpoint-N`` and ``milestone-N``."""
    return name in RUN_FILES or (name.startswith(('checkpoint-', 'milestone-')) and name.endswith('.pth.tar'))


def check_output_folder(args, resume_path: str) -> None:
    """Refuse to write a fresh run over the run already in ``--output/--experiment`` (its checkpoints, summary and
    args would be replaced): continue it with ``--resume`` of a checkpoint in that folder, or pass ``--overwrite``,
    which removes the old run's files first (none of them is left beside the new run's). A folder without run files
    (or a new timestamped one) is used as it is."""
    if not args.experiment:
        return
    out = os.path.join(args.output or './output/train', args.experiment)
    if not os.path.isdir(out):
        return
    found = sorted(f for f in os.listdir(out) if _run_file(f))
    if not found:
        return
    src = os.path.dirname(os.path.abspath(resume_path)) if resume_path else ''
    if src and os.path.isdir(src) and os.path.samefile(src, out):
        return
    if args.overwrite:
        if int(os.environ.get('RANK', 0)) == 0:  # before the process group exists: one process removes them
            for name in found:
                with suppress(FileNotFoundError):
                    os.remove(os.path.join(out, name))
            _logger.info(f'--overwrite: removed the previous run in {out}: {", ".join(found)}')
        return
    raise FileExistsError(
        f'--experiment: {out} holds a run ({", ".join(found)}); continue it with --resume '
        f'{os.path.join(out, "last.pth.tar")}, name another --experiment, or pass --overwrite to replace it'
    )


def check_resume_optimizer(path: str, opt: str) -> None:
    """Refuse, before anything loads, a ``--resume`` checkpoint whose optimizer state is of another ``--opt`` than
    this run's (its ``args`` say which): the state would load and fail at the first step (``KeyError: 'step'``
    for an SGD state under AdamW)."""
    args = load_checkpoint_file(path, '--resume', mmap=True).get('args')
    saved = args.get('opt') if isinstance(args, dict) else getattr(args, 'opt', None)
    if isinstance(saved, str) and saved.lower() != str(opt).lower():
        raise ValueError(
            f'--resume: {path} holds the state of --opt {saved}, this run has --opt {opt}; pass --opt {saved} to '
            'continue that run, or --no-resume-opt to take the weights and epoch only'
        )


def resolve_resume(args) -> str:
    """The checkpoint ``--resume`` names: a path, nothing, or for ``auto`` (timm 1.0.31) the
    ``last.pth.tar`` of the ``--experiment`` folder when there is one (else a fresh run there)."""
    if args.resume != 'auto':
        return args.resume
    if not args.experiment:
        raise SystemExit('tokenaug-train: error: --resume auto needs --experiment (the folder it continues in)')
    last = os.path.join(args.output or './output/train', args.experiment, 'last.pth.tar')
    return last if os.path.exists(last) else ''


#: errors of what the user asked for (their messages name the argument): printed without a traceback
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, UnreadableImageError, MissingLabelMapError)


class DivergedError(RuntimeError):
    """A training step's loss was not finite (NaN or infinite): ``tokenaug-train`` stops the run (exit status
    :data:`DIVERGED`) unless ``--allow-nonfinite-loss``."""


def main(argv=None) -> None:
    """Console entry point (``tokenaug-train``): a user error (a bad argument, file or dataset) is printed as
    ``tokenaug-train: error: ...`` with exit status 2, a diverged run (:class:`DivergedError`) as
    ``tokenaug-train: diverged: ...`` with exit status 3 (``TOKENAUG_TRACEBACK=1`` shows the traceback)."""
    try:
        run(argv)
    except (*USER_ERRORS, DivergedError) as e:
        if os.environ.get('TOKENAUG_TRACEBACK'):
            raise
        diverged = isinstance(e, DivergedError)
        print(f'tokenaug-train: {"diverged" if diverged else "error"}: {e}', file=sys.stderr)
        raise SystemExit(DIVERGED if diverged else 2) from None


def run(argv=None) -> dict:
    """Train and evaluate; returns the last evaluation metrics (``loss``, ``top1``, ``top5``). The phases, in
    timm ``train.py``'s order (which the random streams, hence the weights, depend on): the arguments checked,
    the device and precision, the model and its method (:func:`timm_plugin.recipe.build_training`), the
    optimizer and a resumed state, the data, the training task, the run folder, the schedule, the epochs."""
    utils.setup_default_logging()
    fix_posterize()  # before any transform is built (timm_plugin.timm_fixes)
    args = parse_args(argv)
    resume_path = check_run_args(args)
    device = utils.init_distributed_device(args)
    if args.distributed:
        _logger.info(f'Distributed training: process {args.rank}, total {args.world_size}, device {args.device}.')
    else:
        _logger.info(f'Training with a single process on device {args.device}.')
    model_dtype, amp_dtype = precision(args)
    utils.random_seed(args.seed, args.rank)
    if args.fuser:
        utils.set_jit_fuser(args.fuser)
    if args.fast_norm:
        set_fast_norm()
    # a missing, truncated or foreign file named before anything is built (timm's loaders would say less)
    for flag, path in (('--resume', resume_path), ('--initial-checkpoint', args.initial_checkpoint)):
        if path:
            load_checkpoint_file(path, flag, mmap=True)
    if args.pretrained_path and os.path.splitext(args.pretrained_path)[1] != '.safetensors':
        load_checkpoint_file(args.pretrained_path, '--pretrained-path', mmap=True)
    recipe = build_training(args)  # the model, the method, the mixing and the loss (timm_plugin.recipe)
    model, data_config = place_model(args, recipe, device, model_dtype)
    optimizer = create_optimizer_v2(model, **optimizer_kwargs(cfg=args), **args.opt_kwargs)
    amp_autocast, loss_scaler = suppress, None
    if args.amp:
        amp_autocast = partial(torch.autocast, device_type=device.type, dtype=amp_dtype)
        if device.type == 'cuda' and amp_dtype == torch.float16:
            loss_scaler = NativeScaler(device=device.type)
    resume_epoch = resume_state(args, model, optimizer, loss_scaler, resume_path)
    data = build_data(args, recipe, data_config, device, model_dtype)
    train_loss_fn = recipe.train_loss.to(device=device)
    evaluator = recipe.evaluator(data.loader_eval, device)  # timm's ClassificationEvaluator
    task = training_task(args, recipe, device, train_loss_fn, resume_path)
    # what --mixup-off-epoch switches off: the collate mixer, the loop's mixer, or MixToken in the task
    collate_fn = data.collate_fn
    mixing = (collate_fn if hasattr(collate_fn, 'mixup_enabled') else None) or data.mixer
    mixing = mixing or getattr(task, 'sampler', None)
    output_dir, saver = start_output(args, model, optimizer, task, loss_scaler, data_config, resume_path)

    updates_per_epoch = (len(data.loader_train) + args.grad_accum_steps - 1) // args.grad_accum_steps
    lr_scheduler, num_epochs = create_scheduler_v2(
        optimizer,
        **scheduler_kwargs(args, decreasing_metric=args.eval_metric == 'loss'),
        updates_per_epoch=updates_per_epoch,
    )
    start_epoch = args.start_epoch if args.start_epoch is not None else (resume_epoch or 0)
    if lr_scheduler is not None and start_epoch > 0:
        if args.sched_on_updates:
            lr_scheduler.step_update(start_epoch * updates_per_epoch)
        else:
            lr_scheduler.step(start_epoch)
    if utils.is_primary(args):
        _logger.info(f'Scheduled epochs: {num_epochs}; {updates_per_epoch} updates per epoch.')
    loop = EpochLoop(
        args, task, data, optimizer, device, lr_scheduler, amp_autocast, loss_scaler, mixing, model_dtype, saver,
        output_dir, evaluator, model,
    )  # fmt: skip
    eval_metrics, best_metric, best_epoch, stop_epoch = loop.run(start_epoch, num_epochs, resume_path)
    if best_metric is not None:
        _logger.info(f'*** Best metric: {best_metric} (epoch {best_epoch})')
    if args.distributed:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()  # a live gloo group aborts the process at exit
    results = os.path.join(output_dir, 'results.json') if output_dir is not None else None
    if start_epoch >= stop_epoch and results is not None and os.path.exists(results):
        # a resume of a run with nothing left to train (killed after its last epoch, before its caller noted it):
        # its results stand as they were written
        _logger.info(f'Nothing left to train (epoch {start_epoch} of {stop_epoch}): {results} is kept')
        with open(results) as f:
            return json.load(f)['final']
    if results is not None:
        with open(results, 'w') as f:
            json.dump(
                {
                    'model': args.model,
                    'method': args.method,
                    'mixup_type': args.mixup_type,
                    'best_metric': best_metric,
                    'best_epoch': best_epoch,
                    'final': eval_metrics,
                    'output_dir': output_dir,
                },
                f,
                indent=2,
            )
    return eval_metrics


def check_run_args(args) -> str:
    """The arguments checked before anything is built (the data folders, the output folder, the flags timm's
    train.py would take and tokenaug does not); returns the checkpoint ``--resume`` names (or ``''``)."""
    check_supported(args)
    check_numbers(args)
    for module in args.device_modules or ():
        importlib.import_module(module)
    data_dir = args.data_dir or args.data  # (timm's --data: resolve_flags makes it --data-dir)
    if not data_dir:
        raise SystemExit('tokenaug-train: --data-dir is required')
    if not args.dataset and not os.path.isdir(data_dir):  # before the model is built
        raise FileNotFoundError(f'--data-dir: {data_dir} is not a directory')
    resume_path = resolve_resume(args)
    check_output_folder(args, resume_path)
    if not args.dataset or args.dataset.lower() in ('folder', 'imagefolder'):
        whole = check_split_folder(data_dir, args.train_split, '--train-split')
        if check_split_folder(data_dir, args.val_split, '--val-split') and whole and args.val_split:
            _logger.warning(
                f'--data-dir {data_dir} has no split folders (train, val, ...): it is read whole as both the '
                'training and the validation split, so validation measures the images the model trains on '
                "(timm's behaviour); point --data-dir at the folder that holds the split folders"
            )
    return resume_path


def precision(args) -> tuple:
    """``(model dtype or None, autocast dtype)`` from ``--model-dtype``, ``--amp`` and ``--amp-dtype``."""
    model_dtype = None
    if args.model_dtype:
        if args.model_dtype not in ('float32', 'float16', 'bfloat16'):
            raise ValueError(f'--model-dtype: expected float32, float16 or bfloat16, got {args.model_dtype!r}')
        model_dtype = getattr(torch, args.model_dtype)
        if args.amp and model_dtype != torch.float32:
            raise ValueError('--model-dtype: float32 model dtype must be used with AMP (--amp)')
    if args.amp_dtype not in ('float16', 'bfloat16'):
        raise ValueError(f'--amp-dtype: expected float16 or bfloat16, got {args.amp_dtype!r}')
    amp_dtype = torch.bfloat16 if args.amp_dtype == 'bfloat16' else torch.float16
    return model_dtype, amp_dtype


def place_model(args, recipe, device, model_dtype) -> tuple:
    """The recipe's model on its device and dtype (channels-last, synchronised BN as asked) and the data config
    resolved for it."""
    model = recipe.model
    if utils.is_primary(args):
        _logger.info(
            f'Model {safe_model_name(args.model)} created, param count: {sum(m.numel() for m in model.parameters())}'
        )
    if args.grad_checkpointing:
        model.set_grad_checkpointing(enable=True)
    data_config = resolve_data_config(vars(args), model=model, verbose=utils.is_primary(args))
    model.to(device=device, dtype=model_dtype)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    if args.distributed and args.sync_bn:  # (resolve_flags: no --dist-bn with it)
        model = convert_sync_batchnorm(model)
    return model, data_config


def resume_state(args, model, optimizer, loss_scaler, resume_path: str):
    """The weights (and, unless ``--no-resume-opt``, the optimizer and loss scaler) of ``--resume``; the epoch to
    continue at (``None`` without one). A checkpoint of another model or optimizer is named."""
    resume_epoch = None
    if resume_path:
        if not args.no_resume_opt:
            check_resume_optimizer(resume_path, args.opt)
        try:
            resume_epoch = resume_checkpoint(
                model,
                resume_path,
                optimizer=None if args.no_resume_opt else optimizer,
                loss_scaler=None if args.no_resume_opt else loss_scaler,
                log_info=utils.is_primary(args),
            )
        except RuntimeError as e:  # load_state_dict: another architecture or size, or not a timm run's file
            ckpt = load_checkpoint_file(resume_path, '--resume', mmap=True)
            if isinstance(ckpt, dict) and 'model' in ckpt and 'state_dict' not in ckpt:
                raise ValueError(
                    f"--resume: {resume_path} is a DeiT / TokenMix main.py checkpoint (its weights under 'model'), "
                    "not a timm run's (state_dict, optimizer, epoch) that --resume continues; start from its weights "
                    'with --initial-checkpoint'
                ) from None
            raise ValueError(f'--resume: {resume_path} does not fit --model {args.model}: {e}') from None
        except ValueError as e:  # the optimizer's load_state_dict: other parameter groups
            raise ValueError(
                f"--resume: {resume_path} holds an optimizer state that does not fit this run's optimizer ({e}); "
                'pass --no-resume-opt to take the weights and epoch only'
            ) from None
    return resume_epoch


def training_task(args, recipe, device, train_loss_fn, resume_path: str):
    """The method's training task (EMA, compilation and DDP as timm sets them up); EMA, optimizer, resume and
    checkpoints hold the bare model."""
    task = recipe.task(device, criterion=train_loss_fn)
    if args.model_ema:
        task.setup_ema(
            decay=args.model_ema_decay,
            use_warmup=args.model_ema_warmup,
            device='cpu' if args.model_ema_force_cpu else None,
        )
        if resume_path:
            from timm.models import load_checkpoint

            load_checkpoint(task.get_trainable_module(ema=True).module, resume_path, use_ema=True)
    if args.torchcompile:  # as timm: the task's parts compiled before DDP wraps them
        task.compile(backend=args.torchcompile, mode=args.torchcompile_mode)
        if task.has_ema():
            task.compile_ema(backend=args.torchcompile, mode=args.torchcompile_mode)
    if args.distributed:
        task.prepare_distributed(
            device_ids=[device] if device.type == 'cuda' else None, broadcast_buffers=not args.no_ddp_bb
        )
    return task


def start_output(args, model, optimizer, task, loss_scaler, data_config: dict, resume_path: str) -> tuple:
    """On the primary process: the run folder (``args.yaml``, the checkpoint saver with a resumed run's
    bookkeeping, wandb); ``(output_dir, saver)``, ``(None, None)`` elsewhere."""
    eval_metric = args.eval_metric
    saver = None
    output_dir = None
    if utils.is_primary(args):
        exp_name = args.experiment or '-'.join(
            [time.strftime('%Y%m%d-%H%M%S'), safe_model_name(args.model), str(data_config['input_size'][-1])]
        )
        output_dir = utils.get_outdir(args.output if args.output else './output/train', exp_name)
        for stale in remove_stale_temporaries(output_dir):  # a write killed mid-file (kill -9, a full disk)
            _logger.info(f'Removed the temporary file of an interrupted write: {stale}')
        saver = PlainCheckpointSaver(
            model=model,
            optimizer=optimizer,
            args=args,
            model_ema=task.get_trainable_module(ema=True),
            amp_scaler=loss_scaler,
            checkpoint_dir=output_dir,
            recovery_dir=output_dir,
            decreasing=eval_metric == 'loss',
            max_history=args.checkpoint_hist,
        )
        with open(os.path.join(output_dir, 'args.yaml'), 'w') as f:
            yaml.safe_dump(plain_args(args), f, sort_keys=False)
        if resume_path:  # the best / history bookkeeping of the run being continued (timm's saver wrote it)
            saver.load_state_dict_from_checkpoint(resume_path)
            carry_best_checkpoint(saver, resume_path, output_dir)
        if args.log_wandb:
            start_wandb(args, exp_name, resume_path)

    return output_dir, saver


class EpochLoop(NamedTuple):
    """What the epochs run with (:meth:`run`)."""

    args: object
    task: object
    data: TrainingData
    optimizer: object
    device: object
    lr_scheduler: object
    amp_autocast: object
    loss_scaler: object
    mixing: object
    model_dtype: object
    saver: object
    output_dir: object
    evaluator: object
    model: object  # the bare model (its BN statistics distributed)

    def run(self, start_epoch: int, num_epochs: int, resume_path: str) -> tuple:
        """Train ``start_epoch`` .. the end of the schedule (or ``--stop-epoch``), evaluating and checkpointing as
        timm does; ``(last evaluation, best metric, its epoch, the epoch it stopped before)``."""
        args, task, data, optimizer, device = self.args, self.task, self.data, self.optimizer, self.device
        lr_scheduler, saver, output_dir, evaluator = self.lr_scheduler, self.saver, self.output_dir, self.evaluator
        dataset_train, loader_train, loader_eval = data.dataset_train, data.loader_train, data.loader_eval
        mixer, mixing, amp_autocast, loss_scaler = data.mixer, self.mixing, self.amp_autocast, self.loss_scaler
        model_dtype, eval_metric, model = self.model_dtype, args.eval_metric, self.model
        best_metric = best_epoch = None
        summary = os.path.join(output_dir, 'summary.csv') if output_dir is not None else None
        write_header = summary is not None and not (resume_path and os.path.exists(summary))
        if write_header and os.path.exists(summary):  # a fresh run in an existing folder starts a fresh summary
            os.remove(summary)
        elif summary is not None and os.path.exists(summary):  # resumed: the epochs it will run again are not done
            drop_summary_rows(summary, from_epoch=start_epoch)
        eval_metrics = {}
        if args.stop_epoch is not None and not 0 < args.stop_epoch <= num_epochs:
            raise ValueError(f'--stop-epoch: expected 1..{num_epochs} (the scheduled epochs), got {args.stop_epoch}')
        if args.val_interval < 1:
            raise ValueError(f'--val-interval: expected an integer >= 1, got {args.val_interval}')
        stop_epoch = num_epochs if args.stop_epoch is None else args.stop_epoch
        milestones = set(args.save_epochs or ())
        for epoch in range(start_epoch, stop_epoch):
            # every random stream of the epoch (augmentation, mixing, dropout, sampler, workers) from (seed, epoch):
            # a run resumed at this epoch draws exactly what an uninterrupted one does
            utils.random_seed(epoch_seed(args.seed, epoch), args.rank)
            if hasattr(dataset_train, 'set_epoch'):
                dataset_train.set_epoch(epoch)
            elif args.distributed and hasattr(loader_train.sampler, 'set_epoch'):
                loader_train.sampler.set_epoch(epoch)
            if args.mixup_off_epoch and epoch >= args.mixup_off_epoch and mixing is not None:
                mixing.mixup_enabled = False
            train_metrics = train_one_epoch(
                epoch,
                task,
                loader_train,
                optimizer,
                args,
                device=device,
                lr_scheduler=lr_scheduler,
                amp_autocast=amp_autocast,
                loss_scaler=loss_scaler,
                mixer=mixer,
                model_dtype=model_dtype,
                saver=saver,
                output_dir=output_dir,
            )
            if args.distributed and args.dist_bn in ('broadcast', 'reduce'):
                utils.distribute_bn(model, args.world_size, args.dist_bn == 'reduce')
            done = epoch + 1
            # as timm: evaluate and checkpoint every --val-interval epochs, at a milestone and at the end (of the
            # schedule or of the --stop-epoch part)
            if done % args.val_interval and done not in milestones and done not in (num_epochs, stop_epoch):
                _logger.info('Skipping eval and checkpointing')
                if lr_scheduler is not None:
                    lr_scheduler.step(done, metric=None)
                continue
            eval_metrics = validate(
                task.get_eval_model(),
                loader_eval,
                evaluator,
                args,
                device=device,
                amp_autocast=amp_autocast,
                model_dtype=model_dtype,
            )
            if task.has_ema() and not args.model_ema_force_cpu:  # as timm: a CPU EMA is kept, not evaluated
                if args.distributed and args.dist_bn in ('broadcast', 'reduce'):
                    utils.distribute_bn(task.get_trainable_module(ema=True), args.world_size, args.dist_bn == 'reduce')
                eval_metrics = validate(
                    task.get_eval_model(ema=True),
                    loader_eval,
                    evaluator,
                    args,
                    device=device,
                    amp_autocast=amp_autocast,
                    log_suffix=' (EMA)',
                )
            if output_dir is not None:
                lrs = [pg['lr'] for pg in optimizer.param_groups]
                utils.update_summary(
                    epoch,
                    train_metrics,
                    eval_metrics,
                    filename=summary,
                    lr=sum(lrs) / len(lrs),
                    write_header=write_header,
                    log_wandb=args.log_wandb and has_wandb(),
                )
                write_header = False
            if saver is not None:
                best_metric, best_epoch = saver.save_checkpoint(epoch, metric=eval_metrics[eval_metric])
                if done in milestones:  # milestone-N.pth.tar: never removed by the history
                    saver.save_milestone(done)
            if lr_scheduler is not None:
                lr_scheduler.step(done, eval_metrics[eval_metric])
        return eval_metrics, best_metric, best_epoch, stop_epoch


def train_one_epoch(
    epoch,
    task,
    loader,
    optimizer,
    args,
    device,
    lr_scheduler=None,
    amp_autocast=suppress,
    loss_scaler=None,
    mixer=None,
    model_dtype=None,
    saver=None,
    output_dir=None,
):
    """One epoch of timm's loop over a training task: ``loss = task(x, target)['loss']``."""
    accum = args.grad_accum_steps
    second_order = getattr(optimizer, 'is_second_order', False)
    losses_m, data_time_m, update_time_m = utils.AverageMeter(), utils.AverageMeter(), utils.AverageMeter()
    logged = {k: utils.AverageMeter() for k in getattr(task, 'log_keys', ())}  # a method's own figures
    task.train()
    num_batches = len(loader)
    last_batch_idx = num_batches - 1
    num_updates = epoch * ((num_batches + accum - 1) // accum)
    data_start = update_start = time.time()
    optimizer.zero_grad()
    for batch_idx, (x, target) in enumerate(loader):
        last_batch = batch_idx == last_batch_idx
        need_update = last_batch or (batch_idx + 1) % accum == 0
        if not args.prefetcher:
            if mixer is not None:  # label range checked here, on the CPU (the device would sync)
                check_labels(target, args.num_classes)
            x, target = x.to(device=device, dtype=model_dtype), target.to(device)
        if mixer is not None:  # in the loop: without the prefetcher, or with teacher maps (on the device)
            x, target = mixer(x, target)
        if args.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        data_time_m.update(time.time() - data_start)
        # with gradient accumulation under DDP, all-reduce only on the update step
        sync = task.no_sync if (args.distributed and not need_update) else suppress
        with sync():
            with amp_autocast():
                out = task(x, target)
            loss = out['loss']
            for k, meter in logged.items():
                meter.update(float(out[k]), x.size(0))
            if accum > 1:
                loss = loss / accum
            params = task.get_trainable_module().parameters()
            if loss_scaler is not None:
                loss_scaler(
                    loss,
                    optimizer,
                    clip_grad=args.clip_grad,
                    clip_mode=args.clip_mode,
                    parameters=params,
                    create_graph=second_order,
                    need_update=need_update,
                )
            else:
                loss.backward(create_graph=second_order)
        if loss_scaler is None:
            if need_update:
                if args.clip_grad is not None:
                    utils.dispatch_clip_grad(task.get_clip_parameters(), value=args.clip_grad, mode=args.clip_mode)
                optimizer.step()
        value = loss.item() * accum  # (timm reads it here too: no extra sync)
        if not math.isfinite(value) and not args.allow_nonfinite_loss:
            raise DivergedError(
                f'the loss is {value} at epoch {epoch}, batch {batch_idx}: the run diverged, and every later step '
                'would train on NaN weights; lower --lr (or --warmup-lr, or clip with --clip-grad), or pass '
                "--allow-nonfinite-loss to go on as timm's train.py does"
            )
        losses_m.update(value, x.size(0))
        if not need_update:
            data_start = time.time()
            continue
        num_updates += 1
        optimizer.zero_grad()
        task.update_ema(step=num_updates)
        if args.synchronize_step and device.type != 'cpu':
            torch.accelerator.synchronize(device)
        update_time_m.update(time.time() - update_start)
        update_start = time.time()
        if (last_batch or batch_idx % args.log_interval == 0) and utils.is_primary(args):
            lrs = [pg['lr'] for pg in optimizer.param_groups]
            _logger.info(
                f'Train: {epoch} [{batch_idx:>4d}/{num_batches} ({100.0 * (batch_idx + 1) / num_batches:>3.0f}%)]  '
                f'Loss: {losses_m.val:#.3g} ({losses_m.avg:#.3g})  '
                f'Time: {update_time_m.val:.3f}s, {x.size(0) * accum / update_time_m.val:>7.2f}/s  '
                f'LR: {sum(lrs) / len(lrs):.3e}  Data: {data_time_m.val:.3f} ({data_time_m.avg:.3f})'
                + ''.join(f'  {k}: {m.val:#.3g} ({m.avg:#.3g})' for k, m in logged.items())
            )
            if args.save_images and output_dir:
                torchvision.utils.save_image(
                    x, os.path.join(output_dir, f'train-batch-{batch_idx}.jpg'), padding=0, normalize=True
                )
        if saver is not None and args.recovery_interval and (batch_idx // accum + 1) % args.recovery_interval == 0:
            saver.save_recovery(epoch, batch_idx=batch_idx)
        if lr_scheduler is not None:
            lr_scheduler.step_update(num_updates=num_updates, metric=losses_m.avg)
        data_start = time.time()
    loss = losses_m.avg
    if args.distributed:  # the epoch's loss over every rank's samples (the log lines above are rank 0's)
        total = torch.tensor([losses_m.sum, losses_m.count], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(total)
        loss = float(total[0] / total[1].clamp_min(1))
    return OrderedDict([('loss', loss)] + [(k, m.avg) for k, m in logged.items()])


def validate(model, loader, evaluator, args, device, amp_autocast=suppress, log_suffix='', model_dtype=None):
    """timm's evaluation, counted by ``evaluator`` (:meth:`~timm_plugin.recipe.Recipe.evaluator`, timm's
    ``ClassificationEvaluator``: exact counts over every rank, the distributed sampler's padding left out);
    ``--tta N``: the outputs of each N consecutive samples averaged, as timm."""
    evaluator.reset()
    model.eval()
    with torch.inference_mode():
        for x, target in loader:
            if not args.prefetcher:
                x, target = x.to(device=device, dtype=model_dtype), target.to(device)
            if args.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with amp_autocast():
                output = model(x)
                if isinstance(output, (tuple, list)):
                    output = output[0]
            if args.tta > 1:
                output = output.unfold(0, args.tta, args.tta).mean(dim=2)
                target = target[0 : target.size(0) : args.tta]
            evaluator.update(output, target)
    metrics = evaluator.compute(distributed=args.distributed)
    if utils.is_primary(args):
        _logger.info(
            f'Test{log_suffix}: Loss: {metrics["loss"]:>6.3f}  Acc@1: {metrics["top1"]:>7.3f}  '
            f'Acc@{min(5, args.num_classes)}: {metrics["top5"]:>7.3f}'
        )
    return metrics


if __name__ == '__main__':
    main()
