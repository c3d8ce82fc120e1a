"""Tests for timm_plugin.annotator and timm_plugin.tools.maps_cli (``tokenaug-maps``): dense annotation with real
timm models, generation on the synthetic world, resume after a killed run, sharding + merge, torchrun, info."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from shared_core.map_format import LabelMapError
from shared_core.map_status import store_status
from shared_core.map_store import LabelMapStore
from timm_plugin import annotator
from timm_plugin.tools import maps_cli as maps

INPUT = 64  # resnet18 at 64 px -> a 2x2 grid
BATCH = 4


@pytest.fixture(scope='module')
def data_dir(tiny_world):
    return tiny_world / 'imagenet'  # train/<class>/<id>.jpg: 20 images


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
    """A fixed random resnet18 (10 classes) as a tokenaug-train-like checkpoint, so every run has the same weights."""
    torch.manual_seed(0)
    model = timm.create_model('resnet18', num_classes=10)
    path = tmp_path_factory.mktemp('ckpt') / 'resnet18.pth'
    torch.save({'epoch': 3, 'arch': 'resnet18', 'args': {'model': 'resnet18'}, 'state_dict': model.state_dict()}, path)
    return path


def _argv(data_dir, checkpoint, out, *extra):
    return [
        'generate',
        '--data-dir',
        str(data_dir),
        '--model',
        'resnet18',
        '--checkpoint',
        str(checkpoint),
        '--out',
        str(out),
        '--input-size',
        str(INPUT),
        '-b',
        str(BATCH),
        '-j',
        '0',
        '--device',
        'cpu',
        '--no-progress',
        *map(str, extra),
    ]


def _generate(argv, on_batch=None):
    return maps.generate(maps.parse_args(argv), on_batch=on_batch)


@pytest.fixture(scope='module')
def reference(tmp_path_factory, data_dir, checkpoint):
    """One uninterrupted run; the store every other run must reproduce bit for bit."""
    out = tmp_path_factory.mktemp('ref') / 'maps'
    rows = []
    _generate(_argv(data_dir, checkpoint, out), on_batch=lambda r: rows.append(r.copy()))
    assert sorted(np.concatenate(rows).tolist()) == list(range(20))
    return out


def _same_arrays(a, b):
    for name in ('values.npy', 'indices.npy', 'paths.txt', 'done.npy'):
        assert (Path(a) / name).read_bytes() == (Path(b) / name).read_bytes(), name


# ----------------------------------------------------------------------- per-location classifier
def test_cnn_dense_logits_equal_model_logits_on_a_1x1_map():
    torch.manual_seed(0)
    model = timm.create_model('resnet18', num_classes=7).eval()
    x = torch.randn(3, 3, 32, 32)  # stride 32 -> a 1x1 map: the dense head is the model's own head
    with torch.inference_mode():
        dense = annotator.dense_logits(model, x)
        assert dense.shape == (3, 1, 1, 7)
        torch.testing.assert_close(dense[:, 0, 0], model(x), rtol=0, atol=1e-6)
        values, indices = annotator.annotate(model, x, k=7)
        probs = model(x).softmax(-1)
        torch.testing.assert_close(values[:, :, 0, 0].float(), probs.sort(-1, descending=True).values.half().float())
        assert torch.equal(indices[:, :, 0, 0], probs.argsort(-1, descending=True))


def test_cnn_dense_logits_apply_the_head_at_every_location():
    torch.manual_seed(0)
    model = timm.create_model('resnet18', num_classes=5).eval()
    x = torch.randn(2, 3, 96, 64)
    with torch.inference_mode():
        feats = model.forward_features(x)  # (2, 512, 3, 2)
        dense = annotator.dense_logits(model, x)
        assert dense.shape == (2, 3, 2, 5)
        expect = model.fc(feats.permute(0, 2, 3, 1))
        torch.testing.assert_close(dense, expect, rtol=0, atol=1e-5)


def test_vit_per_token_head_is_head_of_fc_norm():
    torch.manual_seed(0)
    model = timm.create_model('vit_tiny_patch16_224', img_size=48, num_classes=6, global_pool='avg').eval()
    x = torch.randn(2, 3, 48, 48)
    with torch.inference_mode():
        tokens = model.forward_features(x)[:, model.num_prefix_tokens :]  # (2, 9, 192)
        dense = annotator.dense_logits(model, x)
        assert dense.shape == (2, 3, 3, 6)
        expect = model.head(model.fc_norm(tokens)).reshape(2, 3, 3, 6)  # row-major token order
        torch.testing.assert_close(dense, expect, rtol=0, atol=0)


def test_vit_single_token_dense_equals_model_logits():
    torch.manual_seed(0)
    model = timm.create_model(
        'vit_tiny_patch16_224', img_size=16, num_classes=4, class_token=False, global_pool='avg'
    ).eval()
    x = torch.randn(3, 3, 16, 16)
    with torch.inference_mode():
        torch.testing.assert_close(annotator.dense_logits(model, x)[:, 0, 0], model(x), rtol=0, atol=1e-6)


def test_swin_nhwc_features_use_forward_head():
    torch.manual_seed(0)
    model = timm.create_model(
        'swin_tiny_patch4_window7_224',
        img_size=64,
        window_size=2,
        embed_dim=24,
        depths=(1, 1, 1, 1),
        num_heads=(1, 1, 1, 1),
        num_classes=5,
    ).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.inference_mode():
        feats = model.forward_features(x)  # NHWC (2, 2, 2, 192)
        dense = annotator.dense_logits(model, x)
        assert dense.shape == (2, 2, 2, 5)
        torch.testing.assert_close(dense, model.head.fc(feats), rtol=0, atol=1e-5)
        small = torch.randn(2, 3, 32, 32)  # 1x1 final map: dense == the model's logits
        model32 = timm.create_model(
            'swin_tiny_patch4_window7_224',
            img_size=32,
            window_size=1,
            embed_dim=24,
            depths=(1, 1, 1, 1),
            num_heads=(1, 1, 1, 1),
            num_classes=5,
        ).eval()
        torch.testing.assert_close(annotator.dense_logits(model32, small)[:, 0, 0], model32(small), rtol=0, atol=1e-5)


def test_aux_head_is_used_per_token_when_present():
    torch.manual_seed(0)
    model = timm.create_model('vit_tiny_patch16_224', img_size=32, num_classes=6).eval()
    model.aux_head = torch.nn.Linear(model.embed_dim, 6)
    x = torch.randn(1, 3, 32, 32)
    with torch.inference_mode():
        tokens = model.forward_features(x)[:, 1:]
        torch.testing.assert_close(annotator.dense_logits(model, x).reshape(1, 4, 6), model.aux_head(tokens))
        assert annotator.head_kind(model, 3) == 'aux_head'


def test_lvvit_annotates_with_its_aux_head():
    import timm_plugin.lvvit  # noqa: F401  (registers lvvit_*)

    torch.manual_seed(0)
    model = annotator.create_annotator('lvvit_t', num_classes=5, model_kwargs={'img_size': 32, 'depth': 1}).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.inference_mode():
        tokens = model.forward_features(x)[:, model.num_prefix_tokens :]
        dense = annotator.dense_logits(model, x)
        torch.testing.assert_close(dense.reshape(1, -1, 5), model.aux_head(tokens))


def test_attention_pooling_is_refused():
    model = timm.create_model('vit_tiny_patch16_224', img_size=32, num_classes=3, global_pool='map').eval()
    with pytest.raises(ValueError, match='pools with attention'):
        annotator.dense_logits(model, torch.randn(1, 3, 32, 32))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), k=st.integers(1, 10), scale=st.floats(0.1, 30.0))
def test_annotations_are_sorted_probabilities(seed, k, scale):
    torch.manual_seed(seed)
    model = _tiny_cnn()
    x = torch.randn(2, 3, 64, 64) * scale
    with torch.inference_mode():
        values, indices = annotator.annotate(model, x, k)
    v = values.float()
    assert values.dtype == torch.float16 and indices.dtype == torch.int64 and v.shape == (2, k, 2, 2)
    assert (v >= 0).all() and (v <= 1).all()
    assert (v[:, :-1] >= v[:, 1:]).all()  # descending
    assert (v.sum(1) <= 1 + k * 2**-11).all()  # fp16 rounding of k values
    assert ((indices >= 0) & (indices < 10)).all()
    assert (indices.sort(1).values.diff(dim=1) > 0).all()  # distinct classes per cell


_TINY = {}


def _tiny_cnn():
    if 'm' not in _TINY:
        torch.manual_seed(0)
        _TINY['m'] = timm.create_model('resnet18', num_classes=10).eval()
    return _TINY['m']


# -------------------------------------------------------------------------------------- generation
def test_generate_writes_the_annotation_of_each_image(reference, data_dir, checkpoint):
    store = LabelMapStore.open(reference)
    meta = store.meta
    assert len(store) == 20 and store.grid == (2, 2) and store.k == 5 and store.num_classes == 10
    assert meta['annotator'] == 'resnet18' and meta['annotator_checkpoint'] == str(checkpoint.resolve())
    assert meta['input_size'] == [INPUT, INPUT] and meta['feature_layout'] == 'NCHW'
    assert meta['annotator_head'] == 'forward_head' and len(meta['annotator_checkpoint_sha256']) == 64
    assert meta['normalization']['mean'] == list(timm.data.IMAGENET_DEFAULT_MEAN)
    ds = timm.data.create_dataset('', root=str(data_dir), split='train')
    assert store.paths == [ds.filename(i) for i in range(len(ds))]
    # rows 4..7 are one batch of the run: annotate them the same way here
    model = annotator.create_annotator('resnet18', checkpoint=str(checkpoint))
    transform, _ = annotator.eval_transform(model, (INPUT, INPUT))
    imgs = torch.stack([transform(Image.open(data_dir / 'train' / store.paths[r]).convert('RGB')) for r in range(4, 8)])
    with torch.inference_mode():
        values, indices = annotator.annotate(model, imgs, 5)
    for j, r in enumerate(range(4, 8)):
        v, i = store.lookup(store.paths[r])
        assert np.array_equal(v, values[j].numpy()) and np.array_equal(i, indices[j].numpy())


@pytest.mark.parametrize('layout', ['raw', 'state_dict_ema'])
def test_checkpoint_layouts_load_the_same_weights(tmp_path, checkpoint, layout):
    sd = torch.load(checkpoint, weights_only=True)['state_dict']
    path = tmp_path / 'c.pth'
    torch.save(sd if layout == 'raw' else {'state_dict': {k: v * 0 for k, v in sd.items()}, 'state_dict_ema': sd}, path)
    ref = annotator.create_annotator('resnet18', checkpoint=str(checkpoint))
    model = annotator.create_annotator('resnet18', checkpoint=str(path), use_ema=layout != 'raw')
    assert model.num_classes == 10  # read from the checkpoint's classifier
    x = torch.randn(1, 3, 32, 32)
    with torch.inference_mode():
        assert torch.equal(ref(x), model(x))


def test_resume_after_a_killed_run_equals_an_uninterrupted_run(tmp_path, reference, data_dir, checkpoint, run_env):
    """Kill -9 the generating process after its 2nd batch is on disk, resume: every row is computed exactly
    once over both runs and the store is bit-identical to the uninterrupted one."""
    out, log = tmp_path / 'maps', tmp_path / 'rows.log'
    script = tmp_path / 'killed.py'
    script.write_text(
        textwrap.dedent("""
        import os, signal, sys
        from timm_plugin.tools import maps_cli as maps
        log, batches = sys.argv[1], [0]
        def on_batch(rows):
            with open(log, 'a') as f:
                f.write(' '.join(map(str, rows)) + '\\n')
            batches[0] += 1
            if batches[0] == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        maps.generate(maps.parse_args(sys.argv[2:]), on_batch=on_batch)
    """)
    )
    argv = _argv(data_dir, checkpoint, out)
    argv[argv.index('-j') + 1] = '2'  # with DataLoader workers, as a real run
    proc = subprocess.run(
        [sys.executable, str(script), str(log), *argv], env=run_env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    first = [int(r) for r in log.read_text().split()]
    assert first == list(range(2 * BATCH))
    status = store_status(out)
    assert status['rows_done'] == 2 * BATCH and not status['complete']
    with pytest.raises(LabelMapError, match='--resume'):
        _generate(_argv(data_dir, checkpoint, out))  # no silent overwrite
    with pytest.raises(LabelMapError, match='12 of 20 rows missing'):
        LabelMapStore.open(out)
    second = []
    _generate(_argv(data_dir, checkpoint, out, '--resume'), on_batch=lambda r: second.extend(r.tolist()))
    assert sorted(first + second) == list(range(20)) and not set(first) & set(second)
    _same_arrays(out, reference)
    # resuming a complete store computes nothing
    again = []
    res = _generate(_argv(data_dir, checkpoint, out, '--resume'), on_batch=lambda r: again.extend(r.tolist()))
    assert again == [] and res['rows_computed'] == 0


def test_a_disk_that_fills_during_generate_is_one_line_and_a_resume_finishes_the_same_store(
    tmp_path, reference, data_dir, checkpoint, capsys, monkeypatch
):
    """``generate`` on a disk that fills after its up-front check (a row's write refused with ENOSPC at the third
    batch): one line naming the cause and the rows on disk, exit 2; ``--resume`` computes the rest and the store
    is the uninterrupted one's, byte for byte."""
    import errno

    real_flush, calls = np.memmap.flush, [0]

    def flush(self):
        calls[0] += str(self.filename).endswith('values.npy')
        if calls[0] == 4:  # values.npy's flushes: at creation, two batches', the third batch's fails
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_flush(self)

    out = tmp_path / 'maps'
    monkeypatch.setattr(np.memmap, 'flush', flush)
    assert maps.main(_argv(data_dir, checkpoint, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('tokenaug-maps generate: error: disk full: writing'), err
    assert f'{2 * BATCH} of 20 rows written' in err[0] and 'rerun with --resume' in err[0], err
    monkeypatch.undo()
    assert maps.main(_argv(data_dir, checkpoint, out, '--resume')) == 0
    _same_arrays(out, reference)


def test_resume_stops_at_a_test_hook_and_refuses_other_settings(tmp_path, reference, data_dir, checkpoint, capsys):
    out = tmp_path / 'maps'

    class Stop(Exception):
        pass

    def stop_after_3(rows, seen=[]):
        seen.append(rows)
        if len(seen) == 3:
            raise Stop

    with pytest.raises(Stop):
        _generate(_argv(data_dir, checkpoint, out), on_batch=stop_after_3)
    assert store_status(out)['rows_done'] == 3 * BATCH
    assert maps.main(['info', str(out)]) == 0
    assert 'rows: 12 of 20 done, 8 missing; complete: False' in capsys.readouterr().out
    with pytest.raises(LabelMapError, match='k: 5 != 3'):
        _generate(_argv(data_dir, checkpoint, out, '--resume', '--topk', '3'))
    with pytest.raises(LabelMapError, match=r'input_size: \[64, 64\] != \[96, 96\]'):
        _generate(_argv(data_dir, checkpoint, out, '--resume', '--input-size', '96'))
    with pytest.raises(LabelMapError, match='annotator_kwargs'):
        _generate(_argv(data_dir, checkpoint, out, '--resume', '--model-kwargs', 'drop_rate=0.1'))
    with pytest.raises(LabelMapError, match="split: 'train' != 'val'"):
        _generate(_argv(data_dir, checkpoint, out, '--resume', '--split', 'val'))
    fewer = tmp_path / 'fewer'
    shutil.copytree(data_dir / 'train', fewer / 'train')
    next((fewer / 'train').rglob('*.jpg')).unlink()
    with pytest.raises(LabelMapError, match=r'images differ .*\(20 stored, 19 now; first difference at row \d+\)'):
        _generate(_argv(fewer, checkpoint, out, '--resume'))
    # another batch size may resume (only the grouping of the remaining rows changes)
    rows = []
    _generate(_argv(data_dir, checkpoint, out, '--resume'), on_batch=lambda r: rows.extend(r.tolist()))
    assert rows == list(range(3 * BATCH, 20))
    _same_arrays(out, reference)


def test_shards_then_merge_equal_a_single_run(tmp_path, reference, data_dir, checkpoint, capsys):
    out = tmp_path / 'maps'
    computed = []
    for i in (1, 0, 2):  # 20 rows, batch 4 -> blocks of 8: rows 0-7, 8-15, 16-19
        _generate(
            _argv(data_dir, checkpoint, out, '--shard-index', i, '--num-shards', 3),
            on_batch=lambda r: computed.extend(r.tolist()),
        )
    assert sorted(computed) == list(range(20))
    shard1 = LabelMapStore.open(maps.shard_dir(out, 1, 3))
    assert shard1.meta['shard'] == {'index': 1, 'num_shards': 3, 'row_start': 8, 'row_stop': 16, 'num_images_total': 20}
    assert maps.main(['merge', str(out)]) == 0
    _same_arrays(out, reference)
    assert not (out / 'shards').exists()  # merged shards are removed
    assert maps.main(['merge', str(out)]) == 0  # idempotent


def test_merge_refuses_missing_and_unfinished_shards(tmp_path, data_dir, checkpoint, capsys):
    out = tmp_path / 'maps'
    _generate(_argv(data_dir, checkpoint, out, '--shard-index', 0, '--num-shards', 2))
    assert maps.main(['merge', str(out)]) == 2
    assert 'expected shards 0..1 of 2 exactly once' in capsys.readouterr().err
    with pytest.raises(RuntimeError):
        _generate(
            _argv(data_dir, checkpoint, out, '--shard-index', 1, '--num-shards', 2),
            on_batch=lambda r: (_ for _ in ()).throw(RuntimeError('stop')),
        )
    assert maps.main(['merge', str(out)]) == 2
    err = capsys.readouterr().err
    assert 'shard-1-of-2' in err and 'incomplete' in err and '4 of 8 rows missing' in err  # rows 12-19; 12-15 on disk
    assert not (out / 'meta.json').exists()
    with pytest.raises(LabelMapError, match='same --batch-size'):
        _generate(_argv(data_dir, checkpoint, out, '--shard-index', 1, '--num-shards', 2, '--resume', '-b', 5))
    _generate(_argv(data_dir, checkpoint, out, '--shard-index', 1, '--num-shards', 2, '--resume'))
    assert maps.main(['merge', str(out), '--keep-shards']) == 0
    assert (maps.shard_dir(out, 0, 2) / 'meta.json').exists()
    assert len(LabelMapStore.open(out)) == 20


def test_shard_rows_are_batch_aligned_blocks():
    blocks = [maps.shard_rows(1000, i, 3, 32) for i in range(3)]
    assert blocks == [(0, 352), (352, 704), (704, 1000)]
    assert [maps.shard_rows(5, i, 4, 4) for i in range(4)] == [(0, 4), (4, 5), (5, 5), (5, 5)]


@pytest.mark.slow
def test_torchrun_two_processes_equal_a_single_run(tmp_path, reference, data_dir, checkpoint, run_env):
    out = tmp_path / 'maps'
    env = dict(run_env, OMP_NUM_THREADS=str(torch.get_num_threads()))  # as the reference run
    cmd = [
        sys.executable,
        '-m',
        'torch.distributed.run',
        '--standalone',
        '--nproc-per-node',
        '2',
        '-m',
        'timm_plugin.tools.maps_cli',
        *_argv(data_dir, checkpoint, out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (out / 'shards').exists() and 'merged 2 shards' in proc.stderr
    _same_arrays(out, reference)  # same batches (batch-aligned blocks), same numbers


# -------------------------------------------------------------------------------------- info, errors
def test_info_reports_size_and_completeness(reference, capsys):
    assert maps.main(['info', str(reference)]) == 0
    text = capsys.readouterr().out
    assert 'rows: 20 of 20 done, 0 missing; complete: True' in text
    assert 'payload bytes per image: 80 (k 5 x grid 2x2 x (2 B float16 + 2 B uint16))' in text
    assert '"annotator": "resnet18"' in text


def test_cli_errors_name_the_argument(tmp_path, data_dir, checkpoint, capsys):
    assert maps.main(_argv(data_dir, checkpoint, tmp_path / 'a', '--split', 'nope')) == 2
    assert 'nope' in capsys.readouterr().err
    assert (
        maps.main(
            [
                'generate',
                '--data-dir',
                str(data_dir),
                '--model',
                'vit_tiny_patch16_224',
                '--out',
                str(tmp_path / 'b'),
                '--input-size',
                '64',
                '--device',
                'cpu',
                '--num-classes',
                '3',
            ]
        )
        == 2
    )
    assert 'img_size=64' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        maps.parse_args(_argv(data_dir, checkpoint, tmp_path / 'c', '--input-size', '0'))
    assert maps.main(['info', str(tmp_path)]) == 2
    assert 'neither a label-map store' in capsys.readouterr().err
    assert maps.main(_argv(data_dir, tmp_path / 'none.pth', tmp_path / 'd')) == 2
    assert 'none.pth' in capsys.readouterr().err


def test_an_unreadable_image_is_named_not_replaced_by_the_next(tmp_path, data_dir, checkpoint, capsys):
    """Each row must be the annotation of its own image: a file that cannot be decoded (here truncated) stops
    the run naming it (timm's dataset would silently hand over the next image)."""
    bad = tmp_path / 'bad'
    shutil.copytree(data_dir / 'train', bad / 'train')
    victim = sorted((bad / 'train').rglob('*.jpg'))[5]
    raw = victim.read_bytes()
    victim.write_bytes(raw[: len(raw) // 3])
    errors = []
    for workers in ('0', '2'):  # with DataLoader workers: the same one line, not the workers' wrapped traceback
        assert maps.main(_argv(bad, checkpoint, tmp_path / f'maps{workers}') + ['-j', workers]) == 2
        errors.append(capsys.readouterr().err.strip())
    err = errors[1]
    assert f'{victim.parent.name}/{victim.name}' in err and 'cannot be read' in err, err
    assert errors[0] == err and len(err.splitlines()) == 1, errors


def test_maps_info_prints_a_store_without_importing_torch(tmp_path, run_env):
    """``tokenaug-maps info`` (the console script's own entry) reads a store with numpy and json only; the other
    commands go on to the annotation tools."""
    import json

    from ..helpers.data import write_store

    paths = [f'c{i % 2}/img{i}.png' for i in range(6)]
    values = np.full((6, 1, 2, 2), 0.5, np.float16)
    write_store(tmp_path / 's', paths, values, np.zeros((6, 1, 2, 2), np.int64), 4, 'test', (8, 8))
    code = (
        'import sys; from tokenaug.commands import maps; rc = maps(["info", sys.argv[1], "--json"]); '
        'assert "torch" not in sys.modules and "timm" not in sys.modules; sys.exit(rc)'
    )
    res = subprocess.run([sys.executable, '-c', code, str(tmp_path / 's')], capture_output=True, text=True, env=run_env)
    assert res.returncode == 0, res.stderr
    status = json.loads(res.stdout)
    assert status['complete'] and status['meta']['num_images'] == 6
    res = subprocess.run(
        ['tokenaug-maps', 'info', str(tmp_path / 'nothere')], capture_output=True, text=True, env=run_env
    )
    assert res.returncode == 2 and 'tokenaug-maps info: error:' in res.stderr and 'nothere' in res.stderr
