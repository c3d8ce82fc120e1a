#!/usr/bin/env python3
"""``make demo``: the synthetic world, then a small ViT trained with CutMix, with TokenMix-style block
masks and with TL-Align (aligned CutMix targets), through ``tokenaug-train`` (timm) and through
mmpretrain's own ``tools/train.py``; prints one comparison table and the per-epoch curves of the timm
runs, and writes them to ``demo_out/results.md``.

    .venv/bin/python scripts/demo.py [--epochs 6] [--out demo_out]
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


def run(cmd, env=None, log=None):
    """Run a command, keep its whole output in ``log``, echo only the evaluation lines."""
    t = time.time()
    with open(log, 'w') as f:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        for line in proc.stdout:
            f.write(line)
            if 'Test:' in line or 'Epoch(val)' in line:
                print('    ' + line.strip()[-110:], flush=True)
    if proc.wait() != 0:
        raise SystemExit(f'demo: command failed (exit {proc.returncode}), log: {log}\n  {" ".join(map(str, cmd))}')
    return time.time() - t


def timm_run(world, out, kind, epochs, curves):
    exp = out / 'timm' / kind
    shutil.rmtree(exp, ignore_errors=True)  # timm appends to summary.csv of an existing run folder
    secs = run([BIN / 'tokenaug-train', '-c', REPO / 'configs/timm/world_vit-tiny.yaml', '--data-dir',
                world / 'imagenet', '--epochs', str(epochs), '--mixup-type', kind, '--output', out / 'timm',
                '--experiment', kind], log=out / f'timm_{kind}.log')
    final = json.loads((exp / 'results.json').read_text())['final']
    with open(exp / 'summary.csv') as f:
        curves[kind] = list(csv.DictReader(f))
    return final['top1'], final['top5'], secs


def mmpretrain_run(world, out, config, epochs):
    import mmpretrain
    train_py = Path(mmpretrain.__file__).parent / '.mim' / 'tools' / 'train.py'
    work = out / 'mmpretrain' / config
    shutil.rmtree(work, ignore_errors=True)
    env = dict(os.environ, TOKENAUG_WORLD=str(world), PYTHONPATH=f'{REPO}{os.pathsep}{os.environ.get("PYTHONPATH", "")}')
    secs = run([sys.executable, train_py, REPO / 'configs/mmpretrain' / f'{config}.py', '--work-dir', work,
                '--cfg-options', f'train_cfg.max_epochs={epochs}'], env=env, log=out / f'mmpretrain_{config}.log')
    scalars = sorted(work.glob('*/vis_data/scalars.json'))[-1]
    last = [json.loads(line) for line in scalars.read_text().splitlines() if 'accuracy/top1' in line][-1]
    return last['accuracy/top1'], last['accuracy/top5'], secs


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--epochs', type=int, default=int(os.environ.get('DEMO_EPOCHS', 6)))
    p.add_argument('--out', type=Path, default=REPO / 'demo_out')
    args = p.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    world = out / 'world'
    t0 = time.time()
    print('== 1/3 synthetic world (tokenaug-data)', flush=True)
    subprocess.run([BIN / 'tokenaug-data', '--out', world, '--seed', '0'], check=True)

    rows, curves = [], {}
    kinds = [('cutmix', 'MixUp/CutMix (DeiT)'), ('tokenmix_block', 'MixUp/TokenMix block masks'),
             ('tl_align', 'MixUp/CutMix + TL-Align')]
    print(f'== 2/3 timm: ViT-Tiny/16 at 112 px, {args.epochs} epochs (tokenaug-train)', flush=True)
    for kind, label in kinds:
        print(f'  -- {label}', flush=True)
        rows.append(('timm (tokenaug-train)', label, *timm_run(world, out, kind, args.epochs, curves)))
    print(f'== 3/3 mmpretrain: DeiT-Tiny at 112 px, {args.epochs} epochs (mmpretrain tools/train.py)', flush=True)
    for config, label in [('deit-tiny_world_cutmix', kinds[0][1]), ('deit-tiny_world_tokenmix-block', kinds[1][1]),
                          ('deit-tiny_world_tl-align', kinds[2][1])]:
        print(f'  -- {label}', flush=True)
        rows.append(('mmpretrain (tools/train.py)', label, *mmpretrain_run(world, out, config, args.epochs)))

    table = [f'Synthetic world: 10 classes, 112 px, 400 train / 100 val images; {args.epochs} epochs, 2 CPU cores.',
             '', '| ecosystem | mixing | val top-1 | val top-5 | wall s |', '|---|---|---|---|---|']
    table += [f'| {eco} | {mix} | {t1:.1f} | {t5:.1f} | {s:.0f} |' for eco, mix, t1, t5, s in rows]
    table += ['', 'Per epoch, timm runs: train loss (on each run\'s own targets) / val top-1:', '',
              '| epoch | ' + ' | '.join(label for _, label in kinds) + ' |', '|---' * (len(kinds) + 1) + '|']
    for e in range(args.epochs):
        cells = [f"{float(curves[k][e]['train_loss']):.3f} / {float(curves[k][e]['eval_top1']):.0f}" for k, _ in kinds]
        table.append(f'| {e} | ' + ' | '.join(cells) + ' |')
    text = '\n'.join(table)
    (out / 'results.md').write_text(text + '\n')
    print('\n' + text)
    print(f'\n(total {time.time() - t0:.0f} s; logs, checkpoints and results.md under {out})')


if __name__ == '__main__':
    main()
