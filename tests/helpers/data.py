"""Test data: quadrant images (a class per quadrant) and their label maps, and map stores of given rows."""

import numpy as np
from PIL import Image

from shared_core.map_store import MapWriter

COLOURS = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 255]], np.uint8)  # class c -> RGB colour


def quadrant_image(h, w, layout):
    """``layout`` (2x2 classes) painted as four quadrants of an h x w image."""
    img = np.zeros((h, w, 3), np.uint8)
    for qi in range(2):
        for qj in range(2):
            img[qi * h // 2 : (qi + 1) * h // 2, qj * w // 2 : (qj + 1) * w // 2] = COLOURS[layout[qi][qj]]
    return img


def write_quadrant_data(root):
    """6 non-square images with different quadrant layouts (ImageFolder layout: root/train/c{0,1}/img{i}.png)
    and, in root/maps, a store of 8x8 maps of the same layouts. Returns ``root``."""
    rng = np.random.default_rng(0)
    paths, layouts = [], []
    for i in range(6):
        layout = rng.permutation(4).reshape(2, 2)
        h, w = (96, 64) if i % 2 else (64, 112)
        cls_dir = root / 'train' / f'c{i % 2}'
        cls_dir.mkdir(parents=True, exist_ok=True)
        Image.fromarray(quadrant_image(h, w, layout)).save(cls_dir / f'img{i}.png')
        paths.append(f'c{i % 2}/img{i}.png')
        layouts.append(layout)
    indices = np.stack([np.kron(layout, np.ones((4, 4), int))[None] for layout in layouts]).astype(np.int64)
    write_store(
        root / 'maps',
        paths,
        np.ones((len(paths), 1, 8, 8), np.float16),
        indices,
        num_classes=4,
        annotator='quadrants',
        input_size=(64, 64),
    )
    return root


def write_store(out, paths, values, indices, num_classes, annotator, input_size):
    """A complete label-map store at ``out`` whose row r (image ``paths[r]``) is ``values[r]``,
    ``indices[r]`` ((N, k, h, w) arrays: k and the grid come from their shape)."""
    _, k, h, w = values.shape
    writer = MapWriter.create(
        out, paths, num_classes=num_classes, k=k, grid=(h, w), annotator=annotator, input_size=input_size
    )
    writer.write(np.arange(len(paths)), values, indices)
    writer.finalize()
    writer.close()
    return out
