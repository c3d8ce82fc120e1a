"""``tokenaug-study``: does a method help on *my* data? Paired seeds and 95 % intervals on any ImageFolder.

Each run (``--runs``) trains once per seed with the same recipe (``-c``, a ``tokenaug-train`` YAML): one
``tokenaug-train`` command with ``--seed s`` and the run's flags. The final checkpoints are evaluated on the test
split (:mod:`timm_plugin.tools.study_eval`: the model as the training built it, checked against the training's own
final val top-1), or, without a test split, the training's own final val top-1 is used and the results say so.
Each method is compared with ``--baseline`` seed by seed (same seed: same data order, same initialisation draw):
the mean and the 95 % Student-t interval of the paired differences, and a verdict (resolved better / worse,
bounded within ``±--bound`` where the whole interval lies inside it, or neither; not resolvable where every seed
gave the same difference; no verdict word below 3 paired seeds).

The runs that read label maps (``tokenmix``, ``mixtoken``) take a store (``--label-maps``), or, without one, the
study trains an annotator from the same recipe (seed 0, MixUp/CutMix with average pooling, so its head reads every
token, as the bench study does) and writes its maps of the training split with ``tokenaug-maps generate``: two
more steps, ``annotator`` and ``maps``, that every run reading the maps waits for.

Each training and the maps run as a subprocess in the study's process group (:func:`run_logged`); a SIGTERM or
SIGINT to the study ends them and exits (a rerun resumes). One study runs per ``--out`` (``OUT/study.lock``).

Every step keeps its command (:class:`shared_core.study.Step`), keyed without the study folder's path, so that a
folder moved or copied keeps its finished steps: a rerun skips the steps that are done and runs again a step whose
command changed, after moving its old folder aside; an interrupted training resumes through ``tokenaug-train
--resume``. A failed run is reported by name, with its reason (a diverged loss, a refusal), and never becomes a
number in the table. The recipe is checked once before any run starts (the first command parsed as
``tokenaug-train`` parses it, the splits, the warmup against the epochs), and the results say what the evaluation
split can resolve (one image in points of top-1). ``--dry-run`` prints the commands, ``--parallel P`` runs P at
once, ``--launcher torchrun`` runs each under torchrun, ``--emit-jobs FILE`` writes one job per line for a cluster
scheduler and ``--collect`` tabulates what the jobs wrote.

Writes ``OUT/results.md``, ``OUT/results.json`` and ``OUT/results.png`` (the paired differences with their
intervals), ``OUT/plan.json`` (every step's command) and ``OUT/logs/``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from shared_core.configs import resolve_config_arg
from shared_core.map_store import read_store_paths
from shared_core.study import (
    MIN_PAIRS,
    Step,
    complete_pairs,
    image_points,
    interval,
    paired,
    read_json,
    resolution,
    summary,
    verdict,
    write_json,
)
from tokenaug.tool_args import STUDY_RUNS, study_parser
from tokenaug.train_args import DIVERGED

__all__ = [
    'main', 'StudyError', 'Study', 'command_step', 'train_step', 'run_logged', 'stop_commands', 'portable_cmd',
    'OutputError', 'FAILURES',
]  # fmt: skip

BIN = Path(sys.executable).parent


class StudyError(ValueError):
    """Bad input to ``tokenaug-study``, named."""


def _split_ok(root: Path, split: str) -> bool:
    folder = root / split
    return folder.is_dir() and any(p.is_dir() for p in folder.iterdir())


def _images(folder: Path) -> int:
    """The images under one class folder, as timm's folder reader finds them (its extensions, any depth)."""
    from timm.data.readers.img_extensions import get_img_extensions

    suffixes = get_img_extensions(as_set=True)
    return sum(1 for p in folder.rglob('*') if p.suffix.lower() in suffixes and p.is_file())


#: the commands running now (one :class:`subprocess.Popen` each) and whether the study is stopping: a SIGTERM or
#: SIGINT to the study ends them (:func:`stop_commands`) and starts no more
_LIVE: set = set()
_LIVE_LOCK = threading.Lock()
_STOPPING = threading.Event()


def run_logged(cmd: list, log: Path) -> tuple:
    """Run ``cmd`` as a subprocess in the study's process group, its output appended to ``log`` (after the command
    line): ``(exit code, CPU seconds)``, the CPU time of the command and the children it waited for, whatever else
    runs beside it. A study that is stopping (:func:`stop_commands`) starts nothing: ``(-SIGTERM, 0.0)``."""
    with open(log, 'a') as f:
        f.write(f'$ {shlex.join(str(c) for c in cmd)}\n')
        f.flush()
        with _LIVE_LOCK:
            if _STOPPING.is_set():
                f.write('not started: the study is stopping\n')
                return -signal.SIGTERM, 0.0
            proc = subprocess.Popen([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT)
            _LIVE.add(proc)
        if _STOPPING.is_set():  # the handler ran before the command was in _LIVE
            _terminate(proc)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(proc)
        return os.waitstatus_to_exitcode(status), round(usage.ru_utime + usage.ru_stime, 1)


def stop_commands(signum, frame=None) -> None:
    """The study's SIGTERM / SIGINT handler: no command starts from now on (:func:`run_logged`), and every running
    one is sent SIGTERM (``tokenaug-train`` ends at once; torchrun passes it to its workers). The study then ends
    what it was doing, writes nothing as failed, and exits with ``128 + signum`` (:func:`main`)."""
    _STOPPING.set()
    _STOPPING.signum = signum
    for proc in list(_LIVE):  # (no lock: the handler may run while this thread holds it)
        _terminate(proc)


def _terminate(proc: subprocess.Popen) -> None:
    """SIGTERM to a command that its thread waits for (not ``Popen.terminate``, whose poll could reap it first)."""
    try:
        os.kill(proc.pid, signal.SIGTERM)
    except ProcessLookupError:  # ended meanwhile
        pass


#: why a training failed, by its exit status (else: its exit status, and its log)
FAILURES = {DIVERGED: 'diverged: a loss was not finite', 2: "refused: tokenaug-train's error is in its log"}


class OutputError(Exception):
    """What a step's command wrote is missing or cut short (raised by a ``collect`` of :func:`command_step`)."""


def command_step(
    name: str, step: Step, log: Path, runner=run_logged, *, resume=None, collect=None, failures=None, said=None
) -> dict | None:
    """One step that runs one command (a training, the maps, a bench preset's world or evaluation): its record if
    it is done; else the command runs, from scratch, or resumed where ``resume(step)`` gives the command that
    continues what an interrupted attempt of the same command left (``None``: start afresh). ``collect()`` then
    reads what the command wrote, a dict kept in the record with the wall and CPU seconds; it raises
    :class:`OutputError` where that is missing or cut short. ``None`` if the command failed (the reason kept with
    the step, :meth:`Step.fail`, by its exit status in ``failures`` where it is named there, and the log named)
    or the study is stopping. ``runner(cmd, log)`` runs the command (:func:`run_logged`); ``said(record)`` is the
    line printed when it is done."""
    rec = step.done()
    if rec is not None:
        print(f'  {name}: done before, skipped', flush=True)
        return rec
    cmd = resume(step) if resume is not None and step.started() else None
    if cmd is None:
        moved = step.start()
        if moved is not None:
            print(f"  {name}: its folder held another command's output, moved aside to {moved}", flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    t = time.time()
    rc, cpu = runner(step.cmd if cmd is None else cmd, log)
    if _STOPPING.is_set():
        print(f'  {name}: stopped (a rerun resumes it)', flush=True)
        return None
    why, result = (failures or {}).get(rc, f'exit {rc}') if rc else None, {}
    if why is None and collect is not None:
        try:
            result = collect()
        except OutputError as e:
            why = str(e)
    if why is not None:
        step.fail(exit=rc, reason=why)
        print(f'  {name}: FAILED ({why}); see {log}', flush=True)
        return None
    rec = step.finish(**result, secs=round(time.time() - t, 1), cpu_secs=cpu, resumed=cmd is not None)
    line = said(rec) if said is not None else ', '.join(f'{k} {v}' for k, v in result.items())
    print(f'  {name}: {line}{" (resumed)" if cmd is not None else ""} ({rec["secs"]:.0f} s)', flush=True)
    return rec


def train_step(name: str, step: Step, log: Path, runner=run_logged) -> dict | None:
    """One ``tokenaug-train`` step (:func:`command_step`): resumed (``--resume``) where an interrupted attempt of
    the same command left a checkpoint; its record keeps the final val top-1/top-5 of the run's ``results.json``.
    ``None`` if the training failed (a diverged loss, a refusal, its results missing or cut short)."""
    last, results = step.dir / 'last.pth.tar', step.dir / 'results.json'

    def resume(step):
        if not last.is_file():
            return None
        cmd = list(step.cmd)
        i = cmd.index('--experiment') + 2
        cmd[i:i] = ['--resume', str(last)]
        return cmd

    def collect():
        try:
            final = json.loads(results.read_text())['final']
            return dict(top1=final['top1'], top5=final['top5'])
        except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
            raise OutputError(f'{results} is missing or cut short') from None

    return command_step(
        name, step, log, runner, resume=resume, collect=collect, failures=FAILURES,
        said=lambda rec: f'val top-1 {rec["top1"]}',
    )  # fmt: skip


def portable_cmd(cmd: list, out: Path, named: dict | None = None) -> list:
    """A command as a step's key holds it: the study folder ``out`` as ``{out}``, the programs of this environment
    by name (``python``, ``tokenaug-train``), ``NAME=PATH`` settings likewise, and ``named`` arguments by the names
    given (the recipe by its values), so that a study folder moved or copied, or a new environment, keeps its
    finished steps."""
    out, named = str(out), named or {}

    def portable(c) -> str:
        c = str(c)
        if c in named:
            return named[c]
        if c == sys.executable:
            return 'python'
        if Path(c).parent == BIN:
            return Path(c).name
        if c == out or c.startswith(out + os.sep):
            return '{out}' + c[len(out) :]
        name, eq, value = c.partition('=')  # NAME=PATH (an environment setting, a kwarg)
        return f'{name}={portable(value)}' if eq and value and not name.startswith('-') else c

    return [portable(c) for c in cmd]


class Study:
    """The plan of one study (validated arguments, one step per run and seed) and what it does with them.
    ``runner(cmd, log)`` runs each command (:func:`run_logged`, a subprocess; the tests inject one that runs the
    command in their process)."""

    def __init__(self, args, argv=None, runner=run_logged):
        self.args = args
        self.argv = list(sys.argv[1:] if argv is None else argv)
        self.runner = runner
        self.data = Path(args.data_dir).resolve()
        if not self.data.is_dir():
            raise StudyError(f'--data-dir: {self.data} is not a folder')
        for flag, split in (('--train-split', args.train_split), ('--val-split', args.val_split)):
            if not _split_ok(self.data, split):
                raise StudyError(f'{flag}: {self.data / split} is not a folder of class folders')
        self.test_split = None if args.test_split == 'none' else args.test_split
        if self.test_split is not None and not _split_ok(self.data, self.test_split):
            raise StudyError(
                f'--test-split: {self.data / self.test_split} is not a folder of class folders; pass --test-split '
                "none to compare the trainings' own final val top-1 instead"
            )
        try:  # a path, or tokenaug::timm/NAME.yaml, as tokenaug-train -c takes it
            self.config = Path(resolve_config_arg(args.config)).resolve()
        except (ValueError, FileNotFoundError) as e:  # (an unknown or ambiguous installed name)
            raise StudyError(f'-c/--config: {e}') from None
        try:
            cfg = yaml.safe_load(self.config.read_text())
        except FileNotFoundError:
            raise StudyError(f'-c/--config: {self.config} does not exist') from None
        except yaml.YAMLError as e:
            raise StudyError(f'-c/--config: {self.config} does not parse as YAML: {str(e).splitlines()[0]}') from None
        if not isinstance(cfg, dict):
            raise StudyError(f'-c/--config: {self.config} is not a tokenaug-train YAML of key: value lines')
        # the recipe's values, not its bytes: an edited comment keeps the finished steps, an edited value does not
        self.recipe_key = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]
        unknown = [r for r in args.runs if r not in STUDY_RUNS]
        if unknown:
            raise StudyError(f'--runs: no run named {", ".join(unknown)} (runs: {", ".join(STUDY_RUNS)})')
        if len(set(args.runs)) != len(args.runs):
            raise StudyError(f'--runs: a run named twice in {" ".join(args.runs)}')
        if args.baseline not in args.runs:
            raise StudyError(f'--baseline: {args.baseline} is not among --runs {" ".join(args.runs)}')
        if args.seeds < 1:
            raise StudyError(f'--seeds: expected >= 1, got {args.seeds}')
        if args.parallel < 1:
            raise StudyError(f'--parallel: expected >= 1, got {args.parallel}')
        if args.nproc_per_node < 1:
            raise StudyError(f'--nproc-per-node: expected >= 1, got {args.nproc_per_node}')
        if not (math.isfinite(args.bound) and args.bound > 0):
            raise StudyError(f'--bound: expected a finite number > 0, got {args.bound}')
        # the flags the study sets on every run itself: given again, the later one would win and every "seed" train
        # the same model, or the runs write over each other
        own = {'--seed', '--output', '--experiment', '--resume', '--data-dir', '--train-split', '--val-split', '-c'}
        own |= {'--config'} | {f for r in args.runs for f in STUDY_RUNS[r][1] if f.startswith('-')}
        given = sorted({str(t).split('=')[0] for t in args.train_args} & own)
        if given:
            raise StudyError(
                f'--train-args: {", ".join(given)} is set by the study itself for every run (the seed, the run '
                "folder, the data and the runs' method flags); leave it out"
            )
        if 'seed' in cfg:
            print(
                f"tokenaug-study: -c/--config sets seed: {cfg['seed']}; each run's own --seed (0 .. {args.seeds - 1}) "
                'overrides it',
                file=sys.stderr,
            )
        if args.label_maps and not Path(args.label_maps).is_dir():
            raise StudyError(f'--label-maps: {args.label_maps} is not a store folder')
        self.out = Path(args.out).resolve()
        if self.out.exists() and not self.out.is_dir():
            raise StudyError(f'--out: {args.out} is a file; give a folder for the study (new or one to resume)')
        there = next(p for p in (self.out, *self.out.parents) if p.exists())  # what exists of it (nothing made yet)
        if not there.is_dir():
            raise StudyError(f'--out: cannot make the folder {args.out}: {there} is a file')
        if not os.access(there, os.W_OK | os.X_OK):
            raise StudyError(f'--out: {there} is not writable, so the study cannot write {args.out}')
        self.seeds = list(range(args.seeds))
        #: the recipe as every run has it (``-c`` with the study's ``--train-args``), parsed once as ``tokenaug-train``
        #: parses it (:meth:`check_recipe`): the annotator's model, classes and input size are read from it
        self.recipe = self._parse(self._train_cmd(self.out / 'runs' / 'recipe', 0, []), 'the recipe')
        self.check_recipe()
        #: the annotator and its maps (``{'annotator': Step, 'maps': Step}``) where a run reads maps and no
        #: --label-maps store is given; else empty
        self.prep: dict = {}
        self._prepared = None
        self.maps = Path(args.label_maps).resolve() if args.label_maps else None
        if any(self.reads_maps(r) for r in args.runs) and self.maps is None:
            self.maps = self.out / 'maps' / 'train'
            self.prep = self._annotator_steps()
        # seed by seed: a study stopped midway leaves whole pairs of the seeds it finished
        self.steps = {f'{run} seed {s}': self._step(run, s) for s in self.seeds for run in args.runs}
        #: the steps this process ran, and those it found done before (trainings, maps and evaluations, by name)
        self.ran: list = []
        self.skipped: list = []

    def check_recipe(self) -> None:
        """A recipe that cannot train, refused once before any run starts: its command parsed and checked as
        ``tokenaug-train`` would (a YAML key one typo from a flag, a bad flag or value), its splits each holding
        images, the training split at least 2 classes; and a warning where the recipe's warmup is not well below its
        epochs (a short study would spend its runs warming up)."""
        t = self.recipe
        from tokenaug.train_args import check_numbers, check_supported

        try:
            check_supported(t)
            check_numbers(t)
        except ValueError as e:
            raise StudyError(f'-c/--config {self.config} with --train-args: {e}') from None
        splits = [self.args.train_split, self.args.val_split] + ([self.test_split] if self.test_split else [])
        for split in splits:
            classes = {c.name: _images(c) for c in (self.data / split).iterdir() if c.is_dir()}
            if not any(classes.values()):
                raise StudyError(f'--data-dir: the {split} split ({self.data / split}) holds no images')
            if split == self.args.train_split and sum(1 for n in classes.values() if n) < 2:
                raise StudyError(
                    f'--data-dir: the {split} split ({self.data / split}) has images of one class only: nothing to '
                    'classify'
                )
        warmup = t.warmup_epochs if t.sched not in (None, 'none') and t.warmup_lr is not None else 0
        if warmup and warmup * 4 > t.epochs:
            print(
                f'tokenaug-study: warning: the recipe warms up for {warmup} of its {t.epochs} epochs (from lr '
                f'{t.warmup_lr:g}): a large share of every run trains at a low learning rate. For a short study, '
                f'shorten the warmup with the epochs, e.g. --train-args --epochs {t.epochs} --warmup-epochs '
                f'{max(0, t.epochs // 10)}',
                file=sys.stderr,
            )

    def _parse(self, cmd: list, what: str):
        """A ``tokenaug-train`` command (the program, then its flags) as ``tokenaug-train`` parses it."""
        from tokenaug.train_args import parse_args

        i = next(i for i, c in enumerate(cmd) if str(c) == '-c')
        try:
            return parse_args([str(a) for a in cmd[i:]], prog='tokenaug-train')
        except SystemExit:  # argparse has printed what it refuses
            raise StudyError(f"-c/--config {self.config} with --train-args: {what}'s command does not parse") from None

    def keyed(self, cmd: list) -> list:
        """A command as its step's key holds it (:func:`portable_cmd`), the recipe by its values: an edited recipe
        runs the steps again, an edited comment does not."""
        return portable_cmd(cmd, self.out, {str(self.config): f'recipe:{self.recipe_key}'})

    def lock(self, shared: bool):
        """One study per ``--out``: a lock on ``OUT/study.lock`` for the whole run, exclusive for a study run here
        (or its ``--collect``), shared among the jobs of ``--emit-jobs`` (``--run-step``). A held lock is refused
        with its holder's pid; one a dead process left is taken over, and said so. Returns the open lock file
        (closing it releases the lock)."""
        self.out.mkdir(parents=True, exist_ok=True)
        f = open(self.out / 'study.lock', 'a+')
        try:
            fcntl.flock(f, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip()
            f.close()
            who = f'pid {holder}' if holder else 'its jobs (--run-step)'
            raise StudyError(
                f'--out: another tokenaug-study is running on {self.out} ({who}); wait for it to end, or stop it'
            ) from None
        f.seek(0)
        left = f.read().strip()  # only a study that holds the lock alone writes its pid: one found now is a dead one's
        if left:
            print(f'tokenaug-study: took over the lock of {self.out} from pid {left}, which is no longer running')
        f.seek(0)
        f.truncate()
        if not shared:
            f.write(f'{os.getpid()}\n')
        f.flush()
        return f

    @staticmethod
    def reads_maps(run: str) -> bool:
        return 'MAPS' in STUDY_RUNS[run][1]

    def _train_cmd(self, out: Path, seed: int, flags: list) -> list:
        """One ``tokenaug-train`` command of the recipe (``out/seed{seed}`` its run folder)."""
        a = self.args
        train = [str(BIN / 'tokenaug-train')]
        if a.launcher == 'torchrun':
            train = [sys.executable, '-m', 'torch.distributed.run', '--nproc-per-node', str(a.nproc_per_node), *train]
        cmd = train + ['-c', self.config, '--data-dir', self.data, '--train-split', a.train_split]
        cmd += ['--val-split', a.val_split, '--seed', seed, *flags, '--output', out, '--experiment', f'seed{seed}']
        return cmd + list(a.train_args)

    def _step(self, run: str, seed: int) -> Step:
        flags = [str(self.maps) if f == 'MAPS' else f for f in STUDY_RUNS[run][1]]
        out = self.out / 'runs' / run
        inputs = [self.prep['maps'].key] if self.prep and self.reads_maps(run) else []
        return self._make_step(out / f'seed{seed}', self._train_cmd(out, seed, flags), inputs)

    def _make_step(self, directory: Path, cmd: list, inputs=()) -> Step:
        return Step(directory, cmd, inputs, key_cmd=self.keyed(cmd))

    def _annotator_steps(self) -> dict:
        """The annotator (the recipe at seed 0 with MixUp/CutMix and average pooling) and the ``tokenaug-maps
        generate`` command of its maps of the training split, with the model, its kwargs, the classes and the input
        size the training resolves from the config and ``--train-args`` (:attr:`recipe`)."""
        ann = self._train_cmd(self.out / 'runs' / 'annotator', 0, ['--mixup-type', 'cutmix', '--gp', 'avg'])
        t = self.recipe
        # the input size as the training's data: --input-size, --img-size, the model's img_size kwarg, its default
        size = t.input_size[1:] if t.input_size else t.img_size or t.model_kwargs.get('img_size')
        if size is None:
            import timm

            size = (
                (timm.get_pretrained_cfg_value(t.model, 'input_size') or [None])[1:] if timm.is_model(t.model) else []
            )
        if not size:
            raise StudyError(
                f'-c/--config: no input size for the annotator {t.model}: set img_size or pass --label-maps'
            )
        size = [size] if isinstance(size, int) else list(size)
        kwargs = [f'{k}={v if isinstance(v, str) else json.dumps(v)}' for k, v in t.model_kwargs.items()]
        maps = [BIN / 'tokenaug-maps', 'generate', '--data-dir', self.data, '--split', self.args.train_split]
        maps += ['--model', t.model, '--model-kwargs', *kwargs, 'global_pool=avg']
        maps += ['--num-classes', t.num_classes] if t.num_classes else []  # else the checkpoint's
        maps += ['--checkpoint', self.out / 'runs' / 'annotator' / 'seed0' / 'last.pth.tar']
        topk = min(5, t.num_classes or 5)  # the paper's top-5, or every class of a smaller problem
        maps += ['--input-size', *size, '--topk', topk, '--out', self.maps, '-j', t.workers, '--no-progress']
        ann_step = self._make_step(self.out / 'runs' / 'annotator' / 'seed0', ann)
        # the store's folder is the tool's own (it refuses a non-empty one): the step's record sits above it
        return dict(annotator=ann_step, maps=self._make_step(self.maps.parent, maps, [ann_step.key]))

    # ---------------------------------------------------------------------------------------------- running

    def write_plan(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        plan = {name: dict(cmd=s.cmd, dir=str(s.dir), key=s.key) for name, s in self.all_steps().items()}
        (self.out / 'plan.json').write_text(json.dumps(plan, indent=1) + '\n')

    def all_steps(self) -> dict:
        """Every step by name, the annotator and its maps first."""
        return {**self.prep, **self.steps}

    def run_step(self, name: str) -> bool:
        """One step of the plan (``annotator``: the annotator and its maps); a run that reads the maps first
        waits for them (building them if no one has). Returns whether it is done."""
        if _STOPPING.is_set():
            return False
        if name == 'annotator' or (self.prep and self.reads_maps(name.rsplit(' seed ', 1)[0])):
            if not self.prepare():
                if name != 'annotator' and not _STOPPING.is_set():
                    print(f'  {name}: FAILED (no label maps: the annotator or its maps failed)', flush=True)
                return False
            if name == 'annotator':
                return True
        return self._train(name, self.steps[name])

    def prepare(self) -> bool:
        """The annotator and its maps, once: under a lock, so that jobs started together wait for one another."""
        if self._prepared is None:  # once per process: a failure is not tried again by every run that waits
            self.out.mkdir(parents=True, exist_ok=True)
            with open(self.out / 'maps.lock', 'w') as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                self._prepared = self._train('annotator', self.prep['annotator']) and self._make_maps(self.prep['maps'])
        return self._prepared

    def _log(self, name: str) -> Path:
        logs = self.out / 'logs'
        logs.mkdir(parents=True, exist_ok=True)
        return logs / f'{name.replace(" ", "_")}.log'

    def _make_maps(self, step: Step) -> bool:
        """``tokenaug-maps generate`` unless done; an interrupted attempt of the same command resumes (``--resume``
        checks that the store is the same run's). The store's folder is under the step's: an attempt started afresh
        takes an earlier attempt's store with it."""

        def collect():
            try:
                return dict(images=len(read_store_paths(self.maps)))
            except (FileNotFoundError, KeyError, ValueError) as e:
                raise OutputError(f'the store {self.maps} is missing or cut short: {e}') from None

        def resume(step):
            return step.cmd + ['--resume'] if self.maps.is_dir() else None

        def run():
            return command_step(
                'maps',
                step,
                self._log('maps'),
                self.runner,
                resume=resume,
                collect=collect,
                said=lambda rec: str(self.maps),
            )

        return self._counted('maps', step, run) is not None

    def _train(self, name: str, step: Step) -> bool:
        return self._counted(name, step, lambda: train_step(name, step, self._log(name), self.runner)) is not None

    def _counted(self, name: str, step: Step, run) -> dict | None:
        """``run()``'s record of ``step``, counted as run here or done before (:attr:`ran`, :attr:`skipped`)."""
        before = step.done() is not None
        rec = run()
        if rec is not None:
            (self.skipped if before else self.ran).append(name)
        return rec

    def train_all(self) -> None:
        self.write_plan()
        todo = list(self.steps)
        if self.prep:  # before the pool: the runs that read the maps would only wait for them
            self.prepare()
        if self.args.parallel == 1:
            for name in todo:
                self.run_step(name)
        else:
            with ThreadPoolExecutor(self.args.parallel) as pool:
                list(pool.map(self.run_step, todo))

    def job_lines(self) -> list:
        """One ``tokenaug-study ... --run-step NAME`` command per step (what a cluster array job runs)."""
        argv = list(self.argv)
        if '--emit-jobs' in argv:
            i = argv.index('--emit-jobs')
            del argv[i : i + 2]
        # --run-step first: --train-args takes the rest of the line. The annotator's job first: a job that reads
        # its maps and starts before they are written waits for them (or builds them) under the study's lock
        names = (['annotator'] if self.prep else []) + list(self.steps)
        return [shlex.join([str(BIN / 'tokenaug-study'), '--run-step', name, *argv]) for name in names]

    def run(self) -> int:
        """Run the study as its arguments say (every step here, one ``--run-step`` job, or ``--collect``), under its
        lock (:meth:`lock`), with SIGTERM / SIGINT ending what it started (:func:`stop_commands`): 0 when every
        step is done and the results are written, 1 where a step failed or is missing, 128 + the signal when it was
        stopped."""
        a = self.args
        lock = self.lock(shared=a.run_step is not None)
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {sig: signal.signal(sig, stop_commands) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            if a.run_step is not None:
                code = 0 if self.run_step(a.run_step) else 1
            else:
                if not a.collect:
                    annotator = ', and an annotator and its label maps first' if self.prep else ''
                    print(
                        f'== tokenaug-study: {len(self.steps)} trainings ({len(a.runs)} runs x {a.seeds} seeds)'
                        f'{annotator}'
                    )
                    self.train_all()
                code = None if _STOPPING.is_set() else self.report()
            if _STOPPING.is_set():
                for proc in list(_LIVE):
                    proc.wait()
                code = 128 + _STOPPING.signum
                print(
                    f'tokenaug-study: stopped by signal {_STOPPING.signum}: the commands it started have ended; the '
                    'same command resumes the study',
                    file=sys.stderr,
                )
            return code
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            _STOPPING.clear()
            if a.run_step is None:
                lock.seek(0)
                lock.truncate()
            lock.close()

    # ---------------------------------------------------------------------------------------------- results

    def evaluate(self, name: str, rec: dict) -> dict:
        """The step's final checkpoint on the test split (kept in ``study_eval.json`` with the step's key), or the
        training's own final val top-1 where there is no test split."""
        if self.test_split is None:
            return dict(top1=rec['top1'], split=self.args.val_split)
        step = self.steps[name]
        record = step.dir / 'study_eval.json'
        key = [step.key, self.test_split]
        kept = read_json(record)  # (cut short: evaluated again)
        if kept is not None and kept.get('key') == key and isinstance(kept.get('result'), dict):
            self.skipped.append(f'test {name}')
            return kept['result']
        from .study_eval import evaluate_run

        result = evaluate_run(
            step.dir, self.data, self.data, rec['top1'], test_split=self.test_split, val_split=self.args.val_split,
            device=self.args.device,
        )  # fmt: skip
        result['split'] = self.test_split
        write_json(record, dict(key=key, result=result))
        self.ran.append(f'test {name}')
        return result

    def report(self) -> int:
        """Evaluate what is done, write the results, print them; 1 if a step is missing or failed."""
        scores, missing = {}, []
        for name, step in self.steps.items():
            rec = step.done()
            if rec is None:
                failure = step.failure()
                missing.append(f'{name} ({failure["reason"]})' if failure else name)
                continue
            run, seed = name.rsplit(' seed ', 1)
            scores.setdefault(run, {})[int(seed)] = self.evaluate(name, rec)['top1']
        result = self.results(scores, missing)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / 'results.json').write_text(json.dumps(result, indent=1) + '\n')
        text = self.markdown(result)
        (self.out / 'results.md').write_text(text + '\n')
        plotted = self.plot(result)
        print('\n' + text)
        print(
            f'\n({self.out / "results.md"}, results.json{", results.png" if plotted else ""}; {len(self.ran)} steps '
            f'run, {len(self.skipped)} done before)'
        )
        return 1 if missing else 0

    def results(self, scores: dict, missing: list) -> dict:
        a = self.args
        split = self.test_split or a.val_split
        images = sum(_images(c) for c in (self.data / split).iterdir() if c.is_dir())
        runs = {}
        for run in a.runs:
            got = scores.get(run, {})
            runs[run] = dict(
                label=STUDY_RUNS[run][0],
                missing_seeds=[s for s in self.seeds if s not in got],
                **(summary(got) if got else dict(mean=None, sd=None, seeds=[], values=[])),
            )
        comparisons = {}
        base = scores.get(a.baseline, {})
        for run in a.runs:
            if run == a.baseline:
                continue
            got = scores.get(run, {})
            seeds = complete_pairs(got, base)
            if not seeds:
                comparisons[run] = dict(seeds=[], verdict='no seed where both runs finished')
                continue
            d = paired([got[s] for s in seeds], [base[s] for s in seeds])
            said = verdict(d, a.bound)
            if not d['excludes_zero'] and len(seeds) >= MIN_PAIRS and image_points(images) > a.bound:
                said += f'; the split cannot resolve ±{a.bound:g} (below)'
            comparisons[run] = dict(seeds=seeds, **d, interval=interval(d), verdict=said)
        maps = None
        if self.maps is not None:
            ann = self.prep['annotator'].done() if self.prep else None
            maps = dict(
                store=str(self.maps), annotator_val_top1=ann['top1'] if ann else None, trained_here=bool(self.prep)
            )
        return dict(
            data_dir=str(self.data),
            config=str(self.config),
            split=split,
            test_split_missing=self.test_split is None,
            baseline=a.baseline,
            seeds=self.seeds,
            runs=runs,
            comparisons=comparisons,
            resolution=resolution(images, a.bound, comparisons),
            label_maps=maps,
            failed_or_missing=missing,
        )

    def markdown(self, r: dict) -> str:
        where = (
            f"the {r['split']} split (--test-split none: these are the training's "
            'own final val top-1, the split the recipe was checked on)'
            if r['test_split_missing']
            else f'the {r["split"]} split (the final checkpoints, no selection)'
        )
        lines = [
            f'# tokenaug-study: {Path(r["data_dir"]).name}',
            '',
            f'Recipe `{Path(r["config"]).name}`; seeds {", ".join(map(str, r["seeds"]))}; top-1 on {where}.',
            '',
            '| run | top-1 mean ± sd | per seed |',
            '|---|---|---|',
        ]
        for name, run in r['runs'].items():
            if run['values']:
                cells = ' / '.join(f'{v:g}' for v in run['values'])
                lost = f'; seeds {run["missing_seeds"]} failed or missing' if run['missing_seeds'] else ''
                lines.append(f'| {name} ({run["label"]}) | {run["mean"]:.2f} ± {run["sd"]:.2f} | {cells}{lost} |')
            else:
                lines.append(f'| {name} ({run["label"]}) | failed or missing | every seed |')
        m = r['label_maps']
        if m and m['trained_here']:
            top1 = 'did not finish' if m['annotator_val_top1'] is None else f'val top-1 {m["annotator_val_top1"]}'
            where = f'its maps of the {self.args.train_split} split in `{m["store"]}`'
            lines += ['', f'Label maps: an annotator trained here from the recipe (seed 0, MixUp/CutMix, average '
                      f'pooling; {top1}), {where}.']  # fmt: skip
        elif m:
            lines += ['', f'Label maps: the store `{m["store"]}` (--label-maps).']
        lines += [
            '',
            f'Paired differences against {r["baseline"]} (same seed; mean and 95 % t interval over the seeds both runs '
            'finished):',
            '',
            '| run | difference | 95 % interval | seeds | verdict |',
            '|---|---|---|---|---|',
        ]
        for name, c in r['comparisons'].items():
            if not c['seeds']:
                lines.append(f'| {name} | – | – | none | {c["verdict"]} |')
            else:
                lines.append(f'| {name} | {c["mean"]:+.2f} | {c["interval"]} | {len(c["seeds"])} | {c["verdict"]} |')
        lines += [
            '',
            'Verdicts: resolved where the interval excludes 0; bounded within ±b (`--bound`) only where the whole '
            'interval lies inside [−b, +b], an equivalence test; not resolvable where every seed gave the same '
            'difference (a zero-width interval); no verdict below 3 paired seeds.',
        ]
        if r['resolution']['notes']:
            lines += ['', *(f'Resolution: {note}' for note in r['resolution']['notes'])]
        if r['failed_or_missing']:
            lines += ['', f'Failed or not run (logs under {self.out / "logs"}): {", ".join(r["failed_or_missing"])}.']
        return '\n'.join(lines)

    def plot(self, r: dict) -> bool:
        """``results.png``: each run's paired difference with its interval; ``False`` without matplotlib."""
        shown = [(n, c) for n, c in r['comparisons'].items() if c['seeds']]
        if not shown:
            return False
        try:
            import matplotlib

            matplotlib.use('Agg')
            import matplotlib.pyplot as plt
        except ImportError:
            return False
        fig, ax = plt.subplots(figsize=(6, 0.6 * len(shown) + 1.2))
        for i, (name, c) in enumerate(shown):
            half = c['half'] if c['half'] == c['half'] else 0.0  # nan for one seed: the point alone
            ax.errorbar(c['mean'], i, xerr=half, fmt='o', capsize=4, color='C0')
        ax.axvline(0, color='0.5', lw=1)
        ax.set_yticks(range(len(shown)), [n for n, _ in shown])
        ax.set_xlabel(f'top-1 difference to {r["baseline"]} (points; 95 % interval)')
        fig.tight_layout()
        fig.savefig(self.out / 'results.png', dpi=120)
        plt.close(fig)
        return True


def main(argv=None, runner=run_logged) -> int:
    """``tokenaug-study``. ``runner`` runs each command (:func:`run_logged`; the tests inject an in-process one)."""
    args = study_parser().parse_args(argv)
    try:
        study = Study(args, argv, runner)
    except StudyError as e:
        print(f'tokenaug-study: error: {e}', file=sys.stderr)
        return 2
    if (
        args.run_step is not None
        and args.run_step not in study.steps
        and not (args.run_step == 'annotator' and study.prep)
    ):
        print(f'tokenaug-study: error: --run-step: no step named {args.run_step!r}', file=sys.stderr)
        return 2
    if args.dry_run:
        for name, step in study.all_steps().items():
            print(f'# {name}\n{shlex.join(step.cmd)}')
        return 0
    if args.emit_jobs:
        study.write_plan()
        lines = study.job_lines()
        Path(args.emit_jobs).write_text('\n'.join(lines) + '\n')
        print(f'{len(lines)} jobs in {args.emit_jobs}; then: tokenaug-study ... --collect')
        return 0
    try:
        return study.run()
    except StudyError as e:  # (another study holds the lock)
        print(f'tokenaug-study: error: {e}', file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
