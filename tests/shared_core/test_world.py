"""Tests for shared_core.tools.world (the synthetic ImageNet / ADE20K / COCO world)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shared_core.tools import world as W

SMALL = dict(
    seed=3,
    num_classes=4,
    image_size=48,
    train_per_class=3,
    val_per_class=2,
    max_extra_objects=2,
    min_area=0.1,
    max_area=0.3,
)
SPLITS = (('train', 'training', 'train2017'), ('val', 'validation', 'val2017'))


@pytest.fixture(scope='module')
def small_world(tmp_path_factory):
    out = tmp_path_factory.mktemp('world')
    meta = W.generate_world(out, **SMALL)
    return out, meta


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob('*')) if p.is_file()}


def _coco(out: Path, coco_split: str) -> dict:
    return json.loads((out / 'coco' / 'annotations' / f'instances_{coco_split}.json').read_text())


def _anns_by_image(coco: dict) -> dict[int, list[dict]]:
    by: dict[int, list[dict]] = {im['id']: [] for im in coco['images']}
    for a in coco['annotations']:
        by[a['image_id']].append(a)
    return by


def test_determinism_byte_identical(tmp_path, small_world):
    out1, _ = small_world
    out2 = tmp_path / 'again'
    W.generate_world(out2, **SMALL)
    f1, f2 = _files(out1), _files(out2)
    assert f1.keys() == f2.keys()
    assert all(f1[k] == f2[k] for k in f1), [k for k in f1 if f1[k] != f2[k]]
    # a different seed gives different images
    out3 = tmp_path / 'other'
    W.generate_world(out3, **{**SMALL, 'seed': 4})
    f3 = _files(out3)
    jpgs = [k for k in f1 if k.endswith('.jpg')]
    assert all(f1[k] != f3[k] for k in jpgs)


def test_layout_and_counts(small_world):
    out, meta = small_world
    K, S = SMALL['num_classes'], SMALL['image_size']
    names = meta['class_names']
    assert len(names) == K and len(set(names)) == K and names == sorted(names)
    ids_seen = set()
    for split, ade, cs in SPLITS:
        per = SMALL['train_per_class'] if split == 'train' else SMALL['val_per_class']
        n = per * K
        assert sorted(p.name for p in (out / 'imagenet' / split).iterdir()) == names
        for name in names:
            assert len(list((out / 'imagenet' / split / name).glob('*.jpg'))) == per
        imgs = sorted((out / 'ade20k' / 'images' / ade).glob('*.jpg'))
        anns = sorted((out / 'ade20k' / 'annotations' / ade).glob('*.png'))
        cocos = sorted((out / 'coco' / cs).glob('*.jpg'))
        assert len(imgs) == len(anns) == len(cocos) == n
        assert [p.stem for p in imgs] == [p.stem for p in anns] == [p.stem for p in cocos]
        coco = _coco(out, cs)
        assert len(coco['images']) == n
        assert sorted(f'{im["id"]:06d}.jpg' for im in coco['images']) == [p.name for p in cocos]
        assert [c['id'] for c in coco['categories']] == list(range(1, K + 1))
        assert [c['name'] for c in coco['categories']] == names
        for im in coco['images']:
            assert (im['height'], im['width']) == (S, S)
        ids = {im['id'] for im in coco['images']}
        assert not ids & ids_seen  # ids unique over splits
        ids_seen |= ids
        assert meta['counts'][split]['images'] == n
        assert meta['counts'][split]['objects'] == len(coco['annotations'])
        # same scene = same bytes in every format
        for p in imgs:
            b = p.read_bytes()
            assert (out / 'coco' / cs / p.name).read_bytes() == b
            assert len([q for q in (out / 'imagenet' / split).glob(f'*/{p.name}') if q.read_bytes() == b]) == 1
        # image / label formats
        with Image.open(imgs[0]) as im:
            assert im.format == 'JPEG' and im.mode == 'RGB' and im.size == (S, S)
        with Image.open(anns[0]) as im:
            assert im.format == 'PNG' and im.mode == 'L' and im.size == (S, S)
    on_disk = json.loads((out / 'world.json').read_text())
    assert on_disk == meta
    assert meta['seed'] == SMALL['seed'] and meta['image_size'] == [S, S]
    for fmt in W.FORMATS:
        assert fmt in meta['formats'] and fmt in meta['label_conventions']
    assert not (out / W._MARKER).exists()


def test_labels_consistent_across_formats(small_world):
    out, _ = small_world
    S = SMALL['image_size']
    for split, ade, cs in SPLITS:
        coco = _coco(out, cs)
        by = _anns_by_image(coco)
        cls_of = {p.stem: p.parent.name for p in (out / 'imagenet' / split).glob('*/*.jpg')}
        names = [c['name'] for c in coco['categories']]
        for im in coco['images']:
            stem = f'{im["id"]:06d}'
            anns = by[im['id']]
            assert 1 <= len(anns) <= 1 + SMALL['max_extra_objects']
            main = anns[0]
            # ImageNet label = main object = largest object in COCO and in the label map
            assert names[main['category_id'] - 1] == cls_of[stem]
            assert main['area'] == max(a['area'] for a in anns)
            png = np.asarray(Image.open(out / 'ade20k' / 'annotations' / ade / f'{stem}.png'))
            assert png.dtype == np.uint8 and png.shape == (S, S)
            # pixel count of class k+1 == sum of COCO areas of category k+1
            vals, cnts = np.unique(png, return_counts=True)
            hist = dict(zip(vals.tolist(), cnts.tolist()))
            per_cat: dict[int, int] = {}
            for a in anns:
                per_cat[a['category_id']] = per_cat.get(a['category_id'], 0) + a['area']
            assert {k: v for k, v in hist.items() if k != 0} == per_cat
            assert hist.get(0, 0) == S * S - sum(per_cat.values())
            # each bbox tightly encloses its object's mask pixels; boxes don't overlap
            for a in anns:
                x, y, w, h = a['bbox']
                assert all(isinstance(v, float) and float(v).is_integer() for v in a['bbox'])
                x, y, w, h = int(x), int(y), int(w), int(h)
                inside = png[y : y + h, x : x + w] == a['category_id']
                assert inside.sum() == a['area']
                rows, cols = np.flatnonzero(inside.any(1)), np.flatnonzero(inside.any(0))
                assert (rows[0], rows[-1], cols[0], cols[-1]) == (0, h - 1, 0, w - 1)
                assert a['iscrowd'] == 0 and len(a['segmentation']) == 1
                assert set(a) == {'id', 'image_id', 'category_id', 'bbox', 'area', 'segmentation', 'iscrowd'}
                assert len(a['segmentation'][0]) >= 6 and len(a['segmentation'][0]) % 2 == 0
            for i, a in enumerate(anns):
                for b in anns[i + 1 :]:
                    ax, ay, aw, ah = a['bbox']
                    bx, by_, bw, bh = b['bbox']
                    assert ax + aw <= bx or bx + bw <= ax or ay + ah <= by_ or by_ + bh <= ay


def test_polygons_rasterise_to_label_map(small_world):
    out, _ = small_world
    S = SMALL['image_size']
    for _, ade, cs in SPLITS:
        coco = _coco(out, cs)
        for a in coco['annotations']:
            png = np.asarray(Image.open(out / 'ade20k' / 'annotations' / ade / f'{a["image_id"]:06d}.png'))
            x, y, w, h = (int(v) for v in a['bbox'])
            expect = np.zeros((S, S), bool)
            expect[y : y + h, x : x + w] = png[y : y + h, x : x + w] == a['category_id']
            got = W.polygon_mask(a['segmentation'][0], S, S)
            assert (got == expect).all()


def test_area_fractions(small_world):
    out, meta = small_world
    S = SMALL['image_size']
    for split, _, cs in SPLITS:
        by = _anns_by_image(_coco(out, cs))
        fr = []
        for anns in by.values():
            main = anns[0]
            f = main['area'] / S**2
            assert SMALL['min_area'] <= f <= SMALL['max_area']
            fr.append(f)
            for a in anns[1:]:
                assert a['category_id'] != main['category_id']
                assert 0 < a['area'] <= 0.5 * main['area']
        st = meta['area_stats'][split]['main_object_fraction']
        assert st['count'] == len(fr)
        assert st['min'] == pytest.approx(min(fr), abs=1e-6)
        assert st['max'] == pytest.approx(max(fr), abs=1e-6)


def test_background_not_flat(small_world):
    out, _ = small_world
    for p in sorted((out / 'ade20k' / 'images' / 'training').glob('*.jpg'))[:4]:
        img = np.asarray(Image.open(p), np.float64)
        png = np.asarray(Image.open(out / 'ade20k' / 'annotations' / 'training' / f'{p.stem}.png'))
        bg = img[png == 0]
        assert bg.std(0).mean() > 5.0


@pytest.mark.filterwarnings('ignore::DeprecationWarning')
def test_pycocotools_ann_to_mask(small_world):
    import pycocotools.coco as coco_mod  # pinned in constraints.txt (mmdet needs it): must run
    import pycocotools.mask as mask_mod

    out, _ = small_world
    for _, ade, cs in SPLITS:
        ann_file = out / 'coco' / 'annotations' / f'instances_{cs}.json'
        c = coco_mod.COCO(str(ann_file))
        assert len(c.getImgIds()) == len(c.dataset['images'])
        for a in c.dataset['annotations']:
            m = c.annToMask(a).astype(bool)
            png = np.asarray(Image.open(out / 'ade20k' / 'annotations' / ade / f'{a["image_id"]:06d}.png'))
            x, y, w, h = (int(v) for v in a['bbox'])
            expect = np.zeros_like(m)
            expect[y : y + h, x : x + w] = png[y : y + h, x : x + w] == a['category_id']
            assert (m == expect).all()
            rle = c.annToRLE(a)
            assert int(mask_mod.area(rle)) == a['area']
            assert [float(v) for v in mask_mod.toBbox(rle)] == a['bbox']


@pytest.mark.filterwarnings('ignore::DeprecationWarning')
def test_polygon_mask_matches_pycocotools_random():
    import pycocotools.mask as mask_mod

    rng = np.random.default_rng(0)
    for _ in range(200):
        h, w = (int(v) for v in rng.integers(16, 60, 2))
        n = int(rng.integers(3, 25))
        ang = np.sort(rng.uniform(0, 2 * np.pi, n))
        r = rng.uniform(1, min(h, w) / 2 - 1, n)
        pts = np.round(np.stack([w / 2 + r * np.cos(ang), h / 2 + r * np.sin(ang)], 1), 2)
        q5 = np.trunc(pts * 5 + 0.5)
        if (q5 == np.roll(q5, -1, 0)).all(1).any():
            continue
        poly = [float(v) for v in pts.reshape(-1)]
        ref = mask_mod.decode(mask_mod.merge(mask_mod.frPyObjects([poly], h, w))).astype(bool)
        assert (W.polygon_mask(poly, h, w) == ref).all()


def test_idempotent_force_and_stale_cleanup(tmp_path):
    out = tmp_path / 'w'
    args = dict(SMALL, train_per_class=1, val_per_class=1, num_classes=3)
    m1 = W.generate_world(out, **args)
    stamp = (out / 'world.json').stat().st_mtime_ns
    marker = out / 'imagenet' / 'train' / 'keep.txt'
    marker.write_text('x')
    assert W.generate_world(out, **args) == m1  # skipped
    assert marker.exists() and (out / 'world.json').stat().st_mtime_ns == stamp
    W.generate_world(out, **args, force=True)  # regenerated from scratch
    assert not marker.exists()
    assert json.loads((out / 'world.json').read_text()) == m1
    # different arguments: regenerate, and remove formats no longer requested
    m2 = W.generate_world(out, **dict(args, num_classes=2, formats=('imagenet',)))
    assert m2['config']['formats'] == ['imagenet'] and set(m2['formats']) == {'imagenet'}
    assert not (out / 'coco').exists() and not (out / 'ade20k').exists()
    assert len(list((out / 'imagenet' / 'train').iterdir())) == 2


def test_refuses_foreign_directory(tmp_path):
    (tmp_path / 'coco').mkdir()
    (tmp_path / 'coco' / 'mine.json').write_text('{}')
    with pytest.raises(ValueError, match='out'):
        W.generate_world(tmp_path, **dict(SMALL, train_per_class=1, val_per_class=1))
    assert (tmp_path / 'coco' / 'mine.json').exists()


def test_formats_subset_same_scenes(tmp_path, small_world):
    out_all, _ = small_world
    out = tmp_path / 'coco_only'
    W.generate_world(out, **SMALL, formats='coco')
    assert not (out / 'imagenet').exists() and not (out / 'ade20k').exists()
    for p in (out / 'coco' / 'val2017').glob('*.jpg'):
        assert p.read_bytes() == (out_all / 'coco' / 'val2017' / p.name).read_bytes()
    assert (out / 'coco' / 'annotations' / 'instances_val2017.json').read_bytes() == (
        out_all / 'coco' / 'annotations' / 'instances_val2017.json'
    ).read_bytes()


def test_many_classes_unique(tmp_path):
    specs = W.class_specs(W.MAX_CLASSES)
    combos = {(s['shape'], s['texture']) for s in specs}
    assert len(combos) == W.MAX_CLASSES >= 20
    assert len({s['name'] for s in specs}) == W.MAX_CLASSES
    meta = W.generate_world(
        tmp_path, **dict(SMALL, num_classes=20, image_size=32, train_per_class=1, val_per_class=0, formats=['ade20k'])
    )
    assert meta['counts']['train']['images'] == 20 and meta['counts']['val']['images'] == 0
    labels = set()
    for p in (tmp_path / 'ade20k' / 'annotations' / 'training').glob('*.png'):
        labels |= set(np.unique(np.asarray(Image.open(p))).tolist())
    assert set(range(1, 21)) <= labels <= set(range(0, 21))


def _object_colours(out: Path):
    """Per ADE20K label value of every scene: class, mean RGB in [0, 1]; per image the
    median HSV saturation of object and of background pixels."""
    cls, mean_rgb, sat_obj, sat_bg = [], [], [], []
    for _, ade, _ in SPLITS:
        for p in sorted((out / 'ade20k' / 'images' / ade).glob('*.jpg')):
            img = np.asarray(Image.open(p), np.float64) / 255.0
            lab = np.asarray(Image.open(out / 'ade20k' / 'annotations' / ade / f'{p.stem}.png'))
            mx, mn = img.max(-1), img.min(-1)
            sat = (mx - mn) / np.maximum(mx, 1e-6)
            sat_obj.append(float(np.median(sat[lab > 0])))
            sat_bg.append(float(np.median(sat[lab == 0])))
            for v in np.unique(lab)[1:]:  # one class per label value: instances of a scene differ
                cls.append(int(v) - 1)
                mean_rgb.append(img[lab == v].mean(0))
    return np.array(cls), np.array(mean_rgb), np.array(sat_obj), np.array(sat_bg)


def _nearest_class_mean_accuracy(cls: np.ndarray, rgb: np.ndarray, K: int) -> float:
    """Accuracy of a nearest-class-mean classifier on mean RGB, fitted and scored on the
    same objects (an upper bound on what the mean colour tells about the class)."""
    centres = np.stack([rgb[cls == k].mean(0) for k in range(K)])
    pred = ((rgb[:, None] - centres[None]) ** 2).sum(-1).argmin(1)
    return float((pred == cls).mean())


@pytest.fixture(scope='module')
def default_world_objects(tmp_path_factory):
    """Objects of the default world but with color_consistency=0 (colours uniform)."""
    out = tmp_path_factory.mktemp('uniform_colour_world')
    meta = W.generate_world(out, formats='ade20k', color_consistency=0.0)
    return (meta, *_object_colours(out))


@pytest.fixture(scope='module')
def default_world(tmp_path_factory):
    """The default world (default color_consistency), ADE20K only."""
    out = tmp_path_factory.mktemp('default_world')
    return out, W.generate_world(out, formats='ade20k')


def _all_objects(config: dict) -> list[dict]:
    """Every object of every scene of ``config`` (internal records, incl. colour draw)."""
    specs = W.class_specs(config['num_classes'])
    n = {0: config['train_per_class'], 1: config['val_per_class']}
    return [ob for s in (0, 1) for i in range(n[s] * config['num_classes']) for ob in W.scene(config, specs, s, i)[2]]


def _home_fraction(objects: list[dict], specs: list[dict]) -> tuple[float, float]:
    """(fraction drawn as home pair, fraction whose palette indices equal the home pair)."""
    drawn = np.mean([ob['home'] for ob in objects])
    pair = np.mean(
        [
            ob['colors'] == (specs[ob['category']]['home_pair']['light'], specs[ob['category']]['home_pair']['dark'])
            for ob in objects
        ]
    )
    return float(drawn), float(pair)


def _hue(rgb: np.ndarray) -> np.ndarray:
    """HSV hue in [0, 1) of rows of RGB."""
    r, g, b = rgb.T
    mx, mn = rgb.max(1), rgb.min(1)
    d = np.maximum(mx - mn, 1e-9)
    h = np.where(mx == r, (g - b) / d, np.where(mx == g, 2 + (b - r) / d, 4 + (r - g) / d))
    return (h / 6.0) % 1.0


def test_colour_does_not_identify_class(default_world_objects):
    meta, cls, rgb, _, _ = default_world_objects
    K = meta['num_classes']
    assert meta['config']['generator_version'] == W.GENERATOR_VERSION >= 3
    assert meta['config']['color_consistency'] == 0.0
    # classes carry no colours; one palette is shared by all of them
    assert all('colors' not in c for c in meta['classes'])
    assert meta['palette']['light'] == W.PALETTE['light'] and meta['palette']['dark'] == W.PALETTE['dark']
    assert len(W.PALETTE['light']) == len(W.PALETTE['dark']) == W.PALETTE_HUES >= 8
    # every class shows up in many colours: the hues of its objects' mean colours
    # fall into >= 6 of 12 hue bins, none holding more than 40 % of its objects
    bins = np.floor(_hue(rgb) * 12 + 0.5).astype(int) % 12
    for k in range(K):
        b = bins[cls == k]
        assert len(b) >= 30, (k, len(b))
        counts = np.bincount(b, minlength=12)
        assert (counts > 0).sum() >= 6, (k, counts)
        assert counts.max() <= 0.4 * len(b), (k, counts)
    # the mean colour is not separable by class: a nearest-class-mean classifier on the
    # objects' mean RGB, fitted and scored on the same objects, stays near chance (1/K)
    assert _nearest_class_mean_accuracy(cls, rgb, K) < 2.5 / K


def test_home_pairs():
    specs = W.class_specs(W.MAX_CLASSES)
    pairs = [(s['home_pair']['light'], s['home_pair']['dark']) for s in specs]
    assert len(set(pairs)) == W.MAX_CLASSES  # distinct for every class
    assert all(0 <= i < W.PALETTE_HUES and 0 <= j < W.PALETTE_HUES and i != j for i, j in pairs)
    assert len({i for i, _ in pairs[: W.PALETTE_HUES]}) == W.PALETTE_HUES  # light hues too
    assert pairs[:3] == [(0, 3), (5, 8), (10, 1)]


def test_default_colour_consistency(default_world):
    out, meta = default_world
    K = meta['num_classes']
    specs = W.class_specs(K)
    assert meta['config']['color_consistency'] == 0.75
    assert [c['home_pair'] for c in meta['classes']] == [s['home_pair'] for s in specs]
    # the internal renderer reproduces the written scenes ...
    for s, (_, ade, _) in enumerate(SPLITS):
        for i in (0, 7):
            rgb, label, _ = W.scene(meta['config'], specs, s, i)
            stem = f'{1 + i + s * meta["counts"]["train"]["images"]:06d}'
            png = np.asarray(Image.open(out / 'ade20k' / 'annotations' / ade / f'{stem}.png'))
            assert (label == png).all()
            jpg = np.asarray(Image.open(out / 'ade20k' / 'images' / ade / f'{stem}.jpg'), np.float64)
            assert np.abs(jpg - rgb).mean() < 3.0
    # ... and paints about 75 % of the objects in their class's home pair (a uniform
    # draw hits the home pair with probability 1/144 on top of that)
    objects = _all_objects(meta['config'])
    assert len(objects) >= 500
    drawn, pair = _home_fraction(objects, specs)
    assert 0.70 <= drawn <= 0.80
    assert drawn <= pair <= drawn + 0.02
    # measured on pixels: the mean colour is informative but not decisive
    cls, rgb, _, _ = _object_colours(out)
    acc = _nearest_class_mean_accuracy(cls, rgb, K)
    assert 0.5 < acc < 0.9, acc


def test_full_colour_consistency(tmp_path):
    out = tmp_path / 'cc1'
    meta = W.generate_world(out, formats='ade20k', train_per_class=10, val_per_class=0, color_consistency=1.0)
    specs = W.class_specs(meta['num_classes'])
    assert meta['config']['color_consistency'] == 1.0
    objects = _all_objects(meta['config'])
    assert len(objects) >= 100
    assert _home_fraction(objects, specs) == (1.0, 1.0)
    # with every object in its home pair the mean colour identifies the class
    cls, rgb, _, _ = _object_colours(out)
    assert _nearest_class_mean_accuracy(cls, rgb, meta['num_classes']) > 0.95


def test_colour_consistency_changes_only_colours(tmp_path):
    a, b = tmp_path / 'a', tmp_path / 'b'
    W.generate_world(a, **SMALL, color_consistency=0.0)
    W.generate_world(b, **SMALL, color_consistency=1.0)
    fa, fb = _files(a), _files(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        if k.endswith('.png') or k.startswith('coco/annotations'):
            assert fa[k] == fb[k], k  # same geometry, labels, masks
    jpgs = [k for k in fa if k.endswith('.jpg')]
    assert sum(fa[k] != fb[k] for k in jpgs) == len(jpgs)


def test_colour_consistency_in_config_regenerates(tmp_path):
    out = tmp_path / 'w'
    args = dict(SMALL, train_per_class=1, val_per_class=1, num_classes=3, formats='ade20k')
    m1 = W.generate_world(out, **args)
    assert m1['config']['color_consistency'] == 0.75
    m2 = W.generate_world(out, **args, color_consistency=0.25)
    assert m2['config']['color_consistency'] == 0.25
    assert json.loads((out / 'world.json').read_text()) == m2
    assert W.generate_world(out, **args, color_consistency=0.25) == m2  # skipped


def test_objects_saturated_background_not(default_world_objects):
    _, _, _, sat_obj, sat_bg = default_world_objects
    for c in W.PALETTE['light'] + W.PALETTE['dark']:
        assert (max(c) - min(c)) / max(c) >= 0.6
    assert sat_obj.min() > 0.4 and sat_bg.max() < 0.25


@pytest.mark.parametrize(
    'kwargs, arg',
    [
        (dict(num_classes=1), 'num_classes'),
        (dict(num_classes=W.MAX_CLASSES + 1), 'num_classes'),
        (dict(num_classes=2.5), 'num_classes'),
        (dict(image_size=31), 'image_size'),
        (dict(min_area=0.4, max_area=0.2), 'min_area'),
        (dict(min_area=0.0), 'min_area'),
        (dict(max_area=1.0), 'max_area'),
        (dict(min_area=-0.1), 'min_area'),
        (dict(min_area=0.7, max_area=0.9), 'min_area'),
        (dict(formats=('imagenet', 'voc')), 'formats'),
        (dict(formats=''), 'formats'),
        (dict(seed=-1), 'seed'),
        (dict(train_per_class=0), 'train_per_class'),
        (dict(max_extra_objects=-1), 'max_extra_objects'),
        (dict(color_consistency=-0.1), 'color_consistency'),
        (dict(color_consistency=1.01), 'color_consistency'),
        (dict(color_consistency=float('nan')), 'color_consistency'),
        (dict(color_consistency='0.5'), 'color_consistency'),
        (dict(color_consistency=True), 'color_consistency'),
    ],
)
def test_bad_input(tmp_path, kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        W.generate_world(tmp_path / 'w', **kwargs)
    assert not (tmp_path / 'w').exists()


def test_cli(tmp_path, capsys):
    out = tmp_path / 'cli'
    argv = [
        '--out',
        str(out),
        '--num-classes',
        '2',
        '--image-size',
        '32',
        '--train-per-class',
        '1',
        '--val-per-class',
        '1',
        '--formats',
        'imagenet,coco',
        '--seed',
        '5',
        '--color-consistency',
        '0.5',
    ]
    assert W.main(argv) == 0
    msg = capsys.readouterr().out
    assert 'wrote' in msg and str(out) in msg and '2 train + 2 val' in msg
    meta = json.loads((out / 'world.json').read_text())
    assert meta['config']['formats'] == ['imagenet', 'coco'] and meta['seed'] == 5
    assert meta['config']['color_consistency'] == 0.5
    assert W.main(argv) == 0
    assert 'skipped' in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        W.main(['--out', str(tmp_path / 'bad'), '--image-size', '8'])
    assert e.value.code == 2
    assert 'image_size' in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        W.main(['--out', str(tmp_path / 'bad'), '--color-consistency', '2'])
    assert e.value.code == 2
    assert 'color_consistency' in capsys.readouterr().err


def test_one_default_data_folder_for_the_world_and_the_configs_that_read_it():
    """``tokenaug-data`` with no --out writes where every world config reads by default: ``tokenaug-data`` then
    ``tokenaug-train -c tokenaug::timm/world_*.yaml`` / the mm world configs work with no path given."""
    import re

    import yaml

    from ..conftest import REPO

    default = W._parser().parse_args([]).out
    assert default == 'data/world'
    timm_configs = sorted((REPO / 'configs' / 'timm').glob('world_*.yaml'))
    assert timm_configs
    for path in timm_configs:
        assert yaml.safe_load(path.read_text())['data_dir'] == f'{default}/imagenet', path.name
    mm_roots = set()
    for path in (REPO / 'configs').rglob('*.py'):
        mm_roots |= set(re.findall(r'\{\{\$TOKENAUG_WORLD:([^}]*)\}\}', path.read_text()))
    assert mm_roots == {default}, mm_roots
