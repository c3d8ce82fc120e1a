"""The training recipe: what ``tokenaug-train`` builds from its arguments, in one place.

:func:`build_training` turns parsed arguments (:func:`tokenaug.train_args.parse_args`) into a :class:`Recipe`:
the model (with the aux head or the ScoreNets its method trains), which method runs and over which mixing kind,
the mixing configuration (``create_mixer``'s arguments, built once, as timm's ``train.py`` builds its
``mixup_args``), the training loss (timm's ``create_classification_loss``, or token labeling's) and the
evaluator (timm's ``ClassificationEvaluator``). The trainer,
``tokenaug-viz`` and the benches all start from it, so a flag means the same thing in each; what is left to them is
the data, the device and the loop (:meth:`Recipe.mixer`, :meth:`Recipe.task`).

Every check of what the flags combine lives here, with the flag named in its message.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
from timm.models import create_model, is_model, load_checkpoint
from timm.task import ClassificationEvaluator, ClassificationTask, create_classification_loss, evaluation_sample_limit

from shared_core.options import TARGET_METHODS, TOKEN_LABELING_TYPES

from .checkpoints import read_state_dict
from .mixup import MIX_KINDS, create_mixer
from .tasks import TLAlignTask, TokenLabelingTask, TokenMixupTask, TransMixTask
from .tl_align import timm_tracer
from .token_grid import mixing_stride
from .token_labeling import TokenLabelingLoss, attach_aux_head
from .tokenmixup import _has_class_token, attach_scorenets

__all__ = [
    'Recipe',
    'build_model',
    'build_training',
    'resolve_flags',
    'resolve_method',
    'attach_method_modules',
    'attach_modules_in',
    'load_initial_checkpoint',
]

_logger = logging.getLogger('tokenaug.train')


@dataclass
class Recipe:
    """What the arguments ask to train (see the module docstring); ``args`` is resolved in place (the mixing kind
    as timm resolves it, ``num_classes`` from the model).

    Attributes:
        args: the arguments.
        model: the model, with the aux head of dense token labeling or the ScoreNets of HTM attached.
        method: the target method over the mix, ``'tl_align'`` or ``'transmix'`` (``--method``), or ``None``.
        mix_kind: the mixing kind a mixer draws (``--mixup-type``), or ``None`` when no mixer runs.
        token_labeling: token labeling (MixToken mixes in its task, not in a mixer).
        dense: token labeling with its dense term (label maps and ``--dense-weight > 0``).
        mixing: ``create_mixer``'s keyword arguments, or ``None`` when no mixer runs.
        train_loss: the training criterion.
    """

    args: argparse.Namespace
    model: nn.Module
    method: Optional[str]
    mix_kind: Optional[str]
    token_labeling: bool
    dense: bool
    mixing: Optional[dict]
    train_loss: nn.Module

    @property
    def in_model(self) -> Optional[str]:
        """The name of the method that runs inside the model (hooks, label paths, an aux head), or ``None``."""
        if self.method:
            return self.method
        if uses_tokenmixup(self.args):
            return 'TokenMixup'
        return 'token labeling' if self.token_labeling else None

    def mixer(self, **extra):
        """The mixer of :attr:`mixing` (``extra``: ``collate=True``, ``carry_mix``, ``generator``, ...)."""
        if self.mixing is None:
            raise ValueError('nothing mixes: set --mixup and/or --cutmix > 0')
        return create_mixer(self.mix_kind, **self.mixing, **extra)

    def task(self, device, criterion: Optional[nn.Module] = None):
        """The ``timm.task`` training task of the method (``ClassificationTask`` without one), on ``device``, with
        :attr:`train_loss` (or ``criterion``) as its loss."""
        args, model = self.args, self.model
        criterion = self.train_loss if criterion is None else criterion
        if self.method == 'tl_align':
            return TLAlignTask(
                model,
                criterion,
                layers=args.tl_align_layers,
                residual=not args.tl_align_no_residual,
                drop_path=args.tl_align_drop_path,
                input_size=train_input_size(args, model),
                device=device,
            )
        if self.method == 'transmix':
            return TransMixTask(
                model, criterion, mode=args.transmix_mode, input_size=train_input_size(args, model), device=device
            )
        if uses_tokenmixup(args):
            return TokenMixupTask(
                model,
                criterion,
                device=device,
                htm_layers=args.tokenmixup_htm_layers,
                vtm_layers=args.tokenmixup_vtm_layers,
                rho=args.tokenmixup_rho,
                tau=args.tokenmixup_tau,
                kappa=args.tokenmixup_kappa,
                saliency=args.tokenmixup_saliency,
                scorenet=args.tokenmixup_scorenet,
                scorenet_weight=args.tokenmixup_scorenet_weight,
                scorenet_stopgrad=args.tokenmixup_scorenet_stopgrad,
                vtm_stopgrad=args.tokenmixup_vtm_stopgrad,
                vtm_memory=args.tokenmixup_vtm_memory,
                smoothing=args.smoothing,  # for class-index targets (no mixer); a mixer's soft targets are as is
            )
        if self.token_labeling:
            return TokenLabelingTask(
                model,
                criterion,
                mix_token=args.mixup_type == 'mixtoken',
                beta=args.cutmix or 1.0,
                prob=args.mixup_prob,
                mode=args.mixup_mode,
                head_rule=args.head_rule,
                box_rounding=args.box_rounding,
                device=device,
            )
        return ClassificationTask(model, criterion, device=device)

    def evaluator(self, loader, device) -> ClassificationEvaluator:
        """timm's ``ClassificationEvaluator`` for ``loader`` (cross entropy, top-1/5; the distributed sampler's
        padding left out, counted in groups of ``--tta``)."""
        limit = evaluation_sample_limit(loader)  # the real samples of this rank
        return ClassificationEvaluator(device, max_samples=limit and limit // max(1, self.args.tta))

    def describe(self) -> str:
        """The log line of the mixing: kind, method, targets and grid."""
        args = self.args
        shown = f'{self.method} over {self.mix_kind}' if self.method else self.mix_kind
        if args.activation_map_dir:
            shown += f' with {args.activation_target} activation-map targets'
        grid = self.mixing['patch_size']
        grid = f'{grid}x{grid}' if isinstance(grid, int) else 'x'.join(map(str, grid))
        return (
            f'Mixing: {shown} on a {grid}-px token grid (mixup_alpha={args.mixup}, cutmix_alpha={args.cutmix}, '
            f'prob={args.mixup_prob}, switch_prob={args.mixup_switch_prob}, mode={args.mixup_mode})'
        )


def build_training(args: argparse.Namespace) -> Recipe:
    """The :class:`Recipe` of parsed arguments: resolves every derived flag (:func:`resolve_flags`), builds the
    model with its method's modules (:func:`build_model`), resolves the mixing and refuses, naming the flag, what
    the methods cannot combine."""
    resolve_flags(args)
    token_labeling, dense = uses_token_labeling(args), uses_dense_targets(args)
    if token_labeling:
        check_token_labeling(args)
    if uses_tokenmixup(args) and (args.method or token_labeling):
        raise ValueError(
            f"--tokenmixup-*: TokenMixup relabels each sample from several sources (its mixer's and its HTM "
            f"partner's); {'token labeling' if token_labeling else args.method} needs the two-source label "
            f'state of its own mixing, so the two cannot be combined'
        )

    check_switches_apply(args, token_labeling, dense)
    model = build_model(args, lambda model: attach_method_modules(model, args))
    if args.method in ('tl_align', 'transmix'):  # the tracer's refusal (the zoo page's words) before the label grid
        timm_tracer(model, input_size=train_input_size(args, model))
    check_activation_maps(args, token_labeling)
    mixing = None
    if resolve_mixing(args, token_labeling):
        mixing = mixer_kwargs(args, model)
        if args.activation_map_dir:  # mixed on the device, where the maps' targets are built
            mixing['activation_targets'] = args.activation_target
    recipe = Recipe(
        args=args,
        model=model,
        method=args.method,
        mix_kind=args.mixup_type if mixing is not None else None,
        token_labeling=token_labeling,
        dense=dense,
        mixing=mixing,
        train_loss=training_loss(args, token_labeling, dense, soft_targets=mixing is not None or uses_tokenmixup(args)),
    )
    in_model = recipe.in_model
    if in_model:  # their hooks and label paths are written for an fp32 (or autocast) model run block by block
        for flag, value in (
            ('--grad-checkpointing', args.grad_checkpointing),
            ('--model-dtype', args.model_dtype not in (None, 'float32')),
        ):
            if value:
                raise ValueError(f'{flag}: not provided with {in_model} yet (it runs inside the model); drop it')
    return recipe


def train_input_size(args: argparse.Namespace, model: nn.Module) -> tuple:
    """The ``(C, H, W)`` the model trains at: timm's data config of the flags (``--img-size``, ``--input-size``) and
    the model, as the loader resolves it (the graph route compiles its first label program for it)."""
    from timm.data import resolve_data_config

    return tuple(resolve_data_config(vars(args), model=model, verbose=False)['input_size'])


def training_loss(args: argparse.Namespace, token_labeling: bool, dense: bool, soft_targets: bool) -> nn.Module:
    """Token labeling's loss (Eq. 3-4), else timm's ``create_classification_loss``: soft-target cross entropy (or
    BCE) where a mixer or TokenMixup makes the targets (``soft_targets``), label smoothing on class indices
    otherwise."""
    if token_labeling:
        return TokenLabelingLoss(
            args.num_classes,
            dense_weight=args.dense_weight if dense else 0.0,
            cls_target='annotator' if args.relabel else args.cls_target,
            cls_target_mix=args.cls_target_mix,
            smoothing=args.smoothing,
            cls_target_pool=args.cls_target_pool,
        )
    bce = {}
    if args.bce_loss:
        bce = dict(bce_target_thresh=args.bce_target_thresh, bce_sum=args.bce_sum, pos_weight=args.bce_pos_weight)
    return create_classification_loss(
        'bce' if args.bce_loss else 'ce',
        smoothing=args.smoothing,
        soft_targets=soft_targets,
        **bce,
    )


def check_token_labeling(args: argparse.Namespace) -> None:
    """Refuse what token labeling does not combine with, naming the flag."""
    if args.mixup > 0:
        raise ValueError(
            '--mixup: MixUp is not combined with token labeling / MixToken (the Token Labeling paper '
            'Table 3 and supplement Table 1 drop it); set --mixup 0'
        )
    if args.relabel and not args.token_label_dir:
        raise ValueError('--relabel needs --token-label-dir (the pooled labels come from the label maps)')
    if args.cls_target != 'gt' and not args.token_label_dir:
        raise ValueError(f'--cls-target {args.cls_target} needs --token-label-dir')
    if args.method:
        raise ValueError(f'--method {args.method}: token labeling mixes with MixToken only (--mixup-type mixtoken)')
    if args.mixup_type not in (None,) + TOKEN_LABELING_TYPES:
        raise ValueError(
            f'--mixup-type {args.mixup_type}: token labeling mixes with MixToken only '
            f'(--mixup-type mixtoken, or none for token labeling without mixing)'
        )
    if args.mixup_type is None and (args.cutmix > 0 or args.cutmix_minmax):
        raise ValueError(
            '--cutmix: with --token-label-dir the cut is MixToken; add --mixup-type mixtoken '
            '(its box is drawn from Beta(--cutmix)), or set --cutmix 0 for no mixing'
        )
    if args.cutmix_minmax or args.bce_loss:
        raise ValueError(
            f'{"--cutmix-minmax" if args.cutmix_minmax else "--bce-loss"}: not used by token '
            'labeling (MixToken draws its box from Beta(--cutmix); the loss is Eq. 3 cross entropy)'
        )


def resolve_flags(args: argparse.Namespace) -> None:
    """Every flag that other flags or the launch decide, set in place, here and nowhere else (a second call
    changes nothing; :func:`build_training` makes the first):

    - ``--method`` and the mixing kind under it (:func:`resolve_method`: ``--mixup-type tl_align`` is ``--method
      tl_align --mixup-type cutmix``);
    - ``--mixup-type tokenmix``: the paper's TokenMix (:func:`resolve_tokenmix`);
    - timm's ``--data``, the former name of ``--data-dir``;
    - the prefetcher (on unless ``--no-prefetcher``) and ``--grad-accum-steps`` of at least 1;
    - as timm's ``train.py``: ``--lr`` from ``--lr-base`` scaled by the global batch where ``--lr`` is not given
      (linear, or square root for adaptive optimizers; the world size is the launch's, 1 before a process group
      is up), and no BN statistics to distribute (``--dist-bn``) with synchronised BN in a distributed run."""
    resolve_method(args)
    resolve_tokenmix(args)
    if args.data and not args.data_dir:
        args.data_dir = args.data
    args.prefetcher = not args.no_prefetcher
    args.grad_accum_steps = max(1, args.grad_accum_steps)
    if not args.lr:
        global_batch = args.batch_size * getattr(args, 'world_size', 1) * args.grad_accum_steps
        ratio = global_batch / args.lr_base_size
        scale = args.lr_base_scale or ('sqrt' if any(o in args.opt.lower() for o in ('ada', 'lamb')) else 'linear')
        if scale == 'sqrt':
            ratio = ratio**0.5
        args.lr = args.lr_base * ratio
    if getattr(args, 'distributed', False) and args.sync_bn:
        args.dist_bn = ''


def resolve_method(args: argparse.Namespace) -> None:
    """``--method`` and the mixing kind under it. ``--mixup-type tl_align`` (or ``transmix``) is the method over
    the default kind, as ``--method tl_align``; ``--method METHOD --mixup-type KIND`` puts it over another kind.
    With a method and no kind, the kind is ``cutmix`` (the MixUp/CutMix switch with ``--mixup > 0``)."""
    if args.mixup_type in TARGET_METHODS:
        if args.method not in (None, args.mixup_type):
            raise ValueError(
                f'--mixup-type {args.mixup_type}: a method, and --method {args.method} names one too; '
                f'pass --method {args.method} --mixup-type KIND to put a method over another mixing kind'
            )
        args.method, args.mixup_type = args.mixup_type, None
    if args.method is not None:
        args.mixup_type = args.mixup_type or 'cutmix'


def resolve_tokenmix(args) -> None:
    """``--mixup-type tokenmix``: the paper's TokenMix, ``tokenmix_{--tokenmix-mask}`` with λ fixed at 0.5
    unless ``--tokenmix-lam``."""
    if args.mixup_type == 'tokenmix':
        args.mixup_type = f'tokenmix_{args.tokenmix_mask}'
        if args.tokenmix_lam is None:
            args.tokenmix_lam = 0.5


def check_switches_apply(args, token_labeling: bool, dense: bool) -> None:
    """Refuse, naming it, a method's switch set where it would do nothing (a run would train something else under
    the switch's name): the label-map data path's switches without label maps, the dense term's without it, VTM's
    without VTM, TL-Align's blocks given as none."""
    maps = bool(args.token_label_dir or args.activation_map_dir)
    unused = []
    if not maps:  # the switches of the data path that carries label maps
        unused += [
            (f'--{flag} {value}', 'label maps (--token-label-dir or --activation-map-dir)')
            for flag, value, default in (
                ('aa-order', args.aa_order, 'timm'),
                ('geometric-aa', args.geometric_aa, 'follow'),
                ('map-region', args.map_region, 'full_image'),
            )
            if value != default
        ]
    if args.token_targets != 'loader' and not (token_labeling and dense):
        unused.append((f'--token-targets {args.token_targets}', "token labeling's dense term (--token-label-dir)"))
    annotator_target = args.relabel or args.cls_target != 'gt'
    if args.cls_target_pool != 'distributions' and not (token_labeling and annotator_target):
        unused.append((f'--cls-target-pool {args.cls_target_pool}', 'an annotator class target (--cls-target)'))
    if args.tokenmixup_vtm_memory != 'mixed' and not args.tokenmixup_vtm_layers:
        unused.append((f'--tokenmixup-vtm-memory {args.tokenmixup_vtm_memory}', 'VTM (--tokenmixup-vtm-layers)'))
    if args.tl_align_layers is not None and not args.tl_align_layers:
        unused.append(('--tl-align-layers (no block)', 'blocks to align: leave the flag out to align at all'))
    if unused:
        switch, needs = unused[0]
        raise ValueError(f'{switch}: it does nothing here; it needs {needs}')


def check_activation_maps(args, token_labeling: bool) -> None:
    """``--activation-map-dir`` (TokenMix's targets) re-weights the two labels of a mixing kind: not a method's
    targets, nor token labeling's."""
    if args.activation_map_dir and (token_labeling or args.method):
        raise ValueError(
            f'--activation-map-dir: TokenMix targets apply to the mixing kinds {MIX_KINDS}, not to '
            f'{"token labeling" if token_labeling else f"--method {args.method}"}'
        )


def resolve_mixing(args, token_labeling: bool) -> bool:
    """Whether a mixer runs (MixUp/CutMix/token kinds; token labeling mixes in its task), with
    ``args.mixup_type`` resolved as timm does (``cutmix`` if ``--cutmix > 0``, else ``mixup``)."""
    active = not token_labeling and (
        args.mixup > 0
        or args.cutmix > 0.0
        or args.cutmix_minmax is not None
        or (args.mixup_type is not None and args.tokenmix_lam is not None)
    )
    if not active and not token_labeling and (args.method or args.mixup_type is not None):
        flag = f'--method {args.method}' if args.method else f'--mixup-type {args.mixup_type}'
        raise ValueError(f'{flag} needs --mixup and/or --cutmix > 0 (or --tokenmix-lam)')
    if active:
        args.mixup_type = args.mixup_type or ('cutmix' if (args.cutmix > 0 or args.cutmix_minmax) else 'mixup')
    return active


def mixer_kwargs(args, model: nn.Module) -> dict:
    """``create_mixer``'s keyword arguments from the command line (the kind aside)."""
    return dict(
        method=args.method,
        mixup_alpha=args.mixup,
        cutmix_alpha=args.cutmix,
        cutmix_minmax=args.cutmix_minmax,
        prob=args.mixup_prob,
        switch_prob=args.mixup_switch_prob,
        mode=args.mixup_mode,
        label_smoothing=args.smoothing,
        num_classes=args.num_classes,
        patch_size=mixing_stride(model, args.method, train_input_size(args, model)),
        tokenmix_lam=args.tokenmix_lam,
        box_rounding=args.box_rounding,
        tokenmix_rule=args.tokenmix_rule,
    )


#: the modules tokenaug attaches to a timm model: their key prefix, what they are, the flag that attaches them
PLUGIN_MODULES = {
    'aux_head.': ("token labeling's aux head", '--token-label-dir MAPS (dense targets)'),
    'tokenmixup_scorenet.': ("TokenMixup's ScoreNets", '--tokenmixup-htm-layers'),
}


def load_initial_checkpoint(model: nn.Module, path: str, attached: set = frozenset()) -> None:
    """``--initial-checkpoint``: ``path`` into ``model`` as timm's ``create_model(checkpoint_path=...)`` loads it
    (``state_dict_ema`` when the file has one, else ``state_dict`` or the bare dict), strictly, except that the keys
    ``attached`` (of modules the method attached) may be missing: a plain checkpoint starts a method with fresh
    modules (logged). A key of the file the model lacks is refused; one of a module the method would attach names
    the flag that attaches it."""
    if os.path.splitext(path)[-1].lower() in ('.npz', '.npy'):  # timm's foreign formats: the model's own loader
        load_checkpoint(model, path)
        return
    result = model.load_state_dict(read_state_dict(path, '--initial-checkpoint', use_ema=True), strict=False)
    missing = [k for k in result.missing_keys if k not in attached]
    unexpected = list(result.unexpected_keys)
    if missing or unexpected:
        hint = ''.join(_plugin_hint(prefix, unexpected) for prefix in PLUGIN_MODULES)
        raise ValueError(
            f'--initial-checkpoint {path} does not fit {type(model).__name__} ({len(missing)} missing keys: '
            f'{_few(missing)}; {len(unexpected)} unexpected: {_few(unexpected)}){hint}'
        )
    fresh = sorted({_module_of(k) for k in result.missing_keys})
    if fresh:
        _logger.info(f'--initial-checkpoint {path}: not in the file, initialised afresh: {", ".join(fresh)}')


def _plugin_hint(prefix: str, unexpected: list) -> str:
    """What to pass to load the keys of the attached module ``prefix`` among ``unexpected`` ('' for none)."""
    keys = [k for k in unexpected if k.startswith(prefix)]
    if not keys:
        return ''
    what, flag = PLUGIN_MODULES[prefix]
    if prefix == 'tokenmixup_scorenet.':
        flag += ' ' + ' '.join(sorted({k.split('.')[1] for k in keys}, key=int))
    return f'; the file holds {what}: pass {flag} to load them'


def _module_of(key: str) -> str:
    """``aux_head.weight`` -> ``aux_head``, ``tokenmixup_scorenet.3.fc.weight`` -> ``tokenmixup_scorenet.3``."""
    return '.'.join(key.split('.')[: 2 if key.startswith('tokenmixup_scorenet.') else 1])


def _few(keys: list, n: int = 4) -> str:
    return ', '.join(keys[:n]) + (f' and {len(keys) - n} more' if len(keys) > n else '') if keys else 'none'


def uses_token_labeling(args) -> bool:
    return args.mixup_type in TOKEN_LABELING_TYPES or bool(args.token_label_dir) or args.relabel


def uses_dense_targets(args) -> bool:
    """Token labeling with its dense term (the aux head's per-token targets from the label maps)."""
    return bool(args.token_label_dir) and not args.relabel and args.dense_weight > 0


def attach_method_modules(model: nn.Module, args) -> None:
    """The modules the method of ``args`` adds to ``model`` (token labeling's aux head with dense targets, TokenMixup's
    ScoreNets), attached before the initial checkpoint (which may hold them), the optimizer, EMA and resume: they
    are part of the trained model. Resolves ``args.num_classes`` from the model when unset."""
    if args.num_classes is None:
        args.num_classes = model.num_classes
    if uses_dense_targets(args):
        attach_aux_head(model, args.num_classes)
    elif uses_token_labeling(args) and getattr(model, 'aux_head', None) is not None:  # LV-ViT, no dense targets
        model.aux_head.requires_grad_(False)  # its aux head idles (DDP would wait for its gradients)
        if hasattr(model, 'head_rule'):
            model.head_rule = 'cls'  # and must not vote at inference
    if args.tokenmixup_htm_layers:
        attach_scorenets(model, args.tokenmixup_htm_layers, args.tokenmixup_scorenet)


def attach_modules_in(model: nn.Module, state_dict: dict) -> list[str]:
    """Attach to ``model`` the modules of :data:`PLUGIN_MODULES` whose weights ``state_dict`` holds and ``model``
    lacks, so that the file then loads strictly: token labeling's aux head (its classes from ``aux_head.weight``)
    and the ScoreNets at the blocks its keys name (``attn_pool`` where they hold an attention pooling, else the
    model's default kind: the kinds without one have the same weights). Returns the names attached. For a reader of
    a finished run (an annotator, an evaluation), where the modules idle: a training run attaches what its flags
    name (:func:`attach_method_modules`)."""
    attached = []
    if 'aux_head.weight' in state_dict and getattr(model, 'aux_head', None) is None:
        attach_aux_head(model, int(state_dict['aux_head.weight'].shape[0]))
        attached.append('aux_head')
    blocks = sorted({int(k.split('.')[1]) for k in state_dict if k.startswith('tokenmixup_scorenet.')})
    have = getattr(model, 'tokenmixup_scorenet', None) or {}
    for idx in (b for b in blocks if str(b) not in have):
        pool = 'attn_pool' if f'tokenmixup_scorenet.{idx}.attn.weight' in state_dict else 'auto'
        attach_scorenets(model, [idx], 'avg' if pool == 'auto' and not _has_class_token(model) else pool)
        attached.append(f'tokenmixup_scorenet.{idx}')
    return attached


def uses_tokenmixup(args) -> bool:
    return bool(args.tokenmixup_htm_layers or args.tokenmixup_vtm_layers)


def build_model(args, attach: Optional[Callable[[nn.Module], None]] = None) -> nn.Module:
    """The model as timm's ``train.py`` creates it (``--pretrained-path`` with the head re-initialised,
    ``--drop-block``, ``--bn-*``, ``--head-init-*``, ``--model-kwargs``). ``attach(model)`` adds the method's
    modules (token labeling's aux head, TokenMixup's ScoreNets) before ``--initial-checkpoint`` is loaded, so a
    checkpoint that holds them loads them (:func:`load_initial_checkpoint`); then ``--head-init-*``, as timm."""
    # as timm's train.py: --pretrained-path loads a file as the pretrained weights with the head adapted
    # (num_classes=-1: the classifier is always re-initialised); --pretrained-cfg-overlay adds to it
    factory_kwargs = {}
    overlay = dict(args.pretrained_cfg_overlay or {})
    if args.pretrained_path:
        overlay.update(file=args.pretrained_path, num_classes=-1)
    if overlay:
        factory_kwargs['pretrained_cfg_overlay'] = overlay
    in_chans = args.in_chans or (args.input_size[0] if args.input_size else 3)
    # as timm's train.py: --img-size/--input-size set the data size only; a model built for another size
    # gets it through --model-kwargs (e.g. img_size=112 for a ViT)
    model_kwargs = dict(args.model_kwargs)
    if not is_model(args.model) and not args.model.startswith('hf-hub:'):
        raise ValueError(f'--model: {args.model!r} is not a timm model name')
    drop_path = args.drop_path
    if args.drop_connect is not None:  # timm's deprecated name of --drop-path (its train.py ignores it now)
        _logger.warning('--drop-connect is deprecated (timm): use --drop-path; taken as --drop-path here')
        drop_path = args.drop_connect if drop_path is None else drop_path
    try:
        model = create_model(
            args.model,
            pretrained=args.pretrained or bool(args.pretrained_path),
            in_chans=in_chans,
            num_classes=args.num_classes,
            drop_rate=args.drop,
            drop_path_rate=drop_path,
            drop_block_rate=args.drop_block,
            global_pool=args.gp,
            bn_momentum=args.bn_momentum,
            bn_eps=args.bn_eps,
            **factory_kwargs,
            **model_kwargs,
        )
    except TypeError as e:  # a keyword the model does not take, or a value of the wrong type (depth=two)
        if not model_kwargs:
            raise
        given = ' '.join(f'{k}={v!r}' for k, v in model_kwargs.items())
        raise ValueError(f'--model-kwargs {given}: {args.model} cannot be built with them ({e})') from None
    base = set(model.state_dict())
    if attach is not None:
        attach(model)
    if args.initial_checkpoint:
        load_initial_checkpoint(model, args.initial_checkpoint, attached=set(model.state_dict()) - base)
    if args.head_init_scale is not None:
        with torch.no_grad():
            model.get_classifier().weight.mul_(args.head_init_scale)
            model.get_classifier().bias.mul_(args.head_init_scale)
    if args.head_init_bias is not None:
        nn.init.constant_(model.get_classifier().bias, args.head_init_bias)
    return model
