"""The label-map stores the map-store tests write: twelve image paths, plausible top-k rows, a writer and a full
store of those rows."""

from __future__ import annotations

import numpy as np

from shared_core.map_store import MapWriter

PATHS = [f'{c:02d}_class/{i:06d}.jpg' for c in range(3) for i in range(4)]  # 12 images


def random_rows(n, k=5, grid=(3, 4), num_classes=1000, seed=0):
    """Plausible top-k rows: descending float16 probabilities, distinct class indices per cell."""
    rng = np.random.default_rng(seed)
    v = np.sort(rng.dirichlet(np.ones(k + 2), size=(n, *grid))[..., :k], axis=-1)[..., ::-1]
    values = np.ascontiguousarray(np.moveaxis(v, -1, 1)).astype(np.float16)
    idx = (
        np.argsort(rng.random((n, *grid, num_classes)), axis=-1)[..., :k]
        if num_classes <= 2000
        else rng.choice(num_classes, size=(n, *grid, k), replace=True)
    )
    return values, np.ascontiguousarray(np.moveaxis(idx, -1, 1))


def create_store(path, paths=PATHS, num_classes=1000, k=5, grid=(3, 4), **kw):
    return MapWriter.create(
        path, paths, num_classes=num_classes, k=k, grid=grid, annotator='resnet18', input_size=(96, 128), **kw
    )


def full_store(path, paths=PATHS, num_classes=1000, k=5, grid=(3, 4)):
    values, indices = random_rows(len(paths), k, grid, num_classes)
    with create_store(path, paths, num_classes, k, grid) as w:
        w.write(np.arange(len(paths)), values, indices)
        w.finalize()
    return values, indices
