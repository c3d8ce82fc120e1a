"""``tokenaug-study`` end to end on a small world: 2 runs x 2 seeds x 1 epoch with the table, paired intervals and
verdicts; a rerun that skips every step, and a copied study that retrains nothing; ``--dry-run``; ``--emit-jobs``
then ``--collect`` giving the local table; a training killed with SIGKILL resumed through ``tokenaug-train
--resume`` to the uninterrupted run's result; a failed and a diverged run reported by name, never as a number;
one study per ``--out``, and a stopped study whose trainings end; a bad recipe refused once before any run; bad
input named.

Most studies here run their trainings in this process (``study``: ``main(argv, runner=run_in_process)``); the
product's runner, a subprocess per command, keeps its own tests (``study_subprocess``: a killed study resumed,
a failed run, jobs then collect, a stopped study)."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared_core.tools.world import generate_world
from timm_plugin.tools.study_cli import main as study_subprocess

from ..helpers import REPO
from ..helpers.processes import run_in_process

CONFIG = str(REPO / 'configs' / 'timm' / 'world_vit-tiny.yaml')
TRAIN = ['--train-args', '--epochs', '1', '-b', '8', '--num-classes', '4', '--workers', '0']


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    """4 classes at 112 px, 4 train / 2 val images per class, and a test split (the val images again)."""
    out = tmp_path_factory.mktemp('study_world')
    generate_world(
        out, seed=0, num_classes=4, image_size=112, train_per_class=4, val_per_class=2, formats=('imagenet',)
    )
    shutil.copytree(out / 'imagenet' / 'val', out / 'imagenet' / 'test')
    return out / 'imagenet'


@pytest.fixture(scope='module')
def local_study(data, tmp_path_factory):
    """The study of cutmix and tl_align over 2 seeds, run here (the end-to-end test and the jobs' reference)."""
    out = tmp_path_factory.mktemp('local') / 'study'
    assert study(argv(data, out)) == 0
    return out


def study(argv) -> int:
    """``tokenaug-study`` with its trainings in this process."""
    return study_subprocess(argv, runner=run_in_process)


def argv(data, out, *more, runs=('cutmix', 'tl_align'), seeds=2, train=TRAIN):
    return ['--data-dir', str(data), '-c', CONFIG, '--runs', *runs, '--seeds', str(seeds), '--out', str(out), *more,
            *train]  # fmt: skip


@pytest.mark.slow
def test_two_runs_two_seeds_end_to_end_then_a_rerun_skips_every_step(data, local_study, capsys):
    out = local_study
    result = json.loads((out / 'results.json').read_text())
    assert result['split'] == 'test' and not result['test_split_missing']
    for run in ('cutmix', 'tl_align'):
        r = result['runs'][run]
        assert r['seeds'] == [0, 1] and len(r['values']) == 2 and not r['missing_seeds']
        assert all(0 <= v <= 100 for v in r['values'])
    c = result['comparisons']['tl_align']
    # two seeds: the interval, and no verdict word beyond that (or no spread at all)
    assert c['seeds'] == [0, 1] and c['interval'].startswith('[') and c['verdict'].split(':')[0].split(' (')[0] in (
        'too few seeds', 'not resolvable')  # fmt: skip
    text = (out / 'results.md').read_text()
    assert '| tl_align |' in text and 'test split' in text
    assert (out / 'results.png').stat().st_size > 0
    plan = json.loads((out / 'plan.json').read_text())
    assert set(plan) == {f'{r} seed {s}' for r in ('cutmix', 'tl_align') for s in (0, 1)}
    # each seed's evaluation on the test split is kept, with the training's own val top-1 as its check
    evals = json.loads((out / 'runs' / 'tl_align' / 'seed1' / 'study_eval.json').read_text())
    assert evals['result']['images'] == 8
    capsys.readouterr()
    assert study(argv(data, out)) == 0  # the rerun: every step done
    printed = capsys.readouterr().out
    assert printed.count('done before, skipped') == 4 and 'val top-1' not in printed
    assert json.loads((out / 'results.json').read_text()) == result


def test_dry_run_prints_every_command_and_runs_none(data, tmp_path, capsys):
    out = tmp_path / 'dry'
    assert study(argv(data, out, '--dry-run')) == 0
    printed = capsys.readouterr().out.splitlines()
    commands = [shlex.split(line) for line in printed if not line.startswith('#')]
    assert len(commands) == 4 and not out.exists()
    for cmd in commands:
        assert cmd[0].endswith('tokenaug-train') and cmd[cmd.index('--data-dir') + 1] == str(data)
        assert cmd[-8:] == TRAIN[1:]
    assert ['--seed', '1', '--mixup-type', 'tl_align'] == commands[3][commands[3].index('--seed') :][:4]


def test_without_a_store_the_dry_run_shows_the_annotator_and_its_maps_first(data, tmp_path, capsys):
    out = tmp_path / 'dry'
    assert study(argv(data, out, '--dry-run', runs=('cutmix', 'mixtoken'), seeds=1)) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line for line in printed if line.startswith('#')] == ['# annotator', '# maps', '# cutmix seed 0',
                                                                  '# mixtoken seed 0']  # fmt: skip
    ann, maps, _, mixtoken = (shlex.split(line) for line in printed if not line.startswith('#'))
    assert ann[ann.index('--seed') :][:6] == ['--seed', '0', '--mixup-type', 'cutmix', '--gp', 'avg']
    assert ann[-8:] == TRAIN[1:]  # the recipe as every run has it
    # the model, its kwargs, the classes and the size that the training resolves from the config and --train-args
    assert maps[1:2] == ['generate'] and maps[maps.index('--model') + 1] == 'vit_tiny_patch16_224'
    assert maps[maps.index('--model-kwargs') + 1 :][:2] == ['img_size=112', 'global_pool=avg']
    assert maps[maps.index('--num-classes') + 1] == '4' and maps[maps.index('--topk') + 1] == '4'
    assert maps[maps.index('--input-size') + 1] == '112'
    assert maps[maps.index('--checkpoint') + 1] == str(out / 'runs' / 'annotator' / 'seed0' / 'last.pth.tar')
    assert mixtoken[mixtoken.index('--token-label-dir') + 1] == str(out / 'maps' / 'train')
    # a cluster's jobs: the annotator's first (the runs that read its maps wait for it under the study's lock)
    assert study(argv(data, out, '--emit-jobs', str(tmp_path / 'jobs.txt'), runs=('cutmix', 'mixtoken'), seeds=1)) == 0
    jobs = [shlex.split(line) for line in (tmp_path / 'jobs.txt').read_text().splitlines()]
    assert [j[j.index('--run-step') + 1] for j in jobs] == ['annotator', 'cutmix seed 0', 'mixtoken seed 0']


@pytest.mark.slow
def test_without_a_store_an_annotator_is_trained_and_its_maps_serve_the_map_runs(data, tmp_path, capsys):
    from shared_core.map_store import read_store_paths

    out = tmp_path / 'ann'
    assert study(argv(data, out, runs=('cutmix', 'mixtoken', 'tokenmix'), seeds=1)) == 0
    result = json.loads((out / 'results.json').read_text())
    assert not result['failed_or_missing'] and result['runs']['mixtoken']['values']
    assert result['runs']['tokenmix']['values'] and result['comparisons']['tokenmix']['seeds'] == [0]
    ann = json.loads((out / 'runs' / 'annotator' / 'seed0' / 'study_step.json').read_text())
    assert result['label_maps'] == dict(store=str(out / 'maps' / 'train'), annotator_val_top1=ann['top1'],
                                        trained_here=True)  # fmt: skip
    assert len(read_store_paths(out / 'maps' / 'train')) == 16  # every training image
    assert 'Label maps: an annotator trained here' in (out / 'results.md').read_text()
    for run, flag in (('mixtoken', '--token-label-dir'), ('tokenmix', '--activation-map-dir')):
        rec = json.loads((out / 'runs' / run / 'seed0' / 'study_step.json').read_text())
        assert rec['cmd'][rec['cmd'].index(flag) + 1] == str(out / 'maps' / 'train')
    capsys.readouterr()
    assert study(argv(data, out, runs=('cutmix', 'mixtoken', 'tokenmix'), seeds=1)) == 0
    printed = capsys.readouterr().out
    assert printed.count('done before, skipped') == 5 and 'maps: done before' in printed  # annotator, maps, 3 runs


@pytest.mark.slow
def test_emitted_jobs_then_collect_give_the_local_table(data, local_study, tmp_path):
    local, jobs = local_study, tmp_path / 'jobs'
    assert study(argv(data, jobs, '--emit-jobs', str(tmp_path / 'jobs.txt'), seeds=2)) == 0
    lines = (tmp_path / 'jobs.txt').read_text().splitlines()
    assert len(lines) == 4 and all('--run-step' in line for line in lines)
    for line in lines:  # what a scheduler's array job runs, one line each: the console script's main, here
        job = shlex.split(line)
        assert Path(job[0]).name == 'tokenaug-study' and Path(job[0]).is_file()
        assert study_subprocess(job[1:]) == 0  # (its trainings subprocesses: the same numbers as in process)
    assert study_subprocess(argv(data, jobs, '--collect', seeds=2)) == 0
    a, b = (json.loads((d / 'results.json').read_text()) for d in (local, jobs))
    assert a['runs'] == b['runs'] and a['comparisons'] == b['comparisons']


@pytest.mark.slow
def test_a_killed_training_resumes_to_the_uninterrupted_result(data, tmp_path, run_env, capsys):
    train = ['--train-args', '--epochs', '3', '-b', '8', '--num-classes', '4', '--workers', '0']
    whole, killed = tmp_path / 'whole', tmp_path / 'killed'
    assert study_subprocess(argv(data, whole, runs=('cutmix',), seeds=1, train=train)) == 0
    cmd = [sys.executable, '-m', 'timm_plugin.tools.study_cli', *argv(data, killed, runs=('cutmix',), seeds=1,
                                                                        train=train)]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=run_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    ckpt = killed / 'runs' / 'cutmix' / 'seed0' / 'last.pth.tar'  # the first epoch's, which a resume reads
    deadline = time.time() + 120
    while not ckpt.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert ckpt.exists() and proc.poll() is None, 'the training finished or never checkpointed before the kill'
    os.killpg(proc.pid, signal.SIGKILL)  # the study and its tokenaug-train
    proc.wait()
    assert not (killed / 'runs' / 'cutmix' / 'seed0' / 'study_step.json').exists()
    assert study_subprocess(argv(data, killed, runs=('cutmix',), seeds=1, train=train)) == 0
    # the killed study's lock: free (the kernel released it), its pid taken over and said so
    assert f'took over the lock of {killed} from pid {proc.pid}' in capsys.readouterr().out
    rec = json.loads((killed / 'runs' / 'cutmix' / 'seed0' / 'study_step.json').read_text())
    assert rec['resumed'] is True and '--resume' in (killed / 'logs' / 'cutmix_seed_0.log').read_text()
    ref = json.loads((whole / 'runs' / 'cutmix' / 'seed0' / 'study_step.json').read_text())
    assert (rec['top1'], rec['top5']) == (ref['top1'], ref['top5'])
    a, b = (json.loads((d / 'results.json').read_text())['runs'] for d in (whole, killed))
    assert a == b


@pytest.mark.slow
def test_a_failed_run_is_reported_by_name_and_never_as_a_number(data, tmp_path):
    empty = tmp_path / 'no_maps'
    empty.mkdir()
    out = tmp_path / 'failed'
    rc = study_subprocess(argv(data, out, '--label-maps', str(empty), runs=('cutmix', 'mixtoken'), seeds=1))
    assert rc == 1
    result = json.loads((out / 'results.json').read_text())
    assert result['failed_or_missing'] == ["mixtoken seed 0 (refused: tokenaug-train's error is in its log)"]
    assert result['runs']['mixtoken']['mean'] is None and result['runs']['mixtoken']['missing_seeds'] == [0]
    assert result['comparisons']['mixtoken']['verdict'] == 'no seed where both runs finished'
    text = (out / 'results.md').read_text()
    assert '| mixtoken (' in text and 'failed or missing' in text and 'Failed or not run' in text


def test_without_a_test_split_the_val_split_is_used_and_said(data, tmp_path):
    from timm_plugin.tools.study_cli import Study
    from tokenaug.tool_args import study_parser

    args = study_parser().parse_args(argv(data, tmp_path / 'o', '--test-split', 'none', runs=('cutmix',), seeds=1))
    s = Study(args, [])
    assert s.test_split is None
    text = s.markdown(s.results({'cutmix': {0: 50.0}}, []))
    assert '--test-split none' in text and "training's own final val top-1" in text


def test_the_results_say_what_the_split_can_resolve(data, tmp_path):
    """8 val images: one image is 12.5 points, more than the bound; differences of whole images that take one or two
    values are said to say little about an effect smaller than an image."""
    from timm_plugin.tools.study_cli import Study
    from tokenaug.tool_args import study_parser

    args = study_parser().parse_args(argv(data, tmp_path / 'o', '--test-split', 'none', runs=('cutmix', 'tl_align'),
                                          seeds=3))  # fmt: skip
    s = Study(args, [])
    r = s.results({'cutmix': {0: 50.0, 1: 50.0, 2: 62.5}, 'tl_align': {0: 62.5, 1: 50.0, 2: 62.5}}, [])
    assert r['resolution']['images'] == 8 and r['resolution']['image_points'] == 12.5
    c = r['comparisons']['tl_align']
    assert c['diffs'] == [12.5, 0.0, 0.0] and c['verdict'].endswith('; the split cannot resolve ±0.3 (below)')
    text = s.markdown(r)
    assert 'Resolution: one image of the 8-image evaluation split is 12.5 points of top-1, more than the bound' in text
    assert 'It would need 334 images or more (41.8x as many)' in text
    assert 'the 3 paired differences of tl_align take 2 values only (+0, +12.5' in text
    r = s.results({'cutmix': {0: 50.0, 1: 50.0, 2: 50.0}, 'tl_align': {0: 25.0, 1: 12.5, 2: 0.0}}, [])
    assert r['comparisons']['tl_align']['verdict'].startswith('resolved: worse')  # no note: it is resolved
    assert len(r['resolution']['notes']) == 1


@pytest.mark.parametrize(
    'change, message',
    [
        (lambda a: a.__setitem__(a.index('--data-dir') + 1, '/nope'), '--data-dir: /nope is not a folder'),
        (lambda a: a.extend(['--train-split', 'nowhere']), '--train-split: .*nowhere is not a folder of class'),
        (
            lambda a: a.__setitem__(a.index('-c') + 1, str(REPO / 'README.md')),
            '-c/--config: .* (does not parse as YAML|is not a tokenaug-train YAML)',
        ),
        (lambda a: a.__setitem__(a.index('--runs') + 1, 'cutmixx'), '--runs: no run named cutmixx'),
        (lambda a: a.extend(['--baseline', 'mixup']), '--baseline: mixup is not among --runs'),
        (lambda a: a.__setitem__(a.index('--seeds') + 1, '0'), '--seeds: expected >= 1, got 0'),
        (lambda a: a.extend(['--label-maps', '/nope']), '--label-maps: /nope is not a store folder'),
        (lambda a: a.extend(['--bound', 'nan']), '--bound: expected a finite number > 0, got nan'),
        (lambda a: a.__setitem__(a.index('--out') + 1, str(REPO / 'README.md')), '--out: .*README.md is a file'),
        (
            lambda a: a.__setitem__(a.index('--out') + 1, str(REPO / 'README.md' / 'study')),
            '--out: cannot make the folder .*README.md/study: .*README.md is a file',
        ),
        (lambda a: a.extend(['--bound', '-1']), '--bound: expected a finite number > 0, got -1'),
        (lambda a: a.extend(['--nproc-per-node', '0']), '--nproc-per-node: expected >= 1, got 0'),
        (lambda a: a.extend(['--train-args', '--seed', '3']), '--train-args: --seed is set by the study itself'),
        (lambda a: a.extend(['--train-args', '--output=/tmp/x']), '--train-args: --output is set by the study'),
        (lambda a: a.extend(['--train-args', '--mixup-type', 'mixup']), '--train-args: --mixup-type is set by'),
        (
            lambda a: (a.__setitem__(a.index('--runs') + 2, 'tokenmix'), a.extend(['--train-args', '--no-such'])),
            "-c/--config .* with --train-args: the recipe's command does not parse",
        ),
    ],
)
def test_bad_input_is_named(data, tmp_path, capsys, change, message):
    import re

    a = argv(data, tmp_path / 'bad', train=[])
    change(a)
    assert study(a) == 2
    assert re.search(message, capsys.readouterr().err)


def test_run_logged_runs_a_subprocess_in_the_callers_folder_and_environment(quadrant_data, tmp_path, monkeypatch):
    """The product's runner against the console script run by hand: the same exit status and output, in the
    caller's folder (a relative path) and environment; a stopping study starts nothing."""
    from timm_plugin.tools import study_cli
    from timm_plugin.tools.study_cli import BIN, run_logged

    monkeypatch.chdir(quadrant_data)
    for i, args in enumerate((['info', 'maps'], ['info', 'no_store'], ['inf0', 'maps'])):
        monkeypatch.setenv('COLUMNS', str(50 + 11 * i))  # argparse wraps to it: the child has the caller's environment
        cmd = [str(BIN / 'tokenaug-maps'), *args]
        log, own = tmp_path / f'run{i}.log', subprocess.run(cmd, capture_output=True, text=True)
        code, cpu = run_logged(cmd, log)
        assert code == own.returncode and cpu >= 0
        assert log.read_text() == f'$ {shlex.join(cmd)}\n' + own.stdout + own.stderr, args
    assert code == 2 and "invalid choice: 'inf0'" in log.read_text()
    code, _ = run_logged(['bash', '-c', 'echo "$COLUMNS"; exit 3'], tmp_path / 'bash.log')
    assert code == 3 and (tmp_path / 'bash.log').read_text().endswith('72\n')
    study_cli._STOPPING.set()
    try:
        assert run_logged(['bash', '-c', 'touch ran'], tmp_path / 'stopping.log') == (-signal.SIGTERM, 0.0)
    finally:
        study_cli._STOPPING.clear()
    assert not (quadrant_data / 'ran').exists() and 'not started' in (tmp_path / 'stopping.log').read_text()


def test_a_recipe_that_sets_a_seed_is_overridden_by_each_runs_seed_and_says_so(data, tmp_path, capsys):
    """A -c YAML with ``seed: 7``: the command line beats the YAML in tokenaug-train, so each run's own
    ``--seed s`` applies (the dry run shows it), and the study says so before it starts."""
    recipe = tmp_path / 'seeded.yaml'
    recipe.write_text(Path(CONFIG).read_text() + '\nseed: 7\n')
    a = argv(data, tmp_path / 'o', '--dry-run', train=[])
    a[a.index('-c') + 1] = str(recipe)
    assert study(a) == 0
    out, err = capsys.readouterr()
    assert "sets seed: 7; each run's own --seed (0 .. 1) overrides it" in err
    assert out.count('--seed 0') == 2 and out.count('--seed 1') == 2 and '--seed 7' not in out


@pytest.mark.slow
def test_a_copied_study_rerun_from_another_folder_retrains_nothing(data, local_study, tmp_path, monkeypatch, capsys):
    """The step keys hold no path of the study folder: a copy, rerun from elsewhere, skips every step and keeps its
    evaluations; an evaluation record cut short is evaluated again, to the same number."""
    copy = tmp_path / 'moved' / 'study'
    shutil.copytree(local_study, copy)
    record = copy / 'runs' / 'tl_align' / 'seed1' / 'study_eval.json'
    record.write_text(record.read_text()[:20])
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert study(argv(data, copy)) == 0
    printed = capsys.readouterr().out
    assert printed.count('done before, skipped') == 4 and 'val top-1' not in printed and 'moved aside' not in printed
    a, b = (json.loads((d / 'results.json').read_text()) for d in (local_study, copy))
    assert a['runs'] == b['runs'] and a['comparisons'] == b['comparisons']
    assert json.loads(record.read_text())['result']['images'] == 8


@pytest.mark.slow
def test_a_diverged_run_stops_and_is_listed_as_failed_by_name(data, tmp_path):
    """``--lr 1e30`` without warmup: the second step's loss is NaN. tokenaug-train stops with exit status 3 and a
    line naming the epoch and batch; the study lists the run as diverged, never as a number; with
    ``--allow-nonfinite-loss`` the training goes on to its end, as timm's train.py does."""
    train = [*TRAIN, '--lr', '1e30', '--warmup-epochs', '0']
    out = tmp_path / 'diverged'
    assert study(argv(data, out, runs=('cutmix',), seeds=1, train=train)) == 1
    result = json.loads((out / 'results.json').read_text())
    assert result['failed_or_missing'] == ['cutmix seed 0 (diverged: a loss was not finite)']
    assert result['runs']['cutmix']['mean'] is None
    assert 'cutmix seed 0 (diverged: a loss was not finite)' in (out / 'results.md').read_text()
    log = (out / 'logs' / 'cutmix_seed_0.log').read_text()
    assert 'tokenaug-train: diverged: the loss is nan at epoch 0, batch 1: the run diverged' in log
    cmd = json.loads((out / 'plan.json').read_text())['cutmix seed 0']['cmd']
    cmd[cmd.index('--output') + 1] = str(tmp_path / 'allowed')
    code, _ = run_in_process([*cmd, '--allow-nonfinite-loss'], tmp_path / 'allowed.log')
    assert code == 0 and json.loads((tmp_path / 'allowed' / 'seed0' / 'results.json').read_text())['final']


@pytest.mark.slow
def test_one_study_per_out_and_a_stopped_study_ends_its_trainings(data, tmp_path, run_env, capsys):
    """A study running (a subprocess, its training a subprocess of it): a second study on the same --out is refused
    with the first's pid; SIGTERM to the study alone ends its training too, records no failure, exits 143."""
    from ..helpers.processes import children

    train = ['--train-args', '--epochs', '20', '-b', '8', '--num-classes', '4', '--workers', '0']
    out = tmp_path / 'busy'
    cmd = [sys.executable, '-m', 'timm_plugin.tools.study_cli', *argv(data, out, runs=('cutmix',), seeds=1,
                                                                        train=train)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        deadline, trainings = time.time() + 120, []
        while not trainings and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
            trainings = [c for c in children(proc.pid) if 'tokenaug-train' in ' '.join(c[1])]
        assert trainings, 'the study started no training'
        capsys.readouterr()
        assert study(argv(data, out, runs=('cutmix',), seeds=1, train=train)) == 2
        assert f'--out: another tokenaug-study is running on {out} (pid {proc.pid})' in capsys.readouterr().err
        proc.send_signal(signal.SIGTERM)  # the study only, not its process group
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143 and 'stopped by signal 15' in err
    assert not Path(f'/proc/{trainings[0][0]}').exists()  # ended, and reaped by the study
    run = out / 'runs' / 'cutmix' / 'seed0'
    assert not (run / 'study_step.json').exists() and not (run / 'study_failed.json').exists()
    assert (out / 'study.lock').read_text() == ''  # released as it ended


def test_the_lock_of_an_out_folder(data, tmp_path, capsys):
    """Exclusive for a study here, shared among jobs; refused naming the holder; a dead holder's pid taken over."""
    from timm_plugin.tools.study_cli import Study, StudyError
    from tokenaug.tool_args import study_parser

    s = Study(study_parser().parse_args(argv(data, tmp_path / 'o', runs=('cutmix',), seeds=1)), [])
    held = s.lock(shared=False)
    assert (s.out / 'study.lock').read_text() == f'{os.getpid()}\n'
    for shared in (False, True):
        with pytest.raises(StudyError, match=f'another tokenaug-study is running on .* \\(pid {os.getpid()}\\)'):
            s.lock(shared)
    held.close()  # as a process killed with SIGKILL leaves it: free, with its pid
    capsys.readouterr()
    s.lock(shared=False).close()
    printed = capsys.readouterr().out
    assert f'took over the lock of {s.out} from pid {os.getpid()}, which is no longer running' in printed
    jobs = [s.lock(shared=True), s.lock(shared=True)]
    with pytest.raises(StudyError, match=r'\(its jobs \(--run-step\)\)'):
        s.lock(shared=False)
    for job in jobs:
        job.close()


def test_a_bad_recipe_is_refused_once_before_any_run(data, tmp_path, capsys):
    """A YAML key one typo from a flag, a value tokenaug-train refuses, a training split of one class, an empty val
    split, a missing --test-split: refused before anything is made, in one line."""
    typo = tmp_path / 'typo.yaml'
    typo.write_text(Path(CONFIG).read_text() + '\nmixup_typ: tl_align\n')
    bad_lr = tmp_path / 'bad_lr.yaml'
    bad_lr.write_text(Path(CONFIG).read_text().replace('lr: 1.0e-3', 'lr: .nan'))
    one = tmp_path / 'one_class'
    shutil.copytree(data / 'train' / sorted(p.name for p in (data / 'train').iterdir())[0],
                    one / 'train' / 'only')  # fmt: skip
    shutil.copytree(data / 'val', one / 'val')
    empty = tmp_path / 'empty_val'
    shutil.copytree(data / 'train', empty / 'train')
    for c in (data / 'val').iterdir():
        (empty / 'val' / c.name).mkdir(parents=True)
    cases = [
        (['-c', str(typo)], 'does not parse', 'mixup_typ: not an argument of tokenaug-train; did you mean mixup_type?'),
        (['-c', str(bad_lr)], '--lr: expected', None),
        (['--data-dir', str(one), '--test-split', 'none'], 'has images of one class only', None),
        (['--data-dir', str(empty), '--test-split', 'none'], 'the val split .* holds no images', None),
        (['--test-split', 'holdout'], 'holdout is not a folder of class folders; pass --test-split none', None),
    ]
    import re

    for change, message, argparse_said in cases:
        a = argv(data, tmp_path / 'never', runs=('cutmix', 'tl_align'))
        for flag, value in zip(change[::2], change[1::2]):
            if flag in a:
                a[a.index(flag) + 1] = value
            else:
                a[a.index('--train-args') : a.index('--train-args')] = [flag, value]
        assert study(a) == 2, change
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith('tokenaug-study: error:')]
        assert len(lines) == 1 and re.search(message, lines[0]), err
        assert argparse_said is None or argparse_said in err
        assert not (tmp_path / 'never').exists()


def test_a_short_recipe_warmup_is_said_and_installed_recipes_are_taken_by_name(data, tmp_path, capsys):
    from shared_core.configs import resolve_config_arg

    a = argv(data, tmp_path / 'o', '--dry-run', train=['--train-args', '--epochs', '2'])
    a[a.index('-c') + 1] = 'tokenaug::timm/world_vit-tiny.yaml'
    assert study(a) == 0
    out, err = capsys.readouterr()
    assert 'the recipe warms up for 1 of its 2 epochs (from lr 1e-05)' in err
    assert '--train-args --epochs 2 --warmup-epochs 0' in err
    commands = [shlex.split(line) for line in out.splitlines() if not line.startswith('#')]
    installed = str(Path(resolve_config_arg('tokenaug::timm/world_vit-tiny.yaml')).resolve())
    assert len(commands) == 4 and all(c[c.index('-c') + 1] == installed for c in commands)
    assert study(argv(data, tmp_path / 'o', '--dry-run', train=[])) == 0  # the recipe's own 4 epochs: 1 of 4
    assert 'warms up' not in capsys.readouterr().err
    a[a.index('-c') + 1] = 'tokenaug::timm/no_such.yaml'
    assert study(a) == 2 and '-c/--config: ' in capsys.readouterr().err


def test_a_training_whose_results_are_cut_short_fails_naming_the_file(tmp_path, capsys):
    """The runner returned 0 but the run's results.json is cut short: the step fails, naming the file, with the
    reason kept; it is never done."""
    from shared_core.study import Step
    from timm_plugin.tools.study_cli import train_step

    step = Step(tmp_path / 'runs' / 'cutmix' / 'seed0', ['tokenaug-train', '--experiment', 'seed0'])

    def runner(cmd, log):  # a training that wrote half its results (a full disk, a kill between two writes)
        (step.dir / 'results.json').write_text('{"final": {"top1": 5')
        return 0, 0.0

    assert train_step('cutmix seed 0', step, tmp_path / 'log', runner) is None
    printed = capsys.readouterr().out
    assert f'cutmix seed 0: FAILED ({step.dir / "results.json"} is missing or cut short)' in printed
    assert step.done() is None and 'cut short' in step.failure()['reason']
