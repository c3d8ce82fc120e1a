"""``tokenaug-study`` end to end on a small world: 2 runs x 2 seeds x 1 epoch with the table, paired intervals and
verdicts; a rerun that skips every step; ``--dry-run``; ``--emit-jobs`` then ``--collect`` giving the local table;
a training killed with SIGKILL resumed through ``tokenaug-train --resume`` to the uninterrupted run's result; a
failed run reported by name, never as a number; bad input named."""

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
from timm_plugin.tools.study_cli import main as study

from ..helpers import REPO

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
        assert study(job[1:]) == 0
    assert study(argv(data, jobs, '--collect', seeds=2)) == 0
    a, b = (json.loads((d / 'results.json').read_text()) for d in (local, jobs))
    assert a['runs'] == b['runs'] and a['comparisons'] == b['comparisons']


@pytest.mark.slow
def test_a_killed_training_resumes_to_the_uninterrupted_result(data, tmp_path, run_env):
    train = ['--train-args', '--epochs', '3', '-b', '8', '--num-classes', '4', '--workers', '0']
    whole, killed = tmp_path / 'whole', tmp_path / 'killed'
    assert study(argv(data, whole, runs=('cutmix',), seeds=1, train=train)) == 0
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
    assert study(argv(data, killed, runs=('cutmix',), seeds=1, train=train)) == 0
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
    rc = study(argv(data, out, '--label-maps', str(empty), runs=('cutmix', 'mixtoken'), seeds=1))
    assert rc == 1
    result = json.loads((out / 'results.json').read_text())
    assert result['failed_or_missing'] == ['mixtoken seed 0']
    assert result['runs']['mixtoken']['mean'] is None and result['runs']['mixtoken']['missing_seeds'] == [0]
    assert result['comparisons']['mixtoken']['verdict'] == 'no seed where both runs finished'
    text = (out / 'results.md').read_text()
    assert '| mixtoken (' in text and 'failed or missing' in text and 'Failed or not run' in text


def test_without_a_test_split_the_val_split_is_used_and_said(data, tmp_path):
    from timm_plugin.tools.study_cli import Study
    from tokenaug.tool_args import study_parser

    args = study_parser().parse_args(argv(data, tmp_path / 'o', '--test-split', 'holdout', runs=('cutmix',), seeds=1))
    s = Study(args, [])
    assert s.test_split is None
    text = s.markdown(s.results({'cutmix': {0: 50.0}}, []))
    assert 'no holdout split under --data-dir' in text and "training's own final val top-1" in text


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
            "-c/--config .* with --train-args: the annotator's command does not parse",
        ),
    ],
)
def test_bad_input_is_named(data, tmp_path, capsys, change, message):
    import re

    a = argv(data, tmp_path / 'bad', train=[])
    change(a)
    assert study(a) == 2
    assert re.search(message, capsys.readouterr().err)


def test_forked_commands_run_as_their_console_scripts_in_a_fresh_process(quadrant_data, tmp_path, monkeypatch):
    """run_logged's fork server (tokenaug-maps, tokenaug-train) against the console script as a subprocess: the
    same exit status and the same log, in the caller's folder (a relative path) and environment; a command the
    server does not run (any other program) is a subprocess; a server that died fails its command, named in the log,
    and is started again for the next."""
    from timm_plugin.tools.study_cli import BIN, _Forker, run_logged

    monkeypatch.chdir(quadrant_data)
    for i, argv in enumerate((['info', 'maps'], ['info', 'no_store'], ['inf0', 'maps'])):
        monkeypatch.setenv('COLUMNS', str(50 + 11 * i))  # argparse wraps to it: the child has the caller's environment
        cmd = [str(BIN / 'tokenaug-maps'), *argv]
        forked, own = tmp_path / f'forked{i}.log', subprocess.run(cmd, capture_output=True, text=True)
        code, cpu = run_logged(cmd, forked)
        assert code == own.returncode and cpu >= 0
        assert forked.read_text() == f'$ {shlex.join(cmd)}\n' + own.stdout + own.stderr, argv
    assert code == 2 and "invalid choice: 'inf0'" in forked.read_text()
    server = _Forker.here()
    server.proc.kill()
    server.proc.wait()
    assert server.run([str(BIN / 'tokenaug-maps'), 'info', 'maps'], tmp_path / 'killed.log') == (-9, 0.0)
    assert 'the fork server of this command ended (exit -9)' in (tmp_path / 'killed.log').read_text()
    code, _ = run_logged([str(BIN / 'tokenaug-maps'), 'info', 'maps'], tmp_path / 'after.log')
    assert code == 0 and 'classes' in (tmp_path / 'after.log').read_text()
    code, _ = run_logged(['bash', '-c', 'echo "$COLUMNS"; exit 3'], tmp_path / 'bash.log')
    assert code == 3 and (tmp_path / 'bash.log').read_text().endswith('72\n')


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
