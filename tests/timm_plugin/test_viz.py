"""``tokenaug-viz`` and its library (shared_core.viz / plotting): the pictures are read back pixel for pixel."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from shared_core.viz import (
    OWN,
    PARTNER,
    images_uint8,
    share_colours,
    share_from_colour,
    share_image,
    token_centres,
)
from timm_plugin.tools import viz_cli

from ..conftest import REPO

CONFIG = str(REPO / 'configs' / 'timm' / 'world_vit-tiny.yaml')


def _png(path):
    return np.asarray(Image.open(path).convert('RGB'))


def test_share_colours_round_trip_and_paint_every_pixel_of_its_token():
    s = np.linspace(0, 1, 101)
    assert (share_colours(0.0) == OWN).all() and (share_colours(1.0) == PARTNER).all()
    assert np.abs(share_from_colour(share_colours(s)) - s).max() < 1 / 300
    share = torch.tensor([[[0.0, 0.25], [0.5, 1.0]]])
    pic = share_image(share, (20, 24), (8, 16))  # a clipped grid: 8+8+4 rows, 16+8 columns
    assert pic.shape == (1, 20, 24, 3)
    for (r0, r1, c0, c1), v in (((0, 8, 0, 16), 0.0), ((0, 8, 16, 24), 0.25), ((8, 20, 0, 16), 0.5)):
        assert (pic[0, r0:r1, c0:c1] == share_colours(v)).all()
    assert (pic[0, 8:, 16:] == share_colours(1.0)).all()
    x = torch.rand(2, 3, 4, 4)
    assert (
        images_uint8((x - 0.5) / 0.25, [0.5] * 3, [0.25] * 3) == (x * 255).round().byte().permute(0, 2, 3, 1).numpy()
    ).all()


@pytest.mark.parametrize('kind', ['tokenmix_block', 'cutmix'])
def test_mix_pictures_show_what_training_mixes(tiny_world, tmp_path, kind):
    """The share picture's colour at each token is its partner share (token masks 0/1, CutMix's pixel box
    fractional at its edges); where a token came whole from the partner the mixed image is the partner's."""
    out = tmp_path / kind
    argv = ['mix', '-c', CONFIG, '--data-dir', str(tiny_world / 'imagenet'), '--mixup-type', kind]
    argv += ['--mixup', '0', '--cutmix', '1.0', '--mixup-mode', 'elem', '--count', '4', '--viz-dir', str(out)]
    assert viz_cli.main(argv) == 0
    meta = json.loads((out / 'meta.json').read_text())
    assert (out / 'index.html').read_text().count('<img') == 1 and _png(out / 'mix.png').shape[0] > 400
    ph, pw = meta['patch_size']
    partial = 0
    for i, sample in enumerate(meta['samples']):
        share = np.asarray(sample['token_share'])
        pic = _png(out / sample['files']['share'])
        assert pic.shape[:2] == tuple(meta['img_size'])
        rc = token_centres(share.shape, (ph, pw))
        read = share_from_colour(pic[rc[:, 0], rc[:, 1]]).reshape(share.shape)
        assert np.abs(read - share).max() < 1 / 300
        partial += int(((share > 0) & (share < 1)).sum())
        mixed, partner = _png(out / sample['files']['mixed']), _png(out / sample['files']['partner'])
        for r, c in np.argwhere(share == 1.0):
            assert (
                mixed[r * ph : (r + 1) * ph, c * pw : (c + 1) * pw]
                == partner[r * ph : (r + 1) * ph, c * pw : (c + 1) * pw]
            ).all()
        assert abs(float(share.mean()) - (1 - sample['lam'])) < (0.02 if kind == 'cutmix' else 1e-6)
        assert abs(sum(sample['target']) - 1) < 1e-5
    assert (partial > 0) == (kind == 'cutmix')  # pixel boxes cut tokens; token masks never do


def test_mix_pictures_name_the_branch_the_switch_drew(tiny_world, tmp_path):
    """With MixUp beside a token kind (DeiT's switch), each sample's picture and meta.json name the branch drawn
    for it (a blend is 'mixup', not 'tokenmix_block'), and the figure's title says how many of each."""
    out = tmp_path / 'switch'
    argv = ['mix', '-c', CONFIG, '--data-dir', str(tiny_world / 'imagenet'), '--mixup-type', 'tokenmix_block']
    argv += ['--mixup', '0.8', '--cutmix', '1.0', '--mixup-mode', 'elem', '--count', '8', '--viz-dir', str(out)]
    assert viz_cli.main(argv) == 0
    meta = json.loads((out / 'meta.json').read_text())
    branches = [sample['branch'] for sample in meta['samples']]
    for sample, branch in zip(meta['samples'], branches):
        share = np.asarray(sample['token_share'])
        blend = sample['lam'] < 1 and np.allclose(share, 1 - sample['lam'])
        assert (branch == 'mixup') == blend and branch in ('mixup', 'tokenmix_block', 'unmixed')
    assert 'mixup' in branches and 'tokenmix_block' in branches  # this seed draws both
    n = branches.count('mixup')
    assert meta['mixing'].endswith(f'(this draw: mixup for {n}, tokenmix_block for {8 - n} of 8)'), meta['mixing']


def test_panel_titles_stay_within_their_panels():
    """A title longer than its panel takes more lines instead of running into its neighbour's (the activation-map
    figure's λ' was hidden so): every title's box lies within its panel's width, none overlaps another."""
    from shared_core.plotting import draw_figure, pyplot

    img = np.zeros((32, 32, 3), np.uint8)
    long = "tokenmix_block, area λ=0.71, λ'=0.72 and more words to be sure"
    rows = [[(long, img), ('target: 04_grid_hexagon 0.65, 09_grid_lshape 0.27', img), ('short', img)]] * 2
    fig = draw_figure(rows, title='a title')
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    boxes = []
    for ax in fig.axes[:6]:
        panel, title = ax.get_window_extent(renderer), ax.title.get_window_extent(renderer)
        assert panel.x0 - 1 <= title.x0 and title.x1 <= panel.x1 + 1, ax.title.get_text()
        boxes.append(title)
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    assert "λ'=0.72" in fig.axes[0].title.get_text().replace('\n', ' ')  # broken at spaces, nothing lost
    pyplot().close(fig)


def test_tokenmix_masks_have_the_requested_size(tmp_path):
    out = tmp_path / 'tm'
    assert viz_cli.main(['tokenmix', '--lam', '0.3', '--count', '4', '--viz-dir', str(out)]) == 0
    meta = json.loads((out / 'meta.json').read_text())
    rc = token_centres((14, 14), (16, 16))
    for kind in ('tokenmix_block', 'tokenmix_random'):
        for f in meta['samplers'][kind]['files']:
            read = share_from_colour(_png(out / f)[rc[:, 0], rc[:, 1]])
            assert set(np.round(read, 3)) <= {0.0, 1.0} and int(read.sum()) == round(0.7 * 196)  # exactly (1-λ)N
    for kind in ('token_box', 'cutmix'):  # boxes: the draws of Beta(1, 1) nearest λ, as listed
        assert all(abs(v - 0.3) < 0.1 for v in meta['samplers'][kind]['lam'])


def test_bad_arguments_are_named(tiny_world, tmp_path, capsys):
    assert viz_cli.main(['tokenmix', '--count', '3', '--viz-dir', str(tmp_path)]) == 2
    assert '--count: expected an even number' in capsys.readouterr().err
    argv = ['mix', '-c', CONFIG, '--data-dir', str(tiny_world / 'imagenet'), '--mixup-type', 'mixtoken']
    assert viz_cli.main(argv + ['--viz-dir', str(tmp_path)]) == 2
    assert 'token labeling mixes inside the model' in capsys.readouterr().err
    assert viz_cli.main(['nope']) == 2


def test_tl_align_pictures_read_back_and_start_from_the_mix(tiny_world, tmp_path):
    """Fig. 6 for a checkpoint: the initial label picture is the mix's token shares (the same draw as
    ``tokenaug-viz mix`` with the same flags), the aligned one the label state after the last block."""
    import timm

    ckpt = tmp_path / 'vit.pth'
    torch.manual_seed(0)
    torch.save(timm.create_model('vit_tiny_patch16_224', num_classes=10, img_size=112, depth=2).state_dict(), ckpt)
    common = ['-c', CONFIG, '--data-dir', str(tiny_world / 'imagenet'), '--mixup', '0', '--cutmix', '1.0']
    common += ['--mixup-mode', 'elem', '--count', '4', '--model-kwargs', 'img_size=112', 'depth=2']
    out, ref = tmp_path / 'tla', tmp_path / 'mix'
    argv = ['tl-align', *common, '--initial-checkpoint', str(ckpt), '--per-block', '--viz-dir', str(out)]
    assert viz_cli.main(argv) == 0
    assert viz_cli.main(['mix', *common, '--viz-dir', str(ref)]) == 0
    meta, mixed = json.loads((out / 'meta.json').read_text()), json.loads((ref / 'meta.json').read_text())
    assert meta['checkpoint'] == str(ckpt)
    rc = token_centres((7, 7), (16, 16))
    for sample, same in zip(meta['samples'], mixed['samples']):
        assert np.allclose(sample['initial'], same['token_share']) and sample['area_lam'] == same['lam']
        for key in ('initial', 'aligned'):
            read = share_from_colour(_png(out / sample['files'][key])[rc[:, 0], rc[:, 1]]).reshape(7, 7)
            assert np.abs(read - np.asarray(sample[key])).max() < 1 / 300
        assert 0.0 <= sample['aligned_lam'] <= 1.0 and {'block0', 'block1'} <= set(sample['files'])
    # --per-block: the states in a figure of their own, at most BLOCKS_PER_ROW a row (not one strip per sample)
    assert (out / 'index.html').read_text().count('<img') == 2
    assert _png(out / 'tl_align_blocks.png').shape[1] <= _png(out / 'tl_align.png').shape[1]
    # by default the cut branch, even under DeiT's switch (the config's MixUp 0.8 / CutMix 1.0), named
    switch = ['-c', CONFIG, '--data-dir', str(tiny_world / 'imagenet'), '--count', '8', '--initial-checkpoint']
    switch += [str(ckpt), '--model-kwargs', 'img_size=112', 'depth=2']
    for branch, drawn in (('cut', 'cutmix for 8 of 8'), ('mixup', 'mixup for 8 of 8')):
        chosen = [] if branch == 'cut' else ['--branch', branch]  # cut: the default
        assert viz_cli.main(['tl-align', *switch, *chosen, '--viz-dir', str(tmp_path / branch)]) == 0
        meta = json.loads((tmp_path / branch / 'meta.json').read_text())
        assert meta['branch'] == branch and meta['drawn'] == drawn
        assert {s['branch'] for s in meta['samples']} == {drawn.split()[0]}
        if branch == 'cut':  # boxes: some token is cut, so its share is neither 0 nor the same everywhere
            assert any(len(set(np.round(np.ravel(s['initial']), 6))) > 1 for s in meta['samples'])
    assert viz_cli.main(['tl-align', *switch, '--cutmix', '0', '--viz-dir', str(tmp_path / 'r')]) == 2
    with pytest.raises(ValueError, match='no tracer for .*EdgeNeXt'):  # its attention: the graph route stops there
        viz_cli.tl_align(
            [*common[:-3], '--model', 'edgenext_small', '--model-kwargs', '--viz-dir', str(tmp_path / 'r')]
        )
    # any family whose label states lie on a grid: a ResNet's on its stages' grids (stride 4, then coarser)
    res = tmp_path / 'resnet'
    argv = ['tl-align', *common[:-3], '--model', 'resnet18', '--model-kwargs', '--mixup-type', 'tl_align']
    assert viz_cli.main([*argv, '--viz-dir', str(res)]) == 0  # the mixer on the ResNet's first grid (stride 4)
    grids = json.loads((res / 'meta.json').read_text())['block_grids']
    assert grids[0] == [28, 28] and grids[-1] == [4, 4] and len(grids) == 8  # 112-pixel images, 8 blocks
    with pytest.raises(ValueError, match='draws label states on a token grid; Hiera keeps its tokens in another'):
        viz_cli.tl_align([*common[:-3], '--model', 'hiera_tiny_224', '--model-kwargs', 'img_size=[128,128]',
                          '--input-size', '3', '128', '128', '--viz-dir', str(tmp_path / 'r')])  # fmt: skip


def _token_label_agreement(out, grid, stride):
    """Over the pictures of ``tokenaug-viz token-labels`` in ``out``: every token whose centre pixel shows a
    quadrant colour and whose target is confident has that quadrant's class as its target, in meta.json and in
    the picture's colours. Returns (tokens checked, draws flipped, draws moved by a geometric op)."""
    from shared_core.viz import class_from_colour

    from ..helpers.data import COLOURS

    meta = json.loads((out / 'meta.json').read_text())
    assert meta['grid'] == list(grid) and meta['geometric_aa'] == 'follow'
    rc = token_centres(grid, stride)
    checked, flipped, moved = 0, 0, 0
    for image in meta['images']:
        assert _png(out / image['map']).shape == (64, 64, 3)  # the 8x8 stored map, 8 px per cell
        for draw in image['draws']:
            pix = _png(out / draw['files']['image'])[rc[:, 0], rc[:, 1]].astype(float)
            d = ((pix[:, None] - COLOURS[None].astype(float)) ** 2).sum(-1) ** 0.5
            quadrant = np.where(d.min(1) < 30, d.argmin(1), -1)  # -1: fill, or a colour op changed the colours
            top1 = np.asarray(draw['top1']).ravel()
            sure = np.asarray(draw['confidence']).ravel() > 0.9
            painted = class_from_colour(_png(out / draw['files']['targets'])[rc[:, 0], rc[:, 1]], 4)
            ok = (quadrant >= 0) & sure
            assert (top1[ok] == quadrant[ok]).all() and (painted[sure] == top1[sure]).all()
            checked += int(ok.sum())
            identity = np.allclose(np.asarray(draw['affines']).reshape(-1, 2, 3), np.eye(3)[:2])
            flipped += int(draw['flip'] and ok.any())
            moved += int(not identity and ok.any())
    return checked, flipped, moved


def test_token_label_pictures_follow_the_image_through_flips_and_rotations(quadrant_data, tmp_path):
    """Quadrant images with quadrant maps, through crop, flip and RandAugment (geometric ops followed): every
    token whose centre pixel shows a quadrant colour and whose target is confident has that quadrant's class
    as its target, in meta.json and in the picture's colours."""
    out = tmp_path / 'tl'
    argv = ['token-labels', '--data-dir', str(quadrant_data), '--token-label-dir', str(quadrant_data / 'maps')]
    argv += ['--model', 'vit_tiny_patch16_224', '--model-kwargs', 'img_size=64', '--input-size', '3', '64', '64']
    argv += ['--aa', 'rand-m9-n1', '--color-jitter', '0', '--train-interpolation', 'nearest']
    argv += ['--count', '6', '--draws', '6', '--viz-dir', str(out)]
    assert viz_cli.main(argv) == 0
    checked, flipped, moved = _token_label_agreement(out, (4, 4), (16, 16))
    assert checked > 150 and flipped > 3 and moved > 3, (checked, flipped, moved)


def test_token_label_pictures_of_a_resnet_are_on_its_final_feature_grid(quadrant_data, tmp_path):
    """A ResNet, as training takes it: the targets on its final feature map's grid (32 px, the grid token
    labeling trains on; the pictures once looked for a patch grid and refused it), each 32-px cell of a 64-px
    image one quadrant, followed through flips."""
    out = tmp_path / 'tl'
    argv = ['token-labels', '--data-dir', str(quadrant_data), '--token-label-dir', str(quadrant_data / 'maps')]
    argv += ['--model', 'resnet18', '--input-size', '3', '64', '64', '--scale', '1', '1', '--ratio', '1', '1']
    argv += ['--color-jitter', '0', '--train-interpolation', 'nearest']
    argv += ['--count', '6', '--draws', '4', '--viz-dir', str(out)]
    assert viz_cli.main(argv) == 0
    checked, flipped, _ = _token_label_agreement(out, (2, 2), (32, 32))
    assert checked > 40 and flipped > 2, (checked, flipped)


def test_tokenmixup_pictures_show_the_htm_plan(tiny_world, tmp_path):
    """The swapped tokens are where the partner's saliency exceeds the sample's by more than ρ (Eq. 9), as
    meta.json and the picture say, and the image-space picture has the partner's patches exactly there."""
    out = tmp_path / 'tmu'
    argv = ['tokenmixup', '-c', CONFIG, '--data-dir', str(tiny_world / 'imagenet'), '--tokenmixup-htm-layers', '1']
    argv += ['--tokenmixup-tau', '100', '--tokenmixup-rho', '0.001', '--count', '4', '--viz-dir', str(out)]
    argv += ['--model-kwargs', 'img_size=112', 'depth=2']
    assert viz_cli.main(argv) == 0
    meta = json.loads((out / 'meta.json').read_text())
    rc = token_centres((7, 7), (16, 16))
    swapped_any = 0
    for i, sample in enumerate(meta['samples']):
        S, p = np.asarray(sample['saliency']), sample['partner']
        swap = np.asarray(sample['swapped']) > 0.5
        if p != i:
            assert sample['easy'] and (swap == (np.asarray(meta['samples'][p]['saliency']) - S > 0.001)).all()
        else:
            assert not swap.any() and sample['lam'] == 1.0
        read = share_from_colour(_png(out / sample['files']['swapped'])[rc[:, 0], rc[:, 1]]).reshape(7, 7)
        assert (np.round(read) == swap).all()
        pasted, own = _png(out / sample['files']['pasted']), _png(out / sample['files']['image'])
        partner = _png(out / meta['samples'][p]['files']['image'])
        for r in range(7):
            for c in range(7):
                cell = (slice(r * 16, r * 16 + 16), slice(c * 16, c * 16 + 16))
                assert (pasted[cell] == (partner if swap[r, c] else own)[cell]).all()
        swapped_any += int(swap.sum())
        assert abs(sum(sample['target']) - 1) < 1e-5
    assert swapped_any > 0
    assert meta['scorenet_note'] is None  # no checkpoint: nothing loaded, nothing to say


def test_tokenmixup_pictures_of_a_checkpoint_trained_without_tokenmixup(tiny_world, tmp_path, capsys):
    """A checkpoint with no ScoreNets (trained without TokenMixup) draws, with the untrained ScoreNet said in the
    output, meta.json and the title; a checkpoint that does not fit otherwise is an error naming the keys."""
    import timm

    ckpt = tmp_path / 'plain.pth'
    torch.manual_seed(0)
    torch.save(timm.create_model('vit_tiny_patch16_224', num_classes=10, img_size=112, depth=2).state_dict(), ckpt)
    argv = ['tokenmixup', '-c', CONFIG, '--data-dir', str(tiny_world / 'imagenet'), '--tokenmixup-htm-layers', '1']
    argv += ['--count', '2', '--model-kwargs', 'img_size=112', 'depth=2', '--initial-checkpoint', str(ckpt)]
    assert viz_cli.main([*argv, '--viz-dir', str(tmp_path / 'out')]) == 0
    meta = json.loads((tmp_path / 'out' / 'meta.json').read_text())
    assert 'has no ScoreNet' in meta['scorenet_note'] and 'has no ScoreNet' in capsys.readouterr().out
    deeper = tmp_path / 'deeper.pth'
    torch.save(timm.create_model('vit_tiny_patch16_224', num_classes=10, img_size=112, depth=3).state_dict(), deeper)
    argv[argv.index(str(ckpt))] = str(deeper)
    with pytest.raises(ValueError, match=r'--initial-checkpoint: .*deeper.pth does not fit .*unexpected \[.blocks.2'):
        viz_cli.tokenmixup([*argv, '--viz-dir', str(tmp_path / 'out2')])


def test_mix_pictures_show_tokenmix_activation_map_targets(quadrant_data, tmp_path):
    """TokenMix's activation-map targets for pairs (``mix --activation-map-dir``), on quadrant images whose
    teacher map of class c is 1 exactly on quadrant c: each token the image shows whole in one quadrant colour
    has map 1 for its own class's colour and 0 for the others (the map follows the crop and flip), the map
    picture's grey is round(255 · map), and λ' and the target are Eq. 2 recomputed by explicit loops."""
    from ..helpers.data import COLOURS

    out = tmp_path / 'act'
    argv = ['mix', '--data-dir', str(quadrant_data), '--activation-map-dir', str(quadrant_data / 'maps')]
    argv += ['--model', 'vit_tiny_patch16_224', '--model-kwargs', 'img_size=64', '--input-size', '3', '64', '64']
    argv += ['--num-classes', '4', '--mixup-type', 'tokenmix_block', '--cutmix', '1', '--mixup', '0']
    argv += ['--mixup-mode', 'elem', '--train-interpolation', 'nearest', '--color-jitter', '0']
    argv += ['--count', '6', '--viz-dir', str(out)]
    assert viz_cli.main(argv) == 0
    meta = json.loads((out / 'meta.json').read_text())
    assert meta['mixing'] == 'tokenmix_block with true_class activation-map targets'
    samples, checked, eps = meta['samples'], 0, 0.1
    maps = [np.asarray(s['activation_map']) for s in samples]
    rc = token_centres((4, 4), (16, 16))
    for i, s in enumerate(samples):
        own, label = _png(out / s['files']['own']), s['label']
        grey = _png(out / s['files']['map'])[rc[:, 0], rc[:, 1]]
        assert (grey == np.round(255 * maps[i].ravel())[:, None]).all()
        for r in range(4):
            for c in range(4):
                cell = own[r * 16 : r * 16 + 16, c * 16 : c * 16 + 16].reshape(-1, 3)
                whole = [k for k in range(4) if (cell == COLOURS[k]).all()]
                if whole:
                    assert maps[i][r, c] == pytest.approx(float(whole[0] == label), abs=0.02)
                    checked += 1
        # Eq. 2 by loops: spatially normalised maps (even where a map is all zero), weights of the kept and
        # the given tokens, then the pair target with label smoothing
        share, p = np.asarray(s['token_share']), s['partner']

        def normalised(a):
            return a / a.sum() if a.sum() > 1e-12 else np.full_like(a, 1 / a.size)

        A, Ap = normalised(maps[i]), normalised(maps[p])
        w_own = sum((1 - share[r, c]) * A[r, c] for r in range(4) for c in range(4))
        w_partner = sum(share[r, c] * Ap[r, c] for r in range(4) for c in range(4))
        lam = w_own / (w_own + w_partner) if w_own + w_partner > 1e-12 else s['lam']
        assert s['activation_lam'] == pytest.approx(lam, abs=1e-5)
        target = np.full(4, eps / 4)
        target[label] += (1 - eps) * lam
        target[samples[p]['label']] += (1 - eps) * (1 - lam)
        assert np.abs(np.asarray(s['target']) - target).max() < 1e-5
    assert checked > 30, checked
    assert any(abs(s['activation_lam'] - s['lam']) > 0.05 for s in samples)  # the teacher moved some targets
    bad = [a if a != 'tokenmix_block' else 'tl_align' for a in argv[1:]]
    with pytest.raises(ValueError, match='--activation-map-dir: TokenMix targets apply to the mixing kinds'):
        viz_cli.mix(bad)


def test_tl_align_pictures_of_swin_follow_its_stages(tiny_world, tmp_path):
    """Fig. 6 for Swin (the paper's second model): the initial labels on the 4-pixel token grid, one picture per
    block on that block's grid (28x28, then 14x14 after the 2x2 merge), read back pixel for pixel, and the
    aligned λ is one minus the mean partner share of the last grid (Swin's global average pooling)."""
    import timm

    kw = dict(img_size=112, embed_dim=16, depths=(2, 2), num_heads=(1, 2), window_size=7)
    ckpt = tmp_path / 'swin.pth'
    torch.manual_seed(0)
    torch.save(timm.create_model('swin_tiny_patch4_window7_224', num_classes=10, **kw).state_dict(), ckpt)
    out = tmp_path / 'swin'
    argv = ['tl-align', '-c', CONFIG, '--data-dir', str(tiny_world / 'imagenet'), '--mixup', '0', '--cutmix', '1']
    argv += ['--mixup-mode', 'elem', '--count', '2', '--model', 'swin_tiny_patch4_window7_224', '--model-kwargs']
    argv += ['img_size=112', 'embed_dim=16', 'depths=(2,2)', 'num_heads=(1,2)', 'window_size=7']
    argv += ['--initial-checkpoint', str(ckpt), '--per-block', '--viz-dir', str(out)]
    assert viz_cli.main(argv) == 0
    meta = json.loads((out / 'meta.json').read_text())
    assert meta['patch_size'] == [4, 4] and meta['block_grids'] == [[28, 28], [28, 28], [14, 14], [14, 14]]
    for sample in meta['samples']:
        initial, aligned = np.asarray(sample['initial']), np.asarray(sample['aligned'])
        assert initial.shape == (28, 28) and aligned.shape == (14, 14)
        assert sample['aligned_lam'] == pytest.approx(1 - aligned.mean(), abs=1e-6)
        assert sample['area_lam'] == pytest.approx(1 - initial.mean(), abs=1e-6)
        for key, grid in (('initial', 28), ('aligned', 14)):
            rc = token_centres((grid, grid), (112 // grid, 112 // grid))
            read = share_from_colour(_png(out / sample['files'][key])[rc[:, 0], rc[:, 1]]).reshape(grid, grid)
            assert np.abs(read - np.asarray(sample[key])).max() < 1 / 300
        assert (_png(out / sample['files']['block3']) == _png(out / sample['files']['aligned'])).all()
        block0 = _png(out / sample['files']['block0'])  # 28x28 tokens of 4 px, moved by the first block
        assert block0.shape == (112, 112, 3) and not (block0 == _png(out / sample['files']['initial'])).all()
