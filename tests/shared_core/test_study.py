"""The paired-seed verdicts (``shared_core.study``): no verdict from a zero-width interval or from fewer than three
pairs, "bounded" only as an equivalence test, and a false-"resolved" rate at the nominal 5 % under a null that
top-1 on small splits gives. The resumable steps: state files cut short are not done, a changed command's folder
is moved aside (never deleted), a failure is kept with its command."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared_core.study import BOUND, MIN_PAIRS, Step, interval, paired, verdict


def test_the_two_examples_of_the_issue():
    d = paired([60.2, 61.2], [60.0, 61.0])  # every seed +0.20: a zero-width interval
    assert interval(d) == '[+0.20, +0.20]' and verdict(d).startswith('not resolvable: every seed gave the same')
    d = paired([-0.12, 0.093, 0.227, 0.333, 0.467], [0.0] * 5)  # holds 0, half-width 0.28, reaches +0.48
    assert interval(d) == '[-0.08, +0.48]' and d['half'] < BOUND
    assert verdict(d).startswith('neither resolved nor bounded')
    d = paired([1.0, 2.0], [0.0, 0.0])
    assert verdict(d) == f'too few seeds (2 pairs; a verdict needs {MIN_PAIRS})'


@settings(max_examples=300, deadline=None)
@given(diffs=st.lists(st.integers(-4, 4), min_size=2, max_size=10), step=st.sampled_from([0.1, 1.0, 12.5]))
def test_verdict_words_follow_the_rules_on_small_integer_differences(diffs, step):
    """Integer numbers of images times one image's share of top-1, as a small split gives."""
    d = paired([x * step for x in diffs], [0.0] * len(diffs))
    v = verdict(d)
    if len(set(diffs)) == 1:
        assert v.startswith('not resolvable')
    elif len(diffs) < MIN_PAIRS:
        assert v.startswith('too few seeds')
    elif v.startswith('resolved'):
        assert d['mean'] - d['half'] > 0 or d['mean'] + d['half'] < 0
    elif v.startswith('bounded'):
        assert -BOUND <= d['mean'] - d['half'] and d['mean'] + d['half'] <= BOUND
    else:
        assert v.startswith('neither') and (d['mean'] - d['half'] < -BOUND or d['mean'] + d['half'] > BOUND)


@pytest.mark.parametrize('images', [8, 20, 100])
@pytest.mark.parametrize('seeds', [3, 5, 10])
def test_a_method_without_effect_is_resolved_at_most_5_percent_of_the_time(images, seeds):
    """No true effect: each seed's two top-1 values are independent binomial counts on the same test split
    (accuracy 0.3 and 0.7), so the differences are symmetric and whole numbers of images. Over 4000 simulated
    studies (a fixed seed) the share called "resolved" stays within 5 % plus three Monte-Carlo standard errors."""
    rng = np.random.default_rng(images * 100 + seeds)
    trials = 4000
    allowed = 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)
    for accuracy in (0.3, 0.7):
        a, b = (rng.binomial(images, accuracy, size=(trials, seeds)) * 100.0 / images for _ in range(2))
        resolved = sum(verdict(paired(list(x), list(y))).startswith('resolved') for x, y in zip(a, b))
        assert resolved / trials <= allowed, (accuracy, resolved / trials)


def test_a_step_cut_short_is_not_done_and_a_changed_command_moves_the_old_folder_aside(tmp_path):
    run = tmp_path / 'runs' / 'cutmix' / 'seed0'
    a = Step(run, ['tokenaug-train', '--lr', '1e-3'])
    assert a.done() is None and not a.started() and a.start() is None
    assert a.started() and a.done() is None
    (run / 'last.pth.tar').write_bytes(b'weights')
    rec = a.finish(top1=50.0)
    assert a.done() == rec and rec['cmd'] == a.cmd
    # the same command keyed without the folder it ran in (tokenaug-study's key_cmd): the same key
    assert Step(tmp_path / 'copy', ['/elsewhere/tokenaug-train', '--lr', '1e-3'], key_cmd=a.cmd).key == a.key
    # another command: not done; starting it moves the finished run aside, whole, and says where
    b = Step(run, ['tokenaug-train', '--lr', '2e-3'])
    assert b.done() is None and not b.started()
    moved = b.start()
    assert moved == run.with_name(f'seed0.replaced-{a.key}') and (moved / 'last.pth.tar').read_bytes() == b'weights'
    assert Step(moved, a.cmd).done() == rec and b.started() and not (run / 'last.pth.tar').exists()
    # an attempt of the same command is this command's to restart: emptied in place
    (run / 'partial').write_text('x')
    assert b.start() is None and not (run / 'partial').exists() and b.started()
    # a record and a marker cut short (a kill midway through a write): not done, not started, moved aside
    b.finish(top1=1.0)
    b.record.write_text(b.record.read_text()[:9])
    b.marker.write_text('{"ke')
    assert b.done() is None and not b.started()
    again = b.start()
    assert again == run.with_name('seed0.replaced-unknown') and again.is_dir()
    assert b.start() is None  # (its own attempt now)
    c = Step(run, ['tokenaug-train', '--lr', '3e-3'])
    assert c.start() == run.with_name(f'seed0.replaced-{b.key}')  # b's attempt, under b's key
    assert c.start() is None
    d = Step(run, ['tokenaug-train', '--lr', '2e-3'])  # b's command again, over c's finished run
    c.finish(top1=2.0)
    assert d.key == b.key and d.start() == run.with_name(f'seed0.replaced-{c.key}')
    e = Step(run, ['tokenaug-train', '--lr', '3e-3'])  # over d's attempt (b's key, a name taken): numbered
    assert e.start() == run.with_name(f'seed0.replaced-{b.key}.1')


def test_a_failure_is_kept_with_its_command_until_the_step_is_done(tmp_path):
    a = Step(tmp_path / 'seed0', ['tokenaug-train', '--lr', '1e30'])
    a.start()
    a.fail(exit=3, reason='diverged: a loss was not finite')
    assert a.failure() == dict(key=a.key, exit=3, reason='diverged: a loss was not finite')
    assert Step(tmp_path / 'seed0', ['tokenaug-train', '--lr', '1e-3']).failure() is None  # another command's
    (tmp_path / 'seed0' / 'study_failed.json').write_text('{"key": "')  # cut short: no failure on record
    assert a.failure() is None
    a.fail(exit=1, reason='exit 1')
    a.finish(top1=3.0)
    assert a.failure() is None  # done since
