#!/usr/bin/env python3
"""A seeded multi-seed study: each method against its baseline, same recipe, the noise measured.

A preset of ``tokenaug-study`` on a generated world. This script builds the world and its test world
(``tokenaug-data``), lays them out as one ImageFolder (``OUT/data``: the world's train and val splits, and as the
test split the test world's val split, ten times the val split) and runs ``tokenaug-study``'s own
:class:`~timm_plugin.tools.study_cli.Study` on it: its runs (``tokenaug.tool_args.STUDY_RUNS``, one spelling), its
steps and their resumption, its annotator and label maps, its test evaluation, its ``results.md`` against
``cutmix``. Beside that study it runs what the product does not: mmpretrain's own ``tools/train.py`` and
``tools/test.py`` on the same world (:data:`MM_RUNS`), and ``tokenaug-occlusion`` on the checkpoints, each as a
step of the same kind (:func:`timm_plugin.tools.study_cli.command_step`). It writes ``study.md`` and
``study.json`` under ``--out``:

- per run: mean +- standard deviation over seeds of the final checkpoint's top-1 on the test split, beside the
  training's own val top-1 (no selection on either), and the mean wall time of one run. The 500 val images alone
  have a binomial standard error of about 1.9 points at 75 %, as large as the effects looked for;
- per comparison (:data:`COMPARISONS`, each method against its own baseline): the paired difference method -
  baseline over seeds (same seed = same data order, same initialisation draw), its mean, 95 % Student-t interval
  and ``tokenaug-study``'s verdict;
- occlusion (TokenMix Fig. 5 analogue): ``tokenaug-occlusion`` on the same checkpoints, val top-1 with a fraction
  of the patches zeroed (the same patches for every model), mean and paired difference per ratio.

Resumable as ``tokenaug-study`` is: every step keeps its command, keyed without the study folder's path; a rerun
skips what is done and runs again a step whose command changed, after moving its old folder aside; an interrupted
training resumes through ``tokenaug-train --resume``.

Presets: ``cpu_small`` (the default: 300 train images, 60 epochs, where mixing regularises; the grid in about 85
min on this repo's 2-core machine), ``cpu`` (1000 train images, 15 epochs: an underfitting recipe where mixing
costs; about 75 min), ``gpu`` (a larger world and the full ViT-Tiny; minutes on one GPU), ``tiny`` (2 seeds, 1
epoch: the test of the runner itself). The grid is every run but the probes (:data:`PROBES`), which train when
``--runs`` names them.

    .venv/bin/python bench/study.py [--preset cpu_small] [--out study_out] [--seeds N] [--epochs E]
        [--no-mmpretrain] [--runs plain cutmix ... | --runs all]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from shared_core.configs import upstream_tool
from shared_core.study import Step, interval, mean_sd, paired, verdict
from timm_plugin.tools.study_cli import BIN, OutputError, Study, command_step, portable_cmd, run_logged
from tokenaug.tool_args import STUDY_RUNS, study_parser

REPO = Path(__file__).resolve().parents[1]

# The world: objects cover 8-35 % of the image (tokenaug-data's default), so a CutMix box's area is often not
# the share of the object it shows. ViT sizes as timm kwargs; the mmpretrain rows build the same ViT.
PRESETS = {
    'cpu': dict(
        train_per_class=100,
        val_per_class=50,
        test_per_class=500,
        vit=dict(depth=6, embed_dim=96, num_heads=3),
        epochs=15,
        seeds=5,
        batch_size=32,
        workers=2,
    ),
    'gpu': dict(
        train_per_class=500,
        val_per_class=100,
        test_per_class=1000,
        vit=dict(depth=12, embed_dim=192, num_heads=3),
        epochs=40,
        seeds=5,
        batch_size=64,
        workers=8,
    ),
    'tiny': dict(
        train_per_class=8,
        val_per_class=4,
        test_per_class=6,
        vit=dict(depth=3, embed_dim=48, num_heads=3),
        epochs=1,
        seeds=2,
        batch_size=16,
        workers=0,
    ),
}

# fewer images, four times the epochs: the regime where a regulariser can pay (the cpu preset underfits, and
# mixing costs there). Seed 0 probe: no mixing 74.0, CutMix 76.6, TL-Align 76.0 (STUDY.md). Evaluated every 20
# epochs (--val-interval; the table reads the last epoch only): evaluating 500 images every epoch took about 40 %
# of a run, and evaluation draws nothing from the training streams, so the final top-1 is the same.
PRESETS['cpu_small'] = dict(PRESETS['cpu'], train_per_class=30, epochs=60, val_interval=20)

#: the recipe every timm run shares (tokenaug-study's -c); each run adds its own flags (STUDY_RUNS)
RECIPE = REPO / 'configs' / 'timm' / 'world_vit-tiny.yaml'
#: the timm runs, by tokenaug-study's names. HTM at block 2 on top of MixUp/CutMix, as the public CCT CIFAR recipes:
#: the world has 10 classes, as CIFAR-10, whose recipe is τ 0.1, ρ 0.003 (``htm_c10``: easy when CE <= 1.0, 43 % of
#: ln 10). CIFAR-100's τ 0.2, ρ 0.005 (``htm``, tokenaug-train's defaults) mark CE <= 2.0 easy, 87 % of ln 10
#: here: most samples (STUDY.md).
TIMM_RUNS = [
    'plain', 'cutmix', 'tl_align', 'transmix', 'tokenmix_block', 'tokenmix_block_maps', 'mixtoken', 'htm_c10', 'htm',
]  # fmt: skip
#: the mmpretrain runs (tools/train.py): name -> (what it is, config under configs/mmpretrain)
MM_RUNS = {
    'mm_tl_align': ('TL-Align over MixUp/CutMix, mmpretrain tools/train.py', 'deit-tiny_world_tl-align.py'),
    'mm_cutmix': ('MixUp/CutMix (DeiT), mmpretrain tools/train.py', 'deit-tiny_world_cutmix.py'),
}
#: runs that answer a question the grid raised (bench/STUDY.md): trained only when ``--runs`` names them (or
#: ``--runs all``): HTM with CIFAR-100's τ on this 10-class world, and mmpretrain's own CutMix baseline
PROBES = ('htm', 'mm_cutmix')
#: the default grid: every run but the probes
GRID = [n for n in TIMM_RUNS + list(MM_RUNS) if n not in PROBES]
#: (method, baseline) pairs of the table; the last three: TL-Align vs CutMix within mmpretrain, then each of the two
#: across the ecosystems (the same recipe, as far as the two libraries allow)
COMPARISONS = [
    ('cutmix', 'plain'),
    ('tl_align', 'cutmix'),
    ('transmix', 'cutmix'),
    ('tl_align', 'transmix'),
    ('tokenmix_block', 'cutmix'),
    ('tokenmix_block_maps', 'cutmix'),
    ('tokenmix_block_maps', 'tokenmix_block'),
    ('mixtoken', 'cutmix'),
    ('mixtoken', 'plain'),
    ('htm_c10', 'cutmix'),
    ('htm', 'cutmix'),
    ('mm_tl_align', 'mm_cutmix'),
    ('mm_cutmix', 'cutmix'),
    ('mm_tl_align', 'tl_align'),
]
OCCLUSION_RUNS = ['cutmix', 'tokenmix_block', 'tokenmix_block_maps']
OCCLUSION_RATIOS = ['0', '0.2', '0.4', '0.6', '0.8']
IMG_SIZE = 112
NUM_CLASSES = 10
#: what each run is: tokenaug-study's words, and the mmpretrain rows'
LABELS = {n: STUDY_RUNS[n][0] for n in TIMM_RUNS} | {n: v[0] for n, v in MM_RUNS.items()}


def default_area() -> tuple[float, float]:
    """tokenaug-data's default share of the image covered by a scene's main object (--min-area, --max-area)."""
    from shared_core.tools.world import WorldConfig

    return WorldConfig.min_area, WorldConfig.max_area


def area_range(preset: dict) -> str:
    """The main object's share of the image in a preset's world, as ``8-35 %``."""
    lo, hi = preset.get('area') or default_area()
    return f'{lo * 100:g}-{hi * 100:g} %'


class Tally:
    """The steps of a preset run here or found done before, and their recorded wall and CPU seconds (skipped steps
    included: the study's cost, whichever run paid it)."""

    def __init__(self):
        self.ran, self.skipped, self.secs, self.cpu_secs = [], [], 0.0, 0.0
        self._costed = set()  # the folders of the tokenaug-study steps counted (two studies may share a step)

    def add(self, name: str, rec: dict, before: bool) -> dict:
        (self.skipped if before else self.ran).append(name)
        return self.cost(rec)

    def cost(self, rec: dict) -> dict:
        self.secs += rec.get('secs', 0.0)
        self.cpu_secs += rec.get('cpu_secs', 0.0)
        return rec

    def take(self, study: Study, prefix: str = '') -> None:
        """A ``tokenaug-study``'s steps (its trainings, annotator and maps; its evaluations by name only), each
        counted once however many of the preset's studies share it; ``prefix`` names the study (a size)."""
        for step in study.all_steps().values():
            if step.dir not in self._costed:
                self._costed.add(step.dir)
                self.cost(step.done())
        for name in study.ran:
            self.ran.append(prefix + name)
        for name in study.skipped:
            if prefix + name not in self.ran + self.skipped:
                self.skipped.append(prefix + name)

    def step(self, name: str, step: Step, log: Path, **how) -> dict:
        """One of the preset's own commands as a step (:func:`command_step`, a subprocess); a failure ends the
        preset, naming the log."""
        before = step.done() is not None
        rec = command_step(name, step, log, run_logged, **how)
        if rec is None:
            sys.exit(f'{name} failed: see {log}')
        return self.add(name, rec, before)


def world_step(out: Path, preset: dict, tally: Tally, test: bool = False) -> Step:
    """The world (``test=False``), or the test world: the same generator, seed and train split with
    ``test_per_class`` val images per class (each image is drawn from its split and index, so its first val images
    are the world's own)."""
    world = out / ('test_world' if test else 'world')
    cmd = [BIN / 'tokenaug-data', '--out', world, '--seed', '0', '--num-classes', NUM_CLASSES]
    # the world's own split also in the ADE20K layout where a preset reads its object masks (the size study)
    cmd += ['--image-size', IMG_SIZE, '--formats', 'imagenet' if test else preset.get('world_formats', 'imagenet')]
    cmd += ['--train-per-class', preset['train_per_class']]
    cmd += ['--val-per-class', preset['test_per_class' if test else 'val_per_class']]
    if 'max_extra_objects' in preset:  # else tokenaug-data's default (one extra, smaller object per scene)
        cmd += ['--max-extra-objects', preset['max_extra_objects']]
    if 'area' in preset:  # the main object's share of the image; else tokenaug-data's default, 8-35 %
        cmd += ['--min-area', preset['area'][0], '--max-area', preset['area'][1]]
    step = Step(world, cmd, key_cmd=portable_cmd(cmd, out))  # the record lies beside the world's own world.json
    tally.step(world.name.replace('_', ' '), step, out / 'logs' / f'{world.name}.log')
    return step


def data_dir(out: Path) -> Path:
    """``OUT/data``, the study's ImageFolder: ``train`` and ``val`` the world's, ``test`` the test world's val
    split (relative links, so that a study folder moved or copied keeps them)."""
    data = out / 'data'
    data.mkdir(parents=True, exist_ok=True)
    for split, target in (('train', 'world/imagenet/train'), ('val', 'world/imagenet/val')):
        _link(data / split, Path('..') / target)
    _link(data / 'test', Path('..') / 'test_world' / 'imagenet' / 'val')
    return data


def _link(path: Path, target: Path) -> None:
    if path.is_symlink() and Path(path.readlink()) == target:
        return
    if path.is_symlink():
        path.unlink()
    path.symlink_to(target, target_is_directory=True)


def model_kwargs(preset: dict) -> list:
    return [f'img_size={IMG_SIZE}'] + [f'{k}={v}' for k, v in preset['vit'].items()]


def study_argv(out: Path, preset: dict, runs: list, seeds: int) -> list:
    """The ``tokenaug-study`` command line of a preset's timm runs (after ``tokenaug-study``): the recipe at the
    preset's model, epochs, batch and workers, compared with ``cutmix`` where it is among the runs."""
    train = ['--model-kwargs', *model_kwargs(preset), '--epochs', preset['epochs'], '-b', preset['batch_size']]
    train += ['-j', preset['workers'], '--log-interval', '1000']
    train += ['--val-interval', preset['val_interval']] if 'val_interval' in preset else []
    baseline = 'cutmix' if 'cutmix' in runs else runs[0]
    argv = ['--data-dir', out / 'data', '-c', RECIPE, '--runs', *runs, '--baseline', baseline, '--seeds', seeds]
    return [str(a) for a in argv + ['--out', out, '--train-args', *train]]


def timm_study(out: Path, preset: dict, runs: list, seeds: int, runner=None) -> tuple:
    """``tokenaug-study`` on the preset's data (:func:`data_dir`): every run trained and evaluated on the test
    split (a failure ends the preset). Returns the :class:`Study`, each run's training record and its test result,
    by ``(run, seed)``."""
    argv = study_argv(out, preset, runs, seeds)
    study = Study(study_parser().parse_args(argv), argv, runner or run_logged)
    code = study.run()
    if code:
        sys.exit(f'tokenaug-study failed or was stopped (exit {code}): see {out / "results.md"} and {out / "logs"}')
    results, tests = {}, {}
    for name, step in study.steps.items():
        run, seed = name.rsplit(' seed ', 1)
        results[run, int(seed)] = step.done()
        tests[run, int(seed)] = study.evaluate(name, results[run, int(seed)])
    return study, results, tests


def mm_runs(out: Path, preset: dict, runs: list, seeds: list, tally: Tally) -> tuple:
    """mmpretrain's tools/train.py on a config that inherits the repo's and sets the study's ViT, schedule and
    seed, then its tools/test.py on the test world (``$TOKENAUG_WORLD``: its test loader is its val loader)."""
    vit = preset['vit']
    arch = dict(
        embed_dims=vit['embed_dim'], num_layers=vit['depth'], num_heads=vit['num_heads'],
        feedforward_channels=4 * vit['embed_dim'],
    )  # fmt: skip
    val_interval = f', val_interval={preset["val_interval"]}' if 'val_interval' in preset else ''
    results, tests = {}, {}
    for seed in seeds:
        for name, (_, config) in MM_RUNS.items():
            if name not in runs:
                continue
            work, test = out / 'runs' / name / f'seed{seed}', out / 'test' / name / f'seed{seed}'
            cfg = out / 'configs' / f'{name}_seed{seed}.py'
            cfg.parent.mkdir(parents=True, exist_ok=True)
            cfg.write_text(
                '\n'.join(
                    [
                        f'_base_ = [{str(REPO / "configs/mmpretrain" / config)!r}]',
                        f'model = dict(backbone=dict(arch=dict(_delete_=True, **{arch!r})), '
                        f'head=dict(in_channels={arch["embed_dims"]}))',
                        f'train_cfg = dict(max_epochs={preset["epochs"]}{val_interval})',
                        f'train_dataloader = dict(batch_size={preset["batch_size"]}, num_workers={preset["workers"]})',
                        f'val_dataloader = dict(num_workers={preset["workers"]})',
                        f'randomness = dict(seed={seed})',
                        '',
                    ]
                )
            )
            train = ['env', f'TOKENAUG_WORLD={out / "world"}', sys.executable, upstream_tool('mmpretrain', 'train')]
            cmd = train + [cfg, '--work-dir', work]
            step = Step(work, cmd, [cfg.read_text()], key_cmd=portable_cmd(cmd, out))
            log = out / 'logs' / f'{name}_seed{seed}.log'
            results[name, seed] = tally.step(
                f'{name} seed {seed}', step, log, collect=lambda work=work: _mm_top1(work, '*/vis_data/scalars.json')
            )
            ckpt = work / f'epoch_{preset["epochs"]}.pth'
            cmd = ['env', f'TOKENAUG_WORLD={out / "test_world"}', sys.executable, upstream_tool('mmpretrain', 'test')]
            cmd += [cfg, ckpt, '--work-dir', test]
            step = Step(test, cmd, [results[name, seed]['key']], key_cmd=portable_cmd(cmd, out))
            log = out / 'logs' / f'test_{name}_seed{seed}.log'
            tests[name, seed] = tally.step(
                f'test {name} seed {seed}', step, log, collect=lambda test=test: _mm_top1(test, '*/*.json')
            )
    return results, tests


def _mm_top1(work: Path, pattern: str) -> dict:
    """The last top-1 / top-5 an MMEngine run logged to its JSON scalars (the training's ``vis_data/scalars.json``,
    the test's ``<timestamp>.json``)."""
    found = sorted(work.glob(pattern))
    try:
        lines = [json.loads(s) for s in found[-1].read_text().splitlines()]
        last = [r for r in lines if 'accuracy/top1' in r][-1]
    except (IndexError, json.JSONDecodeError) as e:
        raise OutputError(f'no accuracy/top1 in {pattern} under {work} ({e})') from None
    return dict(top1=round(last['accuracy/top1'], 2), top5=round(last['accuracy/top5'], 2))


def occlusion(out: Path, preset: dict, results: dict, seeds: list, tally: Tally) -> dict:
    """``tokenaug-occlusion`` on the val split with each OCCLUSION_RUNS checkpoint."""
    curves = {}
    for seed in seeds:
        for name in OCCLUSION_RUNS:
            if (name, seed) not in results:
                continue
            dst = out / 'occlusion' / name / f'seed{seed}'
            ckpt = out / 'runs' / name / f'seed{seed}' / 'last.pth.tar'
            cmd = [BIN / 'tokenaug-occlusion', '--data-dir', out / 'data', '--split', 'val']
            cmd += ['--model', 'vit_tiny_patch16_224', '--model-kwargs', *model_kwargs(preset), '--checkpoint', ckpt]
            cmd += ['--ratios', *OCCLUSION_RATIOS, '--seed', '0', '--out', dst, '-j', preset['workers']]
            cmd += ['--no-progress']
            step = Step(dst, cmd, [results[name, seed]['key']], key_cmd=portable_cmd(cmd, out))

            def curve(dst=dst):
                import csv

                try:
                    with open(dst / 'occlusion.csv') as f:
                        return dict(top1=[float(r['top1']) for r in csv.DictReader(f)])
                except (FileNotFoundError, KeyError, ValueError) as e:
                    raise OutputError(f'{dst / "occlusion.csv"} is missing or cut short ({e})') from None

            log = out / 'logs' / f'occlusion_{name}_seed{seed}.log'
            curves[name, seed] = tally.step(f'occlusion {name} seed {seed}', step, log, collect=curve)
    return curves


def table(
    results: dict, tests: dict, curves: dict, seeds: list[int], preset_name: str, preset: dict, wall: float
) -> str:
    """The study's markdown: per run the test top-1 (mean ± sd, per seed) beside the training's own val top-1, the
    paired differences on the test top-1 with their verdicts, and the occlusion curves."""
    names = [n for n in LABELS if all((n, s) in results and (n, s) in tests for s in seeds)]
    top1 = {n: [tests[n, s]['top1'] for s in seeds] for n in names}
    val = {n: [results[n, s]['top1'] for s in seeds] for n in names}
    vit = preset['vit']
    n_val, n_test = preset['val_per_class'] * NUM_CLASSES, preset['test_per_class'] * NUM_CLASSES
    lines = [
        f'Preset `{preset_name}`: world of {NUM_CLASSES} classes at {IMG_SIZE} px, '
        f'{preset["train_per_class"]} train / {preset["val_per_class"]} val images per class '
        f'(main object {area_range(preset)} of the image); ViT depth {vit["depth"]}, width {vit["embed_dim"]}, '
        f'{vit["num_heads"]} heads, patch 16 (7x7 tokens); {preset["epochs"]} epochs, batch {preset["batch_size"]}; '
        f'seeds {", ".join(map(str, seeds))}. Test top-1: the final checkpoint on {n_test} test images (the world '
        f'regenerated with {preset["test_per_class"]} val images per class; no selection on either split). Val '
        f"top-1: the training's own final evaluation of {n_val} images. Study wall time {wall / 60:.0f} min.",
        '',
        '| run | test top-1 mean ± sd | per seed | val top-1 mean ± sd | wall s / run |',
        '|---|---|---|---|---|',
    ]
    for n in names:
        m, sd = mean_sd(top1[n])
        vm, vsd = mean_sd(val[n])
        secs = statistics.fmean(results[n, s]['secs'] for s in seeds)
        lines.append(
            f'| {n} ({LABELS[n]}) | {m:.2f} ± {sd:.2f} | {" / ".join(f"{v:g}" for v in top1[n])} '
            f'| {vm:.2f} ± {vsd:.2f} | {secs:.0f} |'
        )
    lines += [
        '',
        f'Paired differences of the test top-1 (method - baseline, same seed; mean and 95 % t interval over '
        f'{len(seeds)} seeds), with the verdicts of tokenaug-study:',
        '',
        '| method | baseline | difference | 95 % interval | verdict |',
        '|---|---|---|---|---|',
    ]
    for m, b in COMPARISONS:
        if m in top1 and b in top1:
            d = paired(top1[m], top1[b])
            lines.append(f'| {m} | {b} | {d["mean"]:+.2f} | {interval(d)} | {verdict(d)} |')
    occ = [n for n in OCCLUSION_RUNS if all((n, s) in curves for s in seeds)]
    if occ:
        lines += [
            '',
            f'Occlusion (tokenaug-occlusion on the same checkpoints; top-1 on the {n_val} val images, mean ± sd over '
            'seeds, with a fraction of the 16x16 patches zeroed, the same patches for every model):',
            '',
            '| run | ' + ' | '.join(f'{float(r):.0%}' for r in OCCLUSION_RATIOS) + ' |',
            '|---' * (len(OCCLUSION_RATIOS) + 1) + '|',
        ]
        for n in occ:
            cells = [mean_sd([curves[n, s]['top1'][i] for s in seeds]) for i in range(len(OCCLUSION_RATIOS))]
            lines.append(f'| {n} | ' + ' | '.join(f'{m:.1f} ± {sd:.1f}' for m, sd in cells) + ' |')
        for n in occ[1:]:
            cells = []
            for i in range(len(OCCLUSION_RATIOS)):
                d = paired([curves[n, s]['top1'][i] for s in seeds], [curves[occ[0], s]['top1'][i] for s in seeds])
                cells.append(f'{d["mean"]:+.1f} {interval(d, 1)}')
            lines.append(f'| {n} - {occ[0]} | ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def run_preset(out: Path, preset: dict, runs: list, seeds: list, mmpretrain: bool = True, runner=None) -> dict:
    """A preset's study under ``out``: the worlds, ``tokenaug-study`` on the timm runs, the mmpretrain runs and the
    occlusion curves. Returns the training records, the test results and the curves by ``(run, seed)``, the
    :class:`Tally` and the :class:`Study` (``None`` without a timm run)."""
    tally = Tally()
    world_step(out, preset, tally)
    world_step(out, preset, tally, test=True)
    data_dir(out)
    timm = [n for n in TIMM_RUNS if n in runs]
    study, results, tests = None, {}, {}
    if timm:
        study, results, tests = timm_study(out, preset, timm, len(seeds), runner)
        tally.take(study)
    if mmpretrain and any(n in runs for n in MM_RUNS):
        mm_results, mm_tests = mm_runs(out, preset, runs, seeds, tally)
        results |= mm_results
        tests |= mm_tests
    curves = occlusion(out, preset, results, seeds, tally)
    return dict(results=results, tests=tests, curves=curves, tally=tally, study=study)


def main(argv=None, runner=None):
    """``runner(cmd, log)`` runs tokenaug-study's commands (its subprocess runner by default; the tests inject an
    in-process one); the preset's own commands run as subprocesses."""
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--preset', choices=sorted(PRESETS), default='cpu_small')
    p.add_argument('--out', type=Path, default=REPO / 'study_out')
    p.add_argument('--seeds', type=int, help="number of seeds (0, 1, ...); default: the preset's")
    p.add_argument('--epochs', type=int, help="default: the preset's")
    p.add_argument('--no-mmpretrain', action='store_true', help='leave out the mmpretrain tools/train.py rows')
    p.add_argument(
        '--runs',
        nargs='+',
        choices=list(LABELS) + ['all'],
        metavar='RUN',
        help=f'train only these runs (default: the grid, {", ".join(GRID)}; the probes {", ".join(PROBES)} only '
        "when named; 'all': the grid and the probes)",
    )
    args = p.parse_args(argv)
    if args.runs and 'all' in args.runs and len(args.runs) > 1:
        p.error("--runs: 'all' stands alone")
    preset = dict(PRESETS[args.preset])
    for key in ('seeds', 'epochs'):
        value = getattr(args, key)
        if value is not None:
            if value < 1:
                p.error(f'--{key} must be >= 1, got {value}')
            preset[key] = value
    runs = GRID if args.runs is None else list(LABELS) if args.runs == ['all'] else args.runs
    runs = [n for n in LABELS if n in runs and not (args.no_mmpretrain and n in MM_RUNS)]
    seeds = list(range(preset['seeds']))
    out = args.out.resolve()
    t0 = time.time()
    print(f'== study, preset {args.preset}: {len(seeds)} seeds x {len(runs)} runs, out {out}', flush=True)
    done = run_preset(out, preset, runs, seeds, runner=runner)
    tally = done['tally']
    text = table(done['results'], done['tests'], done['curves'], seeds, args.preset, preset, tally.secs)
    (out / 'study.md').write_text(text + '\n')
    record = dict(
        preset=args.preset,
        settings=preset,
        seeds=seeds,
        runs={f'{n} seed {s}': r for (n, s), r in done['results'].items()},
        test={f'{n} seed {s}': r for (n, s), r in done['tests'].items()},
        occlusion={f'{n} seed {s}': r for (n, s), r in done['curves'].items()},
        steps_run=len(tally.ran),
        steps_skipped=len(tally.skipped),
    )
    (out / 'study.json').write_text(json.dumps(record, indent=1) + '\n')
    print('\n' + text)
    print(
        f'\n({record["steps_run"]} steps run, {record["steps_skipped"]} skipped, {time.time() - t0:.0f} s; '
        f'{out / "study.md"})'
    )
    return record


if __name__ == '__main__':
    main()
