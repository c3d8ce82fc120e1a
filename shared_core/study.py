"""Paired-seed studies, framework-free: resumable steps that keep their command, the paired statistics of a method
against its baseline over seeds (mean, Student-t interval), the verdict words, and the results page.

Used by ``tokenaug-study`` (:mod:`timm_plugin.tools.study_cli`) and the bench studies (``bench/study.py``,
``bench/study_size.py``).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Sequence

__all__ = [
    'Step',
    'mean_sd',
    't_quantile',
    'paired',
    'interval',
    'excludes_zero',
    'verdict',
    'same_difference',
    'BOUND',
    'MIN_PAIRS',
    'image_points',
    'resolution',
    'read_json',
    'write_json',
]

#: the bound of the equivalence verdict: an interval inside ``[−BOUND, +BOUND]`` is "bounded" (points of top-1)
BOUND = 0.3


def t_quantile(df: int) -> float:
    """Student's t 0.975 quantile with ``df`` degrees of freedom (a two-sided 95 % interval)."""
    from scipy.stats import t

    return float(t.ppf(0.975, df))


def mean_sd(values: Sequence[float]) -> tuple:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def paired(method: Sequence[float], baseline: Sequence[float]) -> dict:
    """The paired difference method - baseline over seeds: mean, sample sd, 95 % t half-width (nan for one seed)
    and whether the interval excludes 0."""
    if len(method) != len(baseline):
        raise ValueError(
            f'paired: method and baseline need one value per seed each, got {len(method)} and {len(baseline)}'
        )
    diffs = [m - b for m, b in zip(method, baseline)]
    mean, sd = mean_sd(diffs)
    half = t_quantile(len(diffs) - 1) * sd / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
    return dict(diffs=diffs, mean=mean, sd=sd, half=half, excludes_zero=bool(abs(mean) > half))


def interval(d: dict, digits: int = 2) -> str:
    """A :func:`paired` difference's 95 % interval as ``[lo, hi]``; ``n/a (1 seed)`` where one seed gives none."""
    if len(d['diffs']) < 2:
        return 'n/a (1 seed)'
    return f'[{d["mean"] - d["half"]:+.{digits}f}, {d["mean"] + d["half"]:+.{digits}f}]'


def excludes_zero(d: dict) -> str:
    """A table cell: does a :func:`paired` difference's interval exclude 0 (``n/a`` for one seed)?"""
    return 'n/a' if len(d['diffs']) < 2 else 'yes' if d['excludes_zero'] else 'no'


#: the fewest complete pairs a verdict word is given for (below: the interval only, "too few seeds")
MIN_PAIRS = 3


def same_difference(d: dict) -> bool:
    """Whether every seed of a :func:`paired` difference gave the same difference (a spread of 0, up to float
    rounding): its interval has zero width and says nothing about the seed-to-seed noise."""
    return len(d['diffs']) > 1 and d['sd'] <= 1e-9 * max(1.0, abs(d['mean']))


def verdict(d: dict, bound: float = BOUND) -> str:
    """The verdict on a :func:`paired` difference:

    - ``resolved: better / worse`` where the 95 % interval excludes 0;
    - ``bounded within ±bound`` where the whole interval lies inside ``[−bound, +bound]`` (an equivalence test:
      whatever the effect, it is smaller than ``bound``);
    - ``neither resolved nor bounded`` otherwise.

    None of these for a set of differences that cannot carry one: one seed (``n/a``), every seed the same
    difference (``not resolvable``: no spread to weigh it against), or fewer than :data:`MIN_PAIRS` pairs (``too
    few seeds``; the interval is still printed)."""
    n = len(d['diffs'])
    if n < 2:
        return 'n/a (1 seed)'
    if same_difference(d):
        return 'not resolvable: every seed gave the same difference, so there is no spread to weigh it against'
    if n < MIN_PAIRS:
        return f'too few seeds ({n} pairs; a verdict needs {MIN_PAIRS})'
    if d['excludes_zero']:
        return f'resolved: {"better" if d["mean"] > 0 else "worse"} (the interval excludes 0)'
    lo, hi = d['mean'] - d['half'], d['mean'] + d['half']
    if -bound <= lo and hi <= bound:
        return f'bounded within ±{bound:g}: the whole interval lies inside [{-bound:g}, +{bound:g}]'
    return f'neither resolved nor bounded: the interval includes 0 and reaches beyond ±{bound:g}'


def image_points(images: int) -> float:
    """One image of an ``images``-image split in points of top-1: the step every paired difference moves by."""
    return 100 / images


def resolution(images: int, bound: float, comparisons: dict) -> dict:
    """What the evaluation split can resolve: one image is ``100 / images`` points of top-1, and every paired
    difference is a whole number of images apart. Notes where one image is more than the bound (no effect smaller
    than the bound can show: the split would need ``ceil(100 / bound)`` images) and where a comparison's
    differences take 2 values or fewer over 3 seeds or more (the interval then mostly counts images)."""
    step = image_points(images)
    notes = []
    if step > bound:
        need = math.ceil(100 / bound)
        notes.append(
            f'one image of the {images}-image evaluation split is {step:.3g} point{"s" * (step != 1)} of top-1, more '
            f'than the bound ±{bound:g}: this split cannot resolve or bound effects of that size. It would need '
            f'{need} images or more ({need / images:.1f}x as many), or a larger --bound.'
        )
    for run, c in comparisons.items():
        distinct = sorted({round(x * images / 100) for x in c.get('diffs', ())})
        if len(c.get('diffs', ())) >= MIN_PAIRS and len(distinct) <= 2:
            values = ', '.join(f'{v * step:+.3g}' for v in distinct)
            notes.append(
                f'the {len(c["diffs"])} paired differences of {run} take {len(distinct)} value'
                f'{"s" if len(distinct) > 1 else ""} only ({values}: whole images of {step:.3g} '
                f'point{"s" * (step != 1)}), so its interval says little about an effect smaller than an image.'
            )
    return dict(images=images, image_points=step, notes=notes)


class Step:
    """One resumable step: done when ``dir/study_step.json`` records the same key (the command and its inputs'
    keys). A rerun skips a done step and runs again one whose command changed, after moving the old folder aside
    (:meth:`start`: nothing a key mismatch alone condemns is deleted).

    ``key_cmd`` is the command as keyed, where it differs from the command run: ``tokenaug-study`` keys its steps
    with the study folder and the programs' folder written as placeholders, so that a study folder moved or copied
    keeps its finished steps."""

    def __init__(self, directory: Path, cmd: list, inputs: Sequence[str] = (), key_cmd: Optional[list] = None):
        self.dir = Path(directory)
        self.cmd = [str(c) for c in cmd]
        keyed = self.cmd if key_cmd is None else [str(c) for c in key_cmd]
        self.key = hashlib.sha256(json.dumps([keyed, list(inputs)]).encode()).hexdigest()[:16]

    @property
    def record(self) -> Path:
        return self.dir / 'study_step.json'

    @property
    def marker(self) -> Path:
        return self.dir / 'study_started.json'

    def done(self) -> Optional[dict]:
        """The step's record if it finished with this key, else ``None`` (a record cut short is not done)."""
        rec = read_json(self.record)
        return rec if rec is not None and rec.get('key') == self.key else None

    def started(self) -> bool:
        """Whether an attempt of this same command began here and did not finish (its marker holds this key):
        what it left may be resumed. A marker cut short is no attempt of this command."""
        mark = read_json(self.marker)
        return mark is not None and mark.get('key') == self.key

    def start(self) -> Optional[Path]:
        """A fresh attempt: the folder emptied, then marked with this key (:meth:`started`). Only what an attempt
        of this same command left is removed; a folder that holds anything else (another command's run, a marker
        or record cut short, files of unknown origin) is moved aside to ``DIR.replaced-KEY`` and that path
        returned."""
        moved = None
        if self.dir.exists():
            if self.started():
                shutil.rmtree(self.dir)
            else:
                old = (read_json(self.record) or read_json(self.marker) or {}).get('key') or 'unknown'
                base = self.dir.with_name(f'{self.dir.name}.replaced-{old}')
                moved = next(p for p in (Path(f'{base}{f".{i}" if i else ""}') for i in range(10**6)) if not p.exists())
                self.dir.rename(moved)
        self.dir.mkdir(parents=True)
        self.marker.write_text(json.dumps(dict(key=self.key)) + '\n')
        return moved

    def finish(self, **result) -> dict:
        """Write the record (atomically: a kill leaves the old one or none)."""
        rec = dict(key=self.key, cmd=self.cmd, **result)
        write_json(self.record, rec)
        return rec

    def fail(self, **why) -> None:
        """Record that this command's attempt failed (``study_failed.json``, with the key): :meth:`failure` reads
        it back, so that a later collection names the reason."""
        write_json(self.dir / 'study_failed.json', dict(key=self.key, **why))

    def failure(self) -> Optional[dict]:
        """What :meth:`fail` recorded for this command, if it is the last word on it (no record since)."""
        rec = read_json(self.dir / 'study_failed.json')
        return rec if rec is not None and rec.get('key') == self.key and self.done() is None else None


def read_json(path: Path) -> Optional[dict]:
    """A JSON object file, or ``None`` where there is none or it is cut short (a kill midway through a write)."""
    try:
        value = json.loads(Path(path).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def write_json(path: Path, value) -> None:
    """Write a JSON file atomically (a kill leaves the old file or none)."""
    path = Path(path)
    tmp = path.with_name(path.name + '.tmp')
    tmp.write_text(json.dumps(value, indent=1) + '\n')
    tmp.replace(path)


def summary(values: Dict[int, float]) -> dict:
    """``{seed: top-1}`` -> mean, sd and the seeds in order."""
    seeds = sorted(values)
    m, sd = mean_sd([values[s] for s in seeds])
    return dict(mean=m, sd=sd, seeds=seeds, values=[values[s] for s in seeds])


def complete_pairs(method: Dict[int, float], baseline: Dict[int, float]) -> List[int]:
    """The seeds both runs finished."""
    return sorted(set(method) & set(baseline))
