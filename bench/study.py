#!/usr/bin/env python3
"""A seeded multi-seed study: each method against its baseline, same recipe, the noise measured.

Trains a grid of {baseline, method} x seeds on a generated world through the real entry points
(``tokenaug-data``, ``tokenaug-train``, ``tokenaug-maps generate``, ``tokenaug-occlusion`` and mmpretrain's own
``tools/train.py`` and ``tools/test.py``) and writes ``study.md`` (the table) and ``study.json`` (every run) under
``--out``:

- per method: mean +- standard deviation over seeds of the final checkpoint's top-1 on a test split ten times the
  val split (the world regenerated with more val images; ``bench/study_eval.py``), beside the training's own val
  top-1 (no selection on either), and the mean wall time of one run. The 500 val images alone have a binomial
  standard error of about 1.9 points at 75 %, as large as the effects looked for;
- per comparison: the paired difference method - baseline over seeds (same seed = same data order, same
  initialisation draw), its mean and a 95 % Student-t interval;
- occlusion (TokenMix Fig. 5 analogue): ``tokenaug-occlusion`` on the same checkpoints, val top-1 with a fraction
  of the patches zeroed (the same patches for every model), mean and paired difference per ratio.

Resumable: every step (world, test world, annotator, maps, each run, its test evaluation, each occlusion curve)
keeps a ``study_step.json`` with the exact command it ran (and its inputs' steps); a rerun skips a step whose
record matches and reruns one whose command changed or that did not finish. The trainings run through
``tokenaug-study``'s runner (:func:`timm_plugin.tools.study_cli.train_step`): a training killed midway resumes
through ``tokenaug-train --resume``; the statistics and verdicts are ``shared_core.study``'s, as tokenaug-study's.
The annotator of token labeling and of TokenMix's activation-map targets is trained in the study (seed 0, the
same recipe with average pooling) and its maps serve every seed.

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
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / 'scripts'), str(REPO / 'bench')]
from demo import BIN, metric, run, upstream  # the demo's command runner: whole log to a file, exit on failure

from shared_core.study import Step, excludes_zero, interval, mean_sd, paired, t_quantile  # noqa: F401  (the runner's parts)

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


def _htm(tau: str, rho: str) -> list:
    """tokenaug-train's flags for HTM at block 2 on top of MixUp/CutMix with this τ and ρ."""
    return ['--mixup-type', 'cutmix', '--tokenmixup-htm-layers', '2', '--tokenmixup-tau', tau, '--tokenmixup-rho', rho]


#: the timm runs: name -> (label, config under configs/timm, flags; MAPS stands for the annotator's maps)
RUNS = {
    # the control: is mixing itself a help in this recipe? (a mixer that never mixes: label smoothing only)
    'plain': (
        'no mixing (label smoothing 0.1)',
        'world_vit-tiny.yaml',
        ['--mixup-type', 'cutmix', '--mixup-prob', '0'],
    ),
    'cutmix': ('MixUp/CutMix (DeiT)', 'world_vit-tiny.yaml', ['--mixup-type', 'cutmix']),
    'tl_align': ('TL-Align (MixUp/CutMix)', 'world_vit-tiny.yaml', ['--method', 'tl_align']),
    'transmix': ('TransMix (MixUp/CutMix)', 'world_vit-tiny.yaml', ['--method', 'transmix']),
    'tokenmix_block': (
        'TokenMix blocks (MixUp/TokenMix, area targets)',
        'world_vit-tiny.yaml',
        ['--mixup-type', 'tokenmix_block'],
    ),
    'tokenmix_maps': (
        'TokenMix blocks + activation-map targets',
        'world_vit-tiny_tokenmix.yaml',
        ['--activation-map-dir', 'MAPS'],
    ),
    'mixtoken': ('MixToken + token labeling', 'world_vit-tiny_token-labeling.yaml', ['--token-label-dir', 'MAPS']),
    # HTM at block 2 on top of MixUp/CutMix, as the public CCT CIFAR recipes. The world has 10 classes, as CIFAR-10:
    # its recipe is τ 0.1, ρ 0.003 (easy when CE <= 1.0, 43 % of ln 10). CIFAR-100's τ 0.2, ρ 0.005 (tokenaug-train's
    # defaults) mark CE <= 2.0 easy, 87 % of ln 10 here: most samples (STUDY.md).
    'htm': ('TokenMixup HTM (MixUp/CutMix; CIFAR-10 recipe, τ 0.1)', 'world_vit-tiny.yaml', _htm('0.1', '0.003')),
    'htm_c100': ('TokenMixup HTM (MixUp/CutMix; CIFAR-100 recipe, τ 0.2)', 'world_vit-tiny.yaml', _htm('0.2', '0.005')),
}
#: the mmpretrain run (tools/train.py): name -> (label, config under configs/mmpretrain)
MM_RUNS = {
    'mm_tl_align': ('TL-Align (MixUp/CutMix), mmpretrain tools/train.py', 'deit-tiny_world_tl-align.py'),
    'mm_cutmix': ('MixUp/CutMix (DeiT), mmpretrain tools/train.py', 'deit-tiny_world_cutmix.py'),
}
#: runs that answer a question the grid raised (bench/STUDY.md): trained only when ``--runs`` names them (or
#: ``--runs all``): HTM with CIFAR-100's τ on this 10-class world, and mmpretrain's own CutMix baseline
PROBES = ('htm_c100', 'mm_cutmix')
#: the default grid: every run but the probes
GRID = [n for n in list(RUNS) + list(MM_RUNS) if n not in PROBES]
#: (method, baseline) pairs of the table; the last three: TL-Align vs CutMix within mmpretrain, then each of the two
#: across the ecosystems (the same recipe, as far as the two libraries allow)
COMPARISONS = [
    ('cutmix', 'plain'),
    ('tl_align', 'cutmix'),
    ('transmix', 'cutmix'),
    ('tl_align', 'transmix'),
    ('tokenmix_block', 'cutmix'),
    ('tokenmix_maps', 'cutmix'),
    ('tokenmix_maps', 'tokenmix_block'),
    ('mixtoken', 'cutmix'),
    ('mixtoken', 'plain'),
    ('htm', 'cutmix'),
    ('htm_c100', 'cutmix'),
    ('mm_tl_align', 'mm_cutmix'),
    ('mm_cutmix', 'cutmix'),
    ('mm_tl_align', 'tl_align'),
]
OCCLUSION_RUNS = ['cutmix', 'tokenmix_block', 'tokenmix_maps']
OCCLUSION_RATIOS = ['0', '0.2', '0.4', '0.6', '0.8']
IMG_SIZE = 112
NUM_CLASSES = 10


def default_area() -> tuple[float, float]:
    """tokenaug-data's default share of the image covered by a scene's main object (--min-area, --max-area)."""
    from shared_core.tools.world import WorldConfig

    return WorldConfig.min_area, WorldConfig.max_area


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and its finished children so far: a step's cost whatever else
    shares the machine (its wall time is not)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def mm_env(world: Path) -> dict:
    """The environment of an mmpretrain tool on the repo's world configs: ``$TOKENAUG_WORLD`` the world's root
    and the repo importable (the configs' custom imports)."""
    path = f'{REPO}{os.pathsep}{os.environ.get("PYTHONPATH", "")}'
    return dict(os.environ, TOKENAUG_WORLD=str(world), PYTHONPATH=path)


class Study:
    def __init__(self, out: Path, preset: dict, mmpretrain: bool, runs=None, runner=None):
        """``runner(cmd, log)`` runs each training (``tokenaug-study``'s :func:`~timm_plugin.tools.study_cli.run_logged`
        by default, a subprocess; the tests inject an in-process one)."""
        from timm_plugin.tools.study_cli import run_logged

        self.out, self.p, self.mmpretrain = out, preset, mmpretrain
        self.runner = runner or run_logged
        every = list(RUNS) + list(MM_RUNS)
        runs = GRID if runs is None else every if list(runs) == ['all'] else runs
        self.runs = [n for n in every if n in runs]  # the runs this study trains
        self.world, self.test_world = out / 'world', out / 'test_world'
        self.logs = out / 'logs'
        self.logs.mkdir(parents=True, exist_ok=True)
        vit = preset['vit']
        self.model_kwargs = [f'img_size={IMG_SIZE}'] + [f'{k}={v}' for k, v in vit.items()]
        self.steps_done = self.steps_skipped = 0
        self.secs = 0.0  # the recorded time of every step of this study, skipped ones included
        self.cpu_secs = 0.0  # and their CPU time (steps recorded before it was kept count 0)

    def count(self, rec: dict, skipped: bool) -> None:
        """Add a step's recorded time to the study's (steps recorded before their CPU time was kept count 0)."""
        self.steps_skipped += skipped
        self.steps_done += not skipped
        self.secs += rec['secs']
        self.cpu_secs += rec.get('cpu_secs', 0.0)

    def step(self, name: str, step: Step, execute) -> dict:
        """``execute()`` -> result dict, unless ``step`` is already done; prints one line either way."""
        rec = step.done()
        if rec is not None:
            self.count(rec, skipped=True)
            print(f'  {name}: done before, skipped', flush=True)
            return rec
        shutil.rmtree(step.dir, ignore_errors=True)
        step.dir.mkdir(parents=True)
        t, cpu = time.time(), cpu_seconds()
        result = execute()
        rec = step.finish(secs=round(time.time() - t, 1), cpu_secs=round(cpu_seconds() - cpu, 1), **result)
        self.count(rec, skipped=False)
        print(
            f'  {name}: {", ".join(f"{k} {v}" for k, v in result.items())} ({rec["secs"]:.0f} s)',
            flush=True,
        )
        return rec

    def make_world(self, test: bool = False) -> Step:
        """The world (``test=False``), or the test world: the same generator, seed and train split with
        ``test_per_class`` val images per class (each image is drawn from its split and index, so its first val
        images are the world's own)."""
        out = self.test_world if test else self.world
        val = self.p['test_per_class' if test else 'val_per_class']
        cmd = [BIN / 'tokenaug-data', '--out', out, '--seed', '0', '--num-classes', NUM_CLASSES]
        # the world's own split also in the ADE20K layout where a preset reads its object masks (the size study)
        formats = 'imagenet' if test else self.p.get('world_formats', 'imagenet')
        cmd += ['--image-size', IMG_SIZE, '--formats', formats]
        cmd += ['--train-per-class', self.p['train_per_class'], '--val-per-class', val]
        if 'max_extra_objects' in self.p:  # else tokenaug-data's default (one extra, smaller object per scene)
            cmd += ['--max-extra-objects', self.p['max_extra_objects']]
        if 'area' in self.p:  # the main object's share of the image; else tokenaug-data's default, 8-35 %
            cmd += ['--min-area', self.p['area'][0], '--max-area', self.p['area'][1]]
        step = Step(out, cmd)

        def execute():
            run(step.cmd, log=self.logs / f'{out.name}.log', echo=False)
            return {}

        self.step(out.name.replace('_', ' '), step, execute)  # the record lies beside the world's own world.json
        return step

    def timm_cmd(self, config: str, out_dir: Path, seed: int, flags: list) -> list:
        return [
            BIN / 'tokenaug-train',
            '-c',
            REPO / 'configs/timm' / config,
            '--data-dir',
            self.world / 'imagenet',
            '--model-kwargs',
            *self.model_kwargs,
            '--epochs',
            self.p['epochs'],
            '-b',
            self.p['batch_size'],
            '-j',
            self.p['workers'],
            '--seed',
            seed,
            *flags,
            '--output',
            out_dir.parent,
            '--experiment',
            out_dir.name,
            '--log-interval',
            '1000',
            *(['--val-interval', self.p['val_interval']] if 'val_interval' in self.p else []),
        ]

    def timm_step(self, name: str, step: Step) -> dict:
        """One training through ``tokenaug-study``'s runner (:func:`timm_plugin.tools.study_cli.train_step`): skipped
        when done, resumed through ``tokenaug-train --resume`` where a killed attempt left a checkpoint."""
        from timm_plugin.tools.study_cli import train_step

        skipped = step.done() is not None
        log = self.logs / f'{name.replace(" ", "_")}.log'
        rec = train_step(name, step, log, self.runner)
        if rec is None:
            sys.exit(f'{name} failed: see {log}')
        self.count(rec, skipped)
        return rec

    def annotator_and_maps(self, world: Step) -> Step:
        """The annotator (seed 0, the cutmix recipe with average pooling, so its head reads every patch token) and
        its dense maps of the training split."""
        ann = self.out / 'runs' / 'annotator' / 'seed0'
        cmd = self.timm_cmd('world_vit-tiny.yaml', ann, 0, ['--mixup-type', 'cutmix', '--gp', 'avg'])
        ann_step = Step(ann, cmd, [world.key])
        self.timm_step('annotator', ann_step)
        maps = self.out / 'maps' / 'train'
        cmd = [
            BIN / 'tokenaug-maps',
            'generate',
            '--data-dir',
            self.world / 'imagenet',
            '--split',
            'train',
            '--model',
            'vit_tiny_patch16_224',
            '--model-kwargs',
            *self.model_kwargs,
            'global_pool=avg',
            '--num-classes',
            NUM_CLASSES,
            '--checkpoint',
            ann / 'last.pth.tar',
            '--input-size',
            IMG_SIZE,
            '--topk',
            '5',
            '--out',
            maps,
            '-j',
            self.p['workers'],
            '--no-progress',
        ]
        # the store's folder is the tool's own (it refuses a non-empty one), so the record sits beside it
        step = Step(maps.parent / 'record', cmd, [ann_step.key])

        def execute():
            shutil.rmtree(maps, ignore_errors=True)
            run(step.cmd, log=self.logs / 'maps.log', echo=False)
            return dict(files=len(list(maps.iterdir())))

        self.step('maps', step, execute)
        return step

    def timm_runs(self, world: Step, maps: Step, seeds: list[int]) -> dict:
        results = {}
        for seed in seeds:
            for name, (_, config, flags) in RUNS.items():
                if name not in self.runs:
                    continue
                uses_maps = 'MAPS' in flags
                flags = [str(self.out / 'maps' / 'train') if f == 'MAPS' else f for f in flags]
                out_dir = self.out / 'runs' / name / f'seed{seed}'
                inputs = [world.key] + ([maps.key] if uses_maps else [])
                step = Step(out_dir, self.timm_cmd(config, out_dir, seed, flags), inputs)
                results[name, seed] = self.timm_step(f'{name} seed {seed}', step)
        return results

    def mm_runs(self, world: Step, seeds: list[int]) -> dict:
        """mmpretrain's tools/train.py on a config that inherits the repo's and sets the study's ViT, schedule and
        seed."""
        vit = self.p['vit']
        arch = dict(
            embed_dims=vit['embed_dim'],
            num_layers=vit['depth'],
            num_heads=vit['num_heads'],
            feedforward_channels=4 * vit['embed_dim'],
        )
        val_interval = f', val_interval={self.p["val_interval"]}' if 'val_interval' in self.p else ''
        results = {}
        for seed in seeds:
            for name, (_, config) in MM_RUNS.items():
                if name not in self.runs:
                    continue
                work = self.out / 'runs' / name / f'seed{seed}'
                cfg = self.out / 'configs' / f'{name}_seed{seed}.py'
                text = '\n'.join(
                    [
                        f'_base_ = [{str(REPO / "configs/mmpretrain" / config)!r}]',
                        f'model = dict(backbone=dict(arch=dict(_delete_=True, **{arch!r})), '
                        f'head=dict(in_channels={arch["embed_dims"]}))',
                        f'train_cfg = dict(max_epochs={self.p["epochs"]}{val_interval})',
                        f'train_dataloader = dict(batch_size={self.p["batch_size"]}, num_workers={self.p["workers"]})',
                        f'val_dataloader = dict(num_workers={self.p["workers"]})',
                        f'randomness = dict(seed={seed})',
                        '',
                    ]
                )
                cmd = [sys.executable, upstream('mmpretrain', 'train.py'), cfg, '--work-dir', work]
                step = Step(work, cmd, [world.key, text])

                def execute(cfg=cfg, text=text, work=work, step=step, name=name, seed=seed):
                    cfg.parent.mkdir(parents=True, exist_ok=True)
                    cfg.write_text(text)
                    env = mm_env(self.world)
                    run(step.cmd, env=env, log=self.logs / f'{name}_seed{seed}.log', echo=False)
                    scalars = sorted(work.glob('*/vis_data/scalars.json'))[-1]
                    lines = [json.loads(s) for s in scalars.read_text().splitlines()]
                    last = [r for r in lines if 'accuracy/top1' in r][-1]
                    return dict(top1=round(last['accuracy/top1'], 2), top5=round(last['accuracy/top5'], 2))

                results[name, seed] = self.step(f'{name} seed {seed}', step, execute)
        return results

    def test_eval(self, runs: dict, test: Step) -> dict:
        """Each run's final checkpoint on the test world's val split: the timm runs in this process
        (``bench/study_eval.py``: the model as ``tokenaug-train`` built it, its val top-1 checked against the
        training's own first), the mmpretrain runs by mmpretrain's ``tools/test.py`` on the run's own config with
        ``$TOKENAUG_WORLD`` the test world (its test loader is its val loader)."""
        results = {}
        for (name, seed), rec in runs.items():
            run_dir = self.out / 'runs' / name / f'seed{seed}'
            dst = self.out / 'test' / name / f'seed{seed}'
            if name in MM_RUNS:
                cfg = self.out / 'configs' / f'{name}_seed{seed}.py'
                ckpt = run_dir / f'epoch_{self.p["epochs"]}.pth'
                cmd = [sys.executable, upstream('mmpretrain', 'test.py'), cfg, ckpt, '--work-dir', dst]
            else:
                cmd = ['bench/study_eval.py', run_dir, self.test_world / 'imagenet']
            step = Step(dst, cmd, [rec['key'], test.key])

            def execute(step=step, name=name, seed=seed, run_dir=run_dir, rec=rec):
                if name in MM_RUNS:
                    env = mm_env(self.test_world)
                    log = self.logs / f'test_{name}_seed{seed}.log'
                    run(step.cmd, env=env, log=log, echo=False)
                    return dict(top1=round(metric(log, 'accuracy/top1'), 2))
                from study_eval import evaluate_run

                return evaluate_run(run_dir, self.test_world / 'imagenet', self.world / 'imagenet', rec['top1'])

            results[name, seed] = self.step(f'test {name} seed {seed}', step, execute)
        return results

    def occlusion(self, runs: dict, seeds: list[int]) -> dict:
        curves = {}
        for seed in seeds:
            for name in OCCLUSION_RUNS:
                if name not in self.runs:
                    continue
                dst = self.out / 'occlusion' / name / f'seed{seed}'
                ckpt = self.out / 'runs' / name / f'seed{seed}' / 'last.pth.tar'
                cmd = [BIN / 'tokenaug-occlusion', '--data-dir', self.world / 'imagenet', '--split', 'val']
                cmd += ['--model', 'vit_tiny_patch16_224', '--model-kwargs', *self.model_kwargs, '--checkpoint', ckpt]
                cmd += ['--ratios', *OCCLUSION_RATIOS, '--seed', '0', '--out', dst, '-j', self.p['workers']]
                cmd += ['--no-progress']
                step = Step(dst, cmd, [runs[name, seed]['key']])

                def execute(dst=dst, step=step, name=name, seed=seed):
                    import csv

                    run(step.cmd, log=self.logs / f'occlusion_{name}_seed{seed}.log', echo=False)
                    with open(dst / 'occlusion.csv') as f:
                        return dict(top1=[float(r['top1']) for r in csv.DictReader(f)])

                curves[name, seed] = self.step(f'occlusion {name} seed {seed}', step, execute)
        return curves


def area_range(preset: dict) -> str:
    """The main object's share of the image in a preset's world, as ``8-35 %``."""
    lo, hi = preset.get('area') or default_area()
    return f'{lo * 100:g}-{hi * 100:g} %'


def table(
    results: dict, tests: dict, curves: dict, seeds: list[int], preset_name: str, preset: dict, wall: float
) -> str:
    """The study's markdown: per run the test top-1 (mean ± sd, per seed) beside the training's own val top-1, the
    paired differences on the test top-1, and the occlusion curves."""
    labels = {k: v[0] for k, v in RUNS.items()} | {k: v[0] for k, v in MM_RUNS.items()}
    names = [n for n in list(RUNS) + list(MM_RUNS) if all((n, s) in results and (n, s) in tests for s in seeds)]
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
            f'| {labels[n]} | {m:.2f} ± {sd:.2f} | {" / ".join(f"{v:g}" for v in top1[n])} | {vm:.2f} ± {vsd:.2f} '
            f'| {secs:.0f} |'
        )
    lines += [
        '',
        f'Paired differences of the test top-1 (method - baseline, same seed; mean and 95 % t interval over '
        f'{len(seeds)} seeds):',
        '',
        '| method | baseline | difference | 95 % interval | interval excludes 0 |',
        '|---|---|---|---|---|',
    ]
    for m, b in COMPARISONS:
        if m in top1 and b in top1:
            d = paired(top1[m], top1[b])
            lines.append(f'| {labels[m]} | {labels[b]} | {d["mean"]:+.2f} | {interval(d)} | {excludes_zero(d)} |')
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
            lines.append(f'| {labels[n]} | ' + ' | '.join(f'{m:.1f} ± {sd:.1f}' for m, sd in cells) + ' |')
        for n in occ[1:]:
            cells = []
            for i in range(len(OCCLUSION_RATIOS)):
                d = paired([curves[n, s]['top1'][i] for s in seeds], [curves[occ[0], s]['top1'][i] for s in seeds])
                cells.append(f'{d["mean"]:+.1f} {interval(d, 1)}')
            lines.append(f'| {labels[n]} - {labels[occ[0]]} | ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def main(argv=None, runner=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--preset', choices=sorted(PRESETS), default='cpu_small')
    p.add_argument('--out', type=Path, default=REPO / 'study_out')
    p.add_argument('--seeds', type=int, help="number of seeds (0, 1, ...); default: the preset's")
    p.add_argument('--epochs', type=int, help="default: the preset's")
    p.add_argument('--no-mmpretrain', action='store_true', help='leave out the mmpretrain tools/train.py row')
    p.add_argument(
        '--runs',
        nargs='+',
        choices=list(RUNS) + list(MM_RUNS) + ['all'],
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
    seeds = list(range(preset['seeds']))
    out = args.out.resolve()
    study = Study(out, preset, mmpretrain=not args.no_mmpretrain, runs=args.runs, runner=runner)
    t0 = time.time()
    timm_runs = [n for n in RUNS if n in study.runs]
    print(f'== study, preset {args.preset}: {len(seeds)} seeds x {len(timm_runs)} timm runs, out {out}', flush=True)
    world = study.make_world()
    # the annotator and its maps only where a run reads them
    maps = study.annotator_and_maps(world) if any('MAPS' in RUNS[n][2] for n in timm_runs) else None
    results = study.timm_runs(world, maps, seeds)
    if study.mmpretrain and any(n in study.runs for n in MM_RUNS):
        results |= study.mm_runs(world, seeds)
    tests = study.test_eval(results, study.make_world(test=True))
    curves = study.occlusion(results, seeds)
    text = table(results, tests, curves, seeds, args.preset, preset, study.secs)
    (out / 'study.md').write_text(text + '\n')
    record = dict(
        preset=args.preset,
        settings=preset,
        seeds=seeds,
        runs={f'{n} seed {s}': r for (n, s), r in results.items()},
        test={f'{n} seed {s}': r for (n, s), r in tests.items()},
        occlusion={f'{n} seed {s}': r for (n, s), r in curves.items()},
        steps_run=study.steps_done,
        steps_skipped=study.steps_skipped,
    )
    (out / 'study.json').write_text(json.dumps(record, indent=1) + '\n')
    print('\n' + text)
    print(
        f'\n({study.steps_done} steps run, {study.steps_skipped} skipped, {time.time() - t0:.0f} s; {out / "study.md"})'
    )


if __name__ == '__main__':
    main()
