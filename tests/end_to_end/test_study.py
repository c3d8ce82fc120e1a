"""bench/study.py and bench/study_size.py, the presets of tokenaug-study on the world: the statistics against
hand-computed values, and each whole preset on ``tiny`` (1 epoch; one seed, then a second for two runs) through
the real entry points, resumed."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from ..helpers.processes import run_in_process

REPO = Path(__file__).resolve().parents[2]


def _bench(name: str):
    """``bench/<name>.py`` as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f'tokenaug_{name}', REPO / 'bench' / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _study():
    return _bench('study')


def test_paired_difference_and_its_interval_by_hand():
    from shared_core import study

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
    """bench/study.py's main on its tiny preset, in this process, its trainings too (``run_in_process``; the other
    steps are subprocesses); its record."""
    _study().main(['--preset', 'tiny', '--out', str(out), *extra], runner=run_in_process)
    return json.loads((out / 'study.json').read_text())


def test_a_preset_is_a_tokenaug_study_command_line(tmp_path):
    """A preset's timm runs are tokenaug-study's (one table, one spelling), on the repo's recipe at the preset's
    model and schedule: cpu_small evaluates every 20 of its 60 epochs (the table reads the last one); cpu, every
    epoch (timm's default, so its runs keep their recorded commands). The grid is every run but the probes."""
    from tokenaug.tool_args import STUDY_RUNS, study_parser

    study = _study()
    assert set(study.TIMM_RUNS) <= set(STUDY_RUNS) and not set(study.TIMM_RUNS) & set(study.MM_RUNS)
    assert study.GRID == [n for n in study.TIMM_RUNS + list(study.MM_RUNS) if n not in study.PROBES]
    assert {n for pair in study.COMPARISONS for n in pair} <= set(study.LABELS)

    def train_args(preset, runs=('plain', 'cutmix')):
        argv = study.study_argv(tmp_path, study.PRESETS[preset], list(runs), 3)
        args = study_parser().parse_args(argv)
        assert args.runs == list(runs) and args.seeds == 3 and args.config == str(study.RECIPE)
        return args

    small = train_args('cpu_small').train_args
    assert small[small.index('--val-interval') + 1] == '20' and small[small.index('--epochs') + 1] == '60'
    assert small[small.index('--model-kwargs') + 1 : small.index('--epochs')] == [
        'img_size=112', 'depth=6', 'embed_dim=96', 'num_heads=3',
    ]  # fmt: skip
    assert '--val-interval' not in train_args('cpu').train_args
    assert train_args('cpu').baseline == 'cutmix' and train_args('cpu', ['plain', 'htm']).baseline == 'plain'


#: the runs the end-to-end test trains: one of each kind of step (no mixing, a mixer, TL-Align, the two runs that
#: read the annotator's maps, two of the occlusion runs, an mmpretrain run); the grid's other runs go through the
#: same code (the grid itself: test_a_preset_evaluates_every_val_interval_epochs)
SOME = ['plain', 'cutmix', 'tl_align', 'tokenmix_block_maps', 'mixtoken', 'mm_tl_align']


@pytest.mark.slow
def test_study_runs_the_grid_writes_the_table_and_resumes(tmp_path, monkeypatch, capsys):
    """SOME on one seed; rerun (every step skipped); an unfinished and a changed step rerun; then a second seed of
    two runs, which runs only their new steps and gives the table's paired differences over two seeds."""
    study = _study()
    monkeypatch.chdir(REPO)
    out = tmp_path / 'study'
    first = _run(out, '--runs', *SOME, '--seeds', '1')
    names = SOME
    assert first['seeds'] == [0]
    assert set(names) < set(study.GRID)
    assert set(first['runs']) == {f'{n} seed 0' for n in names}
    for name, rec in first['runs'].items():
        assert 0 <= rec['top1'] <= 100 and rec['secs'] > 0, name
    # every run's final checkpoint on the test world (6 val images per class, the world's 4 first among them):
    # the timm runs in process after reproducing their own val top-1, the mmpretrain ones by its tools/test.py
    assert set(first['test']) == set(first['runs'])
    for name, rec in first['test'].items():
        assert 0 <= rec['top1'] <= 100, name
        assert name.startswith('mm_') or (rec['images'] == 60 and rec['split'] == 'test'), name
    for split in ('train', 'val'):
        world = sorted(p.read_bytes() for p in (out / 'world' / 'imagenet' / split).rglob('*.jpg'))
        test = sorted(p.read_bytes() for p in (out / 'test_world' / 'imagenet' / split).rglob('*.jpg'))
        assert len(test) == (80 if split == 'train' else 60)
        assert world == test if split == 'train' else set(world) < set(test)
    assert (out / 'logs' / 'test_mm_tl_align_seed0.log').is_file()
    assert (out / 'runs' / 'mm_tl_align' / 'seed0').is_dir()
    # the study's data: the world's train and val splits, the test world's val split as its test split
    world, test_world = out / 'world' / 'imagenet', out / 'test_world' / 'imagenet'
    linked = [(out / 'data' / s).resolve() for s in ('train', 'val', 'test')]
    assert linked == [world / 'train', world / 'val', test_world / 'val']
    # tokenaug-study's own results against cutmix, beside the preset's table
    assert '| tl_align |' in (out / 'results.md').read_text()
    # the evaluator refuses a run whose own val top-1 it does not reproduce (the token-labeling run: cls + aux)
    from timm_plugin.tools.study_eval import evaluate_run

    run, own = out / 'runs' / 'mixtoken' / 'seed0', first['runs']['mixtoken seed 0']['top1']
    worlds = (out / 'test_world' / 'imagenet', out / 'world' / 'imagenet')
    again = evaluate_run(run, *worlds, own)
    assert again['top1'] == first['test']['mixtoken seed 0']['top1'] and again['val_top1'] == pytest.approx(own)
    with pytest.raises(RuntimeError, match='the training reported'):
        evaluate_run(run, *worlds, own + 50)
    # the timm runs are tokenaug-train's own run folders, with their seed and the study's epochs
    args = (out / 'runs' / 'tl_align' / 'seed0' / 'args.yaml').read_text()
    assert '--mixup-type tl_align' in (out / 'logs' / 'tl_align_seed_0.log').read_text()
    assert 'seed: 0\n' in args and 'epochs: 1\n' in args and 'method: tl_align' in args and 'mixup_type: cutmix' in args
    # the annotator's maps feed token labeling and TokenMix's activation-map targets
    maps = str(out / 'maps' / 'train')
    assert maps in (out / 'runs' / 'mixtoken' / 'seed0' / 'args.yaml').read_text()
    assert maps in (out / 'runs' / 'tokenmix_block_maps' / 'seed0' / 'args.yaml').read_text()
    occluded = [n for n in study.OCCLUSION_RUNS if n in names]  # the occlusion runs that trained
    assert set(first['occlusion']) == {f'{n} seed 0' for n in occluded}
    for rec in first['occlusion'].values():
        assert len(rec['top1']) == len(study.OCCLUSION_RATIOS)
    labels = study.LABELS

    def check_table(record, runs, seeds):
        """study.md has a row per run and one per comparison among them, whose difference is the mean of the
        per-seed test differences."""
        table = (out / 'study.md').read_text()
        for name in runs:
            assert f'| {name} ({labels[name]}) |' in table
        pairs = [(m, b) for m, b in study.COMPARISONS if m in runs and b in runs]
        for m, b in pairs:
            diffs = [record['test'][f'{m} seed {s}']['top1'] - record['test'][f'{b} seed {s}']['top1'] for s in seeds]
            assert f'| {m} | {b} | {sum(diffs) / len(seeds):+.2f} |' in table
        return table, pairs

    assert check_table(first, names, [0])[1]
    steps = first['steps_run']  # world, test world, annotator, maps; runs, their test evaluations; occlusion
    assert first['steps_skipped'] == 0 and steps == 4 + len(names) * 2 + len(occluded)

    # a rerun skips every finished step and writes the same table
    again = _run(out, '--runs', *SOME, '--seeds', '1')
    assert again['steps_run'] == 0 and again['steps_skipped'] == steps
    assert again['runs'] == first['runs']
    # an unfinished step (no record) and a changed one (another key) run again; the rest is kept
    (out / 'runs' / 'mixtoken' / 'seed0' / 'study_step.json').unlink()
    record = out / 'runs' / 'tl_align' / 'seed0' / 'study_step.json'
    record.write_text(record.read_text().replace(first['runs']['tl_align seed 0']['key'], 'stale'))
    third = _run(out, '--runs', *SOME, '--seeds', '1')
    # (their test evaluations are kept: a step's key is its command and its inputs' commands, not their outputs)
    assert third['steps_run'] == 2 and third['steps_skipped'] == steps - 2
    assert third['runs']['cutmix seed 0'] == first['runs']['cutmix seed 0']

    # two seeds of a subset (--runs, --seeds): only the new seed's steps run (its runs, their test evaluations, the
    # occlusion of the one that has it); no annotator or maps step, no mmpretrain row; the table over both seeds
    pair = ['plain', 'cutmix']
    two = _run(out, '--runs', *pair, '--seeds', '2')
    assert two['seeds'] == [0, 1] and set(two['runs']) == {f'{n} seed {s}' for n in pair for s in (0, 1)}
    assert set(two['occlusion']) == {'cutmix seed 0', 'cutmix seed 1'}
    assert two['steps_run'] == 2 + 2 + 1 and two['steps_skipped'] == 2 + 2 + 2 + 1
    assert two['runs']['cutmix seed 0'] == first['runs']['cutmix seed 0']
    assert 'seed: 1\n' in (out / 'runs' / 'cutmix' / 'seed1' / 'args.yaml').read_text()
    table, pairs = check_table(two, pair, [0, 1])
    assert pairs == [('cutmix', 'plain')] and labels['tl_align'] not in table
    d = study.paired(*([two['test'][f'{n} seed {s}']['top1'] for s in (0, 1)] for n in pair[::-1]))
    assert f'| {d["mean"]:+.2f} | [{d["mean"] - d["half"]:+.2f}, {d["mean"] + d["half"]:+.2f}] |' in table
    # per-class test accuracy of the study's runs (bench/study_eval.py): one row per run, a cell per class
    per_class = _bench('study_eval').main

    capsys.readouterr()
    per_class(['--out', str(out), '--runs', *pair, '--seeds', '2'])
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith(('| plain |', '| cutmix |'))]
    assert len(rows) == 2 and all(len(r.split('|')) == 1 + 1 + 10 + 1 + 1 for r in rows), printed
    with pytest.raises(SystemExit) as exit_:
        per_class(['--out', str(out), '--runs', *pair, '--seeds', '3'])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and 'no run folder' in err and 'plain seed 2' in err


def _size_study():
    return _bench('study_size')


def test_object_share_of_a_cutmix_box_by_hand():
    """B's weight by what the mix shows of each object: the fractions of A's object outside the box and of B's
    inside it, normalised; ``None`` where neither shows."""
    import numpy as np

    size = _size_study()
    a, b = np.zeros((10, 10), bool), np.zeros((10, 10), bool)
    a[0:2, 0:5] = True  # 10 px, in the top rows
    b[6:8, 6:8] = True  # 4 px, in the lower right
    box = (5, 10, 5, 10)  # rows 5..9, cols 5..9: a quarter of the image, all of B's object, none of A's
    assert size.object_share(a, b, box) == pytest.approx(1 / (1 + 1))
    assert size.object_share(a, b, (0, 10, 0, 3)) == 0.0  # 4 of A's 10 px outside the box, none of B's in it
    assert size.object_share(a, b, (0, 2, 0, 5)) is None  # A's object covered, B's not in the box
    b[6:8, 8:10] = True  # 8 px, half of them in a box over the columns 5..7
    assert size.object_share(a, b, (0, 10, 5, 8)) == pytest.approx(0.5 / (0.5 + 1.0))


@pytest.mark.parametrize(
    'tl_align, cutmix, verdict',
    [
        ([71.0, 72.0, 73.0, 74.0], [70.0, 70.8, 72.1, 72.9], 'resolved: better (the interval excludes 0)'),
        # differences +0.2 / -0.1 / +0.1 / -0.2 over 8 seeds: mean 0, sd 0.17, half-width 2.36 * 0.17 / √8 = 0.14
        ([70.2, 69.9, 70.1, 69.8] * 2, [70.0] * 8, 'bounded within ±0.3: the whole interval lies inside [-0.3, +0.3]'),
        ([71.0, 69.0, 70.5], [70.0, 70.0, 70.0], 'neither resolved nor bounded: the interval includes 0 and reaches'),
        ([71.0, 72.0, 73.0], [70.0, 71.0, 72.0], 'not resolvable: every seed gave the same difference'),
        ([71.0], [70.0], 'n/a (1 seed)'),
    ],
)
def test_size_study_says_whether_tl_align_is_resolved_or_bounded(tl_align, cutmix, verdict):
    """The TL-Align line of study_size.md: resolved where the 95 % interval excludes 0, bounded where the whole
    interval lies inside ±0.3, neither otherwise; not resolvable where every seed gave the same difference; no
    interval for one seed."""
    size, study = _size_study(), _study()
    knob = dict(coverage=0.06, share_off=0.5, mean_error=0.2, invisible=0)
    seeds = list(range(len(tl_align)))
    diff = study.paired(tl_align, cutmix)
    record = dict(
        knob={'small': knob},
        top1={'small': {'cutmix': cutmix, 'tl_align': tl_align}},
        diffs={'small': {'tl_align': study.paired(tl_align[:1], cutmix[:1])}},
        tl_align=dict(size='small', seeds=seeds, diff=diff),
    )
    text = size.render(record, 'tiny', study.PRESETS['tiny'], 'small', 60.0, 120.0)
    line = text.splitlines()[-1]
    assert line.startswith(f'TL-Align − CutMix at the size where area labels are most wrong (small), over {len(seeds)}')
    assert verdict in line


@pytest.mark.slow
def test_size_study_runs_its_grid_on_two_worlds_and_resumes(tmp_path, monkeypatch):
    """bench/study_size.py on the tiny preset: two object sizes, CutMix and TL-Align on one seed, a second seed of
    both at the size whose area labels are most wrong; the table, the plot and the record; a rerun runs nothing."""
    size = _size_study()
    monkeypatch.chdir(REPO)
    out = tmp_path / 'size'
    argv = ['--preset', 'tiny', '--out', str(out), '--sizes', 'small', 'large', '--runs', 'cutmix', 'tl_align']
    record = size.main([*argv, '--seeds', '1', '--tl-align-seeds', '2'], runner=run_in_process)
    # the worlds differ in their main object's coverage only: the same scenes' classes, the knob turned
    for s, (lo, hi) in (('small', (0.03, 0.10)), ('large', (0.30, 0.70))):
        meta = json.loads((out / s / 'world' / 'world.json').read_text())
        assert (meta['config']['min_area'], meta['config']['max_area']) == (lo, hi)
        assert lo <= record['knob'][s]['coverage'] <= hi
    assert record['knob']['small']['share_off'] > record['knob']['large']['share_off'] + 0.2
    # TL-Align's extra seed at the small size only; the per-size differences over the common seed
    assert record['tl_align']['size'] == 'small' and record['tl_align']['seeds'] == [0, 1]
    assert set(record['runs']) == {f'{s} {n} seed 0' for s in ('small', 'large') for n in ('cutmix', 'tl_align')} | {
        'small cutmix seed 1',
        'small tl_align seed 1',
    }
    assert [len(record['top1'][s]['cutmix']) for s in ('small', 'large')] == [2, 1]
    d = record['tl_align']['diff']
    test = [record['test'][f'small {n} seed {i}']['top1'] for n in ('tl_align', 'cutmix') for i in (0, 1)]
    assert d['diffs'] == pytest.approx([test[0] - test[2], test[1] - test[3]])
    table = (out / 'study_size.md').read_text()
    assert '| small | 3-10 % |' in table and '| large | 30-70 % |' in table
    assert 'n/a (1 seed)' in table and 'nan' not in table
    assert f'over 2 seeds: **{d["mean"]:+.2f} [{d["mean"] - d["half"]:+.2f}, {d["mean"] + d["half"]:+.2f}]**' in table
    assert (out / 'study_size.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert json.loads((out / 'study_size.json').read_text())['knob'] == record['knob']
    again = size.main([*argv, '--seeds', '1', '--tl-align-seeds', '2'], runner=run_in_process)
    assert again['steps_run'] == 0 and again['test'] == record['test']
