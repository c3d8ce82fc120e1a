#!/usr/bin/env python3
"""``make demo``: the whole pipeline on the synthetic world, on 2 CPU cores.

1. the world (``tokenaug-data``: ImageNet, ADE20K and COCO layouts of the same scenes);
2. classification: a small ViT trained with CutMix, TokenMix-style block masks and TL-Align, through
   ``tokenaug-train`` (timm) and through mmpretrain's own ``tools/train.py``, and with TokenMixup (HTM, and
   HTM + VTM) on top of CutMix through ``tokenaug-train``; a ConvNeXt-Atto with CutMix and with TL-Align
   (TL-Align Appendix A's rules for a CNN);
3. token labeling and TokenMix: a small annotator (ViT-Tiny with average pooling, so its head reads every
   patch token) trained on the world, its dense maps written by ``tokenaug-maps generate``, then ViT-Tiny
   trained with token labeling + MixToken (``--mixup-type mixtoken --token-label-dir ...``), an MLP-Mixer-S/16
   with token labeling + MixToken on the same maps (Token Labeling Table 5), and
   ViT-Tiny with TokenMix block masks whose targets come from the same maps (``--activation-map-dir ...``);
   ``tokenaug-occlusion`` then compares the CutMix and TokenMix models with patches dropped (TokenMix Fig. 5);
4. transfer, for CutMix and TL-Align pretraining: ``tokenaug-convert`` -> UperNet (the ViT) with mmseg's
   ``tools/train.py`` / ``test.py`` -> mIoU; a small Swin pretrained the same way -> Cascade Mask R-CNN
   with mmdet's ``tools/train.py`` / ``test.py`` -> box / mask AP.

Prints the tables and writes them to ``demo_out/results.md``. Short schedules: the numbers show that
every stage runs end to end, not which method is better.

    .venv/bin/python scripts/demo.py [--epochs 4] [--out demo_out]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(cmd, env=None, log=None, echo=True):
    """Run a command, keep its whole output in ``log``, echo only the evaluation lines (none without ``echo``)."""
    t = time.time()
    with open(log, 'w') as f:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        for line in proc.stdout:
            f.write(line)
            if echo and ('Test:' in line or 'Epoch(val)' in line):
                print('    ' + line.strip()[-110:], flush=True)
    if proc.wait() != 0:
        raise SystemExit(f'demo: command failed (exit {proc.returncode}), log: {log}\n  {" ".join(map(str, cmd))}')
    return time.time() - t


def timm_run(world, out, experiment, epochs, *flags, config='world_vit-tiny.yaml', curves=None):
    """``tokenaug-train -c configs/timm/<config>`` with ``flags`` on the world, as ``experiment`` in out/timm
    (a fresh run folder); its final top-1, top-5 and seconds. The epochs of its summary.csv go to
    ``curves[experiment]`` when ``curves`` is given."""
    exp = out / 'timm' / experiment
    shutil.rmtree(exp, ignore_errors=True)  # timm appends to summary.csv of an existing run folder
    secs = run(
        [
            BIN / 'tokenaug-train',
            '-c',
            REPO / 'configs/timm' / config,
            '--data-dir',
            world / 'imagenet',
            '--epochs',
            str(epochs),
            *flags,
            '--output',
            out / 'timm',
            '--experiment',
            experiment,
        ],
        log=out / f'timm_{experiment}.log',
    )
    final = json.loads((exp / 'results.json').read_text())['final']
    if curves is not None:
        with open(exp / 'summary.csv') as f:
            curves[experiment] = list(csv.DictReader(f))
    return final['top1'], final['top5'], secs


def token_labeling(world, out, epochs, curves):
    """Annotator -> maps -> ViT-Tiny with token labeling + MixToken; returns the two table rows."""
    rows = [
        (
            'timm (tokenaug-train)',
            'annotator: ViT-Tiny, avg pool, MixUp/CutMix',
            *timm_run(world, out, 'annotator', epochs, '--gp', 'avg'),
        )
    ]
    ann = out / 'timm' / 'annotator'
    maps = out / 'maps' / 'train'
    shutil.rmtree(maps, ignore_errors=True)
    t = time.time()
    run(
        [
            BIN / 'tokenaug-maps',
            'generate',
            '--data-dir',
            world / 'imagenet',
            '--split',
            'train',
            '--model',
            'vit_tiny_patch16_224',
            '--model-kwargs',
            'img_size=112',
            'global_pool=avg',
            '--num-classes',
            '10',
            '--checkpoint',
            ann / 'last.pth.tar',
            '--input-size',
            '112',
            '--topk',
            '5',
            '--out',
            maps,
            '-j',
            '2',
        ],
        log=out / 'maps_generate.log',
    )
    print(f'    maps: {len(list((maps).glob("*")))} files in {maps} ({time.time() - t:.0f} s)', flush=True)
    rows.append(
        (
            'timm (tokenaug-train)',
            'MixToken + token labeling',
            *timm_run(
                world,
                out,
                'mixtoken',
                epochs,
                '--token-label-dir',
                maps,
                config='world_vit-tiny_token-labeling.yaml',
                curves=curves,
            ),
        )
    )
    rows.append(
        (
            'timm (tokenaug-train)',
            'MixUp/TokenMix blocks, activation-map targets',
            *timm_run(
                world,
                out,
                'tokenmix',
                epochs,
                '--activation-map-dir',
                maps,
                config='world_vit-tiny_tokenmix.yaml',
                curves=curves,
            ),
        )
    )
    # Token Labeling Table 5's MLP-Mixer: the same maps on a Mixer-S/16 (7x7 tokens at 112 px). Its CutMix baseline
    # run is left out (2 min on 2 cores, and one short run compares nothing: bench/STUDY.md)
    mixer = ['--model', 'mixer_s16_224']
    rows.append(
        (
            'timm (tokenaug-train)',
            'Mixer-S/16: MixToken + token labeling',
            *timm_run(
                world,
                out,
                'mixer_mixtoken',
                epochs,
                *mixer,
                '--token-label-dir',
                maps,
                config='world_vit-tiny_token-labeling.yaml',
            ),
        )
    )
    return rows


def pictures(world, out, count=4, viz=None) -> list:
    """``tokenaug-viz`` on the demo's own runs: what TokenMix mixes, TL-Align's aligned labels (the TL-Align
    ViT and Swin checkpoints), token labels after the training transforms (the annotator's maps), TokenMix's
    activation-map targets (the same maps as the teacher's), TokenMix's masks and HTM's swaps (the HTM
    checkpoint), ``count`` samples each, in ``viz`` (default out/viz)/<name>/ (PNGs, index.html); the list of
    (name, index page)."""
    cfg = REPO / 'configs/timm'
    viz = Path(viz) if viz is not None else out / 'viz'
    data = ['--data-dir', world / 'imagenet', '--count', str(count)]
    jobs = [
        ('mix', ['mix', '-c', cfg / 'world_vit-tiny.yaml', *data, '--mixup-type', 'tokenmix_block', '--mixup', '0']),
        (
            'tl_align',
            ['tl-align', '-c', cfg / 'world_vit-tiny.yaml', *data, '--mixup-mode', 'elem']
            + ['--initial-checkpoint', out / 'timm/tl_align/model_best.pth.tar'],
        ),
        (
            'tl_align_swin',
            ['tl-align', '-c', cfg / 'world_swin-mini.yaml', *data, '--mixup-mode', 'elem']
            + ['--initial-checkpoint', out / 'timm/swin-mini_tl_align/model_best.pth.tar'],
        ),
        (
            'token_labels',
            ['token-labels', '-c', cfg / 'world_vit-tiny_token-labeling.yaml', '--data-dir', world / 'imagenet']
            + ['--token-label-dir', out / 'maps/train', '--count', str(max(1, count // 2)), '--draws', '3'],
        ),
        (
            'activation_maps',
            ['mix', '-c', cfg / 'world_vit-tiny_tokenmix.yaml', *data, '--mixup', '0']
            + ['--activation-map-dir', out / 'maps/train'],
        ),
        ('tokenmix', ['tokenmix', '--img-size', '112', '112', '--count', str(count)]),
        (
            'tokenmixup',
            ['tokenmixup', '-c', cfg / 'world_vit-tiny.yaml', *data, '--tokenmixup-htm-layers', '2']
            + ['--tokenmixup-tau', '1.0', '--initial-checkpoint', out / 'timm/cutmix_htm/model_best.pth.tar'],
        ),
    ]
    pages = []
    for name, cmd in jobs:
        run([BIN / 'tokenaug-viz', *cmd, '--viz-dir', viz / name], log=out / f'viz_{name}.log')
        pages.append((name, viz / name / 'index.html'))
    return pages


def occlusion(world, out, runs):
    """tokenaug-occlusion on the given timm runs; returns {label: [(ratio, top1), ...]}."""
    curves = {}
    for name, label in runs:
        dst = out / 'occlusion' / name
        run(
            [
                BIN / 'tokenaug-occlusion',
                '--data-dir',
                world / 'imagenet',
                '--split',
                'val',
                '--model',
                'vit_tiny_patch16_224',
                '--model-kwargs',
                'img_size=112',
                '--checkpoint',
                out / 'timm' / name / 'last.pth.tar',
                '--ratios',
                '0',
                '0.2',
                '0.4',
                '0.6',
                '0.8',
                '--out',
                dst,
                '-j',
                '2',
                '--no-progress',
            ],
            log=out / f'occlusion_{name}.log',
        )
        with open(dst / 'occlusion.csv') as f:
            curves[label] = [(float(r['ratio']), float(r['top1'])) for r in csv.DictReader(f)]
    return curves


def convert(src, dst, to, model, *model_kwargs):
    """``tokenaug-convert`` of a demo checkpoint; ``--force``: a rerun of the demo replaces its own earlier backbone
    files (they come from the runs it has just repeated)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    run(
        [
            BIN / 'tokenaug-convert',
            '--src',
            src,
            '--dst',
            dst,
            '--to',
            to,
            '--model',
            model,
            *(['--model-kwargs', *model_kwargs] if model_kwargs else []),
            '--force',
        ],
        log=dst.with_suffix('.log'),
    )


def upstream(pkg: str, tool: str) -> Path:
    import importlib

    return Path(importlib.import_module(pkg).__file__).parent / '.mim' / 'tools' / tool


def metric(log: Path, name: str) -> float:
    """The last ``name: value`` an mm test script logged (0 when mmdet found no detection at all: its
    COCO metric then logs that the results are empty and reports nothing)."""
    import re

    text = log.read_text()
    values = re.findall(re.escape(name) + r': (-?[\d.]+)', text)
    if values:
        return float(values[-1])
    if 'results of the whole dataset is empty' in text:
        return 0.0
    raise SystemExit(f'demo: no {name} in {log}')


def transfer(world, out, method, seg_iters, det_epochs, det_pretrain_epochs):
    """CutMix or TL-Align pretraining carried to segmentation and detection; returns (mIoU, box AP, mask AP)."""
    env = dict(
        os.environ, TOKENAUG_WORLD=str(world), PYTHONPATH=f'{REPO}{os.pathsep}{os.environ.get("PYTHONPATH", "")}'
    )
    # segmentation: the ViT-Tiny of the classification stage
    seg_ckpt = out / 'backbones' / f'vit-tiny_{method}_mmseg.pth'
    convert(out / 'timm' / method / 'last.pth.tar', seg_ckpt, 'mmseg', 'vit_tiny_patch16_224', 'img_size=112')
    cfg = REPO / 'configs/mmseg/upernet_vit-tiny_world.py'
    work = out / 'mmseg' / method
    shutil.rmtree(work, ignore_errors=True)
    env['TOKENAUG_BACKBONE'] = str(seg_ckpt)
    run(
        [
            sys.executable,
            upstream('mmseg', 'train.py'),
            cfg,
            '--work-dir',
            work,
            '--cfg-options',
            f'train_cfg.max_iters={seg_iters}',
            f'train_cfg.val_interval={seg_iters}',
            f'default_hooks.checkpoint.interval={seg_iters}',
        ],
        env=env,
        log=out / f'mmseg_{method}.log',
    )
    run(
        [
            sys.executable,
            upstream('mmseg', 'test.py'),
            cfg,
            work / f'iter_{seg_iters}.pth',
            '--work-dir',
            work / 'test',
        ],
        env=env,
        log=out / f'mmseg_{method}_test.log',
    )
    miou = metric(out / f'mmseg_{method}_test.log', 'mIoU')
    # detection: a small Swin pretrained with the same method, then Cascade Mask R-CNN
    swin = f'swin-mini_{method}'
    timm_run(world, out, swin, det_pretrain_epochs, '--mixup-type', method, config='world_swin-mini.yaml')
    det_ckpt = out / 'backbones' / f'swin-mini_{method}_mmdet.pth'
    convert(
        out / 'timm' / f'swin-mini_{method}' / 'last.pth.tar',
        det_ckpt,
        'mmdet',
        'swin_tiny_patch4_window7_224',
        'embed_dim=32',
        'depths=(2,2,2,2)',
        'num_heads=(1,2,4,8)',
    )
    cfg = REPO / 'configs/mmdet/cascade-mask-rcnn_swin-mini_world.py'
    work = out / 'mmdet' / method
    shutil.rmtree(work, ignore_errors=True)
    env['TOKENAUG_BACKBONE'] = str(det_ckpt)
    run(
        [
            sys.executable,
            upstream('mmdet', 'train.py'),
            cfg,
            '--work-dir',
            work,
            '--cfg-options',
            f'train_cfg.max_epochs={det_epochs}',
            f'train_cfg.val_interval={det_epochs + 1}',
        ],
        env=env,
        log=out / f'mmdet_{method}.log',
    )
    run(
        [sys.executable, upstream('mmdet', 'test.py'), cfg, work / f'epoch_{det_epochs}.pth', '--work-dir']
        + [work / 'test'],
        env=env,
        log=out / f'mmdet_{method}_test.log',
    )
    log = out / f'mmdet_{method}_test.log'
    return miou, metric(log, 'coco/bbox_mAP'), metric(log, 'coco/segm_mAP')


def mmpretrain_run(world, out, config, epochs):
    import mmpretrain

    train_py = Path(mmpretrain.__file__).parent / '.mim' / 'tools' / 'train.py'
    work = out / 'mmpretrain' / config
    shutil.rmtree(work, ignore_errors=True)
    env = dict(
        os.environ, TOKENAUG_WORLD=str(world), PYTHONPATH=f'{REPO}{os.pathsep}{os.environ.get("PYTHONPATH", "")}'
    )
    secs = run(
        [
            sys.executable,
            train_py,
            REPO / 'configs/mmpretrain' / f'{config}.py',
            '--work-dir',
            work,
            '--cfg-options',
            f'train_cfg.max_epochs={epochs}',
        ],
        env=env,
        log=out / f'mmpretrain_{config}.log',
    )
    scalars = sorted(work.glob('*/vis_data/scalars.json'))[-1]
    last = [json.loads(line) for line in scalars.read_text().splitlines() if 'accuracy/top1' in line][-1]
    return last['accuracy/top1'], last['accuracy/top5'], secs


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 4 epochs: the schedule of the world configs (configs/timm/world_*.yaml, configs/mmpretrain/_base_/world_*)
    p.add_argument('--epochs', type=int, default=int(os.environ.get('DEMO_EPOCHS', 4)))
    p.add_argument('--out', type=Path, default=REPO / 'demo_out')
    p.add_argument('--seg-iters', type=int, default=int(os.environ.get('DEMO_SEG_ITERS', 80)))
    # 1 epoch = 200 iterations of batch 2 over the 400 train scenes (about 3.5 min on 2 cores): box AP ~0.1; 2: ~0.34
    p.add_argument('--det-epochs', type=int, default=int(os.environ.get('DEMO_DET_EPOCHS', 1)))
    p.add_argument('--det-pretrain-epochs', type=int, default=int(os.environ.get('DEMO_DET_PRETRAIN_EPOCHS', 3)))
    args = p.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    world = out / 'world'
    t0 = time.time()
    starts = []  # (stage, start time): the wall time of each stage goes to results.md

    def stage(title: str) -> None:
        starts.append((title.split(':')[0].split(' (')[0], time.time()))
        print(f'== {len(starts)}/6 {title}', flush=True)

    stage('synthetic world (tokenaug-data)')
    subprocess.run([BIN / 'tokenaug-data', '--out', world, '--seed', '0'], check=True)

    rows, curves = [], {}
    kinds = [
        ('cutmix', 'MixUp/CutMix (DeiT)'),
        ('tokenmix_block', 'MixUp/TokenMix block masks'),
        ('tl_align', 'MixUp/CutMix + TL-Align'),
    ]
    # TokenMixup on the same ViT-Tiny and mixing (a tau at which the untrained ScoreNet already marks samples easy)
    tokenmixup = [
        ('cutmix_htm', 'MixUp/CutMix + TokenMixup HTM', ['--tokenmixup-htm-layers', '2']),
        (
            'cutmix_hvtm',
            'MixUp/CutMix + TokenMixup HTM+VTM',
            ['--tokenmixup-htm-layers', '3', '--tokenmixup-vtm-layers', '2', '--tokenmixup-kappa', '3'],
        ),
    ]
    stage(f'timm: ViT-Tiny/16 and ConvNeXt-Atto at 112 px, {args.epochs} epochs (tokenaug-train)')
    for kind, label in kinds:
        print(f'  -- {label}', flush=True)
        rows.append(
            (
                'timm (tokenaug-train)',
                label,
                *timm_run(world, out, kind, args.epochs, '--mixup-type', kind, curves=curves),
            )
        )
    # TL-Align Appendix A's generalised rules on a CNN: ConvNeXt-Atto (the mix on its 4-px stem grid)
    for kind, label in [
        ('cutmix', 'ConvNeXt-Atto: MixUp/CutMix'),
        ('tl_align', 'ConvNeXt-Atto: MixUp/CutMix + TL-Align'),
    ]:
        print(f'  -- {label}', flush=True)
        flags = ['--model', 'convnext_atto', '--model-kwargs', '--mixup-type', kind]
        rows.append(('timm (tokenaug-train)', label, *timm_run(world, out, f'convnext_{kind}', args.epochs, *flags)))
    for experiment, label, flags in tokenmixup:
        print(f'  -- {label}', flush=True)
        tm_flags = ['--mixup-type', 'cutmix', '--tokenmixup-tau', '1.0', *flags]
        rows.append(
            ('timm (tokenaug-train)', label, *timm_run(world, out, experiment, args.epochs, *tm_flags, curves=curves))
        )
    stage(f'mmpretrain: DeiT-Tiny at 112 px, {args.epochs} epochs (mmpretrain tools/train.py)')
    for config, label in [
        ('deit-tiny_world_cutmix', kinds[0][1]),
        ('deit-tiny_world_tokenmix-block', kinds[1][1]),
        ('deit-tiny_world_tl-align', kinds[2][1]),
    ]:
        print(f'  -- {label}', flush=True)
        rows.append(('mmpretrain (tools/train.py)', label, *mmpretrain_run(world, out, config, args.epochs)))

    stage(
        f'token labeling and TokenMix: annotator, tokenaug-maps generate, MixToken + token labeling '
        f'(ViT-Tiny, Mixer-S/16), TokenMix with activation-map targets ({args.epochs} epochs each), tokenaug-occlusion'
    )
    rows += token_labeling(world, out, args.epochs, curves)
    kinds += [(e, label) for e, label, _ in tokenmixup]
    kinds += [('mixtoken', 'MixToken + token labeling'), ('tokenmix', 'TokenMix + activation maps')]
    occ = occlusion(world, out, [('cutmix', 'MixUp/CutMix (DeiT)'), ('tokenmix', 'TokenMix + activation maps')])

    table = [
        f'Synthetic world: 10 classes, 112 px, 400 train / 100 val images; {args.epochs} epochs, 2 CPU cores.',
        'Val top-1 / top-5 in % on the 100 val images, wall seconds of the run. Each row is one short run: the '
        'differences between rows are within the run-to-run noise here (about 5 points); bench/STUDY.md compares '
        'the methods over seeds on a 5000-image test split.',
        '',
        '| ecosystem | mixing | val top-1 | val top-5 | wall s |',
        '|---|---|---|---|---|',
    ]
    table += [f'| {eco} | {mix} | {t1:.1f} | {t5:.1f} | {s:.0f} |' for eco, mix, t1, t5, s in rows]
    table += [
        '',
        "Per epoch, timm runs: train loss (on each run's own targets) / val top-1:",
        '',
        '| epoch | ' + ' | '.join(label for _, label in kinds) + ' |',
        '|---' * (len(kinds) + 1) + '|',
    ]
    for e in range(args.epochs):
        cells = [f'{float(curves[k][e]["train_loss"]):.3f} / {float(curves[k][e]["eval_top1"]):.0f}' for k, _ in kinds]
        table.append(f'| {e} | ' + ' | '.join(cells) + ' |')
    ratios = [r for r, _ in next(iter(occ.values()))]
    table += [
        '',
        'Occlusion (tokenaug-occlusion, val top-1 with a fraction of the 16x16 patches zeroed):',
        '',
        '| pretraining | ' + ' | '.join(f'{r:.0%}' for r in ratios) + ' |',
        '|---' * (len(ratios) + 1) + '|',
    ]
    table += [f'| {label} | ' + ' | '.join(f'{t:.0f}' for _, t in pts) + ' |' for label, pts in occ.items()]
    stage(
        f'transfer: UperNet {args.seg_iters} iterations (mmseg), Cascade Mask R-CNN {args.det_epochs} '
        f'epoch(s) of 200 iterations after a {args.det_pretrain_epochs}-epoch small-Swin pretraining (mmdet)'
    )
    transfer_rows = []
    for method, label in [('cutmix', kinds[0][1]), ('tl_align', kinds[2][1])]:
        print(f'  -- pretrained with {label}', flush=True)
        transfer_rows.append(
            (label, *transfer(world, out, method, args.seg_iters, args.det_epochs, args.det_pretrain_epochs))
        )
    table += [
        '',
        f'Transfer (upstream test scripts; UperNet {args.seg_iters} it., Cascade Mask R-CNN {args.det_epochs} '
        f'epoch(s) of 200 it. on a small Swin): mIoU in %, box and mask AP in [0, 1] (COCO mAP@[.5:.95]) on the '
        '100 val scenes. One short run per row: the differences between rows are within the run-to-run noise; '
        'bench/STUDY.md compares the methods over seeds.',
        '',
        '| pretraining | ADE20K-world mIoU | COCO-world box AP | COCO-world mask AP |',
        '|---|---|---|---|',
    ]
    table += [f'| {label} | {miou:.2f} | {box:.3f} | {mask:.3f} |' for label, miou, box, mask in transfer_rows]
    stage('pictures (tokenaug-viz; after the transfer step, which trains the Swin they include)')
    pages = pictures(world, out)
    table += ['', 'Pictures (tokenaug-viz; open the index pages):', '']
    table += [f'- {name}: {page.relative_to(out)}' for name, page in pages]
    ends = [t for _, t in starts[1:]] + [time.time()]
    table += ['', f'Wall time of this run ({os.cpu_count()} CPUs; `make install` before it is not counted):', '']
    table += ['| stage | minutes |', '|---|---|']
    table += [f'| {name} | {(end - t) / 60:.1f} |' for (name, t), end in zip(starts, ends)]
    table += [f'| total | {(ends[-1] - t0) / 60:.1f} |']
    text = '\n'.join(table)
    (out / 'results.md').write_text(text + '\n')
    print('\n' + text)
    print(f'\n(total {time.time() - t0:.0f} s; logs, checkpoints and results.md under {out})')


if __name__ == '__main__':
    main()
