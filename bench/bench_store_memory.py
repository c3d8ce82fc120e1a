"""Memory of a label-map store's path index at ImageNet scale, per process and per spawned worker.

Builds a store of ``--rows`` (default 1,281,167: ImageNet-1k's training set) ImageNet-style paths with one-cell
rows (the index does not depend on the row size), then measures, each in a fresh process, the heap (anonymous
resident memory, ``RssAnon``: the process's own) that opening the store and looking up images adds, and the
file pages it maps (``RssFile``: the page cache, shared by every process mapping the same files):

- ``dict``: the index as it was, a Python dict of every path (``_index_paths(_read_paths(...))``);
- ``mmap``: :class:`shared_core.map_paths.PathIndex`, memory-mapped (what ``LabelMapStore.open`` uses);

and the same in ``--workers`` spawned worker processes that each unpickle the store (as a DataLoader's spawn /
forkserver workers do) and look up ``--lookups`` random images. Linux only (``/proc``)::

    python bench/bench_store_memory.py [--rows 1281167] [--workers 4] [--out /tmp/store]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared_core import map_store as M  # noqa: E402


def memory_mib() -> tuple:
    """``(anonymous, file-backed)`` resident memory of this process, MiB (``RssAnon``, ``RssFile``): the heap
    is the process's own; file-backed pages of memory-mapped files are the page cache, shared by every process
    that maps them."""
    out = {}
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(('RssAnon:', 'RssFile:')):
                out[line.split(':')[0]] = int(line.split()[1]) / 1024
    return out['RssAnon'], out['RssFile']


def imagenet_paths(n: int) -> list:
    rng = random.Random(0)
    classes = [f'n{rng.randrange(10**7, 10**8):08d}' for _ in range(1000)]
    return [f'{classes[i % 1000]}/{classes[i % 1000]}_{i:d}.JPEG' for i in range(n)]


def build(root: Path, n: int) -> float:
    paths = imagenet_paths(n)
    t = time.perf_counter()
    with M.MapWriter.create(root, paths, num_classes=1000, k=1, grid=(1, 1), annotator='bench', input_size=(8, 8)) as w:
        w.write(np.arange(n), np.ones((n, 1, 1, 1), np.float16), np.zeros((n, 1, 1, 1), np.int64))
        w.finalize()  # writes the path index
    return time.perf_counter() - t


def measure(kind: str, root: str, lookups: int, queue) -> None:
    """In a fresh process: USS before, after opening, after ``lookups`` random lookups; seconds to open."""
    keys = random.Random(1).sample(imagenet_paths(lookups * 10), lookups) if lookups else []
    before = memory_mib()
    t = time.perf_counter()
    if kind == 'dict':
        n = M._read_meta(Path(root))['num_images']
        index = M._index_paths(M._read_paths(Path(root), n), root)
        find = index.__getitem__
    else:
        store = M.LabelMapStore.open(root) if kind == 'mmap' else pickle.loads(kind)
        find = store.index_of
        if kind != 'mmap':
            kind = 'mmap (worker)'
    opened = time.perf_counter() - t
    after_open = memory_mib()
    t = time.perf_counter()
    for key in keys:
        find(key)
    per_lookup = (time.perf_counter() - t) / max(1, len(keys))
    queue.put((kind, before, after_open, memory_mib(), opened, per_lookup))


def run_in(kind, root, lookups):
    ctx = mp.get_context('spawn')
    q = ctx.Queue()
    p = ctx.Process(target=measure, args=(kind, root, lookups, q))
    p.start()
    out = q.get()
    p.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--rows', type=int, default=1_281_167)
    ap.add_argument('--workers', type=int, default=4)
    ap.add_argument('--lookups', type=int, default=2000)
    ap.add_argument('--out', default=None, help='store folder (default: a temporary one)')
    args = ap.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix='store-')) / 'maps'
    if not (root / M.META_FILE).exists():
        print(f'building a store of {args.rows:,} rows in {root} ...', flush=True)
        print(f'  built in {build(root, args.rows):.1f} s (path index included)')
    size = (root / M.PATHS_FILE).stat().st_size / 2**20
    print(
        f'paths.txt: {size:.1f} MiB; path index files: '
        f'{sum((root / f).stat().st_size for f in (M.PATH_INDEX_FILE, M.PATH_OFFSETS_FILE)) / 2**20:.1f} MiB'
    )
    print(
        '| index | process | heap before (MiB) | heap + open | heap + lookups | mapped file pages after (MiB) '
        '| open (s) | lookup (µs) |'
    )
    print('|---|---|---|---|---|---|---|---|')
    rows = [run_in('dict', str(root), args.lookups), run_in('mmap', str(root), args.lookups)]
    store = pickle.dumps(M.LabelMapStore.open(root))
    rows += [run_in(store, str(root), args.lookups) for _ in range(args.workers)]
    for kind, before, opened, looked, secs, per in rows:
        proc = 'spawned worker' if 'worker' in kind else 'process'
        print(
            f'| {kind.split()[0]} | {proc} | {before[0]:.1f} | {opened[0] - before[0]:+.1f} | '
            f'{looked[0] - opened[0]:+.1f} | {looked[1] - before[1]:+.1f} | {secs:.2f} | {per * 1e6:.1f} |'
        )
    print(f'pickled store: {len(store)} bytes')


if __name__ == '__main__':
    main()
