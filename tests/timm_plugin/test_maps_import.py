"""``tokenaug-maps import --from tokenlabeling``: the maps released with Token Labeling into a store.

The label files are written by a port of the public ``generate_label.py``'s saving lines (top-5 of dense logits,
``torch.stack([value.half(), indices.half()]).permute(0, 3, 1, 2)``, one file per image at
``<root>/<class>/<stem>.pt``). What the public training makes of them is ported too: the dense map with logit 0
outside the top-k (``get_featuremaps``), RoIAlign of the crop with the boxes shifted by half a cell (aligned),
then a softmax over the classes."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from torchvision.ops import roi_align

from shared_core.label_maps import rows_from_topk_logits, token_targets
from shared_core.map_store import LabelMapStore
from timm_plugin.tools import maps_cli

C, K, GRID = 10, 5, (7, 7)


def public_label_files(data_dir, root, split='train', seed=0):
    """The public saving lines on every image of the split; returns {relative image path: dense logits (h, w, C)}."""
    g = torch.Generator().manual_seed(seed)
    dense = {}
    for cls in sorted(os.listdir(data_dir / split)):
        for name in sorted(os.listdir(data_dir / split / cls)):
            path = f'{data_dir}/{split}/{cls}/{name}'
            # the annotator's (h, w, C) logits of one image: a spatially smooth field (a 3x3 mean of noise), std 2
            noise = torch.randn(1, C, GRID[0] + 2, GRID[1] + 2, generator=g)
            output = torch.nn.functional.avg_pool2d(noise, 3, stride=1)[0].permute(1, 2, 0) * 6
            value, indices = output.topk(K)
            score_path = os.path.join(root, '/'.join(path.split('/')[-2:]).split('.')[0] + '.pt')
            os.makedirs(os.path.join(root, path.split('/')[-2]), exist_ok=True)
            torch.save(torch.stack([value.cpu().half(), indices.cpu().half()]).permute(0, 3, 1, 2), score_path)
            dense[f'{cls}/{name}'] = output
    return dense


def public_targets(label_file, box, grid):
    """The public training's targets of one crop: dense logit map (0 outside the top-k), RoIAlign of the box (in
    cells, less half a cell), softmax over the classes: ``(C, gh, gw)``."""
    t = torch.load(label_file, weights_only=True)
    dense = torch.zeros(C, *t.shape[2:])
    dense.scatter_(0, t[1].long(), t[0].float())
    h, w = t.shape[2:]
    x0, y0, x1, y1 = box
    rois = torch.tensor([[0.0, x0 * w - 0.5, y0 * h - 0.5, x1 * w - 0.5, y1 * h - 0.5]], dtype=torch.float32)
    return roi_align(dense[None], rois, output_size=grid).softmax(1)[0]


def run_import(data_dir, src, out, *extra):
    argv = ['import', '--from', 'tokenlabeling', '--src', str(src), '--data-dir', str(data_dir)]
    argv += ['--num-classes', str(C), '--out', str(out), '-j', '0', '--no-progress', *extra]
    return maps_cli.main(argv)


@pytest.fixture(scope='module')
def imported(tiny_world, tmp_path_factory):
    tmp = tmp_path_factory.mktemp('import')
    data = tiny_world / 'imagenet'
    dense = public_label_files(data, tmp / 'labels')
    assert run_import(data, tmp / 'labels', tmp / 'store', '-b', '8') == 0
    return data, tmp / 'labels', LabelMapStore.open(tmp / 'store'), dense


def test_a_row_is_the_softmax_of_the_public_dense_map(imported):
    """Each stored cell: the top-k probabilities of softmax over all C classes of the map with logit 0 outside the
    top-k, to float16; the classes as given."""
    data, labels, store, dense = imported
    assert len(store) == len(dense) and store.grid == GRID and store.k == K and store.num_classes == C
    meta = store.meta
    assert meta['source']['from'] == 'tokenlabeling' and meta['annotator'] == 'tokenlabeling'
    worst = 0.0
    for rel, logits in dense.items():
        values, indices = store.lookup(rel)
        t = torch.load(labels / rel.replace('.jpg', '.pt'), weights_only=True)
        full = torch.zeros(C, *GRID).scatter_(0, t[1].long(), t[0].float()).softmax(0)  # public semantics
        expect = full.gather(0, torch.from_numpy(indices))
        worst = max(worst, float((torch.from_numpy(values.astype(np.float32)) - expect).abs().max()))
        assert np.array_equal(np.sort(indices, 0), np.sort(t[1].long().numpy(), 0))
    assert worst < 1e-3, worst  # float16 storage


@pytest.mark.parametrize(
    'box, grid',
    [((0.0, 0.0, 1.0, 1.0), GRID), ((2 / 7, 1 / 7, 5 / 7, 6 / 7), (5, 3)), ((0.0, 3 / 7, 4 / 7, 1.0), (4, 4))],
)
def test_token_targets_equal_the_public_pipeline_on_crops_aligned_to_the_map(imported, box, grid):
    """A crop whose edges sit on map cells, one token per cell: the store's targets equal the public pipeline's
    (dense logits, RoIAlign, softmax) to float16 storage."""
    data, labels, store, _ = imported
    for rel in store.paths[:6]:
        values, indices = store.lookup(rel)
        ours = token_targets(values, indices, C, box, False, grid)
        theirs = public_targets(labels / rel.replace('.jpg', '.pt'), box, grid)
        assert float((ours - theirs).abs().max()) < 2e-3


def test_unaligned_crops_interpolate_probabilities_where_the_public_code_interpolates_logits(imported):
    """Off the cell grid, RoIAlign averages samples of neighbouring cells: of probabilities here, of logits in the
    public code (then a softmax). The two differ, by what the departures table states (measured here)."""
    data, labels, store, _ = imported
    rng = np.random.default_rng(0)
    diffs = []
    for rel in store.paths:
        values, indices = store.lookup(rel)
        for _ in range(5):
            x0, y0 = rng.uniform(0, 0.5, 2)
            box = (x0, y0, x0 + rng.uniform(0.3, 0.5), y0 + rng.uniform(0.3, 0.5))
            ours = token_targets(values, indices, C, box, False, (4, 4))
            theirs = public_targets(labels / rel.replace('.jpg', '.pt'), box, (4, 4))
            diffs.append(float((ours - theirs).abs().max()))
    print(f'unaligned crops: max |ours - public| per crop, median {np.median(diffs):.3f}, max {np.max(diffs):.3f}')
    assert 0.0 < np.median(diffs) and np.max(diffs) < 0.5


def test_the_logit_pooled_class_target_is_the_public_class_target(imported):
    """``--cls-target-pool logits`` (:func:`crop_logit_targets`): on the same crops, cell-aligned or not, the class
    target of the store's rows equals the public code's (its ``get_label`` at ``label_size=1``: RoIAlign of the dense
    logits to 1x1, softmax) to float16 storage; the distribution-pooled target (ReLabel, the default) does not."""
    from shared_core.label_maps import CropMaps, crop_logit_targets, crop_targets

    data, labels, store, _ = imported
    rng = np.random.default_rng(1)
    boxes = [(0.0, 0.0, 1.0, 1.0), (2 / 7, 1 / 7, 5 / 7, 6 / 7)]
    boxes += [tuple(np.r_[xy, xy + rng.uniform(0.3, 0.5, 2)]) for xy in rng.uniform(0, 0.5, (4, 2))]
    worst, gap = 0.0, 0.0
    for rel in store.paths[:8]:
        values, indices = store.lookup(rel)
        for box in boxes:
            maps = CropMaps.stack([values], [indices], [box], [False], [None], C)
            theirs = public_targets(labels / rel.replace('.jpg', '.pt'), box, (1, 1))[:, 0, 0]
            worst = max(worst, float((crop_logit_targets(maps)[0] - theirs).abs().max()))
            gap = max(gap, float((crop_targets(maps)[0] - theirs).abs().max()))
    print(f'class target vs the public one: logit pooling max |d| {worst:.2e}, distribution pooling {gap:.3f}')
    assert worst < 2e-3 and gap > 10 * worst


def test_the_logit_pooled_class_target_at_imagenet_scale():
    """NFNet-like maps of 1000 classes (top-5 logits of a peaked annotator): the public class target put next to
    the two poolings of the same stored rows, cell-aligned and random crops (the fidelity review measured the top
    class at 0.013 public against 0.143 for the distribution pooling)."""
    from shared_core.label_maps import CropMaps, crop_logit_targets, crop_targets, rows_from_topk_logits

    g = torch.Generator().manual_seed(0)
    classes, h, w = 1000, 14, 14
    rows, public = [], []
    for _ in range(4):
        logits = torch.randn(classes, h, w, generator=g) * 2.0
        logits[torch.randint(0, classes, (1,), generator=g)] += 6.0  # one dominant class
        top = logits.topk(K, 0)
        values, indices = rows_from_topk_logits(top.values.half(), top.indices, classes)
        rows.append((values, indices))
        public.append(torch.zeros(classes, h, w).scatter_(0, top.indices, top.values.half().float()))
    rng = np.random.default_rng(0)
    boxes = [(2 / 14, 3 / 14, 10 / 14, 12 / 14)] + [tuple(np.r_[xy, xy + 0.4]) for xy in rng.uniform(0, 0.5, (3, 2))]
    report = []
    for (values, indices), dense in zip(rows, public):
        for box in boxes:
            maps = CropMaps.stack([values], [indices], [box], [False], [None], classes)
            rois = torch.tensor([[0.0, box[0] * w - 0.5, box[1] * h - 0.5, box[2] * w - 0.5, box[3] * h - 0.5]]).float()
            theirs = roi_align(dense[None], rois, output_size=(1, 1))[0, :, 0, 0].softmax(0)
            ours_logits, ours_dist = crop_logit_targets(maps)[0], crop_targets(maps)[0]
            top = int(theirs.argmax())
            report.append((float(theirs[top]), float(ours_logits[top]), float(ours_dist[top])))
            assert float((ours_logits - theirs).abs().max()) < 1e-3
    public_top, logit_top, dist_top = np.mean(report, 0)
    print(f'top class, C=1000: public {public_top:.4f}, logit pooling {logit_top:.4f}, distributions {dist_top:.4f}')
    assert abs(public_top - logit_top) < 1e-3 and dist_top > 2 * public_top


def test_a_missing_or_malformed_file_names_the_image_and_nothing_partial_is_readable(tiny_world, tmp_path, capsys):
    from shared_core.map_format import IncompleteStoreError

    data = tiny_world / 'imagenet'
    public_label_files(data, tmp_path / 'labels')
    files = sorted((tmp_path / 'labels').rglob('*.pt'))
    files[5].unlink()
    assert run_import(data, tmp_path / 'labels', tmp_path / 'store', '-b', '4') == 2
    rel = f'{files[5].parent.name}/{files[5].stem}.jpg'
    err = capsys.readouterr().err
    assert f"no label file for image '{rel}'" in err and str(files[5]) in err
    with pytest.raises(IncompleteStoreError):
        LabelMapStore.open(tmp_path / 'store')
    torch.save(torch.zeros(3, 5, 7, 7), files[5])  # malformed: not (2, k, h, w)
    assert run_import(data, tmp_path / 'labels', tmp_path / 'store', '-b', '4', '--resume') == 2
    assert f"the label file of image '{rel}'" in capsys.readouterr().err
    torch.save(torch.zeros(2, 5, 7, 7, dtype=torch.float16), files[5])  # class 0 five times
    assert run_import(data, tmp_path / 'labels', tmp_path / 'store', '-b', '4', '--resume') == 2
    assert 'a class appears twice in one cell' in capsys.readouterr().err
    files[6].write_bytes(b'not a checkpoint')
    files[5].unlink()
    public_label_files(data, tmp_path / 'labels')  # the files as released again
    assert run_import(data, tmp_path / 'labels', tmp_path / 'store', '-b', '4', '--resume') == 0
    assert 'maps imported' in capsys.readouterr().err
    assert len(LabelMapStore.open(tmp_path / 'store')) == len(files)


def test_errors_in_import_workers_are_the_one_line_of_one_process_and_a_shape_names_both_files(
    tiny_world, tmp_path, capsys
):
    """With DataLoader workers (``-j 2``), a bad label file gives the one-line error of ``-j 0``, not DataLoader's
    wrapped traceback. One file of another grid among the rest, the first image's included: the error names the
    two files and their shapes."""
    data = tiny_world / 'imagenet'
    public_label_files(data, tmp_path / 'labels')
    files = sorted((tmp_path / 'labels').rglob('*.pt'))
    torch.save(torch.zeros(3, 5, 7, 7), files[5])  # malformed: not (2, k, h, w)
    errors = []
    for workers in ('0', '2'):
        assert run_import(data, tmp_path / 'labels', tmp_path / f'store{workers}', '-b', '4', '-j', workers) == 2
        errors.append(capsys.readouterr().err.strip())
    assert errors[0] == errors[1] and len(errors[1].splitlines()) == 1, errors
    assert errors[1].startswith('tokenaug-maps import: error: --src: the label file of image')
    assert 'Caught' not in errors[1] and 'Traceback' not in errors[1]

    public_label_files(data, tmp_path / 'labels')
    first = files[0]  # the odd one is the first image's file: 5x5 among 7x7
    torch.save(torch.stack([torch.zeros(5, 5, 5), torch.arange(5).view(5, 1, 1).expand(5, 5, 5)]).half(), first)
    assert run_import(data, tmp_path / 'labels', tmp_path / 'store_shape', '-b', '4', '-j', '2') == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'label files of two shapes (k, h, w)' in err, err
    rel = lambda f: f'{f.parent.name}/{f.name}'  # noqa: E731
    assert f"{rel(files[1])} holds (5, 7, 7), {rel(first)} (the first image's) (5, 5, 5)" in err


def test_the_store_records_the_centre_square_and_training_registers_it_on_request(imported):
    """The released maps saw the centre square of each image: the imported store says so. Training registers them
    on the whole image as the public code does (default); ``map_region='recorded'`` registers them on the centre
    square (each sample's crop, flip and ops become a chain after the registration, ``register_center_square``)."""
    from timm.data import create_dataset, create_transform

    from shared_core.map_format import CENTER_SQUARE
    from timm_plugin.token_label_data import TokenLabelDataset

    data, _, store, _ = imported
    assert store.meta['region'] == CENTER_SQUARE and 'centre square' in store.meta['source']['region']
    samples = {}
    for region in ('full_image', 'recorded'):
        ds = TokenLabelDataset(create_dataset('', root=str(data), split='train'), store, map_region=region)
        ds.transform = create_transform((3, 32, 32), is_training=True, hflip=0.5)
        torch.manual_seed(0)
        samples[region] = ds[0][1]
    chain, (rbox, rflip, rchain) = samples['full_image'][5], samples['recorded'][3:]
    assert len(chain) == 0 and (rbox, rflip, len(rchain)) == ((0.0, 0.0, 1.0, 1.0), False, 2)
    with pytest.raises(ValueError, match='map_region: expected one of'):
        TokenLabelDataset(create_dataset('', root=str(data), split='train'), store, map_region='centre')


def test_a_bad_label_file_is_read_by_the_checked_reader(tiny_world, tmp_path, capsys):
    """Each bad label file gets the project's reader's one-line reason, never torch's advice to load with
    ``weights_only=False`` (the unsafe route) nor a raw traceback: a pickle with a global, garbage, an empty file,
    a numpy file, a text file, an empty (2, 5, 0, 0) tensor. Nothing in the pickle runs."""
    import pickle

    data = tiny_world / 'imagenet'
    public_label_files(data, tmp_path / 'labels')
    victim = sorted((tmp_path / 'labels').rglob('*.pt'))[0]
    marker = tmp_path / 'ran'

    class Payload:
        def __reduce__(self):
            return (os.system, (f'touch {marker}',))

    bad = {
        'a pickle with a global': lambda p: p.write_bytes(pickle.dumps(Payload())),
        'garbage': lambda p: p.write_bytes(os.urandom(300)),
        'empty': lambda p: p.write_bytes(b''),
        'numpy': lambda p: np.save(open(p, 'wb'), np.zeros((2, 5, 7, 7))),
        'text': lambda p: p.write_text('101\n'),
        'an empty tensor': lambda p: torch.save(torch.zeros(2, 5, 0, 0, dtype=torch.float16), p),
    }
    for what, write in bad.items():
        write(victim)
        assert run_import(data, tmp_path / 'labels', tmp_path / f'store_{len(what)}', '-b', '4') == 2, what
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith('tokenaug-maps import: error: --src:'), (what, err)
        assert 'weights_only' not in err and '\x1b[' not in err and 'Traceback' not in err, (what, err)
        assert victim.stem in err, (what, err)
    assert not marker.exists()


def test_a_resume_from_another_label_tree_is_refused(tiny_world, tmp_path, capsys):
    """An interrupted import resumed with another ``--src`` would fill the rest of the store from a second source
    (``meta.json`` naming the first): the store records the tree it imports and a resume from another is refused."""
    data = tiny_world / 'imagenet'
    for tree in ('one', 'two'):
        public_label_files(data, tmp_path / tree)
    files = sorted((tmp_path / 'one').rglob('*.pt'))
    files[5].unlink()  # the first import stops there, its first rows written
    assert run_import(data, tmp_path / 'one', tmp_path / 'store', '-b', '4') == 2
    capsys.readouterr()
    assert run_import(data, tmp_path / 'two', tmp_path / 'store', '-b', '4', '--resume') == 2
    err = capsys.readouterr().err
    assert 'was generated with different settings' in err and 'source_tree' in err and "/two'" in err, err
    assert len(err) < 600, err  # the one setting that differs, not the whole meta
    public_label_files(data, tmp_path / 'one')  # the missing file restored: the same tree resumes
    assert run_import(data, tmp_path / 'one', tmp_path / 'store', '-b', '4', '--resume') == 0


def test_a_full_disk_is_named_before_the_store_is_written(tiny_world, tmp_path, capsys, monkeypatch, run_env):
    """The writer checks the space everything it writes still needs first (create and resume: the arrays, the path
    list, meta.json and its temporary, the path index, each rounded up to the disk's blocks) and says how much to
    free; a file-size limit (``ulimit -f``) below a file it writes is named as such, one line, for ``import`` and
    ``generate`` alike, before anything is written."""
    import shutil
    import subprocess
    import sys

    from shared_core.map_format import _on_disk, store_bytes

    data = tiny_world / 'imagenet'
    public_label_files(data, tmp_path / 'labels')
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, 'disk_usage', lambda p: real(p)._replace(free=1000))
    assert run_import(data, tmp_path / 'labels', tmp_path / 'store', '-b', '4') == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'disk full: the store at' in err and '0 of' in err, err
    assert 'rerun with --resume' in err
    # room for the three arrays alone (what the check once counted) is not enough: paths.txt and meta.json too
    n = sum(1 for p in (data / 'train').rglob('*') if p.is_file())
    sizes = store_bytes(n, (K, *GRID), 2, [], {})
    arrays = sum(_on_disk(tmp_path, sizes[n]) for n in ('values.npy', 'indices.npy', 'done.npy'))
    monkeypatch.setattr(shutil, 'disk_usage', lambda p: real(p)._replace(free=arrays))
    assert run_import(data, tmp_path / 'labels', tmp_path / 'store', '-b', '4') == 2
    err = capsys.readouterr().err.strip()
    assert 'disk full: the store at' in err and not (tmp_path / 'store').exists(), err
    monkeypatch.setattr(shutil, 'disk_usage', real)
    for command in (
        ['import', '--from', 'tokenlabeling', '--src', str(tmp_path / 'labels'), '--num-classes', str(C)],
        ['generate', '--model', 'resnet18', '--num-classes', str(C), '--input-size', '128'],
    ):
        out = tmp_path / f'limited_{command[0]}'
        argv = [*command, '--data-dir', str(data), '--out', str(out), '-j', '0', '--no-progress']
        code = f'import sys; from tokenaug.commands import maps; sys.exit(maps({argv!r}))'
        res = subprocess.run(['bash', '-c', f'ulimit -f 2; exec {sys.executable} -c "$0"', code], env=run_env,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert res.returncode == 2, res.stderr[-2000:]
        last = res.stderr.strip().splitlines()[-1]
        assert 'file-size limit:' in last and '(ulimit -f)' in last and 'Traceback' not in res.stderr, last
        assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())


def test_a_worker_that_cannot_hand_its_batch_over_is_one_line(imported, tmp_path, run_env):
    """Under ``ulimit -f 20`` (20 kB) the store's files fit, but a DataLoader worker's batch of 20 rows does not
    fit into its shared-memory file (the int64 class indices: 39 kB): torch's error in the worker, once a
    60-line traceback, is one line naming the cause and the way out; then a resume without the limit finishes the
    store, the uninterrupted import's byte for byte."""
    import subprocess
    import sys

    data, labels, reference, _ = imported
    store = tmp_path / 'store'
    argv = ['import', '--from', 'tokenlabeling', '--src', str(labels), '--num-classes', str(C), '--data-dir']
    argv += [str(data), '--out', str(store), '-j', '1', '-b', '20', '--no-progress']
    code = f'import sys; from tokenaug.commands import maps; sys.exit(maps({argv!r}))'
    res = subprocess.run(['bash', '-c', f'ulimit -f 20; exec {sys.executable} -c "$0"', code], env=run_env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 2 and 'Traceback' not in res.stderr, res.stderr[-3000:]
    assert res.stderr.strip().splitlines()[-1] == (
        'tokenaug-maps import: error: a DataLoader worker could not hand its batch over through shared memory '
        '(File too large); raise the file-size limit (ulimit -f), or pass --workers 0'
    )
    assert run_import(data, labels, store, '-b', '8', '--resume') == 0
    for name in STORE_BYTES:
        assert (store / name).read_bytes() == (reference.root / name).read_bytes(), name


def test_torchs_shared_memory_error_is_recognised():
    """The real error torch raises where shared memory cannot be allocated (a file-size limit, in this process
    for a moment) is turned into an ``OSError`` naming it; other errors are left alone."""
    import errno
    import resource

    from timm_plugin.tools.common import shared_memory_error

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(RuntimeError) as caught:
            torch.empty(100_000).share_memory_()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    plain = shared_memory_error(caught.value)
    assert isinstance(plain, OSError) and plain.errno == errno.EFBIG and 'ulimit -f' in plain.strerror
    assert shared_memory_error(RuntimeError('unable to resize file </torch_1> to the right size: x (28)')).errno == 28
    assert shared_memory_error(RuntimeError('a shape mismatch (3)')) is None
    assert shared_memory_error(ValueError('unable to resize file </x>: (27)')) is None


#: the files of a finished store, compared byte for byte (meta.json apart: its times and run record differ)
STORE_BYTES = ('values.npy', 'indices.npy', 'done.npy', 'paths.txt', 'paths.index.npy', 'paths.offsets.npy')


def _refusing_open(real_open, suffix, code, at=1):
    """``open`` whose ``at``-th file named ``...suffix`` fails its writes with ``code`` (after a few bytes)."""
    count = [0]

    class Refusing:
        def __init__(self, f):
            self.f, self.wrote = f, 0

        def write(self, text):
            if self.wrote:
                raise OSError(code, os.strerror(code))
            self.wrote += 1
            return self.f.write(text[:3])

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def fake(file, *args, **kwargs):
        f = real_open(file, *args, **kwargs)
        if str(file).endswith(suffix):
            count[0] += 1
            if count[0] == at:
                return Refusing(f)
        return f

    return fake


@pytest.mark.parametrize(
    'where, code',
    [
        ('allocating values.npy', 'ENOSPC'),
        ('allocating values.npy', 'EFBIG'),
        ('paths.txt', 'ENOSPC'),
        ('meta.json at creation', 'ENOSPC'),
        ('rows of the second batch', 'ENOSPC'),
        ('rows of the second batch', 'EFBIG'),
        ('meta.json at finalize', 'EDQUOT'),
    ],
)
def test_every_write_the_disk_refuses_ends_in_one_line_and_a_resume_finishes_the_same_store(
    imported, tmp_path, capsys, monkeypatch, where, code
):
    """A full disk (ENOSPC, EDQUOT) or a file-size limit (EFBIG) at each write of the store, injected after the
    up-front check (a disk that fills during the import): one line naming the cause, the file and the rows on
    disk, no temporary left; then ``--resume`` finishes a store whose files are the uninterrupted import's, byte
    for byte."""
    import builtins
    import errno

    from shared_core import map_format

    data, labels, reference, _ = imported
    err_code = getattr(errno, code)
    if where.startswith('allocating'):
        real = os.posix_fallocate

        def fallocate(fd, offset, length):
            raise OSError(err_code, os.strerror(err_code))

        monkeypatch.setattr(os, 'posix_fallocate', fallocate)
    elif where == 'rows of the second batch':
        real_flush, calls = np.memmap.flush, [0]

        def flush(self):
            calls[0] += str(self.filename).endswith('values.npy')
            if calls[0] == 3:  # values.npy's flushes: at creation, the first batch's, the second's fails
                raise OSError(err_code, os.strerror(err_code))
            return real_flush(self)

        monkeypatch.setattr(np.memmap, 'flush', flush)
    else:
        suffix, at = {'paths.txt': ('paths.txt.tmp', 1), 'meta.json at creation': ('meta.json.tmp', 1)}.get(
            where, ('meta.json.tmp', 2)
        )
        monkeypatch.setattr(map_format, 'open', _refusing_open(builtins.open, suffix, err_code, at), raising=False)
    store = tmp_path / 'store'
    assert run_import(data, labels, store, '-b', '8') == 2
    err = capsys.readouterr().err.strip().splitlines()
    cause = 'file-size limit' if code == 'EFBIG' else 'disk full'
    assert len(err) == 1 and err[0].startswith(f'tokenaug-maps import: error: {cause}: writing'), err
    assert 'rows written' in err[0] and ('ulimit -f' in err[0]) == (code == 'EFBIG'), err
    if where == 'rows of the second batch':
        assert '8 of ' in err[0] and 'rerun with --resume' in err[0], err
    if where.startswith('allocating') or where in ('paths.txt', 'meta.json at creation'):
        assert not store.exists(), sorted(store.iterdir())  # a failed creation leaves nothing
    else:
        assert not [p.name for p in store.iterdir() if 'tmp' in p.name]
    monkeypatch.undo()
    if where.startswith('allocating'):
        assert os.posix_fallocate is real
    assert run_import(data, labels, store, '-b', '8', '--resume') == 0
    for name in STORE_BYTES:
        assert (store / name).read_bytes() == (reference.root / name).read_bytes(), name
    got, want = (json.loads((root / 'meta.json').read_text()) for root in (store, reference.root))
    for meta in (got, want):
        for key in ('created', 'completed', 'run'):
            meta.pop(key)
    assert got == want


def test_the_arrays_are_allocated_when_the_store_is_created(tmp_path):
    """The rows are written through memory maps, where a disk that fills during the import would be a SIGBUS:
    the writer allocates the arrays' blocks up front (``posix_fallocate``), so nothing another writer does
    later can take them. A file system without ``fallocate`` keeps the sparse files (the up-front check holds)."""
    from shared_core.map_store import MapWriter

    probe = tmp_path / 'probe'
    probe.write_bytes(b'')
    try:
        with open(probe, 'r+b') as f:
            os.posix_fallocate(f.fileno(), 0, 1 << 16)
        supported = True
    except OSError:
        supported = False
    paths = [f'c/{i}.png' for i in range(64)]
    with MapWriter.create(
        tmp_path / 'store', paths, num_classes=C, k=K, grid=GRID, annotator='x', input_size=(224, 224)
    ) as writer:
        assert writer.num_done() == 0
    for name in ('values.npy', 'indices.npy', 'done.npy'):
        st = (tmp_path / 'store' / name).stat()
        assert (st.st_blocks * 512 >= st.st_size) == supported, (name, st.st_blocks, st.st_size)


def test_resume_and_shards_give_the_same_store(imported, tmp_path):
    data, labels, store, _ = imported
    for i in range(2):
        assert (
            run_import(data, labels, tmp_path / 'sharded', '-b', '8', '--shard-index', str(i), '--num-shards', '2') == 0
        )
    assert maps_cli.main(['merge', str(tmp_path / 'sharded')]) == 0
    merged = LabelMapStore.open(tmp_path / 'sharded')
    assert merged.paths == store.paths
    assert np.array_equal(np.asarray(merged.values), np.asarray(store.values))
    assert np.array_equal(np.asarray(merged.indices), np.asarray(store.indices))
    assert run_import(data, labels, tmp_path / 'sharded') == 2  # exists: --resume or another --out
    assert run_import(data, labels, tmp_path / 'sharded', '--resume') == 0  # complete: nothing to do


def test_rows_from_topk_logits_refuses_what_is_not_a_top_k_map():
    logits = torch.randn(3, 2, 2)
    idx = torch.tensor([0.0, 1.0, 2.0]).view(3, 1, 1).expand(3, 2, 2)
    values, indices = rows_from_topk_logits(logits, idx, 4)
    assert values.dtype == np.float16 and (np.diff(values.astype(np.float32), axis=0) <= 0).all()
    total = values.astype(np.float64).sum(0) + (4 - 3) / (np.exp(logits.double().numpy()).sum(0) + 1)
    np.testing.assert_allclose(total, 1.0, atol=2e-3)  # the rest of the mass: 1 / (Σ exp + C − k) per class
    for bad_idx, match in ((idx + 0.5, 'whole class indices'), (idx + 2, r'in \[0, 4\)')):
        with pytest.raises(ValueError, match=match):
            rows_from_topk_logits(logits, bad_idx, 4)
    with pytest.raises(ValueError, match='finite'):
        rows_from_topk_logits(logits * float('nan'), idx, 4)
    with pytest.raises(ValueError, match='k: 3 top classes for num_classes=2'):
        rows_from_topk_logits(logits, idx, 2)
    assert json.dumps(maps_cli.public_label_file('n01/n01_1.JPEG')) == '"n01/n01_1.pt"'
    assert maps_cli.public_label_file('a/b.c/img.x.jpg') == 'b.pt'  # the public naming cuts at the first '.'
