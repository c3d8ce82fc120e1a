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
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Sequence, Union

import numpy as np
from PIL import Image

from shared_core.tools.world_render import (
    GENERATOR_VERSION,
    MARGIN,
    MAX_CLASSES,
    PALETTE,
    PALETTE_HUES,
    SHAPES,
    TEXTURES,
    class_specs,
    max_fit_fraction,
    polygon_mask,
    scene,
)

__all__ = [
    'generate_world',
    'WorldConfig',
    'main',
    'SHAPES',
    'TEXTURES',
    'FORMATS',
    'MAX_CLASSES',
    'class_specs',
    'polygon_mask',
    'PALETTE',
    'PALETTE_HUES',
]

FORMATS = ('imagenet', 'ade20k', 'coco')
_SPLITS = (('train', 'training', 'train2017'), ('val', 'validation', 'val2017'))
_MARKER = '.tokenaug-world-incomplete'


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


def _validate(c: 'WorldConfig') -> dict:
    """The checked configuration as ``world.json`` records it; ``ValueError`` naming a bad field."""
    seed, num_classes, image_size, formats = c.seed, c.num_classes, c.image_size, c.formats
    train_per_class, val_per_class, max_extra_objects = c.train_per_class, c.val_per_class, c.max_extra_objects
    min_area, max_area, color_consistency = c.min_area, c.max_area, c.color_consistency
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
    lim = (1 - 2 * MARGIN / image_size) ** 2
    fit, shape = min((0.95 * max_fit_fraction(sh) * lim, sh) for sh in SHAPES[: min(num_classes, len(SHAPES))])
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
@dataclass(frozen=True)
class WorldConfig:
    """A world's parameters with their defaults: ``tokenaug-data``'s flags and :func:`generate_world`'s keywords.

    ``min_area`` / ``max_area``: the main object's share of the image; ``max_extra_objects``: smaller objects of
    other classes per scene; ``color_consistency``: the probability that an object wears its class's home colour
    pair; ``formats``: a comma list or a sequence of ``imagenet``, ``ade20k``, ``coco``.
    """

    seed: int = 0
    num_classes: int = 10
    image_size: int = 112
    train_per_class: int = 40
    val_per_class: int = 10
    max_extra_objects: int = 1
    min_area: float = 0.08
    max_area: float = 0.35
    color_consistency: float = 0.75
    formats: Union[str, Sequence[str]] = FORMATS

    def validated(self) -> dict:
        """The checked configuration as ``world.json`` records it; ``ValueError`` naming a bad field."""
        return _validate(self)


def _prepare(out: Path, config: dict, force: bool):
    """``world.json``'s content where ``out`` already holds this world (nothing to do), else ``None`` after
    clearing what a previous generation of ours left (marked incomplete until the end)."""
    meta_path = out / 'world.json'
    if out.exists() and not out.is_dir():
        raise ValueError(f'out must be a directory, got existing file {str(out)!r}')
    if meta_path.is_file() and not force:
        try:
            old = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            old = None
        if isinstance(old, dict) and old.get('config') == config and not (out / _MARKER).exists():
            return old
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
    return None


def _write_splits(out: Path, config: dict, specs: list) -> tuple[dict, dict]:
    """Every scene of both splits in every format; ``(counts, area_stats)`` per split."""
    K, S = config['num_classes'], config['image_size']
    fmts = set(config['formats'])
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
            rgb, label, objects = scene(config, specs, s_idx, i)
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
    return counts, area_stats


def _world_json(config: dict, specs: list, counts: dict, area_stats: dict) -> dict:
    """``world.json``: the configuration, the classes, the palette, the counts, the paths and the conventions."""
    K, S = config['num_classes'], config['image_size']
    fmts = set(config['formats'])
    names = [s['name'] for s in specs]
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
    return world


def _generate(out, config: WorldConfig, force: bool):
    """``(world.json's content, whether it was written)``."""
    checked = config.validated()
    out = Path(out)
    old = _prepare(out, checked, force)
    if old is not None:
        return old, False
    specs = class_specs(checked['num_classes'])
    counts, area_stats = _write_splits(out, checked, specs)
    world = _world_json(checked, specs, counts, area_stats)
    _write(out / 'world.json', _json_dump(world).encode())
    (out / _MARKER).unlink()
    return world, True


def generate_world(out, *, force: bool = False, **fields) -> dict:
    """Write the synthetic world under ``out`` and return the ``world.json`` content; ``fields`` are
    :class:`WorldConfig`'s (``seed``, ``num_classes``, ``image_size``, ``train_per_class``, ``val_per_class``,
    ``max_extra_objects``, ``min_area``, ``max_area``, ``color_consistency``, ``formats``), defaults elsewhere.

    If ``out/world.json`` exists with the same configuration, nothing is written and its
    content is returned, unless ``force``.  Raises ``ValueError`` on bad arguments.
    """
    return _generate(out, WorldConfig(**fields), force)[0]


def _parser() -> argparse.ArgumentParser:
    d = WorldConfig()  # the defaults, in one place
    p = argparse.ArgumentParser(
        prog='tokenaug-data',
        description='Write a deterministic synthetic world of textured objects as ImageNet '
        'folders, ADE20K label maps and COCO instances (same scenes in all).',
    )
    p.add_argument(
        '--out', default='data/world', help='output directory (default: data/world, where the world configs read)'
    )
    p.add_argument('--seed', type=int, default=d.seed)
    p.add_argument('--num-classes', type=int, default=d.num_classes, help=f'2..{MAX_CLASSES} (default {d.num_classes})')
    side = f'square image side, >= 32 (default {d.image_size})'
    p.add_argument('--image-size', type=int, default=d.image_size, help=side)
    p.add_argument('--train-per-class', type=int, default=d.train_per_class)
    p.add_argument('--val-per-class', type=int, default=d.val_per_class)
    p.add_argument(
        '--max-extra-objects',
        type=int,
        default=d.max_extra_objects,
        help=f'extra smaller objects of other classes per scene: 0..N (default {d.max_extra_objects})',
    )
    p.add_argument('--min-area', type=float, default=d.min_area, help='main object min image fraction')
    p.add_argument('--max-area', type=float, default=d.max_area, help='main object max image fraction')
    p.add_argument(
        '--color-consistency',
        type=float,
        default=d.color_consistency,
        help="probability in [0, 1] that an object is painted in its class's home "
        f'colour pair instead of a uniformly drawn one (default {d.color_consistency})',
    )
    p.add_argument('--formats', default=','.join(d.formats), help='comma list of imagenet,ade20k,coco (default: all)')
    p.add_argument('--force', action='store_true', help='regenerate even if world.json matches')
    return p


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        config = WorldConfig(**{f.name: getattr(args, f.name) for f in fields(WorldConfig)})
        world, generated = _generate(args.out, config, args.force)
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
