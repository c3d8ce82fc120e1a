"""TL-Align's cost: one training step (forward, loss, backward, optimizer) with the aligned target vs the
same step with the plain area target, on the same mixed batch; interleaved, medians, ratio. TransMix's step (the
target re-weighted by the last block's attention) is timed in the same rounds.

    .venv/bin/python bench/bench_tl_align.py [--model deit_tiny_patch16_224] [--batch 32] [--repeats 10]
        [--compile inductor] [--default-only] [--profile]

Any model TLAlign traces (``--model mixer_s16_224``, ``convnext_tiny``, ...); the mix is drawn on its token grid.

``--compile BACKEND``: every step runs through ``torch.compile(model, backend=BACKEND)`` (as ``tokenaug-train
--torchcompile``: the method's hooks sit on the bare model, the compiled module runs the forward).

``--default-only``: time the plain step and the methods' default paths only (the materialised and recomputed
TL-Align columns ``-``), so that more rounds fit in the same time where the per-round ratio is noisy.

``--profile``: after the timing, each step's host op time and kernel time (``common.profile_table``): whether the
step is launch-bound, and the methods' kernel-time ratio apart from their launches.

``--paths auto,triton,labels,sdpa``: TL-Align's label paths against the plain step in the same rounds, one row
each (``auto``: the row names the path it picked), instead of the methods' table.
"""

from __future__ import annotations

import argparse
import platform
import statistics

import torch
from common import device_sync, interleaved_times, optimizer_step, pair_ratios, profile_table

from shared_core.label_attention import LabelBackend
from timm_plugin.recipe import build_training
from timm_plugin.tl_align import TLAlign, TransMix
from tokenaug.train_args import parse_args


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--model', default='deit_tiny_patch16_224')
    p.add_argument('--batch', type=int, default=32)
    p.add_argument('--repeats', type=int, default=10)
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    p.add_argument('--amp', action='store_true')
    p.add_argument('--compile', default=None, metavar='BACKEND', help='run every step through torch.compile')
    p.add_argument('--default-only', action='store_true', help="time only the plain step and the methods' defaults")
    p.add_argument('--profile', action='store_true', help='print host op time and kernel time per step')
    p.add_argument('--kernels', type=int, default=0, help='with --profile: the N kernels each method adds most')
    p.add_argument(
        '--fused',
        choices=list(FUSED),
        default='default',
        help='the label attention of the TL-Align/TransMix columns: the default (the Triton kernel on CUDA where '
        "Triton is installed, else SDPA with label columns), 'triton', 'sdpa' (label columns) or 'off'",
    )
    p.add_argument(
        '--paths', default=None, help='comma-separated label paths to compare (auto, triton, labels, sdpa, off)'
    )
    args = p.parse_args()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    # the model, the mixer and the loss as tokenaug-train builds them from these flags (timm_plugin.recipe): CutMix
    # boxes on the grid TL-Align's label state starts on (ViTs: the patch grid; ConvNeXt, ResNet: 4 px)
    flags = ['--model', args.model, '--num-classes', '1000', '--method', 'tl_align', '--mixup', '0', '--cutmix', '1']
    recipe = build_training(parse_args(flags))
    model = recipe.model.to(dev).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    loss_fn = recipe.train_loss
    mixer = recipe.mixer(carry_mix=True)
    x = torch.randn(args.batch, 3, 224, 224, device=dev)
    y = torch.randint(0, 1000, (args.batch,), device=dev)
    xm, target = mixer(x, y)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.amp)

    run = torch.compile(model, backend=args.compile) if args.compile else model
    plain = optimizer_step(lambda: loss_fn(run(xm), target), opt, autocast)
    if args.paths:
        return compare_paths(args, model, run, plain, loss_fn, opt, autocast, xm, target, dev)
    fused = FUSED[args.fused]
    wrappers = [TLAlign(model, fused=fused)]  # one attention per block for tokens and labels (the default)
    try:  # TransMix reads the class token's attention: ViTs (DeiT family, Swin, PVT v2) only
        wrappers.append(TransMix(model, fused=fused))
    except ValueError:
        wrappers.append(None)
    if not args.default_only:
        # ViTs: one attention for both, materialised; models without the shared path: their recomputing path
        wrappers.append(TLAlign(model, fused=False))
        wrappers.append(TLAlign(model, shared=False))  # the model's own attention, recomputed (non-ViTs: the same)

    def aligned(w):
        return optimizer_step(lambda: loss_fn(*w.align(xm, target, lambda: run(xm))), opt, autocast)

    live = [w for w in wrappers if w is not None]
    steps = [plain] + [aligned(w) for w in live]
    times = interleaved_times(steps, args.repeats, warmup=2, sync=device_sync(dev))
    medians = iter(statistics.median(t) for t in times[1:])
    b = statistics.median(times[0])
    a, t, m, r = (None if w is None else next(medians) for w in wrappers + [None] * (4 - len(wrappers)))

    def cells(t):
        return '- | -' if t is None else f'{t * 1e3:.1f} | {t / b:.3f}'

    name = torch.cuda.get_device_name(dev) if dev.type == 'cuda' else (platform.processor() or platform.machine())
    print(
        f'# {args.model}, batch {args.batch}x3x224x224, device {dev} ({name}), amp={args.amp}, '
        f'torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats}'
        + (f', torch.compile backend {args.compile}' if args.compile else '')
        + f', label attention: {label_path(fused, dev)}'
    )
    print(
        '| training step | plain (area target) ms | TL-Align ms | ratio of medians | per-round ratio median [q1, q3] '
        '| TransMix ms | ratio | TL-Align, attention materialised (fused=False) ms | ratio '
        '| TL-Align, attention recomputed ms | ratio |'
    )
    print('|---|---|---|---|---|---|---|---|---|---|---|')
    print(
        f'| {args.model} | {b * 1e3:.1f} | {a * 1e3:.1f} | {a / b:.3f} | {pair_ratios(times[1], times[0])} '
        f'| {cells(t)} | {cells(m)} | {cells(r)} |',
        flush=True,
    )
    if args.profile:
        names = ['plain (area target)', 'TL-Align', 'TransMix', 'TL-Align fused=False', 'TL-Align recomputed']
        profile_table(steps, [n for n, w in zip(names, [plain] + wrappers) if w is not None], dev, kernels=args.kernels)


#: --fused, --paths: the wrappers' ``fused`` argument
FUSED = {'default': None, 'auto': 'auto', 'triton': 'triton', 'labels': 'labels', 'sdpa': True, 'off': False}
#: a resolved path's name in the tables
PATH_NAMES = {'kernel': 'triton', 'columns': 'sdpa', 'apart': 'labels', 'materialised': 'off'}


def compare_paths(args, model, run, plain, loss_fn, opt, autocast, xm, target, dev):
    """One row per label path (``--paths``): its TL-Align step against the plain step, interleaved, medians."""
    paths = [p.strip() for p in args.paths.split(',')]
    unknown = [p for p in paths if p not in FUSED or p == 'default']
    if unknown:
        raise SystemExit(f'--paths: unknown {unknown}; expected some of auto, triton, labels, sdpa, off')
    wrappers = [TLAlign(model, fused=FUSED[p]) for p in paths]

    def aligned(w):
        return optimizer_step(lambda: loss_fn(*w.align(xm, target, lambda: run(xm))), opt, autocast)

    times = interleaved_times([plain] + [aligned(w) for w in wrappers], args.repeats, warmup=2, sync=device_sync(dev))
    b = statistics.median(times[0])
    name = torch.cuda.get_device_name(dev) if dev.type == 'cuda' else (platform.processor() or platform.machine())
    print(
        f'# {args.model}, device {dev} ({name}), amp={args.amp}, torch {torch.__version__}, median of {args.repeats}'
        + (f', torch.compile backend {args.compile}' if args.compile else ', eager')
    )
    print('| label path | batch | plain ms | TL-Align ms | ratio of medians | per-round ratio median [q1, q3] |')
    print('|---|---|---|---|---|---|')
    for p, w, t in zip(paths, wrappers, times[1:]):
        picked = {PATH_NAMES[r.shared] if r.separate != 'labels' else 'labels' for r in w.backend.resolved.values()}
        label = f'auto (picked {", ".join(sorted(picked))})' if p == 'auto' else p
        m = statistics.median(t)
        print(f'| {label} | {args.batch} | {b * 1e3:.1f} | {m * 1e3:.1f} | {m / b:.3f} | {pair_ratios(t, times[0])} |')


def label_path(fused, dev: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """Which label attention the ViT shared path runs with this choice on this device (the wrappers' backend)."""
    shared = LabelBackend(fused).path(dev, dtype).shared
    return {'kernel': 'Triton kernel', 'columns': 'SDPA with label columns', 'materialised': 'materialised'}[shared]


if __name__ == '__main__':
    main()
