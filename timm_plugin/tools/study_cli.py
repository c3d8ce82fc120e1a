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

The trainings and the maps run as processes of their own forked from one that imported torch and timm once
(:func:`run_logged`), so a study of many short runs does not pay those imports per run.

Every step keeps its command (:class:`shared_core.study.Step`): a rerun skips the steps that are done and runs again
a step whose command changed; an interrupted training resumes through ``tokenaug-train --resume``. A failed run is
reported by name and never becomes a number in the table. ``--dry-run`` prints the commands, ``--parallel P`` runs P
at once, ``--launcher torchrun`` runs each under torchrun, ``--emit-jobs FILE`` writes one job per line for a
cluster scheduler and ``--collect`` tabulates what the jobs wrote.

Writes ``OUT/results.md``, ``OUT/results.json`` and ``OUT/results.png`` (the paired differences with their
intervals), ``OUT/plan.json`` (every step's command) and ``OUT/logs/``.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from shared_core.map_store import read_store_paths
from shared_core.study import Step, complete_pairs, interval, paired, summary, verdict
from tokenaug.tool_args import STUDY_RUNS, study_parser

__all__ = ['main', 'StudyError', 'Study', 'train_step', 'run_logged', 'FORKED']

BIN = Path(sys.executable).parent


class StudyError(ValueError):
    """Bad input to ``tokenaug-study``, named."""


def _split_ok(root: Path, split: str) -> bool:
    folder = root / split
    return folder.is_dir() and any(p.is_dir() for p in folder.iterdir())


#: the console commands a study runs locally in a process forked from one that imported their modules once
#: (:func:`run_logged`): command name -> the function of :mod:`tokenaug.commands` its console script calls
FORKED = {'tokenaug-train': 'train', 'tokenaug-maps': 'maps'}


def _serve() -> None:
    """The fork server of :class:`_Forker` (``python -c``): imports what :data:`FORKED` runs, then for each request
    line on stdin (JSON: the command, its log, environment and folder) forks a child that runs the command as its
    console script would in a fresh process, and answers one line on stdout: the child's exit status and CPU
    seconds (its own and its waited children's, from ``wait4``)."""
    import importlib

    commands = importlib.import_module('tokenaug.commands')
    importlib.import_module('timm_plugin.train')
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns into this loop (the command's SystemExit or error ends the process)
            os.environ.clear()
            os.environ.update(req['env'])
            os.chdir(req['cwd'])
            null = os.open(os.devnull, os.O_RDONLY)
            log = os.open(req['log'], os.O_WRONLY | os.O_APPEND)
            os.dup2(null, 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(null)
            os.close(log)
            sys.argv = req['cmd']
            sys.exit(getattr(commands, FORKED[Path(req['cmd'][0]).name])(req['cmd'][1:]))
        _, status, usage = os.wait4(pid, 0)
        print(json.dumps([os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime]), flush=True)


class _Forker:
    """A fork server (:func:`_serve`) of this thread: started by the first :data:`FORKED` command run here, it ends
    with this process (its stdin closes)."""

    _local = threading.local()

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, '-c', 'from timm_plugin.tools.study_cli import _serve; _serve()'],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    @classmethod
    def here(cls) -> '_Forker':
        forker = getattr(cls._local, 'forker', None)
        if forker is None or forker.proc.poll() is not None:
            forker = cls._local.forker = cls()
        return forker

    def run(self, cmd: list, log: Path) -> tuple:
        req = dict(cmd=[str(c) for c in cmd], log=str(log), env=dict(os.environ), cwd=os.getcwd())
        try:
            self.proc.stdin.write(json.dumps(req) + '\n')
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
        except BrokenPipeError:
            answer = ''
        if not answer:  # the server died (killed, or it could not import): the command did not run to its end
            code = self.proc.wait() or 1
            with open(log, 'a') as f:
                f.write(f'the fork server of this command ended (exit {code}) before it answered; see stderr\n')
            return code, 0.0
        code, cpu = json.loads(answer)
        return code, round(cpu, 1)


def run_logged(cmd: list, log: Path) -> tuple:
    """Run ``cmd`` with its output appended to ``log`` (after the command line): ``(exit code, CPU seconds)``, the
    CPU time of the command and the children it waited for, whatever else runs beside it.

    This environment's ``tokenaug-train`` and ``tokenaug-maps`` (:data:`FORKED`) run in a process of their own
    forked from a server that imported torch and timm once (:func:`_serve`, one per thread of the study), as their
    console scripts would run in a fresh process: a study of many short runs does not pay those 3-5 s of imports per
    run, and their CPU seconds count from the fork. Other commands (``--launcher torchrun``), and every command on
    other systems than Linux (macOS's frameworks are not safe to fork), run as subprocesses."""
    with open(log, 'a') as f:
        f.write(f'$ {shlex.join(str(c) for c in cmd)}\n')
        f.flush()
        path = Path(str(cmd[0]))
        if path.parent == BIN and path.name in FORKED and sys.platform.startswith('linux'):
            return _Forker.here().run(cmd, log)
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        return os.waitstatus_to_exitcode(status), round(usage.ru_utime + usage.ru_stime, 1)


def train_step(name: str, step: Step, log: Path) -> dict | None:
    """The runner of one ``tokenaug-train`` step (``tokenaug-study``'s and the bench studies'): its record if it is
    done; else it trains, from scratch or resumed (``--resume``) where an interrupted attempt of the same command
    left a checkpoint, and records the final val top-1/top-5, wall and CPU seconds. ``None`` if the training
    failed (the log named)."""
    rec = step.done()
    if rec is not None:
        print(f'  {name}: done before, skipped', flush=True)
        return rec
    last = step.dir / 'last.pth.tar'
    resume = step.started() and last.is_file()
    cmd = list(step.cmd)
    if resume:
        i = cmd.index('--experiment') + 2
        cmd[i:i] = ['--resume', str(last)]
    else:
        step.start()
    log.parent.mkdir(parents=True, exist_ok=True)
    t = time.time()
    rc, cpu = run_logged(cmd, log)
    if rc != 0:
        print(f'  {name}: FAILED (exit {rc}); see {log}', flush=True)
        return None
    final = json.loads((step.dir / 'results.json').read_text())['final']
    secs = round(time.time() - t, 1)
    rec = step.finish(top1=final['top1'], top5=final['top5'], secs=secs, cpu_secs=cpu, resumed=resume)
    print(f'  {name}: val top-1 {final["top1"]}{" (resumed)" if resume else ""} ({secs:.0f} s)', flush=True)
    return rec


class Study:
    """The plan of one study (validated arguments, one step per run and seed) and what it does with them."""

    def __init__(self, args, argv=None):
        self.args = args
        self.argv = list(sys.argv[1:] if argv is None else argv)
        self.data = Path(args.data_dir).resolve()
        if not self.data.is_dir():
            raise StudyError(f'--data-dir: {self.data} is not a folder')
        for flag, split in (('--train-split', args.train_split), ('--val-split', args.val_split)):
            if not _split_ok(self.data, split):
                raise StudyError(f'{flag}: {self.data / split} is not a folder of class folders')
        self.test_split = args.test_split if _split_ok(self.data, args.test_split) else None
        self.config = Path(args.config).resolve()
        try:
            cfg = yaml.safe_load(self.config.read_text())
        except FileNotFoundError:
            raise StudyError(f'-c/--config: {self.config} does not exist') from None
        except yaml.YAMLError as e:
            raise StudyError(f'-c/--config: {self.config} does not parse as YAML: {str(e).splitlines()[0]}') from None
        if not isinstance(cfg, dict):
            raise StudyError(f'-c/--config: {self.config} is not a tokenaug-train YAML of key: value lines')
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
        #: the annotator and its maps (``{'annotator': Step, 'maps': Step}``) where a run reads maps and no
        #: --label-maps store is given; else empty
        self.prep: dict = {}
        self._prepared = None
        self.maps = Path(args.label_maps).resolve() if args.label_maps else None
        if any(self.reads_maps(r) for r in args.runs) and self.maps is None:
            self.maps = self.out / 'maps' / 'train'
            self.prep = self._annotator_steps()
        self.steps = {f'{run} seed {s}': self._step(run, s) for run in args.runs for s in self.seeds}

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
        return Step(out / f'seed{seed}', self._train_cmd(out, seed, flags), inputs)

    def _annotator_steps(self) -> dict:
        """The annotator (the recipe at seed 0 with MixUp/CutMix and average pooling) and the ``tokenaug-maps
        generate`` command of its maps of the training split, with the model, its kwargs, the classes and the input
        size the training resolves from the config and ``--train-args``."""
        from tokenaug.train_args import parse_args

        flags = ['--mixup-type', 'cutmix', '--gp', 'avg']
        ann = self._train_cmd(self.out / 'runs' / 'annotator', 0, flags)
        try:
            t = parse_args([str(a) for a in ann[ann.index('-c') :]])
        except SystemExit:  # argparse has printed what it refuses
            raise StudyError(
                f"-c/--config {self.config} with --train-args: the annotator's command does not parse"
            ) from None
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
        ann_step = Step(self.out / 'runs' / 'annotator' / 'seed0', ann)
        # the store's folder is the tool's own (it refuses a non-empty one): the step's record sits beside it
        return dict(annotator=ann_step, maps=Step(self.maps.parent / 'record', maps, [ann_step.key]))

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
        if name == 'annotator' or (self.prep and self.reads_maps(name.rsplit(' seed ', 1)[0])):
            if not self.prepare():
                if name != 'annotator':
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
        checks that the store is the same run's)."""
        if step.done():
            print('  maps: done before, skipped', flush=True)
            return True
        resume = step.started() and self.maps.is_dir()
        if not resume:
            shutil.rmtree(self.maps, ignore_errors=True)  # the store's folder is beside the step's record
            step.start()
        cmd = step.cmd + (['--resume'] if resume else [])
        t = time.time()
        rc, _ = run_logged(cmd, self._log('maps'))
        if rc != 0:
            print(f'  maps: FAILED (exit {rc}); see {self._log("maps")}', flush=True)
            return False
        step.finish(images=len(read_store_paths(self.maps)), secs=round(time.time() - t, 1), resumed=resume)
        print(f'  maps: {self.maps} ({time.time() - t:.0f} s)', flush=True)
        return True

    def _train(self, name: str, step: Step) -> bool:
        return train_step(name, step, self._log(name)) is not None

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

    # ---------------------------------------------------------------------------------------------- results

    def evaluate(self, name: str, rec: dict) -> dict:
        """The step's final checkpoint on the test split (kept in ``study_eval.json`` with the step's key), or the
        training's own final val top-1 where there is no test split."""
        if self.test_split is None:
            return dict(top1=rec['top1'], split=self.args.val_split)
        step = self.steps[name]
        record = step.dir / 'study_eval.json'
        key = [step.key, self.test_split]
        if record.is_file():
            kept = json.loads(record.read_text())
            if kept.get('key') == key:
                return kept['result']
        from .study_eval import evaluate_run

        result = evaluate_run(
            step.dir, self.data, self.data, rec['top1'], test_split=self.test_split, val_split=self.args.val_split,
            device=self.args.device,
        )  # fmt: skip
        result['split'] = self.test_split
        record.write_text(json.dumps(dict(key=key, result=result), indent=1) + '\n')
        return result

    def report(self) -> int:
        """Evaluate what is done, write the results, print them; 1 if a step is missing or failed."""
        scores, missing = {}, []
        for name, step in self.steps.items():
            rec = step.done()
            if rec is None:
                missing.append(name)
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
        print(f'\n({self.out / "results.md"}, results.json{", results.png" if plotted else ""})')
        return 1 if missing else 0

    def results(self, scores: dict, missing: list) -> dict:
        a = self.args
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
            comparisons[run] = dict(seeds=seeds, **d, interval=interval(d), verdict=verdict(d, a.bound))
        split = self.test_split or a.val_split
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
            label_maps=maps,
            failed_or_missing=missing,
        )

    def markdown(self, r: dict) -> str:
        where = (
            f"the {r['split']} split (no {self.args.test_split} split under --data-dir: these are the training's "
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


def main(argv=None) -> int:
    args = study_parser().parse_args(argv)
    try:
        study = Study(args, argv)
    except StudyError as e:
        print(f'tokenaug-study: error: {e}', file=sys.stderr)
        return 2
    if args.run_step is not None:
        if args.run_step not in study.steps and not (args.run_step == 'annotator' and study.prep):
            print(f'tokenaug-study: error: --run-step: no step named {args.run_step!r}', file=sys.stderr)
            return 2
        return 0 if study.run_step(args.run_step) else 1
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
    if not args.collect:
        annotator = ', and an annotator and its label maps first' if study.prep else ''
        print(
            f'== tokenaug-study: {len(study.steps)} trainings ({len(args.runs)} runs x {args.seeds} seeds){annotator}'
        )
        study.train_all()
    return study.report()


if __name__ == '__main__':
    sys.exit(main())
