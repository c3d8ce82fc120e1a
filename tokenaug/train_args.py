"""``tokenaug-train``'s arguments: every flag of timm's ``train.py`` with timm's default and help text, then
the methods' flags.

The timm part is timm ``train.py``'s argument definitions (huggingface/pytorch-image-models, Apache-2.0,
Ross Wightman), taken verbatim from the newest stored ``train.py`` (aa4b5850, timm 1.0.29.dev0) plus the
flags timm 1.0.31's own tests drive (``--stop-epoch``, ``--save-epochs``, ``--resume auto``,
``--pretrained-cfg-overlay``, ``--task``, ``--lr-decay-fn``, ``--lr-stable-timescale``).
``tests/test_train_flags.py`` diffs this parser against the flag table ``tests/data/timm_train_flags.json``.

One default differs: ``--device`` is ``cuda`` where CUDA is available and ``cpu`` elsewhere (timm's ``cuda``
fails on a machine without one). Flags whose feature ``tokenaug-train`` does not provide are accepted at
their defaults (so a timm ``args.yaml`` runs) and refused, naming the flag, when set: :data:`REFUSED`.

A ``-c/--config`` YAML file is read as timm 1.0.31 reads it: an unknown key is warned about and ignored,
a value is converted and checked as the command line would (``'3e-4'`` becomes a float, a bad choice or a
scalar for a list stops with the key named).

Building the parser and parsing import neither torch nor timm (``--help`` answers at once): the choices come
from :mod:`shared_core.options`, timm's ``ParseKwargs`` is imported when a ``key=value`` flag is given, and
the default ``--device`` is resolved after parsing.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import warnings

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

_logger = logging.getLogger('tokenaug.train')

LOCAL_RANK_HELP = 'set by torch.distributed.launch (torchrun sets LOCAL_RANK instead); not for hand use'
MODEL_KWARGS_HELP = 'extra keyword arguments of timm.create_model, as key=value (values read as Python literals)'
OPT_KWARGS_HELP = 'extra keyword arguments of the optimizer, as key=value (values read as Python literals)'

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


def default_device() -> str:
    """``--device``'s default: ``cuda`` where CUDA is available, else ``cpu`` (timm's ``cuda`` fails there)."""
    import torch

    return 'cuda' if torch.cuda.is_available() else 'cpu'


class ParseKwargs(argparse.Action):
    """timm's ``utils.ParseKwargs`` (``key=value`` items, values read as Python literals), imported from timm when
    such a flag is given."""

    def __call__(self, parser, namespace, values, option_string=None):
        from timm.utils import ParseKwargs as TimmParseKwargs

        TimmParseKwargs.__call__(self, parser, namespace, values, option_string)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, keeping the line breaks of a help text (one line per choice)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        split = super()._split_lines
        return [line for part in text.splitlines() for line in split(part, width)]


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

    # Dataset parameters
    group = parser.add_argument_group('Dataset parameters')
    # Keep this argument outside the dataset group because it is positional.
    group.add_argument(
        'data',
        nargs='?',
        metavar='DIR',
        const=None,
        help='path to dataset (positional is *deprecated*, use --data-dir)',
    )
    group.add_argument('--data-dir', metavar='DIR', help='path to dataset (root dir)')
    group.add_argument(
        '--dataset',
        metavar='NAME',
        default='',
        help='dataset type + name ("<type>/<name>") (default: ImageFolder or ImageTar if empty)',
    )
    group.add_argument('--train-split', metavar='NAME', default='train', help='dataset train split (default: train)')
    group.add_argument(
        '--val-split', metavar='NAME', default='validation', help='dataset validation split (default: validation)'
    )
    group.add_argument(
        '--train-num-samples',
        default=None,
        type=int,
        metavar='N',
        help='Manually specify num samples in train split, for IterableDatasets.',
    )
    group.add_argument(
        '--val-num-samples',
        default=None,
        type=int,
        metavar='N',
        help='Manually specify num samples in validation split, for IterableDatasets.',
    )
    group.add_argument(
        '--dataset-download',
        action='store_true',
        default=False,
        help='Allow download of dataset for torch/ and tfds/ datasets that support it.',
    )
    group.add_argument(
        '--class-map', default='', type=str, metavar='FILENAME', help='path to class to idx mapping file (default: "")'
    )
    group.add_argument(
        '--input-img-mode', default=None, type=str, help='Dataset image conversion mode for input images.'
    )
    group.add_argument('--input-key', default=None, type=str, help='Dataset key for input images.')
    group.add_argument('--target-key', default=None, type=str, help='Dataset key for target labels.')
    group.add_argument(
        '--dataset-trust-remote-code',
        action='store_true',
        default=False,
        help="Allow huggingface dataset import to execute code downloaded from the dataset's repo.",
    )

    # Model parameters
    group = parser.add_argument_group('Model parameters')
    group.add_argument(
        '--model', default='resnet50', type=str, metavar='MODEL', help='Name of model to train (default: "resnet50")'
    )
    group.add_argument(
        '--pretrained',
        action='store_true',
        default=False,
        help='Start with pretrained version of specified network (if avail)',
    )
    group.add_argument(
        '--pretrained-path',
        default=None,
        type=str,
        help='Load this checkpoint as if they were the pretrained weights (with adaptation).',
    )
    group.add_argument(
        '--initial-checkpoint',
        default='',
        type=str,
        metavar='PATH',
        help='Load this checkpoint into model after initialization (default: none)',
    )
    group.add_argument(
        '--resume',
        default='',
        type=str,
        metavar='PATH',
        help='Resume full model and optimizer state from checkpoint (default: none)',
    )
    group.add_argument(
        '--no-resume-opt',
        action='store_true',
        default=False,
        help='prevent resume of optimizer state when resuming model',
    )
    group.add_argument(
        '--num-classes', type=int, default=None, metavar='N', help='number of label classes (Model default if None)'
    )
    group.add_argument(
        '--gp',
        default=None,
        type=str,
        metavar='POOL',
        help='Global pool type, one of (fast, avg, max, avgmax, avgmaxc). Model default if None.',
    )
    group.add_argument(
        '--img-size', type=int, default=None, metavar='N', help='Image size (default: None => model default)'
    )
    group.add_argument(
        '--in-chans', type=int, default=None, metavar='N', help='Image input channels (default: None => 3)'
    )
    group.add_argument(
        '--input-size',
        default=None,
        nargs=3,
        type=int,
        metavar='N',
        help='Input all image dimensions (d h w, e.g. --input-size 3 224 224), uses model default if empty',
    )
    group.add_argument(
        '--crop-pct',
        default=None,
        type=float,
        metavar='N',
        help='Input image center crop percent (for validation only)',
    )
    group.add_argument(
        '--mean', type=float, nargs='+', default=None, metavar='MEAN', help='Override mean pixel value of dataset'
    )
    group.add_argument(
        '--std', type=float, nargs='+', default=None, metavar='STD', help='Override std deviation of dataset'
    )
    group.add_argument(
        '--interpolation',
        default='',
        type=str,
        metavar='NAME',
        help='Image resize interpolation type (overrides model)',
    )
    group.add_argument(
        '-b', '--batch-size', type=int, default=128, metavar='N', help='Input batch size for training (default: 128)'
    )
    group.add_argument(
        '-vb',
        '--validation-batch-size',
        type=int,
        default=None,
        metavar='N',
        help='Validation batch size override (default: None)',
    )
    group.add_argument('--channels-last', action='store_true', default=False, help='Use channels_last memory layout')
    group.add_argument('--fuser', default='', type=str, help="Select jit fuser. One of ('', 'te', 'old', 'nvfuser')")
    group.add_argument(
        '--grad-accum-steps',
        type=int,
        default=1,
        metavar='N',
        help='The number of steps to accumulate gradients (default: 1)',
    )
    group.add_argument(
        '--grad-checkpointing',
        action='store_true',
        default=False,
        help='Enable gradient checkpointing through model blocks/stages',
    )
    group.add_argument('--fast-norm', default=False, action='store_true', help='enable experimental fast-norm')
    group.add_argument('--model-kwargs', nargs='*', default={}, action=ParseKwargs, help=MODEL_KWARGS_HELP)
    group.add_argument('--head-init-scale', default=None, type=float, help='Head initialization scale')
    group.add_argument('--head-init-bias', default=None, type=float, help='Head initialization bias value')
    group.add_argument('--torchcompile-mode', type=str, default=None, help='torch.compile mode (default: None).')

    # scripting / codegen
    scripting_group = group.add_mutually_exclusive_group()
    scripting_group.add_argument(
        '--torchscript', dest='torchscript', action='store_true', help='torch.jit.script the full model'
    )
    scripting_group.add_argument(
        '--torchcompile',
        nargs='?',
        type=str,
        default=None,
        const='inductor',
        help='Enable compilation w/ specified backend (default: inductor).',
    )

    # Device & distributed
    group = parser.add_argument_group('Device parameters')
    # default: default_device(), resolved by parse_args (timm's 'cuda' fails on a machine without CUDA)
    group.add_argument('--device', default=None, type=str, help='Device (accelerator) to use.')
    group.add_argument('--amp', action='store_true', default=False, help='use AMP for mixed precision training')
    group.add_argument('--amp-dtype', default='float16', type=str, help='lower precision AMP dtype (default: float16)')
    group.add_argument(
        '--model-dtype', default=None, type=str, help='Model dtype override (non-AMP) (default: float32)'
    )
    group.add_argument(
        '--no-ddp-bb', action='store_true', default=False, help='Force broadcast buffers for native DDP to off.'
    )
    group.add_argument(
        '--synchronize-step', action='store_true', default=False, help='torch.cuda.synchronize() end of each step'
    )
    group.add_argument('--local_rank', '--local-rank', default=0, type=int, help=LOCAL_RANK_HELP)
    group.add_argument(
        '--device-modules', default=None, type=str, nargs='+', help='Python imports for device backend modules.'
    )

    # Optimizer parameters
    group = parser.add_argument_group('Optimizer parameters')
    group.add_argument('--opt', default='sgd', type=str, metavar='OPTIMIZER', help='Optimizer (default: "sgd")')
    group.add_argument(
        '--opt-eps',
        default=None,
        type=float,
        metavar='EPSILON',
        help='Optimizer Epsilon (default: None, use opt default)',
    )
    group.add_argument(
        '--opt-betas',
        default=None,
        type=float,
        nargs='+',
        metavar='BETA',
        help='Optimizer Betas (default: None, use opt default)',
    )
    group.add_argument('--momentum', type=float, default=0.9, metavar='M', help='Optimizer momentum (default: 0.9)')
    group.add_argument('--weight-decay', type=float, default=2e-5, help='weight decay (default: 2e-5)')
    group.add_argument(
        '--clip-grad', type=float, default=None, metavar='NORM', help='Clip gradient norm (default: None, no clipping)'
    )
    group.add_argument(
        '--clip-mode', type=str, default='norm', help='Gradient clipping mode. One of ("norm", "value", "agc")'
    )
    group.add_argument('--layer-decay', type=float, default=None, help='layer-wise learning rate decay (default: None)')
    group.add_argument(
        '--layer-decay-min-scale', type=float, default=0, help='layer-wise lr decay minimum scale clamp (default: 0)'
    )
    group.add_argument(
        '--layer-decay-no-opt-scale',
        type=float,
        default=None,
        help='layer-wise lr decay no optimization scale (default: None)',
    )
    group.add_argument('--opt-kwargs', nargs='*', default={}, action=ParseKwargs, help=OPT_KWARGS_HELP)

    # Learning rate schedule parameters
    group = parser.add_argument_group('Learning rate schedule parameters')
    group.add_argument(
        '--sched', type=str, default='cosine', metavar='SCHEDULER', help='LR scheduler (default: "cosine"'
    )
    group.add_argument(
        '--sched-on-updates',
        action='store_true',
        default=False,
        help='Apply LR scheduler step on update instead of epoch end.',
    )
    group.add_argument(
        '--lr', type=float, default=None, metavar='LR', help='learning rate, overrides lr-base if set (default: None)'
    )
    group.add_argument(
        '--lr-base',
        type=float,
        default=0.1,
        metavar='LR',
        help='base learning rate: lr = lr_base * global_batch_size / base_size',
    )
    group.add_argument(
        '--lr-base-size',
        type=int,
        default=256,
        metavar='DIV',
        help='base learning rate batch size (divisor, default: 256).',
    )
    group.add_argument(
        '--lr-base-scale',
        type=str,
        default='',
        metavar='SCALE',
        help='base learning rate vs batch_size scaling ("linear", "sqrt", based on opt if empty)',
    )
    group.add_argument(
        '--lr-noise',
        type=float,
        nargs='+',
        default=None,
        metavar='pct, pct',
        help='learning rate noise on/off epoch percentages',
    )
    group.add_argument(
        '--lr-noise-pct',
        type=float,
        default=0.67,
        metavar='PERCENT',
        help='learning rate noise limit percent (default: 0.67)',
    )
    group.add_argument(
        '--lr-noise-std', type=float, default=1.0, metavar='STDDEV', help='learning rate noise std-dev (default: 1.0)'
    )
    group.add_argument(
        '--lr-cycle-mul',
        type=float,
        default=1.0,
        metavar='MULT',
        help='learning rate cycle len multiplier (default: 1.0)',
    )
    group.add_argument(
        '--lr-cycle-decay',
        type=float,
        default=0.5,
        metavar='MULT',
        help='amount to decay each learning rate cycle (default: 0.5)',
    )
    group.add_argument(
        '--lr-cycle-limit', type=int, default=1, metavar='N', help='learning rate cycle limit, cycles enabled if > 1'
    )
    group.add_argument(
        '--lr-k-decay', type=float, default=1.0, help='learning rate k-decay for cosine/poly (default: 1.0)'
    )
    group.add_argument(
        '--warmup-lr', type=float, default=1e-5, metavar='LR', help='warmup learning rate (default: 1e-5)'
    )
    group.add_argument(
        '--min-lr',
        type=float,
        default=0,
        metavar='LR',
        help='lower lr bound for cyclic schedulers that hit 0 (default: 0)',
    )
    group.add_argument('--epochs', type=int, default=300, metavar='N', help='number of epochs to train (default: 300)')
    group.add_argument(
        '--epoch-repeats',
        type=float,
        default=0.0,
        metavar='N',
        help='epoch repeat multiplier (number of times to repeat dataset epoch per train epoch).',
    )
    group.add_argument(
        '--start-epoch', default=None, type=int, metavar='N', help='manual epoch number (useful on restarts)'
    )
    group.add_argument(
        '--decay-milestones',
        default=[90, 180, 270],
        type=int,
        nargs='+',
        metavar='MILESTONES',
        help='list of decay epoch indices for multistep lr. must be increasing',
    )
    group.add_argument('--decay-epochs', type=float, default=90, metavar='N', help='epoch interval to decay LR')
    group.add_argument(
        '--warmup-epochs', type=int, default=5, metavar='N', help='epochs to warmup LR, if scheduler supports'
    )
    (
        group.add_argument(
            '--warmup-prefix', action='store_true', default=False, help='Exclude warmup period from decay schedule.'
        ),
    )
    group.add_argument(
        '--cooldown-epochs',
        type=int,
        default=0,
        metavar='N',
        help='epochs to cooldown LR at min_lr, after cyclic schedule ends',
    )
    group.add_argument(
        '--patience-epochs',
        type=int,
        default=10,
        metavar='N',
        help='patience epochs for Plateau LR scheduler (default: 10)',
    )
    group.add_argument(
        '--decay-rate', '--dr', type=float, default=0.1, metavar='RATE', help='LR decay rate (default: 0.1)'
    )

    # Augmentation & regularization parameters
    group = parser.add_argument_group('Augmentation and regularization parameters')
    group.add_argument(
        '--no-aug',
        action='store_true',
        default=False,
        help='Disable all training augmentation, override other train aug args',
    )
    (group.add_argument('--train-crop-mode', type=str, default=None, help='Crop-mode in train'),)
    group.add_argument(
        '--scale',
        type=float,
        nargs='+',
        default=[0.08, 1.0],
        metavar='PCT',
        help='Random resize scale (default: 0.08 1.0)',
    )
    group.add_argument(
        '--ratio',
        type=float,
        nargs='+',
        default=[3.0 / 4.0, 4.0 / 3.0],
        metavar='RATIO',
        help='Random resize aspect ratio (default: 0.75 1.33)',
    )
    group.add_argument('--hflip', type=float, default=0.5, help='Horizontal flip training aug probability')
    group.add_argument('--vflip', type=float, default=0.0, help='Vertical flip training aug probability')
    group.add_argument(
        '--color-jitter', type=float, default=0.4, metavar='PCT', help='Color jitter factor (default: 0.4)'
    )
    group.add_argument(
        '--color-jitter-prob', type=float, default=None, metavar='PCT', help='Probability of applying any color jitter.'
    )
    group.add_argument(
        '--grayscale-prob',
        type=float,
        default=None,
        metavar='PCT',
        help='Probability of applying random grayscale conversion.',
    )
    group.add_argument(
        '--gaussian-blur-prob', type=float, default=None, metavar='PCT', help='Probability of applying gaussian blur.'
    )
    (
        group.add_argument(
            '--aa',
            type=str,
            default=None,
            metavar='NAME',
            help='Use AutoAugment policy. "v0" or "original". (default: None)',
        ),
    )
    group.add_argument(
        '--aug-repeats',
        type=float,
        default=0,
        help='Number of augmentation repetitions (distributed training only) (default: 0)',
    )
    group.add_argument(
        '--aug-splits', type=int, default=0, help='Number of augmentation splits (default: 0, valid: 0 or >=2)'
    )
    group.add_argument(
        '--jsd-loss',
        action='store_true',
        default=False,
        help='Enable Jensen-Shannon Divergence + CE loss. Use with `--aug-splits`.',
    )
    group.add_argument('--bce-loss', action='store_true', default=False, help='Enable BCE loss w/ Mixup/CutMix use.')
    group.add_argument('--bce-sum', action='store_true', default=False, help='Sum over classes when using BCE loss.')
    group.add_argument(
        '--bce-target-thresh',
        type=float,
        default=None,
        help='Threshold for binarizing softened BCE targets (default: None, disabled).',
    )
    group.add_argument('--bce-pos-weight', type=float, default=None, help='Positive weighting for BCE loss.')
    group.add_argument('--reprob', type=float, default=0.0, metavar='PCT', help='Random erase prob (default: 0.)')
    group.add_argument('--remode', type=str, default='pixel', help='Random erase mode (default: "pixel")')
    group.add_argument('--recount', type=int, default=1, help='Random erase count (default: 1)')
    group.add_argument(
        '--resplit', action='store_true', default=False, help='Do not random erase first (clean) augmentation split'
    )
    group.add_argument('--mixup', type=float, default=0.0, help='mixup alpha, mixup enabled if > 0. (default: 0.)')
    group.add_argument('--cutmix', type=float, default=0.0, help='cutmix alpha, cutmix enabled if > 0. (default: 0.)')
    group.add_argument(
        '--cutmix-minmax',
        type=float,
        nargs='+',
        default=None,
        help='cutmix min/max ratio, overrides alpha and enables cutmix if set (default: None)',
    )
    group.add_argument(
        '--mixup-prob',
        type=float,
        default=1.0,
        help='Probability of performing mixup or cutmix when either/both is enabled',
    )
    group.add_argument(
        '--mixup-switch-prob',
        type=float,
        default=0.5,
        help='Probability of switching to cutmix when both mixup and cutmix enabled',
    )
    group.add_argument(
        '--mixup-mode',
        type=str,
        default='batch',
        help='How to apply mixup/cutmix params. Per "batch", "pair", or "elem"',
    )
    group.add_argument(
        '--mixup-off-epoch',
        default=0,
        type=int,
        metavar='N',
        help='Turn off mixup after this epoch, disabled if 0 (default: 0)',
    )
    group.add_argument('--smoothing', type=float, default=0.1, help='Label smoothing (default: 0.1)')
    group.add_argument(
        '--train-interpolation',
        type=str,
        default='random',
        help='Training interpolation (random, bilinear, bicubic default: "random")',
    )
    group.add_argument('--drop', type=float, default=0.0, metavar='PCT', help='Dropout rate (default: 0.)')
    group.add_argument(
        '--drop-connect',
        type=float,
        default=None,
        metavar='PCT',
        help='Drop connect rate, DEPRECATED, use drop-path (default: None)',
    )
    group.add_argument('--drop-path', type=float, default=None, metavar='PCT', help='Drop path rate (default: None)')
    group.add_argument('--drop-block', type=float, default=None, metavar='PCT', help='Drop block rate (default: None)')

    # Batch norm parameters (only works with gen_efficientnet based models currently)
    group = parser.add_argument_group(
        'Batch norm parameters', 'Only works with gen_efficientnet based models currently.'
    )
    group.add_argument('--bn-momentum', type=float, default=None, help='BatchNorm momentum override (if not None)')
    group.add_argument('--bn-eps', type=float, default=None, help='BatchNorm epsilon override (if not None)')
    group.add_argument('--sync-bn', action='store_true', help='Enable synchronized BatchNorm.')
    group.add_argument(
        '--dist-bn',
        type=str,
        default='reduce',
        help='Distribute BatchNorm stats between nodes after each epoch ("broadcast", "reduce", or "")',
    )
    group.add_argument('--split-bn', action='store_true', help='Enable separate BN layers per augmentation split.')

    # Model Exponential Moving Average
    group = parser.add_argument_group('Model exponential moving average parameters')
    group.add_argument(
        '--model-ema', action='store_true', default=False, help='Enable tracking moving average of model weights.'
    )
    group.add_argument(
        '--model-ema-force-cpu',
        action='store_true',
        default=False,
        help='Force ema to be tracked on CPU, rank=0 node only. Disables EMA validation.',
    )
    group.add_argument(
        '--model-ema-decay',
        type=float,
        default=0.9998,
        help='Decay factor for model weights moving average (default: 0.9998)',
    )
    group.add_argument('--model-ema-warmup', action='store_true', help='Enable warmup for model EMA decay.')

    # Misc
    group = parser.add_argument_group('Miscellaneous parameters')
    group.add_argument('--seed', type=int, default=42, metavar='S', help='random seed (default: 42)')
    group.add_argument('--worker-seeding', type=str, default='all', help='worker seed mode (default: all)')
    group.add_argument(
        '--log-interval',
        type=int,
        default=50,
        metavar='N',
        help='how many batches to wait before logging training status',
    )
    group.add_argument(
        '--val-interval', type=int, default=1, metavar='N', help='how many epochs between validation and checkpointing'
    )
    group.add_argument(
        '--recovery-interval',
        type=int,
        default=0,
        metavar='N',
        help='how many batches to wait before writing recovery checkpoint',
    )
    group.add_argument(
        '--checkpoint-hist', type=int, default=10, metavar='N', help='number of checkpoints to keep (default: 10)'
    )
    group.add_argument(
        '-j', '--workers', type=int, default=4, metavar='N', help='how many training processes to use (default: 4)'
    )
    group.add_argument(
        '--save-images',
        action='store_true',
        default=False,
        help='save images of input batches every log interval for debugging',
    )
    group.add_argument(
        '--pin-mem',
        action='store_true',
        default=False,
        help='Pin CPU memory in DataLoader for more efficient (sometimes) transfer to GPU.',
    )
    group.add_argument('--no-prefetcher', action='store_true', default=False, help='disable fast prefetcher')
    group.add_argument(
        '--output', default='', type=str, metavar='PATH', help='path to output folder (default: none, current dir)'
    )
    group.add_argument(
        '--experiment',
        default='',
        type=str,
        metavar='NAME',
        help='name of train experiment, name of sub-folder for output',
    )
    group.add_argument(
        '--overwrite',
        action='store_true',
        default=False,
        help='replace the run already in the --experiment folder (without it, and without --resume of that run, '
        'tokenaug-train refuses to write over it)',
    )
    group.add_argument(
        '--eval-metric', default='top1', type=str, metavar='EVAL_METRIC', help='Best metric (default: "top1"'
    )
    group.add_argument(
        '--tta',
        type=int,
        default=0,
        metavar='N',
        help='Test/inference time augmentation (oversampling) factor. 0=None (default: 0)',
    )
    group.add_argument(
        '--use-multi-epochs-loader',
        action='store_true',
        default=False,
        help='use the multi-epochs-loader to save time at the beginning of every epoch',
    )
    group.add_argument(
        '--log-wandb', action='store_true', default=False, help='log training and validation metrics to wandb'
    )
    group.add_argument('--wandb-project', default=None, type=str, help='wandb project name')
    group.add_argument('--wandb-tags', default=[], type=str, nargs='+', help='wandb tags')
    group.add_argument(
        '--wandb-resume-id', default='', type=str, metavar='ID', help='If resuming a run, the id of the run in wandb'
    )

    # Scheduled resolution loader arguments
    group.add_argument(
        '--train-img-sizes',
        type=int,
        nargs='+',
        default=None,
        help='Per-batch square image sizes for scheduled resolution training',
    )
    group.add_argument(
        '--train-batch-sizes',
        type=int,
        nargs='+',
        default=None,
        help='Batch size for each --train-img-sizes choice (default: --batch-size for every choice)',
    )
    group.add_argument(
        '--train-size-probs',
        type=float,
        nargs='+',
        default=None,
        help='Base sampling weights for --train-img-sizes (default: uniform)',
    )
    group.add_argument(
        '--train-size-schedule',
        type=str,
        default='constant',
        choices=('constant', 'progressive'),
        help='Resolution choice schedule; progressive moves from the first size to the last',
    )
    group.add_argument(
        '--train-size-schedule-spread',
        type=float,
        default=0.65,
        help='Progressive schedule spread in resolution-choice index units (default: 0.65)',
    )
    group.add_argument(
        '--train-size-random-mix',
        type=float,
        default=0.1,
        help='Fraction of uniform random active choices mixed into a progressive schedule (default: 0.1)',
    )
    group.add_argument(
        '--train-batches-per-epoch',
        '--train-steps-per-epoch',
        type=int,
        default=None,
        help='Fixed loader batches (before gradient accumulation) per epoch; inferred if unspecified',
    )
    group.add_argument(
        '--variable-batch-loss-scale',
        default='none',
        type=str,
        choices=('none', 'sqrt', 'linear'),
        help='Scale gradients relative to the policy-average scheduled batch size',
    )

    # NaFlex scheduled loader arguments
    group.add_argument(
        '--naflex-loader',
        action='store_true',
        default=False,
        help='Use NaFlex loader (Requires NaFlex compatible model)',
    )
    group.add_argument(
        '--naflex-train-seq-lens',
        type=int,
        nargs='+',
        default=[128, 256, 576, 784, 1024],
        help='Sequence lengths to use for NaFlex loader',
    )
    group.add_argument(
        '--naflex-max-seq-len',
        type=int,
        default=576,
        help='Fixed maximum sequence length for NaFlex loader (validation)',
    )
    group.add_argument(
        '--naflex-patch-sizes',
        type=int,
        nargs='+',
        default=None,
        help='List of patch sizes for variable patch size training (e.g., 8 12 16 24 32)',
    )
    group.add_argument(
        '--naflex-patch-size-probs',
        type=float,
        nargs='+',
        default=None,
        help='Probabilities for each patch size (must sum to 1.0, uniform if not specified)',
    )
    group.add_argument(
        '--naflex-loss-scale',
        default='linear',
        type=str,
        choices=('none', 'sqrt', 'linear'),
        help='Scale loss (gradient) by batch_size ("none", "sqrt", or "linear")',
    )
    group.add_argument(
        '--naflex-patchify-channels-first',
        action='store_true',
        default=False,
        help='Emit NaFlex patches in C-P-P (channels-first) flat layout instead of the default '
        'P-P-C (channels-last). Use for models that consume HF/Gemma4-style C-P-P patches.',
    )

    # Knowledge Distillation parameters
    group = parser.add_argument_group('Knowledge distillation parameters')
    group.add_argument(
        '--kd-model-name', default=None, type=str, help='Name of teacher model for knowledge distillation'
    )
    group.add_argument(
        '--kd-distill-type',
        default='logit',
        type=str,
        choices=['logit', 'feature', 'token'],
        help='Type of distillation: "logit" for output distillation, "feature" for intermediate features, "token" for models with distillation heads (default: logit)',
    )
    group.add_argument(
        '--kd-loss-type',
        default='kl',
        type=str,
        help='Loss function for logit distillation (default: kl). Currently only "kl" supported, reserved for future extensions.',
    )
    group.add_argument(
        '--distill-loss-weight',
        default=None,
        type=float,
        help='Weight for distillation loss. If both weights specified: loss = task_weight * task + distill_weight * distill. '
        'If only task_weight: loss = task_weight * task + (1-task_weight) * distill. Default: 1.0 if only this specified.',
    )
    group.add_argument(
        '--task-loss-weight',
        default=None,
        type=float,
        help='Weight for task (classification) loss. See --distill-loss-weight for weighting modes. Default: 1.0 if unspecified.',
    )
    group.add_argument(
        '--kd-temperature',
        default=4.0,
        type=float,
        help='Temperature for softmax in distillation (default: 4.0, typical range: 1-4)',
    )
    group.add_argument(
        '--kd-student-feature-dim',
        default=None,
        type=int,
        help='Student model feature dimension (auto-detected from model.head_hidden_size or model.num_features if not specified)',
    )
    group.add_argument(
        '--kd-teacher-feature-dim',
        default=None,
        type=int,
        help='Teacher model feature dimension (auto-detected from model.head_hidden_size or model.num_features if not specified)',
    )
    group.add_argument(
        '--kd-token-distill-type',
        default='soft',
        type=str,
        choices=['soft', 'hard'],
        help='Token distillation type: "soft" for KL-div with temperature, "hard" for CE with teacher argmax (default: soft)',
    )

    add_timm_1031_args(parser)
    add_tokenaug_args(parser)
    for action in parser._actions:  # refused flags say so in --help
        if action.dest in REFUSED and action.help:
            action.help += ' [tokenaug-train: refused when set]'
    return parser


def _action(parser: argparse.ArgumentParser, dest: str) -> argparse.Action:
    return next(a for a in parser._actions if a.dest == dest)


def add_timm_1031_args(parser: argparse.ArgumentParser) -> None:
    """The flags of timm 1.0.31's ``train.py`` beyond the stored source (as its own tests drive them)."""
    _action(
        parser, 'resume'
    ).help += "; 'auto': continue from last.pth.tar in the --experiment folder if there is one, else start there"
    g = parser.add_argument_group('timm 1.0.31 parameters')
    g.add_argument(
        '--stop-epoch',
        default=None,
        type=int,
        metavar='N',
        help='end the run before epoch N, keeping the schedule of --epochs (split a run; --resume continues it)',
    )
    g.add_argument(
        '--save-epochs',
        default=None,
        type=int,
        nargs='+',
        metavar='N',
        help='also keep milestone-N.pth.tar after N completed epochs (evaluated even between --val-interval)',
    )
    g.add_argument(
        '--pretrained-cfg-overlay',
        nargs='*',
        default={},
        action=ParseKwargs,
        help="overrides of the model's pretrained config, as key=value (merged under --pretrained-path's file)",
    )
    g.add_argument(
        '--task',
        default='classification',
        choices=('classification',),
        help="training task: single-label classification (timm's 'multilabel' task is not provided by tokenaug)",
    )
    g.add_argument('--lr-decay-fn', default=None, type=str, help="decay shape of schedulers that take one (e.g. 'wsd')")
    g.add_argument('--lr-stable-timescale', default=None, type=float, help="stable-phase length of the 'wsd' scheduler")


def add_tokenaug_args(parser: argparse.ArgumentParser) -> None:
    """The methods' flags (TL-Align, TransMix, TokenMix, token labeling, TokenMixup), on top of timm's."""
    g = parser.add_argument_group('tokenaug: token-aware mixing and targets')
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
    g.add_argument('--method-mix', default=None, choices=MIX_KINDS, help=argparse.SUPPRESS)  # see resolve_method
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
    resolve_method(args)
    return args


def check_one_kind(args: argparse.Namespace) -> None:
    """Refuse two different mixing kinds under a method: ``--method-mix`` and ``--mixup-type``."""
    if args.method_mix is not None and args.mixup_type not in (None, args.method_mix):
        raise ValueError(
            f'--method-mix {args.method_mix} and --mixup-type {args.mixup_type}: two mixing kinds under '
            f'--method {args.method}; pass --mixup-type only'
        )


def resolve_method(args: argparse.Namespace) -> None:
    """``--method`` and the mixing kind under it. ``--mixup-type tl_align`` (or ``transmix``) is the method over
    the default kind, as ``--method tl_align``; ``--method METHOD --mixup-type KIND`` puts it over another kind.
    With a method and no kind, the kind is ``cutmix`` (the MixUp/CutMix switch with ``--mixup > 0``).
    ``--method-mix KIND``, the former way to name the kind under ``--mixup-type METHOD``, still parses and warns
    (``FutureWarning``) with the spelling that replaces it."""
    if args.mixup_type in TARGET_METHODS:
        if args.method not in (None, args.mixup_type):
            raise ValueError(
                f'--mixup-type {args.mixup_type}: a method, and --method {args.method} names one too; '
                f'pass --method {args.method} --mixup-type KIND to put a method over another mixing kind'
            )
        args.method, args.mixup_type = args.mixup_type, None
    if args.method_mix is not None:
        if args.method is None:
            raise ValueError(f'--method-mix {args.method_mix}: it names the mixing kind under a --method; none given')
        check_one_kind(args)
        warnings.warn(
            f'--method-mix is deprecated: use --method {args.method} --mixup-type {args.method_mix} '
            '(--mixup-type names the mixing kind under --method)',
            FutureWarning,
            stacklevel=2,
        )
    if args.method is not None:
        check_one_kind(args)
        args.mixup_type = args.mixup_type or args.method_mix or 'cutmix'
        args.method_mix = None


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
            flag = next(s for s in _action(defaults, dest).option_strings if s.startswith('--'))
            raise ValueError(f'{flag}: {why} (got {value!r})')
