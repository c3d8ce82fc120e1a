"""Tests for timm_plugin.occlusion (``tokenaug-occlusion``, TokenMix Fig. 5): masks, zero / drop modes with real
timm models (a tiny-input ViT-Ti and resnet18) on the synthetic world, the CLI outputs and its argument errors."""

from __future__ import annotations

import csv
import subprocess

import pytest
import timm
import torch
from torch.utils.data import DataLoader

from timm_plugin import occlusion as occ
from timm_plugin.tools import occlusion_cli
from timm_plugin.tools.common import split_dataset

IMG = 112  # the world's image size: a 7 x 7 grid of 16 px patches
GRID = (7, 7)
PATCH = (16, 16)
DEPTH = 2  # a shallow ViT-Ti keeps the tests quick; token dropping does not depend on depth


@pytest.fixture(scope='module')
def data_dir(tiny_world):
    return tiny_world / 'imagenet'  # val/<class>/<image>: 10 images, one per class


def _vit(**kwargs):
    torch.manual_seed(0)
    return timm.create_model('vit_tiny_patch16_224', img_size=IMG, depth=DEPTH, num_classes=10, **kwargs).eval()


@pytest.fixture(scope='module')
def vit():
    return _vit()


@pytest.fixture(scope='module')
def resnet():
    torch.manual_seed(0)
    return timm.create_model('resnet18', num_classes=10).eval()


def _loader(model, data_dir, batch_size, img_size=IMG):
    config = occ.data_config(model, img_size, None)
    dataset, _ = split_dataset(str(data_dir), 'val', timm.data.create_transform(**config, is_training=False))
    return DataLoader(occ.Indexed(dataset), batch_size=batch_size, shuffle=False, num_workers=0)


# ------------------------------------------------------------------------------------------ masks
@pytest.mark.parametrize('ratio', occ.DEFAULT_RATIOS + (0.05, 0.55))
def test_each_mask_drops_round_ratio_n_patches(ratio):
    n = GRID[0] * GRID[1]
    expected = int(ratio * n + 0.5)  # round half up
    assert occ.num_dropped(n, ratio) == expected
    for index in range(12):
        mask = occ.occlusion_mask(*GRID, ratio, seed=0, index=index)
        assert mask.shape == GRID and mask.dtype == torch.bool
        assert int(mask.sum()) == expected


def test_masks_are_seeded_per_image_nested_and_reproducible():
    a = [occ.occlusion_mask(*GRID, 0.5, seed=0, index=i) for i in range(4)]
    assert all(torch.equal(m, occ.occlusion_mask(*GRID, 0.5, seed=0, index=i)) for i, m in enumerate(a))
    assert not torch.equal(a[0], a[1])  # per image
    assert not torch.equal(a[0], occ.occlusion_mask(*GRID, 0.5, seed=1, index=0))  # per seed
    assert not torch.equal(a[0], occ.occlusion_mask(*GRID, 0.5, seed=0, index=0, repeat=1))  # per repeat
    previous = torch.zeros(GRID, dtype=torch.bool)
    for ratio in occ.DEFAULT_RATIOS:  # "gradually drop 10% more patches": each mask contains the previous one
        mask = occ.occlusion_mask(*GRID, ratio, seed=0, index=3)
        assert torch.equal(mask & previous, previous)
        previous = mask


def test_zero_patches_blanks_exactly_the_masked_patches():
    images = torch.randn(3, 3, IMG, IMG)
    ranks = torch.stack([occ.patch_ranks(49, 0, i) for i in range(3)])
    masks = occ.batch_masks(ranks, GRID, 0.3)
    fill = occ.fill_values('black', (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    out = occ.zero_patches(images, masks, PATCH, fill)
    patches = out.unflatten(2, (7, 16)).unflatten(4, (7, 16))  # B, C, h, 16, w, 16
    blank = (patches == fill.view(1, 3, 1, 1, 1, 1)).all(dim=(1, 3, 5))
    assert torch.equal(blank, masks)
    assert blank.flatten(1).sum(1).tolist() == [occ.num_dropped(49, 0.3)] * 3
    assert torch.equal(
        out[~masks.repeat_interleave(16, 1).repeat_interleave(16, 2)[:, None].expand_as(out)],
        images[~masks.repeat_interleave(16, 1).repeat_interleave(16, 2)[:, None].expand_as(images)],
    )
    assert torch.equal(occ.fill_values('zero', (0.5,) * 3, (0.5,) * 3), torch.zeros(3))


def _recorded_masks(model, data_dir, batch_size, ratio):
    """Zero-mode masks as the model sees them (patches that are exactly zero), image by image."""
    seen = []
    handle = model.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
    try:
        occ.evaluate(model, _loader(model, data_dir, batch_size), grid=GRID, patch=PATCH, ratios=[ratio])
    finally:
        handle.remove()
    x = torch.cat(seen)
    return (x.unflatten(2, (7, 16)).unflatten(4, (7, 16)) == 0).all(dim=(1, 3, 5))


def test_masks_identical_across_batch_sizes_and_runs(resnet, data_dir):
    masks = _recorded_masks(resnet, data_dir, 4, 0.4)
    assert masks.shape == (10, *GRID)
    for index in range(10):
        assert torch.equal(masks[index], occ.occlusion_mask(*GRID, 0.4, seed=0, index=index))
    assert torch.equal(masks, _recorded_masks(resnet, data_dir, 1, 0.4))
    assert torch.equal(masks, _recorded_masks(resnet, data_dir, 3, 0.4))


# ------------------------------------------------------------------------------------- evaluation
def _plain_top1(model, loader):
    correct = n = 0
    with torch.inference_mode():
        for images, target, _ in loader:
            correct += int((model(images).argmax(-1) == target).sum())
            n += len(target)
    return 100.0 * correct / n


@pytest.mark.parametrize('mode', occ.MODES)
def test_ratio_zero_equals_plain_evaluation(vit, data_dir, mode):
    loader = _loader(vit, data_dir, 4)
    rows = occ.evaluate(vit, loader, grid=GRID, patch=PATCH, ratios=[0.0, 0.5], mode=mode, repeats=2)
    assert [r['ratio'] for r in rows] == [0.0, 0.5] and rows[0]['images'] == 10
    assert rows[0]['top1'] == _plain_top1(vit, loader) and rows[0]['top1_std'] == 0
    assert rows[0]['top5'] >= rows[0]['top1']


def test_batch_size_does_not_change_results(resnet, data_dir):
    kwargs = dict(grid=GRID, patch=PATCH, ratios=[0.0, 0.3, 0.8], repeats=2)
    assert occ.evaluate(resnet, _loader(resnet, data_dir, 10), **kwargs) == occ.evaluate(
        resnet, _loader(resnet, data_dir, 3), **kwargs
    )


def _reference_drop(model, images, keep):
    """ViT forward on the kept patch tokens, by hand: each with its own position embedding, prefix tokens kept."""
    tokens = model.patch_embed(images)
    p = model.num_prefix_tokens
    prefix = [t.expand(len(images), -1, -1) for t in (model.cls_token, model.reg_token) if t is not None]
    prefix = torch.cat(prefix, dim=1)
    if model.no_embed_class:
        tokens = tokens + model.pos_embed
    else:
        prefix, tokens = prefix + model.pos_embed[:, :p], tokens + model.pos_embed[:, p:]
    kept = torch.stack([tokens[b, keep[b]] for b in range(len(images))])
    x = model.norm(model.blocks(model.norm_pre(torch.cat([prefix, kept], dim=1))))
    return model.forward_head(x)


@pytest.mark.parametrize(
    'kwargs',
    [{}, {'reg_tokens': 2, 'no_embed_class': True}, {'global_pool': 'avg'}],
    ids=['cls', 'reg+no_embed_class', 'avgpool'],
)
def test_drop_mode_matches_a_forward_on_the_kept_tokens(kwargs):
    model = _vit(**kwargs)
    images = torch.randn(3, 3, IMG, IMG)
    with torch.inference_mode():
        plain = model(images)
        none = torch.zeros(3, *GRID, dtype=torch.bool)
        assert torch.equal(occ.occluded_logits(model, images, none, PATCH, mode='drop'), plain)
        for ratio in (0.1, 0.5, 0.9):
            masks = torch.stack([occ.occlusion_mask(*GRID, ratio, 0, i) for i in range(3)])
            keep = occ.keep_indices(masks)
            assert keep.shape == (3, 49 - occ.num_dropped(49, ratio))
            assert all(torch.equal(keep[b], (~masks[b].flatten()).nonzero()[:, 0]) for b in range(3))
            dropped = occ.occluded_logits(model, images, masks, PATCH, mode='drop')
            torch.testing.assert_close(dropped, _reference_drop(model, images, keep), rtol=1e-5, atol=1e-5)
            assert not torch.allclose(dropped, plain)
        assert torch.equal(model(images), plain)  # the hook is gone


# -------------------------------------------------------------------------------------------- CLI
def _argv(data_dir, out, *extra):
    return [
        '--data-dir',
        str(data_dir),
        '--out',
        str(out),
        '-b',
        '4',
        '-j',
        '0',
        '--device',
        'cpu',
        '--no-progress',
        *map(str, extra),
    ]


def _read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_cli_writes_csv_md_png_one_row_per_ratio(tmp_path, data_dir, vit, capsys):
    ckpt = tmp_path / 'vit.pth'
    torch.save({'epoch': 1, 'state_dict': vit.state_dict()}, ckpt)
    out = tmp_path / 'drop'
    assert (
        occlusion_cli.main(
            _argv(
                data_dir,
                out,
                '--model',
                'vit_tiny_patch16_224',
                '--model-kwargs',
                f'img_size={IMG}',
                f'depth={DEPTH}',
                '--checkpoint',
                ckpt,
                '--mode',
                'drop',
            )
        )
        == 0
    )
    rows = _read_csv(out / 'occlusion.csv')
    assert [float(r['ratio']) for r in rows] == pytest.approx(occ.DEFAULT_RATIOS)
    assert [int(r['dropped_patches']) for r in rows] == [occ.num_dropped(49, r) for r in occ.DEFAULT_RATIOS]
    assert float(rows[0]['top1']) == _plain_top1(vit, _loader(vit, data_dir, 4))
    assert (out / 'occlusion.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    md = (out / 'occlusion.md').read_text()
    assert md.count('\n| ') == 1 + len(occ.DEFAULT_RATIOS) and '7x7 patches of 16x16 px' in md
    printed = capsys.readouterr().out
    assert '| 90% | 44/49 |' in printed and 'occlusion.csv' in printed


def test_console_script_zero_mode_on_a_cnn(tmp_path, data_dir, run_env):
    out = tmp_path / 'zero'
    proc = subprocess.run(
        [
            'tokenaug-occlusion',
            *_argv(
                data_dir,
                out,
                '--model',
                'resnet18',
                '--num-classes',
                10,
                '--img-size',
                IMG,
                '--ratios',
                0,
                0.5,
                '--repeats',
                2,
                '--fill',
                'black',
            ),
        ],
        env=run_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    rows = _read_csv(out / 'occlusion.csv')
    assert len(rows) == 2 and [int(r['num_patches']) for r in rows] == [49, 49]
    assert all((out / f'occlusion.{ext}').is_file() for ext in ('csv', 'md', 'png'))


@pytest.mark.parametrize(
    'extra, needle',
    [
        (['--ratios', '0', '1.0'], '--ratios'),
        (['--ratios', '-0.1'], '--ratios'),
        (['--mode', 'cut'], '--mode'),
        (['--repeats', '0'], '--repeats'),
    ],
)
def test_bad_arguments_are_named(tmp_path, data_dir, capsys, extra, needle):
    with pytest.raises(SystemExit) as e:
        occlusion_cli.main(_argv(data_dir, tmp_path, '--model', 'resnet18', *extra))
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize(
    'extra, needle',
    [
        (['--model', 'resnet18', '--mode', 'drop'], '--mode drop'),
        (['--model', 'resnet18', '--patch-size', '15'], '--patch-size'),
        (
            [
                '--model',
                'vit_tiny_patch16_224',
                '--model-kwargs',
                f'img_size={IMG}',
                '--mode',
                'drop',
                '--patch-size',
                '8',
            ],
            '--patch-size',
        ),
        (['--model', 'resnet18', '--split', 'nope'], '--split'),
    ],
)
def test_bad_setups_give_clear_errors(tmp_path, data_dir, capsys, extra, needle):
    assert occlusion_cli.main(_argv(data_dir, tmp_path / 'out', '--num-classes', 10, '--img-size', IMG, *extra)) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / 'out' / 'occlusion.csv').exists()


def test_function_level_errors(resnet):
    with pytest.raises(ValueError, match=r'ratio: expected a fraction in \[0, 1\), got 1.0'):
        occ.occlusion_mask(7, 7, 1.0, 0, 0)
    with pytest.raises(ValueError, match='--mode'):
        occ.occluded_logits(
            resnet, torch.zeros(1, 3, IMG, IMG), torch.zeros(1, *GRID, dtype=torch.bool), PATCH, mode='cut'
        )
    with pytest.raises(ValueError, match='--mode drop.*ResNet'):
        with occ.token_drop(resnet):
            pass


def test_top5_is_left_out_with_five_classes_or_fewer(tmp_path):
    """With 5 classes or fewer top-5 is 100 % whatever the model: the table and the plot leave it out (the CSV,
    the data, keeps it); with more classes both columns stay."""
    rows = [
        dict(ratio=r, dropped_patches=d, num_patches=49, top1=t, top5=100.0, top1_std=0.0, top5_std=0.0, images=8)
        for r, d, t in ((0.0, 0, 62.5), (0.5, 24, 37.5))
    ]
    assert 'top-5' not in occlusion_cli.format_table(rows, num_classes=4)
    assert occlusion_cli.format_table(rows, num_classes=4).splitlines()[2] == '| 0% | 0/49 | 62.50 |'
    assert occlusion_cli.format_table(rows, num_classes=10).splitlines()[2] == '| 0% | 0/49 | 62.50 | 100.00 |'
    paths = occlusion_cli.write_results(rows, tmp_path, header='h', num_classes=4)
    assert 'top-5' not in paths['md'].read_text() and 'top5' in paths['csv'].read_text().splitlines()[0]
