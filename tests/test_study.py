"""bench/study.py, the multi-seed study runner: its statistics against hand-computed values, and the whole
runner on its ``tiny`` preset (2 seeds, 1 epoch) through the real entry points, resumed."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _study():
    spec = importlib.util.spec_from_file_location('tokenaug_study', REPO / 'bench' / 'study.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paired_difference_and_its_interval_by_hand():
    study = _study()
    method, baseline = [71.0, 73.4, 70.2, 72.8, 74.0], [70.0, 72.0, 71.0, 71.2, 72.6]
    d = study.paired(method, baseline)
    diffs = [1.0, 1.4, -0.8, 1.6, 1.4]
    mean = sum(diffs) / 5
    sd = math.sqrt(sum((x - mean) ** 2 for x in diffs) / 4)
    assert d['diffs'] == pytest.approx(diffs)
    assert d['mean'] == pytest.approx(mean) and d['sd'] == pytest.approx(sd)
    # t(0.975, 4) = 2.7764 (tables); the half-width of the 95 % interval is t * sd / sqrt(n)
    assert study.t_quantile(4) == pytest.approx(2.7764, abs=1e-4)
    assert d['half'] == pytest.approx(2.7764 * sd / math.sqrt(5), rel=1e-4)
    assert d['excludes_zero'] == (mean - d['half'] > 0)
    # one seed: no interval; a difference that is the same on every seed excludes 0
    assert math.isnan(study.paired([1.0], [0.0])['half'])
    assert study.paired([2.0, 3.0, 4.0], [1.0, 2.0, 3.0])['excludes_zero']
    with pytest.raises(ValueError, match='one value per seed'):
        study.paired([1.0, 2.0], [1.0])


def _run(out: Path, *extra) -> dict:
    cmd = [sys.executable, REPO / 'bench' / 'study.py', '--preset', 'tiny', '--out', out, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / 'study.json').read_text())


def test_a_preset_evaluates_every_val_interval_epochs(tmp_path):
    """cpu_small evaluates every 20 of its 60 epochs (the table reads the last one); cpu, every epoch (timm's
    default, so its runs keep their recorded commands)."""
    study = _study()

    def cmd(preset):
        s = study.Study(tmp_path / preset, study.PRESETS[preset], mmpretrain=False)
        return [str(c) for c in s.timm_cmd('world_vit-tiny.yaml', tmp_path / 'runs' / 'seed0', 0, [])]

    assert study.Study(tmp_path / 'grid', study.PRESETS['tiny'], mmpretrain=False).runs == study.GRID
    every = study.Study(tmp_path / 'all', study.PRESETS['tiny'], mmpretrain=False, runs=['all']).runs
    assert every == list(study.RUNS) + list(study.MM_RUNS)
    small = cmd('cpu_small')
    assert small[small.index('--val-interval') + 1] == '20' and small[small.index('--epochs') + 1] == '60'
    assert '--val-interval' not in cmd('cpu')


#: the runs the end-to-end test trains (2 seeds each): one of each kind of step (no mixing, a mixer, TL-Align, the two
#: runs that read the annotator's maps, two of the occlusion runs, an mmpretrain run); the grid's other runs go
#: through the same code (the grid itself: test_a_preset_evaluates_every_val_interval_epochs)
SOME = ['plain', 'cutmix', 'tl_align', 'tokenmix_maps', 'mixtoken', 'mm_tl_align']


@pytest.mark.slow
def test_study_runs_the_grid_writes_the_table_and_resumes(tmp_path):
    study = _study()
    out = tmp_path / 'study'
    first = _run(out, '--runs', *SOME)
    seeds = [0, 1]
    assert first['seeds'] == seeds
    names = SOME
    assert set(names) < set(study.GRID)
    assert set(study.PROBES) <= set(study.RUNS) | set(study.MM_RUNS) and not set(study.PROBES) & set(study.GRID)
    assert set(first['runs']) == {f'{n} seed {s}' for n in names for s in seeds}
    for name, rec in first['runs'].items():
        assert 0 <= rec['top1'] <= 100 and rec['secs'] > 0, name
    # every run's final checkpoint on the test world (6 val images per class, the world's 4 first among them):
    # the timm runs in process after reproducing their own val top-1, the mmpretrain ones by its tools/test.py
    assert set(first['test']) == set(first['runs'])
    for name, rec in first['test'].items():  # (a 60-image evaluation may take under the 0.1 s the record keeps)
        assert 0 <= rec['top1'] <= 100 and rec['secs'] >= 0, name
        assert name.startswith('mm_') or rec['images'] == 60, name
    for split in ('train', 'val'):
        world = sorted(p.read_bytes() for p in (out / 'world' / 'imagenet' / split).rglob('*.jpg'))
        test = sorted(p.read_bytes() for p in (out / 'test_world' / 'imagenet' / split).rglob('*.jpg'))
        assert len(test) == (80 if split == 'train' else 60)
        assert world == test if split == 'train' else set(world) < set(test)
    assert (out / 'logs' / 'test_mm_tl_align_seed1.log').is_file()
    # per-class test accuracy of the study's runs (bench/study_eval.py): one row per run, a cell per class
    cmd = [sys.executable, REPO / 'bench' / 'study_eval.py', '--out', out, '--runs', 'plain', 'tl_align']
    cmd += ['--seeds', '2']
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(('| plain |', '| tl_align |'))]
    assert len(rows) == 2 and all(len(r.split('|')) == 1 + 1 + 10 + 1 + 1 for r in rows), proc.stdout
    cmd[-1] = '3'
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and 'no run folder' in proc.stderr and 'plain seed 2' in proc.stderr
    # the evaluator refuses a run whose own val top-1 it does not reproduce (the token-labeling run: cls + aux)
    sys.path.insert(0, str(REPO / 'bench'))
    try:
        from study_eval import evaluate_run
    finally:
        sys.path.remove(str(REPO / 'bench'))
    run, own = out / 'runs' / 'mixtoken' / 'seed0', first['runs']['mixtoken seed 0']['top1']
    worlds = (out / 'test_world' / 'imagenet', out / 'world' / 'imagenet')
    again = evaluate_run(run, *worlds, own)
    assert again['top1'] == first['test']['mixtoken seed 0']['top1'] and again['val_top1'] == pytest.approx(own)
    with pytest.raises(RuntimeError, match='the training reported'):
        evaluate_run(run, *worlds, own + 50)
    # the timm runs are tokenaug-train's own run folders, with their seed and the study's epochs
    for s in seeds:
        args = (out / 'runs' / 'tl_align' / f'seed{s}' / 'args.yaml').read_text()
        assert f'seed: {s}\n' in args and 'epochs: 1\n' in args and 'mixup_type: tl_align' in args
        assert (out / 'runs' / 'mm_tl_align' / f'seed{s}').is_dir()
    # the annotator's maps feed token labeling and TokenMix's activation-map targets
    maps = str(out / 'maps' / 'train')
    assert maps in (out / 'runs' / 'mixtoken' / 'seed0' / 'args.yaml').read_text()
    assert maps in (out / 'runs' / 'tokenmix_maps' / 'seed1' / 'args.yaml').read_text()
    occluded = [n for n in study.OCCLUSION_RUNS if n in names]  # the occlusion runs that trained
    assert set(first['occlusion']) == {f'{n} seed {s}' for n in occluded for s in seeds}
    for rec in first['occlusion'].values():
        assert len(rec['top1']) == len(study.OCCLUSION_RATIOS)
    table = (out / 'study.md').read_text()
    labels = {k: v[0] for k, v in study.RUNS.items()} | {k: v[0] for k, v in study.MM_RUNS.items()}
    for name in names:
        assert f'| {labels[name]} |' in table
    # every comparison of the grid's runs is a row, and its difference is the mean of the per-seed test differences
    for m, b in [(m, b) for m, b in study.COMPARISONS if m in names and b in names]:
        diff = sum(first['test'][f'{m} seed {s}']['top1'] - first['test'][f'{b} seed {s}']['top1'] for s in seeds) / 2
        assert f'| {labels[m]} | {labels[b]} | {diff:+.2f} |' in table
    steps = first['steps_run']  # world, annotator, maps, test world; runs, their test evaluations; occlusion
    assert first['steps_skipped'] == 0 and steps == 4 + len(names) * 2 * 2 + len(occluded) * 2

    # a rerun skips every finished step and writes the same table
    again = _run(out, '--runs', *SOME)
    assert again['steps_run'] == 0 and again['steps_skipped'] == steps
    assert again['runs'] == first['runs']
    # an unfinished step (no record) and a changed one (another key) run again; the rest is kept
    (out / 'runs' / 'mixtoken' / 'seed1' / 'study_step.json').unlink()
    record = out / 'runs' / 'tl_align' / 'seed0' / 'study_step.json'
    record.write_text(record.read_text().replace(first['runs']['tl_align seed 0']['key'], 'stale'))
    third = _run(out, '--runs', *SOME)
    # (their test evaluations are kept: a step's key is its command and its inputs' commands, not their outputs)
    assert third['steps_run'] == 2 and third['steps_skipped'] == steps - 2
    assert third['runs']['cutmix seed 0'] == first['runs']['cutmix seed 0']
    # a subset (--runs): only those runs, no annotator or maps, no mmpretrain row, occlusion of the ones trained
    subset = _run(tmp_path / 'subset', '--runs', 'plain', 'cutmix', '--seeds', '1')
    assert set(subset['runs']) == {'plain seed 0', 'cutmix seed 0'} and set(subset['occlusion']) == {'cutmix seed 0'}
    assert subset['steps_run'] == 2 + 2 * 2 + 1 and not (tmp_path / 'subset' / 'maps').exists()
    table = (tmp_path / 'subset' / 'study.md').read_text()
    assert f'| {labels["cutmix"]} | {labels["plain"]} |' in table and labels['tl_align'] not in table
