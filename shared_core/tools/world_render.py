"""The synthetic world's scenes (:mod:`shared_core.tools.world` writes them): the shapes and their exact polygons,
the rasteriser that matches COCO's, the palette and the classes, and the rendering of one scene from its seed.

A scene is a function of the world's configuration, its split and its index only (:func:`scene`), so every
format and every rerun writes the same bytes.
"""

from __future__ import annotations

import colorsys
import math

import numpy as np
from PIL import Image, ImageDraw

__all__ = [
    'GENERATOR_VERSION',
    'SHAPES',
    'TEXTURES',
    'MAX_CLASSES',
    'PALETTE',
    'PALETTE_HUES',
    'class_specs',
    'polygon_mask',
    'max_fit_fraction',
    'scene',
]

# 1: per-class colour palettes; 2: one palette shared by all classes, colours drawn per instance;
# 3: per-class home colour pair used with probability color_consistency, else uniform draw
GENERATOR_VERSION = 3
SHAPES = ('circle', 'square', 'triangle', 'star', 'hexagon', 'cross', 'diamond', 'arrow', 'pentagon', 'lshape')
TEXTURES = ('striped', 'checkered', 'dotted', 'gradient', 'grid')
MAX_CLASSES = len(SHAPES) * len(TEXTURES)
MARGIN = 1.0  # polygon vertices stay at least this far (px) from the image border
_BOX_GAP = 2  # min gap (px) between the pixel boxes of two objects of a scene
_EXTRA_REL = (0.2, 0.5)  # extra object area relative to the main object's area


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
    """The RGB colour (0-255, float64) of hue ``h`` in [0, 1), saturation ``s`` and value ``v``."""
    return np.array(colorsys.hsv_to_rgb(h, s, v), np.float64) * 255.0


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
    lim = size - 2 * MARGIN
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
        ox = float(rng.uniform(MARGIN - lo_xy[0] * scale, size - MARGIN - hi_xy[0] * scale))
        oy = float(rng.uniform(MARGIN - lo_xy[1] * scale, size - MARGIN - hi_xy[1] * scale))
        q = np.round(p * scale + np.array([ox, oy]), 2)
        q = np.clip(q, MARGIN * 0.5, size - MARGIN * 0.5)
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


def scene(config: dict, specs: list[dict], split_index: int, i: int):
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


def max_fit_fraction(shape: str) -> float:
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
