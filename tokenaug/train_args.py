"""``tokenaug-train``'s arguments: every flag of timm's ``train.py`` with timm's default and help text
(vendored in ``tokenaug/_vendor/timm_train_parser.py``), then the methods' flags, and their checks.

One default differs: ``--device`` is ``cuda`` where CUDA is available and ``cpu`` elsewhere (timm's ``cuda``
fails on a machine without one). Flags whose feature ``tokenaug-train`` does not provide are accepted at
their defaults (so a timm ``args.yaml`` runs) and refused, naming the flag, when set: :data:`REFUSED`.

A ``-c/--config`` YAML file is read as timm 1.0.31 reads it: an unknown key is warned about and ignored,
a value is converted and checked as the command line would (``'3e-4'`` becomes a float, a bad choice or a
scalar for a list stops with the key named).

Building the parser and parsing import neither torch nor timm (``--help`` answers at once): the choices come
from :mod:`shared_core.options`, timm's ``ParseKwargs`` is imported when a ``key=value`` flag is given, and
the default ``--device`` is resolved after parsing. The flags that other flags decide (the method and the mixing
kind under it, the learning rate from ``--lr-base``, ...) are resolved by
:func:`timm_plugin.recipe.resolve_flags`, which :func:`timm_plugin.recipe.build_training` runs first.
"""

from __future__ import annotations

import argparse
import difflib
import logging

import yaml

from shared_core.checks import check_int, check_real
from shared_core.configs import resolve_config_arg
from shared_core.options import (
    AA_ORDERS,
    BOX_ROUNDINGS,
    CLS_TARGET_POOLS,
    DROP_PATH_LABELS,
    GEOMETRIC_AA,
    HEAD_RULES,
    MAP_REGIONS,
    MIX_KINDS,
    TARGET_METHODS,
    TOKEN_LABELING_TYPES,
    TOKENMIX_RULES,
    TRANSMIX_MODES,
    VTM_MEMORY,
)

from ._vendor.timm_train_parser import HelpFormatter, ParseKwargs, add_timm_1031_args, add_timm_args, find_action

_logger = logging.getLogger('tokenaug.train')

_SCHEDULED_SIZES = (
    'scheduled-resolution loading is not provided by tokenaug-train: the token grids of the methods assume one size'
)
_NAFLEX = 'NaFlex loading is not provided by tokenaug-train: the methods need a fixed token grid'
_KD = "knowledge distillation is not provided by tokenaug-train (one training task per run: the method's)"
_SPLITS = (
    'augmentation splits (AugMix / JSD loss / split BN) are not provided by tokenaug-train: '
    'the mixers and label targets are per sample'
)

#: timm flags tokenaug-train accepts at their default and refuses, naming the flag, when set
REFUSED = {
    'torchscript': 'TorchScript is not provided by tokenaug-train (deprecated in PyTorch; use --torchcompile)',
    'aug_splits': _SPLITS,
    'jsd_loss': _SPLITS,
    'split_bn': _SPLITS,
    'train_img_sizes': _SCHEDULED_SIZES,
    'train_batch_sizes': _SCHEDULED_SIZES,
    'train_size_probs': _SCHEDULED_SIZES,
    'train_size_schedule': _SCHEDULED_SIZES,
    'train_size_schedule_spread': _SCHEDULED_SIZES,
    'train_size_random_mix': _SCHEDULED_SIZES,
    'train_batches_per_epoch': _SCHEDULED_SIZES,
    'variable_batch_loss_scale': _SCHEDULED_SIZES,
    'naflex_loader': _NAFLEX,
    'naflex_train_seq_lens': _NAFLEX,
    'naflex_max_seq_len': _NAFLEX,
    'naflex_patch_sizes': _NAFLEX,
    'naflex_patch_size_probs': _NAFLEX,
    'naflex_loss_scale': _NAFLEX,
    'naflex_patchify_channels_first': _NAFLEX,
    'kd_model_name': _KD,
    'kd_distill_type': _KD,
    'kd_loss_type': _KD,
    'distill_loss_weight': _KD,
    'task_loss_weight': _KD,
    'kd_temperature': _KD,
    'kd_student_feature_dim': _KD,
    'kd_teacher_feature_dim': _KD,
    'kd_token_distill_type': _KD,
}


#: ``tokenaug-train``'s exit status for a run stopped on a non-finite loss (:class:`timm_plugin.train.DivergedError`;
#: 2 is a user error)
DIVERGED = 3


def default_device() -> str:
    """``--device``'s default: ``cuda`` where CUDA is available, else ``cpu`` (timm's ``cuda`` fails there)."""
    import torch

    return 'cuda' if torch.cuda.is_available() else 'cpu'


config_parser = argparse.ArgumentParser(description='Training Config', add_help=False)
config_parser.add_argument(
    '-c',
    '--config',
    default='',
    type=str,
    metavar='FILE',
    help='YAML config file specifying default arguments (tokenaug::timm/NAME.yaml: an installed tokenaug config)',
)


def build_parser() -> argparse.ArgumentParser:
    """timm ``train.py``'s parser (every flag, default and help) and the tokenaug flags."""
    parser = argparse.ArgumentParser(
        description='tokenaug-train: timm training with token-aware mixing and targets', formatter_class=HelpFormatter
    )

    add_timm_args(parser)
    add_timm_1031_args(parser)
    add_tokenaug_args(parser)
    for action in parser._actions:  # refused flags say so in --help
        if action.dest in REFUSED and action.help:
            action.help += ' [tokenaug-train: refused when set]'
    return parser


def add_tokenaug_args(parser: argparse.ArgumentParser) -> None:
    """The methods' flags (TL-Align, TransMix, TokenMix, token labeling, TokenMixup), on top of timm's."""
    g = parser.add_argument_group('tokenaug: token-aware mixing and targets')
    _add_mixing_args(g)
    _add_token_labeling_args(g)
    _add_tokenmixup_args(parser)
    parser.add_argument_group('tokenaug: training checks').add_argument(
        '--allow-nonfinite-loss',
        action='store_true',
        help="go on training when a step's loss is NaN or infinite, as timm's train.py does (default: stop the run "
        'with exit status 3, naming the epoch and batch)',
    )


def _add_mixing_args(g) -> None:
    """The method and its mixing kind; TL-Align's, TransMix's and TokenMix's flags."""
    g.add_argument(
        '--method',
        default=None,
        choices=TARGET_METHODS,
        help='the target method over another mixing kind: --method tl_align --mixup-type KIND (--mixup-type tl_align '
        'alone is the method over cutmix)',
    )
    g.add_argument(
        '--mixup-type',
        default=None,
        choices=MIX_KINDS + TOKEN_LABELING_TYPES + ('tokenmix',) + TARGET_METHODS,
        help='how the batch is mixed (default: cutmix if --cutmix > 0 else mixup, as timm):\n'
        'mixup: MixUp only\n'
        "cutmix: timm's MixUp/CutMix switch\n"
        'token_box: a CutMix box on the token grid\n'
        'tokenmix_block, tokenmix_random: TokenMix token masks\n'
        'tokenmix: TokenMix (--tokenmix-mask kind, λ 0.5)\n'
        'mixtoken: MixToken, with --token-label-dir\n'
        'tl_align: TL-Align over cutmix (λ traced by attention)\n'
        'transmix: TransMix over cutmix (λ by class attention)',
    )
    g.add_argument(
        '--tl-align-layers',
        type=int,
        nargs='*',
        default=None,
        help='align only at these block indices (TL-Align paper Table 8 ablation; default: all)',
    )
    g.add_argument(
        '--tl-align-no-residual',
        action='store_true',
        default=False,
        help='drop the residual from the label path (TL-Align paper Table 8, normalisation disabled)',
    )
    g.add_argument(
        '--tl-align-drop-path',
        default='kept',
        choices=DROP_PATH_LABELS,
        help="labels of samples whose attention branch stochastic depth dropped: 'kept' (ours) or 'public' "
        '(the public code updates them anyway)',
    )
    g.add_argument(
        '--transmix-mode',
        default='paper',
        choices=TRANSMIX_MODES,
        help="TransMix λ: 'paper' (attention over the box) or 'average' (with the area, public code)",
    )
    g.add_argument(
        '--tokenmix-lam',
        type=float,
        default=None,
        help='fix λ (own share) of token-mask kinds, e.g. 0.5 as in TokenMix (default: Beta(--cutmix))',
    )
    g.add_argument(
        '--tokenmix-mask',
        default='block',
        choices=('block', 'random'),
        help='the TokenMix mask of --mixup-type tokenmix (TokenMix paper Tables 8-9)',
    )
    g.add_argument(
        '--tokenmix-rule',
        default='paper',
        choices=TOKENMIX_RULES,
        help="TokenMix masks: 'paper' (exactly round((1-λ)N) tokens, parts >= 14 tokens) or 'public' "
        '(the public code: int((1-λ)N)+14 tokens targeted, parts from 1 token)',
    )
    g.add_argument(
        '--box-rounding',
        default='timm',
        choices=BOX_ROUNDINGS,
        help="CutMix / MixToken / TL-Align token boxes: 'timm' (today's timm) or 'public' (the public "
        "code's pinned timm: cut // 2 on both sides of the centre)",
    )
    g.add_argument(
        '--activation-map-dir',
        default=None,
        type=str,
        metavar='DIR',
        help="teacher maps of the training split (tokenaug-maps generate): TokenMix's targets from "
        'activation maps (TokenMix paper Eq. 2), for any cut kind (with cutmix: Table 7 refinement)',
    )
    g.add_argument(
        '--activation-target',
        default='true_class',
        choices=('true_class', 'distribution'),
        help="true_class: the maps' channel of each image's class (paper / public code); "
        "distribution: the teacher's full class distribution over what each image shows (ours)",
    )


def _add_token_labeling_args(g) -> None:
    """Token labeling's flags: the maps, the losses' targets, the heads' rule and the maps' geometry."""
    g.add_argument(
        '--token-label-dir',
        default=None,
        type=str,
        metavar='DIR',
        help='label-map store of the training split (tokenaug-maps generate): token labeling',
    )
    g.add_argument('--dense-weight', type=float, default=0.5, help='β of the token loss (Token Labeling paper Eq. 3)')
    g.add_argument(
        '--cls-target',
        default='gt',
        choices=('gt', 'annotator', 'mix'),
        help="class-token target: ground truth (paper), the annotator's pooled label over the crop "
        "(public code's default) or --cls-target-mix · annotator + (1 - it) · ground truth",
    )
    g.add_argument('--cls-target-mix', type=float, default=0.5, help="the annotator's weight under --cls-target mix")
    g.add_argument(
        '--cls-target-pool',
        default='distributions',
        choices=CLS_TARGET_POOLS,
        help="how the annotator's class target pools the crop: the mean of the map's distributions (ReLabel) or "
        "'logits', the softmax of the mean of its logits (the public Token Labeling code)",
    )
    g.add_argument(
        '--relabel',
        action='store_true',
        default=False,
        help='ReLabel: one pooled label per crop from the maps as the class target, no dense term',
    )
    g.add_argument(
        '--token-targets',
        default='loader',
        choices=('loader', 'step'),
        help="where the dense term's token targets are built: by the DataLoader's workers (more to copy to the "
        'device, asynchronously with the prefetcher) or in the training step',
    )
    g.add_argument(
        '--head-rule',
        default='cls+aux',
        choices=HEAD_RULES,
        help='eval output with an aux head: cls + 0.5 max(aux) (public code) or the class head only',
    )
    g.add_argument(
        '--geometric-aa',
        default='follow',
        choices=GEOMETRIC_AA,
        help="with label maps (token labeling, TokenMix activation targets): 'follow' (the public code) keeps "
        "RandAugment's rotate/shear/translate and the maps follow them; 'drop' removes those ops",
    )
    g.add_argument(
        '--aa-order',
        default='timm',
        choices=AA_ORDERS,
        help="with label maps: 'timm' crops, flips, then runs RandAugment or ColorJitter (timm's transform); "
        "'public' flips and runs RandAugment or ColorJitter on the whole image, then crops (the public Token "
        'Labeling code: less fill in a crop)',
    )
    g.add_argument(
        '--map-region',
        default='full_image',
        choices=MAP_REGIONS,
        help="with label maps: 'full_image' registers each map on the whole image (the public code); 'recorded' "
        'where the store records the annotator saw (the maps released with Token Labeling: the centre square)',
    )


def _add_tokenmixup_args(parser: argparse.ArgumentParser) -> None:
    """TokenMixup's flags (HTM, VTM, the ScoreNets), in their own group."""
    g = parser.add_argument_group(
        'TokenMixup parameters (TokenMixup paper; with any mixing kind but tl_align/transmix)'
    )
    g.add_argument(
        '--tokenmixup-htm-layers',
        type=int,
        nargs='*',
        default=[],
        metavar='L',
        help='Horizontal TokenMixup at the input of these blocks (0-based; CCT 2, ViT-B 3)',
    )
    g.add_argument(
        '--tokenmixup-vtm-layers',
        type=int,
        nargs='*',
        default=[],
        metavar='L',
        help="Vertical TokenMixup: these blocks also attend to earlier blocks' salient tokens",
    )
    g.add_argument('--tokenmixup-rho', type=float, default=0.005, help='ρ, saliency margin of a swapped token')
    g.add_argument(
        '--tokenmixup-tau',
        type=float,
        default=0.2,
        help='τ: easy when 0.1 · ScoreNet CE <= τ (public recipes: CIFAR-100 0.2, CIFAR-10 0.1, ImageNet ViT-B 0.1)',
    )
    g.add_argument('--tokenmixup-kappa', type=int, default=3, help='κ, salient tokens per earlier block (VTM)')
    g.add_argument(
        '--tokenmixup-saliency',
        default='auto',
        choices=('auto', 'cls', 'mean'),
        help="class-token row ('cls', public ViT code) or Eq. 3 mean ('mean', CCT); auto: by class token",
    )
    g.add_argument(
        '--tokenmixup-scorenet',
        default='auto',
        choices=('auto', 'cls', 'attn_pool', 'avg'),
        help='ScoreNet pooling: class token, attention pooling (CCT) or average; auto: by the model',
    )
    g.add_argument('--tokenmixup-scorenet-weight', type=float, default=1e-3, help='λ_s of the ScoreNet loss')
    g.add_argument(
        '--tokenmixup-scorenet-stopgrad',
        action='store_true',
        default=False,
        help='ScoreNet trained on detached features (its loss does not reach the backbone)',
    )
    g.add_argument(
        '--tokenmixup-vtm-stopgrad',
        action='store_true',
        default=False,
        help="VTM's earlier-block tokens detached (the public code's choice)",
    )
    g.add_argument(
        '--tokenmixup-vtm-memory',
        default='mixed',
        choices=VTM_MEMORY,
        help="VTM memory of an HTM block: chosen by the block's attention on its mixed input ('mixed'), or by "
        "HTM's pre-mix saliency and gathered from the mixed input ('public', the public code)",
    )


def _bad(parser, path, key, what):
    parser.error(f'config {path}: {key}: {what}')


def _convert(parser, path, key, action, value):
    """One config value as the command line would read it (``action.type`` applied, nargs and choices checked)."""
    if value is None:
        return None
    if action.nargs == 0:  # store_true / store_false / store_const
        if not isinstance(value, bool):
            _bad(parser, path, key, f'expected true or false, got {value!r}')
        return value
    if isinstance(action, ParseKwargs):
        if not isinstance(value, dict):
            _bad(parser, path, key, f'expected a mapping, got {value!r}')
        return value
    many = action.nargs not in (None, '?')
    if many != isinstance(value, (list, tuple)):
        _bad(parser, path, key, f'expected {"a list" if many else "a single value"}, got {value!r}')
    items = list(value) if many else [value]
    if isinstance(action.nargs, int) and len(items) != action.nargs:
        _bad(parser, path, key, f'expected {action.nargs} values, got {len(items)}')
    out = []
    for item in items:
        if action.type is not None and isinstance(item, str):  # YAML 1.1 reads 3e-4 as a string
            try:
                item = action.type(item)
            except (TypeError, ValueError):
                _bad(parser, path, key, f'invalid {getattr(action.type, "__name__", "")} value: {item!r}')
        elif action.type in (int, float) and (isinstance(item, bool) or not isinstance(item, (int, float))):
            _bad(parser, path, key, f'invalid {action.type.__name__} value: {item!r}')
        elif action.type is int and isinstance(item, float):
            if not item.is_integer():
                _bad(parser, path, key, f'invalid int value: {item!r}')
            item = int(item)
        elif action.type is float:
            item = float(item)
        if action.choices is not None and item not in action.choices:
            _bad(parser, path, key, f'invalid choice: {item!r} (choose from {", ".join(map(repr, action.choices))})')
        out.append(item)
    return out if many else out[0]


def load_config(path: str, parser: argparse.ArgumentParser) -> None:
    """A ``-c`` YAML file's values as the parser's defaults (the command line still overrides them)."""
    with open(path, 'r') as f:
        cfg = yaml.safe_load(f) or {}
    if not isinstance(cfg, dict):
        parser.error(f'config {path}: expected a mapping of argument names to values, got {type(cfg).__name__}')
    actions = {a.dest: a for a in parser._actions if a.dest != 'help'}
    unknown = [k for k in cfg if k not in actions]
    # a key one typo away from an argument would silently not apply it (mixup_typ: tl_align trains CutMix): an
    # error; other unknown keys (timm's train.py writes some to args.yaml) are ignored with a warning
    near = {k: difflib.get_close_matches(k, actions, n=1, cutoff=0.85) for k in unknown}
    near = {k: m[0] for k, m in near.items() if m}
    if near:
        k, m = next(iter(near.items()))
        parser.error(f'config {path}: {k}: not an argument of tokenaug-train; did you mean {m}?')
    if unknown:
        _logger.warning(f'config {path}: unknown keys ignored (not arguments of tokenaug-train): {unknown}')
    parser.set_defaults(**{k: _convert(parser, path, k, actions[k], v) for k, v in cfg.items() if k in actions})


def parse_args(argv=None, add=None, prog: str | None = None) -> argparse.Namespace:
    """timm's two-stage parse: ``-c FILE`` YAML values become defaults, the command line overrides.
    ``add(parser)`` adds a tool's own flags (``tokenaug-viz mix`` takes the training flags and its own)."""
    parser = build_parser()
    if prog:
        parser.prog = prog
    if add is not None:
        add(parser)
    args_config, remaining = config_parser.parse_known_args(argv)
    if args_config.config:  # a path, or tokenaug::timm/NAME.yaml for an installed config
        args_config.config = resolve_config_arg(args_config.config)
        load_config(args_config.config, parser)
    args = parser.parse_args(remaining)
    args.config = args_config.config
    if args.device is None:
        args.device = default_device()
    return args


def check_numbers(args: argparse.Namespace) -> None:
    """Refuse, naming the flag, a number that would silently switch a method off or poison the run: NaN or
    infinite learning rates and weights (``--lr inf`` trains NaN weights into ``model_best``), a negative or NaN
    dense weight (no aux head: token labeling without its dense term) or τ (HTM never mixes), no epochs."""
    check_int(args.epochs, '--epochs', lo=1)
    for flag, value in (('--lr', args.lr), ('--lr-base', args.lr_base)):
        if value is not None:
            check_real(value, flag, lo=0.0, lo_open=True)
    check_real(args.smoothing, '--smoothing', lo=0.0, hi=1.0, hi_open=True)
    check_real(args.dense_weight, '--dense-weight', lo=0.0)
    check_real(args.tokenmixup_rho, '--tokenmixup-rho', lo=0.0)
    check_real(args.tokenmixup_scorenet_weight, '--tokenmixup-scorenet-weight', lo=0.0)
    check_int(args.tokenmixup_kappa, '--tokenmixup-kappa', lo=1)
    from shared_core.tokenmixup import check_tau

    try:
        check_tau(args.tokenmixup_tau)
    except ValueError as e:
        raise ValueError(f'--tokenmixup-{e}') from None


def check_supported(args: argparse.Namespace) -> None:
    """Refuse, naming the flag, a timm feature tokenaug-train does not provide (:data:`REFUSED`)."""
    defaults = build_parser()
    for dest, why in REFUSED.items():
        value, default = getattr(args, dest), defaults.get_default(dest)
        if value != default:
            flag = next(s for s in find_action(defaults, dest).option_strings if s.startswith('--'))
            raise ValueError(f'{flag}: {why} (got {value!r})')
