"""Label-map store and ``tokenaug-maps generate``: bytes per image, generation speed, row read time.

Three measurements, printed as one table:

1. **Size.** A store of the paper's shape (18 x 18 grid, top-5, 1000 classes): payload bytes per image
   (18 * 18 * 5 * (2 B float16 + 2 B uint16) = 6480 B) and the real on-disk figure per image (all
   files: values, indices, done flags, paths, meta, .npy headers) for ``--store-rows`` rows.
2. **Generation.** ``tokenaug-maps generate`` end to end (JPEG decode, squash resize, annotator,
   top-k, memmap writes) over ``--images`` synthetic ImageNet-sized JPEGs (``--image-size``, smooth
   random content), and the annotator alone (``annotate`` on a preloaded batch, after a warm-up).
   Random weights: speed does not depend on them.
3. **Reads.** µs per random ``store.row(i)`` and ``store.lookup(path)`` on a memory-mapped store of
   ``--store-rows`` rows (warm page cache: the file was just written).

    .venv/bin/python bench/bench_maps.py [--model resnet50] [--input-size 576] [--batch-size 16]
        [--images 64] [--workers 2] [--device cpu] [--amp] [--store-rows 20000]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import device_sync, median_times
from PIL import Image

from shared_core.map_status import store_status
from shared_core.map_store import LabelMapStore, MapWriter
from timm_plugin import annotator
from timm_plugin.tools import maps_cli as maps


def write_images(root: Path, n: int, size: tuple[int, int], seed: int = 0) -> None:
    """``n`` JPEGs of ``size`` (W, H) in 10 class folders: smooth colour noise (a realistic JPEG size)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        small = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
        img = Image.fromarray(small).resize(size, Image.BICUBIC)
        folder = root / f'class_{i % 10:02d}'
        folder.mkdir(parents=True, exist_ok=True)
        img.save(folder / f'img_{i:06d}.jpg', quality=90)


def bench_size(tmp: Path, rows: int) -> dict:
    """Create and fill a 18x18 top-5 store of 1000 classes with ``rows`` rows; its size and the store."""
    paths = [f'n{c:08d}/n{c:08d}_{i:06d}.JPEG' for i in range(rows) for c in [i % 1000]]
    rng = np.random.default_rng(0)
    with MapWriter.create(
        tmp / 'store', paths, num_classes=1000, k=5, grid=(18, 18), annotator='bench', input_size=(576, 576)
    ) as w:
        for a in range(0, rows, 2048):
            b = min(rows, a + 2048)
            values = np.sort(rng.random((b - a, 5, 18, 18), dtype=np.float32) / 5, axis=1)[:, ::-1]
            w.write(np.arange(a, b), values, rng.integers(0, 1000, (b - a, 5, 18, 18)))
        w.finalize()
    return store_status(tmp / 'store')


def bench_reads(store_dir: Path, repeats: int) -> tuple[float, float]:
    store = LabelMapStore.open(store_dir)
    rng = np.random.default_rng(1)
    rows = rng.integers(0, len(store), repeats).tolist()
    paths = [store.paths[r] for r in rows]
    for r in rows[:1000]:
        store.row(r)  # warm-up
    t = time.perf_counter()
    for r in rows:
        store.row(r)
    t_row = (time.perf_counter() - t) / repeats
    t = time.perf_counter()
    for p in paths:
        store.lookup(p)
    t_lookup = (time.perf_counter() - t) / repeats
    return t_row * 1e6, t_lookup * 1e6


def bench_generate(tmp: Path, args) -> dict:
    data = tmp / 'data'
    write_images(data / 'train', args.images, tuple(args.image_size))
    argv = [
        'generate',
        '--data-dir',
        str(data),
        '--model',
        args.model,
        '--num-classes',
        '1000',
        '--out',
        str(tmp / 'maps'),
        '--input-size',
        str(args.input_size),
        '-b',
        str(args.batch_size),
        '-j',
        str(args.workers),
        '--device',
        args.device,
        '--no-progress',
    ]
    if args.amp:
        argv.append('--amp')
    result = maps.generate(maps.parse_args(argv))
    return {'img_s': args.images / result['seconds'], 'grid': LabelMapStore.open(tmp / 'maps').grid}


def bench_annotator(args) -> float:
    device = torch.device(args.device)
    model = annotator.create_annotator(args.model, num_classes=1000).to(device)
    x = torch.randn(args.batch_size, 3, args.input_size, args.input_size, device=device)
    amp_dtype = torch.float16 if device.type == 'cuda' else torch.bfloat16

    def step():
        with torch.inference_mode(), torch.autocast(device.type, dtype=amp_dtype, enabled=args.amp):
            v, i = annotator.annotate(model, x, 5)
        v.cpu(), i.cpu()

    return args.batch_size / median_times([step], args.repeats, warmup=2, sync=device_sync(device))[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--model', default='resnet50')
    p.add_argument('--input-size', type=int, default=576)
    p.add_argument('--batch-size', type=int, default=16)
    p.add_argument('--images', type=int, default=64)
    p.add_argument('--image-size', type=int, nargs=2, default=[500, 375], metavar=('W', 'H'))
    p.add_argument('--workers', type=int, default=2)
    p.add_argument('--device', default='cpu')
    p.add_argument('--amp', action='store_true')
    p.add_argument('--repeats', type=int, default=3, help='timed annotator-only batches')
    p.add_argument('--store-rows', type=int, default=20000)
    p.add_argument('--reads', type=int, default=20000)
    p.add_argument('--skip-generate', action='store_true')
    args = p.parse_args()
    dev = torch.cuda.get_device_name() if args.device.startswith('cuda') else platform.processor() or 'cpu'
    print(f'# torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device} ({dev})')
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        status = bench_size(tmp, args.store_rows)
        row_us, lookup_us = bench_reads(tmp / 'store', args.reads)
        n = args.store_rows
        print('| measurement | value |')
        print('|---|---|')
        print(
            f'| payload bytes / image (18x18, top-5, 1000 classes: fp16 + uint16) | '
            f'{status["payload_bytes_per_image"]} |'
        )
        print(f'| on-disk bytes / image, all files, {n} rows | {status["file_bytes_per_image"]:.1f} |')
        print(f'| allocated bytes / image, all files, {n} rows | {sum(status["allocated_bytes"].values()) / n:.1f} |')
        print(f'| random row() read, {n}-row memmapped store | {row_us:.1f} µs |')
        print(f'| random lookup(path) read, {n}-row memmapped store | {lookup_us:.1f} µs |', flush=True)
        if args.skip_generate:
            return
        gen = bench_generate(tmp, args)
        ann = bench_annotator(args)
        what = (
            f'{args.model} @ {args.input_size} px (grid {gen["grid"][0]}x{gen["grid"][1]}), batch '
            f'{args.batch_size}, {args.device}{" AMP" if args.amp else ""}'
        )
        print(
            f'| generate end to end, {args.images} JPEGs {args.image_size[0]}x{args.image_size[1]}, '
            f'{args.workers} workers: {what} | {gen["img_s"]:.2f} img/s |'
        )
        print(f'| annotator only (annotate on a preloaded batch): {what} | {ann:.2f} img/s |')


if __name__ == '__main__':
    main()
