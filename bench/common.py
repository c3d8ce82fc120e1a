"""Timing helpers shared by the bench scripts. They run as ``python bench/<script>.py`` (from any working
directory): Python puts the script's folder, this one, first on ``sys.path``, so ``from common import ...``
finds this module."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from typing import Callable, List, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def device_sync(device) -> Callable[[], None]:
    """What waits for the work queued on ``device``: ``torch.cuda.synchronize`` on CUDA, nothing elsewhere."""
    return torch.cuda.synchronize if torch.device(device).type == 'cuda' else (lambda: None)


def optimizer_step(loss: Callable[[], torch.Tensor], opt: torch.optim.Optimizer, autocast) -> Callable[[], None]:
    """One training step as a function: ``loss()`` under ``autocast``, backward, ``opt.step()``, zeroed grads."""

    def step():
        with autocast:
            value = loss()
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def timed(fn: Callable[[], object], sync: Optional[Callable[[], None]] = None) -> float:
    """Seconds of one call of ``fn``; with ``sync``, between two ``sync()`` calls (the device work counted)."""
    if sync is not None:
        sync()
    t = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - t


def interleaved_times(
    fns: Sequence[Callable[[], object]], repeats: int, warmup: int = 0, sync: Optional[Callable[[], None]] = None
) -> List[List[float]]:
    """Seconds of each call of each of ``fns``: ``warmup`` untimed rounds, then ``repeats`` rounds that time each
    function once (interleaved: a drift of the machine's speed hits all alike). Round ``r`` starts at function
    ``r mod len(fns)`` (the order rotated: each function takes each place in a round equally often, so what one
    step leaves behind, a warm cache or a heap to grow, does not always fall on the same neighbour; for two
    functions, ABBA)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    n = len(fns)
    for r in range(repeats):
        for i in range(n):
            j = (r + i) % n
            times[j].append(timed(fns[j], sync))
    return times


def median_times(
    fns: Sequence[Callable[[], object]], repeats: int, warmup: int = 0, sync: Optional[Callable[[], None]] = None
) -> List[float]:
    """Median seconds per call of each of ``fns`` over :func:`interleaved_times`'s rounds."""
    return [statistics.median(t) for t in interleaved_times(fns, repeats, warmup, sync)]


def pair_ratios(ours: Sequence[float], base: Sequence[float]) -> str:
    """``median [q1, q3]`` of the per-round ratios ``ours / base`` of two interleaved series (each round's pair ran
    in the same round, so a drift of the machine's speed cancels in the ratio)."""
    r = [a / b for a, b in zip(ours, base)]
    q1, med, q3 = statistics.quantiles(r, n=4) if len(r) > 1 else (r[0],) * 3
    return f'{med:.3f} [{q1:.3f}, {q3:.3f}]'


#: ops that only make a tensor's metadata (no kernel on a device) besides those aten marks as views
METADATA_OPS = ('aten._unsafe_view', 'aten._reshape_alias')


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active (by overload packet: ``aten.mm``, ``aten.add_``, ...), and
    in ``kernels`` those that compute (not views: no kernel launch on a GPU)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()
        self.kernels = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.counts[name] += 1
        if not func.is_view and name not in METADATA_OPS:
            self.kernels[name] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], object]) -> int:
    """The number of aten ops one call of ``fn`` dispatches."""
    with OpCounter() as counter:
        fn()
    return sum(counter.counts.values())


def profile_table(
    fns: Sequence[Callable[[], object]], names: Sequence[str], device, steps: int = 5, kernels: int = 0
) -> None:
    """Where each step's time goes on ``device``: per step, the host time of the aten ops (what launches the
    kernels) and the device time of the kernels, from ``torch.profiler`` over ``steps`` calls (after one untimed
    call), printed as a table. An eager step whose host time exceeds its kernel time is launch-bound: there each
    extra op costs wall time even when its kernel is tiny. ``kernels=N``: then, for each step after the first, the
    N kernels whose device time per step grew most against the first step (what the method adds)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == 'cuda' else [])
    sync = device_sync(device)
    print('| step | host op time ms / step | kernel time ms / step | kernel time / first row |')
    print('|---|---|---|---|')
    first, per_kernel = None, []
    for fn, name in zip(fns, names):
        fn()
        sync()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                fn()
            sync()
        events = prof.key_averages()
        host = sum(e.self_cpu_time_total for e in events) / steps / 1e3
        kernel = sum(getattr(e, 'self_device_time_total', 0) or 0 for e in events) / steps / 1e3
        per_kernel.append(Counter())
        for e in events:
            per_kernel[-1][e.key] += (getattr(e, 'self_device_time_total', 0) or 0) / steps / 1e3
        first = first or kernel or None
        ratio = f'{kernel / first:.3f}' if first else '-'
        print(f'| {name} | {host:.1f} | {kernel:.1f} | {ratio} |', flush=True)
    for name, counts in list(zip(names, per_kernel))[1:] if kernels else ():
        grown = sorted(counts.keys() | per_kernel[0].keys(), key=lambda k: per_kernel[0][k] - counts[k])[:kernels]
        print(f'\n| {name}: kernel (grown most) | ms / step | {names[0]} ms / step |')
        print('|---|---|---|')
        for k in grown:
            print(f'| {k[:90]} | {counts[k]:.2f} | {per_kernel[0][k]:.2f} |')
