"""Deterministic synthetic "world" of textured objects, written as ImageNet, ADE20K and COCO.

``tokenaug-data`` (``main``) and :func:`generate_world` render, from one integer seed, a
small set of scenes and write the *same* scenes (same id, byte-identical JPEG) in up to
three standard dataset layouts, so that classification (timm / mmpretrain), semantic
segmentation (mmseg) and instance detection/segmentation (mmdet) can be trained and
checked on one tiny, fully known world.

The world
---------
* **Classes.** Class ``k`` (``0 <= k < num_classes``) is a unique combination of a
  *shape* (circle, square, triangle, star, hexagon, cross, diamond, arrow, pentagon,
  L-shape) and a *texture* (striped, checkered, dotted, gradient, grid) with
  class-specific texture angle/period.  Shape x texture identify the class on every
  instance; colour is only partly informative (see *Colours*).  Class ``k`` has shape
  ``SHAPES[k % 10]`` and texture ``TEXTURES[(k % 10 + k // 10) % 5]``, so up to
  ``10 * 5 = 50`` classes are available.  Its name is ``f"{k:02d}_{texture}_{shape}"``
  (e.g. ``00_striped_circle``); the two-digit prefix makes alphabetical order (what
  torchvision ``ImageFolder``, timm and mmpretrain use for folder datasets) equal to the
  label order ``k``.
* **Colours.** All classes share one palette (:data:`PALETTE`): ``PALETTE_HUES`` = 12
  evenly spaced hues, each as a *light* colour (HSV s=0.85, v=0.95) and a *dark* colour
  (s=0.75, v=0.45).  Every class ``k`` has a *home pair* of palette indices (see
  :func:`class_specs`): light hue ``(5 * k) % 12`` and dark hue
  ``(5 * k + 3 + k // 12) % 12``, distinct for all 50 classes (and the light hues alone
  distinct for the first 12).  Each object instance is painted in its class's home pair
  with probability ``color_consistency`` (default 0.75); otherwise it draws a light and
  a dark colour uniformly (any two hues) from the shared palette.  So colour hints at the
  class without deciding it (``color_consistency=0`` makes colour carry no class
  information, ``1`` makes it a fixed per-class pair), while shape x texture stay fully
  consistent.  The per-instance draws come from the scene's RNG and consume the same
  random numbers whatever ``color_consistency`` is, so changing it changes only object
  colours, never geometry, labels or masks.  The light/dark pairing keeps the texture
  visible whatever the hues.
* **Background.** Smooth low-resolution colour noise upsampled to the image size, plus
  random clutter strokes and blobs and mild pixel noise, all in *low-saturation*
  colours (HSV saturation <= 0.25).  Object colours are saturated (>= 0.6), and the
  clutter uses no stripe/checker/dot/grid/gradient texture, so no background pixel
  looks like an object, yet the background is never flat.
* **Objects.** Each scene has one *main* object of its labelled class whose mask covers
  a fraction ``min_area <= a <= max_area`` of the image (default 8-35 %; measured on the
  rasterised mask), plus ``0..max_extra_objects`` (default up to 1) extra objects of
  other classes, each with a mask area between 20 % and 50 % of the main object's.
  Every instance gets its colours (above), a random rotation, scale, position,
  texture phase and mild colour jitter; the texture rotates with the object.  Objects never overlap: their pixel
  bounding boxes are at least 2 px apart (placement is retried, and an extra object
  that cannot be placed is dropped), so no object is occluded and every polygon below
  describes exactly the visible object.
* **Masks are polygons, rasterised the COCO way.** Every object is a simple polygon
  (round shapes are 40-gons) whose vertices are rounded to 2 decimals.  The object's
  pixel mask is computed with a numpy port of the COCO API rasteriser
  (``maskApi.c:rleFrPoly``, what ``pycocotools`` ``frPyObjects``/``annToMask`` use), and
  that exact mask is what is painted into the JPEG, written into the ADE20K label map
  and counted as the COCO ``area``.  (PIL's ``ImageDraw.polygon`` rasterises boundary
  pixels differently from pycocotools, so it is not used for objects.)

Layout under ``OUT`` (ids are integers, unique over both splits; files are ``f"{id:06d}"``)
-------------------------------------------------------------------------------------------
* ``imagenet/{train,val}/<class_name>/<id>.jpg`` -- label = class of the main object.
* ``ade20k/images/{training,validation}/<id>.jpg`` and
  ``ade20k/annotations/{training,validation}/<id>.png`` -- single-channel uint8 label
  maps: ``0`` = background, ``k + 1`` = object class ``k``.  In mmseg either use
  ``reduce_zero_label=True`` (background becomes 255 = ignored, ``k + 1 -> k``; classes
  = the ``num_classes`` names) or ``reduce_zero_label=False`` with classes
  ``("background", *class_names)``.
* ``coco/{train2017,val2017}/<id>.jpg`` and ``coco/annotations/instances_{train,val}2017.json``
  with ``images`` (id, file_name, height, width), ``annotations`` (id, image_id,
  category_id = ``k + 1``, bbox ``[x, y, w, h]`` = tight pixel box of the mask in the
  pixel-corner convention (as ``pycocotools.mask.toBbox``), area = mask pixel count,
  segmentation = ``[[x1, y1, x2, y2, ...]]``, iscrowd 0) and ``categories`` (id, name,
  supercategory = shape name).  The first annotation of every image is its main object.
* ``world.json`` -- seed, configuration, classes, shared colour palette, image size, counts per split,
  object-area statistics, format paths (relative to ``OUT``) and label conventions.
  It is written last; if it already exists with the same configuration, generation is
  skipped (idempotent) unless ``force``.

Determinism: scene ``i`` of split ``s`` (0 = train, 1 = val) draws all its randomness
from ``numpy.random.default_rng(SeedSequence(seed, spawn_key=(s, i)))``, i.e. the
``spawn`` children of ``SeedSequence(seed)``, so a scene does not depend on the other
scenes, on the split sizes or on the formats written.  Training scene ``i`` has main
class ``i % num_classes`` (likewise for val).  JPEGs use quality 95, 4:4:4 chroma and no
optimisation; PNGs use a fixed compression level; JSON is written with fixed key order.
The same arguments therefore give byte-identical files.

Command line::

    tokenaug-data [--out data/world] [--seed 0] [--num-classes 10] [--image-size 112]
                  [--train-per-class 40] [--val-per-class 10] [--max-extra-objects 1]
                  [--min-area 0.08] [--max-area 0.35] [--color-consistency 0.75]
                  [--formats imagenet,ade20k,coco] [--force]

Bad arguments raise ``ValueError`` naming the argument (``main`` turns them into an
argparse usage error, exit status 2).

This module uses only numpy, Pillow and the standard library.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

__all__ = [
    'generate_world',
    'main',
    'SHAPES',
    'TEXTURES',
    'FORMATS',
    'MAX_CLASSES',
    'class_specs',
    'PALETTE',
    'PALETTE_HUES',
]

# 1: per-class colour palettes; 2: one palette shared by all classes, colours drawn per instance;
# 3: per-class home colour pair used with probability color_consistency, else uniform draw
GENERATOR_VERSION = 3
FORMATS = ('imagenet', 'ade20k', 'coco')
SHAPES = ('circle', 'square', 'triangle', 'star', 'hexagon', 'cross', 'diamond', 'arrow', 'pentagon', 'lshape')
TEXTURES = ('striped', 'checkered', 'dotted', 'gradient', 'grid')
MAX_CLASSES = len(SHAPES) * len(TEXTURES)
_SPLITS = (('train', 'training', 'train2017'), ('val', 'validation', 'val2017'))
_MARGIN = 1.0  # polygon vertices stay at least this far (px) from the image border
_BOX_GAP = 2  # min gap (px) between the pixel boxes of two objects of a scene
_EXTRA_REL = (0.2, 0.5)  # extra object area relative to the main object's area
_MARKER = '.tokenaug-world-incomplete'


# --------------------------------------------------------------------------- shapes
def _regular(n: int, start: float = -math.pi / 2) -> np.ndarray:
    t = start + 2 * math.pi * np.arange(n) / n
    return np.stack([np.cos(t), np.sin(t)], 1)


def _star(n: int = 5, inner: float = 0.55) -> np.ndarray:
    t = -math.pi / 2 + math.pi * np.arange(2 * n) / n
    r = np.where(np.arange(2 * n) % 2 == 0, 1.0, inner)
    return np.stack([r * np.cos(t), r * np.sin(t)], 1)


def _unit_polygon(shape: str) -> np.ndarray:
    """Counter-clockwise-or-not simple polygon of radius ~1 around the origin."""
    if shape == 'circle':
        p = _regular(40)
    elif shape == 'square':
        p = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], float) * 0.75
    elif shape == 'triangle':
        p = _regular(3)
        p[:, 1] += 0.25  # centre the bounding box
    elif shape == 'star':
        p = _star()
        p[:, 1] += 0.1
    elif shape == 'hexagon':
        p = _regular(6, 0.0)
    elif shape == 'cross':
        a, b = 0.33, 1.0
        p = np.array(
            [
                [-a, -b],
                [a, -b],
                [a, -a],
                [b, -a],
                [b, a],
                [a, a],
                [a, b],
                [-a, b],
                [-a, a],
                [-b, a],
                [-b, -a],
                [-a, -a],
            ],
            float,
        )
    elif shape == 'diamond':
        p = np.array([[0, -1], [0.62, 0], [0, 1], [-0.62, 0]], float)
    elif shape == 'arrow':
        p = np.array([[-1, -0.28], [0.15, -0.28], [0.15, -0.7], [1, 0], [0.15, 0.7], [0.15, 0.28], [-1, 0.28]], float)
    elif shape == 'pentagon':
        p = _regular(5)
        p[:, 1] += 0.1
    elif shape == 'lshape':
        p = np.array([[-0.8, -1], [-0.15, -1], [-0.15, 0.35], [0.8, 0.35], [0.8, 1], [-0.8, 1]], float)
    else:  # pragma: no cover - guarded by SHAPES
        raise KeyError(shape)
    return p


def _polygon_area(p: np.ndarray) -> float:
    x, y = p[:, 0], p[:, 1]
    return 0.5 * abs(float(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))))


# ------------------------------------------------------------------ COCO rasteriser
def polygon_mask(poly, height: int, width: int) -> np.ndarray:
    """Boolean ``(height, width)`` mask of a polygon ``[x1, y1, x2, y2, ...]``.

    numpy port of the COCO API ``rleFrPoly`` (pycocotools), so that
    ``COCO.annToMask`` of the written segmentation reproduces this mask exactly.
    Coordinates must be non-negative and consecutive vertices distinct.
    """
    xy = np.asarray(poly, dtype=np.float64).reshape(-1, 2)
    k = len(xy)
    scale = 5.0
    x = np.trunc(scale * xy[:, 0] + 0.5).astype(np.int64)
    y = np.trunc(scale * xy[:, 1] + 0.5).astype(np.int64)
    x = np.append(x, x[0])
    y = np.append(y, y[0])
    us, vs = [], []
    for j in range(k):
        xs, xe, ys, ye = int(x[j]), int(x[j + 1]), int(y[j]), int(y[j + 1])
        dx, dy = abs(xe - xs), abs(ys - ye)
        flip = (dx >= dy and xs > xe) or (dx < dy and ys > ye)
        if flip:
            xs, xe, ys, ye = xe, xs, ye, ys
        if dx >= dy:
            if dx == 0:
                raise ValueError('polygon has two identical consecutive vertices')
            s = (ye - ys) / dx
            d = np.arange(dx + 1)
            t = dx - d if flip else d
            us.append(t + xs)
            vs.append(np.trunc(ys + s * t.astype(np.float64) + 0.5).astype(np.int64))
        else:
            s = (xe - xs) / dy
            d = np.arange(dy + 1)
            t = dy - d if flip else d
            vs.append(t + ys)
            us.append(np.trunc(xs + s * t.astype(np.float64) + 0.5).astype(np.int64))
    u = np.concatenate(us)
    v = np.concatenate(vs)
    ch = u[1:] != u[:-1]
    u1, u0, v1, v0 = u[1:][ch], u[:-1][ch], v[1:][ch], v[:-1][ch]
    xd = np.where(u1 < u0, u1, u1 - 1).astype(np.float64)
    xd = (xd + 0.5) / scale - 0.5
    ok = (np.floor(xd) == xd) & (xd >= 0) & (xd <= width - 1)
    yd = np.minimum(v1, v0).astype(np.float64)
    yd = (yd + 0.5) / scale - 0.5
    yd = np.ceil(np.clip(yd, 0, height))
    pos = xd[ok].astype(np.int64) * height + yd[ok].astype(np.int64)
    toggles = np.bincount(pos, minlength=height * width + 1)[: height * width]
    flat = (np.cumsum(toggles) % 2).astype(bool)
    return flat.reshape(width, height).T


# ------------------------------------------------------------------ colours / classes
def _hsv(h: float, s: float, v: float) -> np.ndarray:
    h = (h % 1.0) * 6.0
    i = int(h) % 6
    f = h - int(h)
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    rgb = [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)][i]
    return np.array(rgb, np.float64) * 255.0


PALETTE_HUES = 12
_LIGHT_SV = (0.85, 0.95)
_DARK_SV = (0.75, 0.45)


def _rgb_int(c: np.ndarray) -> list[int]:
    return [int(round(float(x))) for x in c]


#: Colour palette shared by all classes: ``{"light": [[r, g, b], ...], "dark": [...]}``,
#: one light and one dark saturated colour per hue ``i / PALETTE_HUES``.  An object's
#: texture mixes one light and one dark colour: its class's home pair (probability
#: ``color_consistency``) or two independently, uniformly drawn ones.
PALETTE = {
    'light': [_rgb_int(_hsv(i / PALETTE_HUES, *_LIGHT_SV)) for i in range(PALETTE_HUES)],
    'dark': [_rgb_int(_hsv(i / PALETTE_HUES, *_DARK_SV)) for i in range(PALETTE_HUES)],
}


def _home_pair(k: int) -> tuple[int, int]:
    """(light, dark) :data:`PALETTE` indices of class ``k``'s home colour pair.

    Light hues ``5k mod 12`` run through all 12 hues for k = 0..11; the dark hue is
    3 + k // 12 (3..7, never 0) hues further, so all :data:`MAX_CLASSES` pairs differ.
    """
    light = (5 * k) % PALETTE_HUES
    return light, (light + 3 + k // PALETTE_HUES) % PALETTE_HUES


def class_specs(num_classes: int) -> list[dict]:
    """Static description of the classes (shape, texture, texture parameters, home pair).

    ``home_pair`` = ``{"light": i, "dark": j}`` indexes :data:`PALETTE`; an instance uses
    it with probability ``color_consistency``, else draws its colours uniformly.
    """
    specs = []
    for k in range(num_classes):
        shape = SHAPES[k % len(SHAPES)]
        texture = TEXTURES[(k % len(SHAPES) + k // len(SHAPES)) % len(TEXTURES)]
        light, dark = _home_pair(k)
        specs.append(
            {
                'id': k,
                'name': f'{k:02d}_{texture}_{shape}',
                'shape': shape,
                'texture': texture,
                'angle_deg': float((k * 47) % 180),
                'period': float(6 + 2 * (k % 3)),  # px at image_size 112
                'home_pair': {'light': light, 'dark': dark},
            }
        )
    return specs


# ------------------------------------------------------------------ rendering
def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    g = int(rng.integers(3, 7))
    hues = rng.random((g, g))
    sats = rng.uniform(0.0, 0.25, (g, g))
    vals = rng.uniform(0.3, 0.85, (g, g))
    low = np.stack([[_hsv(hues[i, j], sats[i, j], vals[i, j]) for j in range(g)] for i in range(g)]).astype(np.uint8)
    img = Image.fromarray(low, 'RGB').resize((size, size), Image.BILINEAR)
    draw = ImageDraw.Draw(img)
    sc = size / 112.0
    for _ in range(int(rng.integers(2, 6))):  # blobs
        cx, cy = rng.uniform(0, size, 2)
        rx, ry = rng.uniform(4, 18, 2) * sc
        col = _hsv(rng.random(), rng.uniform(0, 0.25), rng.uniform(0.2, 0.9))
        draw.ellipse([cx - rx, cy - ry, cx + rx, cy + ry], fill=tuple(int(c) for c in col))
    for _ in range(int(rng.integers(3, 9))):  # strokes
        n = int(rng.integers(2, 5))
        pts = [tuple(float(c) for c in rng.uniform(-0.1 * size, 1.1 * size, 2)) for _ in range(n)]
        col = _hsv(rng.random(), rng.uniform(0, 0.25), rng.uniform(0.15, 0.95))
        draw.line(pts, fill=tuple(int(c) for c in col), width=max(1, int(round(rng.uniform(1, 3.5) * sc))))
    arr = np.asarray(img, np.float64)
    return arr + rng.normal(0.0, 3.0, arr.shape)


def _texture(
    spec: dict, u: np.ndarray, v: np.ndarray, radius: float, size: int, rng: np.random.Generator
) -> np.ndarray:
    """Mix weight in [0, 1] between the object's light (1) and dark (0) colour at (u, v)."""
    ps = max(size / 112.0, 0.5)
    period = spec['period'] * ps * rng.uniform(0.9, 1.1)
    a = math.radians(spec['angle_deg'])
    ph1, ph2 = rng.random(2)
    tex = spec['texture']
    if tex == 'striped':
        w = (u * math.cos(a) + v * math.sin(a)) / period
        return (np.sin(2 * math.pi * (w + ph1)) > 0).astype(np.float64)
    if tex == 'checkered':
        cell = period * 0.6
        return ((np.floor(u / cell + ph1) + np.floor(v / cell + ph2)) % 2).astype(np.float64)
    if tex == 'dotted':
        sp = period * 1.1
        fu = (u / sp + ph1) % 1.0 - 0.5
        fv = (v / sp + ph2) % 1.0 - 0.5
        return (fu * fu + fv * fv < 0.3**2).astype(np.float64)
    if tex == 'gradient':
        w = (u * math.cos(a) + v * math.sin(a)) / (2.0 * radius)
        return np.clip(0.5 + w, 0.0, 1.0)
    if tex == 'grid':
        sp = period * 1.2
        return (((u / sp + ph1) % 1.0 < 0.28) | ((v / sp + ph2) % 1.0 < 0.28)).astype(np.float64)
    raise KeyError(tex)  # pragma: no cover


def _boxes_overlap(a, b, gap: int) -> bool:
    # boxes are (x0, y0, x1, y1) with inclusive pixel indices
    return not (a[2] + gap < b[0] or b[2] + gap < a[0] or a[3] + gap < b[1] or b[3] + gap < a[1])


def _place(rng, unit, size, area_lo, area_hi, taken, tries):
    """Random rotation/scale/position with mask area in [area_lo, area_hi] px and box
    clear of ``taken``.  Returns (poly list, mask, box, theta, centre, radius) or None."""
    a_unit = _polygon_area(unit)
    lim = size - 2 * _MARGIN
    for _ in range(tries):
        theta = float(rng.uniform(0, 2 * math.pi))
        c, s = math.cos(theta), math.sin(theta)
        p = unit @ np.array([[c, s], [-s, c]])
        lo_xy, hi_xy = p.min(0), p.max(0)
        ext = float((hi_xy - lo_xy).max())
        fit_area = a_unit * (lim / ext) ** 2
        hi = min(area_hi, fit_area)
        if hi < area_lo:
            continue
        scale = math.sqrt(float(rng.uniform(area_lo, hi)) / a_unit)
        ox = float(rng.uniform(_MARGIN - lo_xy[0] * scale, size - _MARGIN - hi_xy[0] * scale))
        oy = float(rng.uniform(_MARGIN - lo_xy[1] * scale, size - _MARGIN - hi_xy[1] * scale))
        q = np.round(p * scale + np.array([ox, oy]), 2)
        q = np.clip(q, _MARGIN * 0.5, size - _MARGIN * 0.5)
        # cheap rejection on the polygon's box before rasterising
        pbox = (int(q[:, 0].min()) - 1, int(q[:, 1].min()) - 1, int(q[:, 0].max()) + 1, int(q[:, 1].max()) + 1)
        if any(_boxes_overlap(pbox, t, _BOX_GAP) for t in taken):
            continue
        q5 = np.trunc(q * 5 + 0.5)
        if (q5 == np.roll(q5, -1, 0)).all(1).any():
            continue  # degenerate edge for the COCO rasteriser
        flat = [float(vv) for vv in q.reshape(-1)]
        mask = polygon_mask(flat, size, size)
        area = int(mask.sum())
        if not (area_lo <= area <= area_hi) or area == 0:
            continue
        rows = np.flatnonzero(mask.any(1))
        cols = np.flatnonzero(mask.any(0))
        box = (int(cols[0]), int(rows[0]), int(cols[-1]), int(rows[-1]))
        if any(_boxes_overlap(box, t, _BOX_GAP) for t in taken):
            continue
        return flat, mask, box, theta, (ox, oy), scale
    return None


def _render_scene(
    scene_seq: np.random.SeedSequence,
    main_cls: int,
    specs: list[dict],
    size: int,
    min_area: float,
    max_area: float,
    max_extra: int,
    color_consistency: float,
):
    rng = np.random.default_rng(scene_seq)
    img = _background(rng, size)
    label = np.zeros((size, size), np.uint8)
    n_px = size * size
    n_extra = int(rng.integers(0, max_extra + 1)) if max_extra > 0 else 0
    classes = [main_cls]
    others = [k for k in range(len(specs)) if k != main_cls]
    for _ in range(n_extra):
        classes.append(int(others[int(rng.integers(len(others)))]))

    objects, taken = [], []
    main_area = None
    for idx, k in enumerate(classes):
        spec = specs[k]
        unit = _unit_polygon(spec['shape'])
        if idx == 0:
            lo, hi = math.ceil(min_area * n_px), math.floor(max_area * n_px)
            placed = _place(rng, unit, size, lo, hi, taken, tries=400)
            if placed is None:
                raise RuntimeError(
                    f'could not place a {spec["shape"]} covering {min_area}..{max_area} of a '
                    f'{size}px image; widen min_area/max_area or increase image_size'
                )
        else:
            lo = max(1, math.ceil(_EXTRA_REL[0] * main_area))
            hi = math.floor(_EXTRA_REL[1] * main_area)
            placed = _place(rng, unit, size, lo, hi, taken, tries=100) if hi >= lo else None
            if placed is None:
                continue  # no room: drop this extra object
        poly, mask, box, theta, (cx, cy), radius = placed
        if idx == 0:
            main_area = int(mask.sum())
        taken.append(box)
        # paint the texture inside the mask (only within the box, for speed)
        x0, y0, x1, y1 = box
        yy, xx = np.mgrid[y0 : y1 + 1, x0 : x1 + 1].astype(np.float64) + 0.5
        dx, dy = xx - cx, yy - cy
        c, s = math.cos(theta), math.sin(theta)
        u, v = dx * c + dy * s, -dx * s + dy * c
        w = _texture(spec, u, v, radius, size, rng)[..., None]
        # colours: the class's home pair with probability color_consistency, else a
        # uniform draw from the shared palette.  Both draws are always made, so the
        # random stream (hence all geometry) does not depend on color_consistency.
        i1, i2 = (int(i) for i in rng.integers(0, PALETTE_HUES, 2))
        home = bool(rng.random() < color_consistency)
        if home:
            i1, i2 = spec['home_pair']['light'], spec['home_pair']['dark']
        c1 = np.array(PALETTE['light'][i1], np.float64)
        c2 = np.array(PALETTE['dark'][i2], np.float64)
        jit = rng.uniform(0.92, 1.08, 3) * rng.uniform(0.9, 1.1)
        col = (c2 + w * (c1 - c2)) * jit
        m = mask[y0 : y1 + 1, x0 : x1 + 1]
        region = img[y0 : y1 + 1, x0 : x1 + 1]
        region[m] = col[m] + rng.normal(0.0, 2.0, (int(m.sum()), 3))
        label[y0 : y1 + 1, x0 : x1 + 1][m] = k + 1
        # "colors" / "home" are internal (not written): palette indices and whether the
        # home pair was drawn (a uniform draw can also hit the home pair by chance)
        objects.append(
            {
                'category': k,
                'polygon': poly,
                'area': int(mask.sum()),
                'bbox': [float(x0), float(y0), float(x1 - x0 + 1), float(y1 - y0 + 1)],
                'colors': (i1, i2),
                'home': home,
            }
        )
    rgb = np.clip(np.rint(img), 0, 255).astype(np.uint8)
    return rgb, label, objects


def _scene(config: dict, specs: list[dict], split_index: int, i: int):
    """Render scene ``i`` of split ``split_index`` (0 = train, 1 = val) of a validated
    ``config``: ``(rgb, label, objects)``, exactly as written by :func:`generate_world`."""
    seq = np.random.SeedSequence(config['seed'], spawn_key=(split_index, i))
    return _render_scene(
        seq,
        i % config['num_classes'],
        specs,
        config['image_size'],
        config['min_area'],
        config['max_area'],
        config['max_extra_objects'],
        config['color_consistency'],
    )


# ------------------------------------------------------------------ validation / io
def _check_int(name, value, lo, hi=None):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f'{name} must be an integer, got {value!r}')
    if value < lo or (hi is not None and value > hi):
        want = f'>= {lo}' if hi is None else f'in [{lo}, {hi}]'
        raise ValueError(f'{name} must be {want}, got {value!r}')
    return int(value)


def _normalise_formats(formats) -> tuple[str, ...]:
    if isinstance(formats, str):
        formats = formats.split(',')
    items = [str(f).strip().lower() for f in formats]
    items = [f for f in items if f]
    bad = [f for f in items if f not in FORMATS]
    if bad or not items:
        raise ValueError(
            f'formats must be a non-empty comma list of {", ".join(FORMATS)}; got {bad if bad else formats!r}'
        )
    return tuple(f for f in FORMATS if f in items)


def _max_fit_fraction(shape: str) -> float:
    """Largest mask-area fraction a shape can reach inside the image (any rotation)."""
    unit = _unit_polygon(shape)
    a = _polygon_area(unit)
    best = 0.0
    for deg in range(0, 360, 2):
        t = math.radians(deg)
        c, s = math.cos(t), math.sin(t)
        p = unit @ np.array([[c, s], [-s, c]])
        best = max(best, a / float((p.max(0) - p.min(0)).max()) ** 2)
    return best


def _validate(
    seed,
    num_classes,
    image_size,
    train_per_class,
    val_per_class,
    max_extra_objects,
    min_area,
    max_area,
    formats,
    color_consistency=0.75,
) -> dict:
    seed = _check_int('seed', seed, 0)
    num_classes = _check_int('num_classes', num_classes, 2, MAX_CLASSES)
    image_size = _check_int('image_size', image_size, 32, 4096)
    train_per_class = _check_int('train_per_class', train_per_class, 1)
    val_per_class = _check_int('val_per_class', val_per_class, 0)
    max_extra_objects = _check_int('max_extra_objects', max_extra_objects, 0, 16)
    areas = {}
    for name, val in (('min_area', min_area), ('max_area', max_area)):
        if (
            isinstance(val, bool)
            or not isinstance(val, (int, float, np.floating, np.integer))
            or not math.isfinite(float(val))
            or not 0.0 < float(val) < 1.0
        ):
            raise ValueError(f'{name} must be an image-area fraction in (0, 1), got {val!r}')
        areas[name] = float(val)
    if areas['min_area'] > areas['max_area']:
        raise ValueError(
            f'min_area must be <= max_area, got min_area={areas["min_area"]} > max_area={areas["max_area"]}'
        )
    lim = (1 - 2 * _MARGIN / image_size) ** 2
    fit, shape = min((0.95 * _max_fit_fraction(sh) * lim, sh) for sh in SHAPES[: min(num_classes, len(SHAPES))])
    if areas['min_area'] > fit:
        raise ValueError(
            f'min_area must be <= {fit:.3f} (the largest image fraction a '
            f'{shape} can cover at image_size={image_size}), got {areas["min_area"]}'
        )
    n_px = image_size**2
    if math.floor(areas['max_area'] * n_px) < math.ceil(areas['min_area'] * n_px):
        raise ValueError(
            f'max_area - min_area must leave room for a whole pixel count at '
            f'image_size={image_size} ({n_px} px), got min_area={areas["min_area"]}, '
            f'max_area={areas["max_area"]}'
        )
    if areas['min_area'] * n_px < 16:
        raise ValueError(
            f'min_area must give a main object of >= 16 px at image_size='
            f'{image_size}, i.e. >= {16 / image_size**2:.4f}; got {areas["min_area"]}'
        )
    cc = color_consistency
    if (
        isinstance(cc, bool)
        or not isinstance(cc, (int, float, np.floating, np.integer))
        or not math.isfinite(float(cc))
        or not 0.0 <= float(cc) <= 1.0
    ):
        raise ValueError(f'color_consistency must be a probability in [0, 1], got {cc!r}')
    return {
        'generator_version': GENERATOR_VERSION,
        'seed': seed,
        'num_classes': num_classes,
        'image_size': image_size,
        'train_per_class': train_per_class,
        'val_per_class': val_per_class,
        'max_extra_objects': max_extra_objects,
        'min_area': areas['min_area'],
        'max_area': areas['max_area'],
        'color_consistency': float(cc),
        'formats': list(_normalise_formats(formats)),
    }


def _jpeg_bytes(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb, 'RGB').save(buf, format='JPEG', quality=95, subsampling=0, optimize=False, progressive=False)
    return buf.getvalue()


def _png_bytes(label: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(label, 'L').save(buf, format='PNG', compress_level=6, optimize=False)
    return buf.getvalue()


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _json_dump(obj, indent=1) -> str:
    seps = (',', ':') if indent is None else (',', ': ')
    return json.dumps(obj, indent=indent, separators=seps, ensure_ascii=True) + '\n'


def _stats(values) -> dict:
    if not values:
        return {'count': 0, 'min': None, 'mean': None, 'max': None}
    a = np.asarray(values, np.float64)
    return {
        'count': int(a.size),
        'min': round(float(a.min()), 6),
        'mean': round(float(a.mean()), 6),
        'max': round(float(a.max()), 6),
    }


# ------------------------------------------------------------------ public API
def _generate(
    out,
    *,
    seed,
    num_classes,
    image_size,
    train_per_class,
    val_per_class,
    max_extra_objects,
    min_area,
    max_area,
    color_consistency,
    formats,
    force,
):
    config = _validate(
        seed,
        num_classes,
        image_size,
        train_per_class,
        val_per_class,
        max_extra_objects,
        min_area,
        max_area,
        formats,
        color_consistency,
    )
    out = Path(out)
    meta_path = out / 'world.json'
    if out.exists() and not out.is_dir():
        raise ValueError(f'out must be a directory, got existing file {str(out)!r}')
    if meta_path.is_file() and not force:
        try:
            old = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            old = None
        if isinstance(old, dict) and old.get('config') == config and not (out / _MARKER).exists():
            return old, False

    ours = meta_path.is_file() or (out / _MARKER).exists()
    stale = [d for d in FORMATS if (out / d).exists()]
    if stale and not (ours or force):
        raise ValueError(
            f'out {str(out)!r} already has {", ".join(stale)}/ not written by '
            f'tokenaug-data (no world.json); choose an empty directory or pass force'
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / _MARKER).write_text('generation in progress\n')
    if meta_path.exists():
        meta_path.unlink()
    for d in stale:
        shutil.rmtree(out / d)

    K, S = config['num_classes'], config['image_size']
    fmts = set(config['formats'])
    specs = class_specs(K)
    names = [s['name'] for s in specs]
    categories = [{'id': k + 1, 'name': names[k], 'supercategory': specs[k]['shape']} for k in range(K)]
    counts, area_stats = {}, {}
    next_id = 1
    for s_idx, (split, ade_split, coco_split) in enumerate(_SPLITS):
        per_class = config['train_per_class'] if s_idx == 0 else config['val_per_class']
        n = per_class * K
        images, anns = [], []
        main_fr, extra_fr, extra_rel = [], [], []
        n_objects = 0
        inst = [0] * K
        for i in range(n):
            main_cls = i % K
            rgb, label, objects = _scene(config, specs, s_idx, i)
            img_id = next_id
            next_id += 1
            stem = f'{img_id:06d}'
            jpg = _jpeg_bytes(rgb)
            if 'imagenet' in fmts:
                _write(out / 'imagenet' / split / names[main_cls] / f'{stem}.jpg', jpg)
            if 'ade20k' in fmts:
                _write(out / 'ade20k' / 'images' / ade_split / f'{stem}.jpg', jpg)
                _write(out / 'ade20k' / 'annotations' / ade_split / f'{stem}.png', _png_bytes(label))
            if 'coco' in fmts:
                _write(out / 'coco' / coco_split / f'{stem}.jpg', jpg)
            images.append({'id': img_id, 'file_name': f'{stem}.jpg', 'height': S, 'width': S})
            for j, ob in enumerate(objects):
                anns.append(
                    {
                        'id': len(anns) + 1,
                        'image_id': img_id,
                        'category_id': ob['category'] + 1,
                        'bbox': ob['bbox'],
                        'area': ob['area'],
                        'segmentation': [ob['polygon']],
                        'iscrowd': 0,
                    }
                )
                inst[ob['category']] += 1
                if j == 0:
                    main_fr.append(ob['area'] / (S * S))
                else:
                    extra_fr.append(ob['area'] / (S * S))
                    extra_rel.append(ob['area'] / objects[0]['area'])
            n_objects += len(objects)
        if 'coco' in fmts:
            coco = {
                'info': {'description': 'tokenaug synthetic world', 'version': str(GENERATOR_VERSION)},
                'licenses': [],
                'images': images,
                'annotations': anns,
                'categories': categories,
            }
            _write(
                out / 'coco' / 'annotations' / f'instances_{coco_split}.json', _json_dump(coco, indent=None).encode()
            )
        counts[split] = {
            'images': n,
            'images_per_class': per_class,
            'objects': n_objects,
            'extra_objects': n_objects - n,
            'instances_per_class': inst,
        }
        area_stats[split] = {
            'main_object_fraction': _stats(main_fr),
            'extra_object_fraction': _stats(extra_fr),
            'extra_over_main_area': _stats(extra_rel),
        }

    paths = {}
    if 'imagenet' in fmts:
        paths['imagenet'] = {'root': 'imagenet', 'train': 'imagenet/train', 'val': 'imagenet/val'}
    if 'ade20k' in fmts:
        paths['ade20k'] = {
            'root': 'ade20k',
            'train': {'img': 'ade20k/images/training', 'seg': 'ade20k/annotations/training'},
            'val': {'img': 'ade20k/images/validation', 'seg': 'ade20k/annotations/validation'},
        }
    if 'coco' in fmts:
        paths['coco'] = {
            'root': 'coco',
            'train': {'img': 'coco/train2017', 'ann': 'coco/annotations/instances_train2017.json'},
            'val': {'img': 'coco/val2017', 'ann': 'coco/annotations/instances_val2017.json'},
        }
    world = {
        'name': 'tokenaug synthetic world',
        'config': config,
        'seed': config['seed'],
        'image_size': [S, S],
        'num_classes': K,
        'class_names': names,
        'classes': [{k2: s[k2] for k2 in ('id', 'name', 'shape', 'texture', 'home_pair')} for s in specs],
        'palette': {
            **PALETTE,
            'note': 'shared by all classes: with probability color_consistency '
            "an object instance paints its texture with its class's "
            'home_pair (light, dark palette indices), otherwise with '
            'one light and one dark colour drawn uniformly '
            '(independent indices)',
        },
        'counts': counts,
        'area_stats': area_stats,
        'formats': paths,
        'file_names': "f'{id:06d}' with integer ids unique over train and val; the same id is the "
        'same scene (byte-identical JPEG) in every format',
        'label_conventions': {
            'imagenet': "folder name = class name of the scene's main object; names start with the "
            '2-digit class index so alphabetical order = class index',
            'ade20k': 'single-channel uint8 PNG: 0 = background, k+1 = class k (class_names[k]); '
            'mmseg: reduce_zero_label=True -> classes = class_names (background ignored), '
            "or reduce_zero_label=False with classes = ['background'] + class_names",
            'coco': 'category_id = k+1 for class k; one polygon per object, exact: pycocotools '
            'annToMask reproduces the ADE20K mask; area = mask pixels; bbox = tight pixel '
            'box [x, y, w, h]; objects never overlap; the first annotation of an image is '
            'its main object',
        },
    }
    _write(meta_path, _json_dump(world).encode())
    (out / _MARKER).unlink()
    return world, True


def generate_world(
    out,
    *,
    seed: int = 0,
    num_classes: int = 10,
    image_size: int = 112,
    train_per_class: int = 40,
    val_per_class: int = 10,
    max_extra_objects: int = 1,
    min_area: float = 0.08,
    max_area: float = 0.35,
    color_consistency: float = 0.75,
    formats=FORMATS,
    force: bool = False,
) -> dict:
    """Write the synthetic world under ``out`` and return the ``world.json`` content.

    If ``out/world.json`` exists with the same configuration, nothing is written and its
    content is returned, unless ``force``.  Raises ``ValueError`` on bad arguments.
    """
    world, _ = _generate(
        out,
        seed=seed,
        num_classes=num_classes,
        image_size=image_size,
        train_per_class=train_per_class,
        val_per_class=val_per_class,
        max_extra_objects=max_extra_objects,
        min_area=min_area,
        max_area=max_area,
        color_consistency=color_consistency,
        formats=formats,
        force=force,
    )
    return world


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog='tokenaug-data',
        description='Write a deterministic synthetic world of textured objects as ImageNet '
        'folders, ADE20K label maps and COCO instances (same scenes in all).',
    )
    p.add_argument(
        '--out', default='data/world', help='output directory (default: data/world, where the world configs read)'
    )
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--num-classes', type=int, default=10, help=f'2..{MAX_CLASSES} (default 10)')
    p.add_argument('--image-size', type=int, default=112, help='square image side, >= 32 (default 112)')
    p.add_argument('--train-per-class', type=int, default=40)
    p.add_argument('--val-per-class', type=int, default=10)
    p.add_argument(
        '--max-extra-objects',
        type=int,
        default=1,
        help='extra smaller objects of other classes per scene: 0..N (default 1)',
    )
    p.add_argument('--min-area', type=float, default=0.08, help='main object min image fraction')
    p.add_argument('--max-area', type=float, default=0.35, help='main object max image fraction')
    p.add_argument(
        '--color-consistency',
        type=float,
        default=0.75,
        help="probability in [0, 1] that an object is painted in its class's home "
        'colour pair instead of a uniformly drawn one (default 0.75)',
    )
    p.add_argument('--formats', default=','.join(FORMATS), help='comma list of imagenet,ade20k,coco (default: all)')
    p.add_argument('--force', action='store_true', help='regenerate even if world.json matches')
    return p


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        world, generated = _generate(
            args.out,
            seed=args.seed,
            num_classes=args.num_classes,
            image_size=args.image_size,
            train_per_class=args.train_per_class,
            val_per_class=args.val_per_class,
            max_extra_objects=args.max_extra_objects,
            min_area=args.min_area,
            max_area=args.max_area,
            color_consistency=args.color_consistency,
            formats=args.formats,
            force=args.force,
        )
    except (ValueError, RuntimeError) as e:
        parser.error(str(e))
    except OSError as e:  # an --out the user cannot write (permissions, a read-only or full disk, /proc)
        parser.error(f'--out {args.out}: cannot write the world there: {e.strerror or e}')
    c = world['counts']
    summary = (
        f'{world["num_classes"]} classes, {c["train"]["images"]} train + '
        f'{c["val"]["images"]} val scenes ({c["train"]["objects"] + c["val"]["objects"]} '
        f'objects), {world["image_size"][0]}px, formats: {", ".join(world["formats"])}'
    )
    if generated:
        print(f'tokenaug-data: wrote {summary} to {args.out} in {time.perf_counter() - t0:.1f}s')
    else:
        print(
            f'tokenaug-data: {args.out}/world.json already matches these arguments ({summary}); '
            f'skipped (use --force to regenerate)'
        )
    return 0


if __name__ == '__main__':  # pragma: no cover
    sys.exit(main())
