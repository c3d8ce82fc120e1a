"""timm adapter: create_mixer / FastCollateTokenMixup with real timm losses, loaders and prefetcher."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from timm.data import FastCollateMixup, create_dataset, create_loader
from timm.loss import BinaryCrossEntropy, SoftTargetCrossEntropy

from shared_core.mixing import mix_images, mix_target
from timm_plugin import MixTarget, create_mixer

TOKEN_KINDS = ['token_box', 'tokenmix_block', 'tokenmix_random']


def _args(kind):
    return dict(mixup_alpha=0.8, cutmix_alpha=1.0) if kind != 'mixup' else dict(mixup_alpha=0.8)


@pytest.mark.parametrize('kind', ['mixup', 'cutmix'] + TOKEN_KINDS)
def test_mixer_is_called_like_timm_mixup(kind):
    g = torch.Generator().manual_seed(0)
    mixer = create_mixer(kind, num_classes=10, patch_size=16, generator=g, mode='elem', **_args(kind))
    x = torch.randn(8, 3, 64, 32)
    y = torch.randint(0, 10, (8,))
    xm, target = mixer(x.clone(), y)
    assert xm.shape == x.shape and target.shape == (8, 10)
    assert torch.allclose(target.sum(1), torch.ones(8))
    if kind in ('mixup', 'cutmix'):
        assert type(target) is torch.Tensor
    else:
        assert isinstance(target, MixTarget) and target.mix.kind == kind
        # the mix it carries reproduces both the images and the target
        assert torch.allclose(mix_images(x, target.mix), xm)
        assert torch.allclose(mix_target(y, target.mix, 10, 0.1), target.as_tensor())
    logits = torch.randn(8, 10)
    plain = target.as_subclass(torch.Tensor).clone()
    for loss in (SoftTargetCrossEntropy(), BinaryCrossEntropy()):
        assert torch.allclose(loss(logits, target), loss(logits, plain))


def test_mix_target_survives_to_pickle_and_worker_processes():
    mixer = create_mixer('tokenmix_block', cutmix_alpha=1.0, num_classes=5, patch_size=8)
    _, t = mixer(torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3]))
    moved = t.to('cpu', torch.float32)
    assert isinstance(moved, MixTarget) and torch.equal(moved.mix.token_share, t.mix.token_share)
    assert type(t * 2) is torch.Tensor  # every op gives a plain tensor

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return np.full((3, 16, 16), i * 10, dtype=np.uint8), i % 5

    collate = create_mixer('tokenmix_random', cutmix_alpha=1.0, num_classes=5, patch_size=8, collate=True)
    loader = torch.utils.data.DataLoader(DS(), batch_size=4, num_workers=2, collate_fn=collate)
    for x, target in loader:
        assert isinstance(target, MixTarget) and target.mix.token_share.shape == (4, 2, 2)
        assert x.dtype == torch.uint8


@pytest.mark.parametrize(
    'kind,mode',
    [(k, m) for k in ['cutmix', 'tokenmix_block'] for m in ['batch', 'pair', 'elem']]
    + [('cutmix', 'half'), ('mixup', 'half')],
)
def test_collate_equals_mixer_on_stacked_batch(kind, mode):
    imgs = [np.random.RandomState(i).randint(0, 256, (3, 32, 32)).astype(np.uint8) for i in range(6)]
    batch = [(im, i % 4) for i, im in enumerate(imgs)]
    collate = create_mixer(
        kind,
        num_classes=4,
        patch_size=8,
        collate=True,
        mode=mode,
        generator=torch.Generator().manual_seed(7),
        **_args(kind),
    )
    assert isinstance(collate, FastCollateMixup)
    x, target = collate(batch)
    ref_mode = 'elem' if mode == 'half' else mode
    mixer = create_mixer(
        kind, num_classes=4, patch_size=8, mode=ref_mode, generator=torch.Generator().manual_seed(7), **_args(kind)
    )
    xr, tr = mixer(torch.from_numpy(np.stack(imgs)), torch.tensor([b[1] for b in batch]))
    n = 3 if mode == 'half' else 6
    assert torch.equal(x, xr[:n]) and torch.allclose(target, tr[:n])


def _image_folder(root, classes=3, per_class=4, size=32):
    rng = np.random.RandomState(0)
    for c in range(classes):
        d = root / f'class{c}'
        d.mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.randint(0, 256, (size, size, 3), dtype=np.uint8)).save(d / f'{i}.png')
    return root


def test_prefetcher_and_mixup_off_switch(tmp_path):
    """timm's create_loader + PrefetchLoader drive our collate, and its mixup_enabled switch reaches it."""
    ds = create_dataset('', root=str(_image_folder(tmp_path / 'train')), is_training=True)
    collate = create_mixer(
        'tokenmix_block',
        cutmix_alpha=1.0,
        mixup_alpha=0.0,
        num_classes=3,
        patch_size=8,
        collate=True,
        label_smoothing=0.0,
        tokenmix_lam=0.5,
    )  # λ = 0.5: always mixed
    loader = create_loader(
        ds,
        input_size=(3, 32, 32),
        batch_size=4,
        is_training=True,
        use_prefetcher=True,
        collate_fn=collate,
        num_workers=0,
        device=torch.device('cpu'),
        no_aug=True,
    )
    assert loader.mixup_enabled
    x, target = next(iter(loader))
    assert x.dtype == torch.float32 and isinstance(target, MixTarget)
    assert torch.all(target.mix.lam == 0.5)  # mixed
    loader.mixup_enabled = False
    assert not collate.mixup_enabled
    x, target = next(iter(loader))
    assert torch.all(target.as_tensor().max(1).values == 1)  # one-hot: nothing mixed


def test_bad_input_errors():
    mixer = create_mixer('tokenmix_block', cutmix_alpha=1.0, num_classes=10, patch_size=16)
    with pytest.raises(ValueError, match='x: .*even'):
        mixer(torch.randn(3, 3, 32, 32), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r'target: .*\[0, num_classes=10\)'):
        mixer(torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 10]))
    with pytest.raises(ValueError, match='target: .*integer'):
        mixer(torch.randn(4, 3, 32, 32), torch.rand(4))
    with pytest.raises(ValueError, match='x: image size 32x40 is not divisible by patch_size 16x16'):
        mixer(torch.randn(4, 3, 32, 40), torch.tensor([0, 1, 2, 3]))
    for plain in (create_mixer(mixup_alpha=0.8, num_classes=10), create_mixer(cutmix_alpha=1.0, num_classes=10)):
        # the batch path without a Mix: the range is checked when one_hot's scatter refuses an index
        for bad in ([0, 1, 2, 10], [0, -1, 2, 3]):
            with pytest.raises(ValueError, match=r'target: .*\[0, num_classes=10\)'):
                plain(torch.randn(4, 3, 32, 32), torch.tensor(bad))
        with pytest.raises(ValueError, match='target: .*integer'):
            plain(torch.randn(4, 3, 32, 32), torch.rand(4))
        with pytest.raises(ValueError, match='x: .*even'):
            plain(torch.randn(3, 3, 32, 32), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match='mix_kind'):
        create_mixer('transmixx')
    with pytest.raises(ValueError, match='num_classes'):
        create_mixer('mixup', num_classes=0)
    with pytest.raises(ValueError, match="mode='half'.*partners"):
        create_mixer('tokenmix_block', cutmix_alpha=1.0, mode='half', collate=True)
    with pytest.raises(ValueError, match='collate=True'):
        create_mixer('mixup', mode='half')


def test_a_channels_last_batch_is_refused_naming_the_layout():
    """A ``(B, H, W, C)`` batch: timm's ``Mixup`` takes it and its CutMix cuts the ``W x C`` plane (kept as timm's
    behaviour until now); tokenaug refuses it by shape for every kind, the collate and mmpretrain's augment
    (docs/departures.md). A ``channels_last`` memory format is a (B, C, H, W) tensor and is mixed as any."""
    from timm.data import Mixup

    from mm_plugin.batch_augments import TACutMix

    nhwc, y = torch.rand(4, 64, 64, 3), torch.tensor([0, 1, 2, 3])
    out, _ = Mixup(mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=10)(nhwc.clone(), y)
    assert out.shape == (4, 64, 64, 3)  # timm's: taken as it is
    layout = r'x: \(4, 64, 64, 3\) looks like a channels-last \(B, H, W, C\) batch.*permute\(0, 3, 1, 2\)'
    for kind, alphas in (
        ('cutmix', dict(mixup_alpha=0.8, cutmix_alpha=1.0)),
        ('mixup', dict(mixup_alpha=0.8)),
        ('token_box', dict(cutmix_alpha=1.0)),
        ('tokenmix_block', dict(cutmix_alpha=1.0)),
    ):
        with pytest.raises(ValueError, match=layout):
            create_mixer(kind, **alphas, num_classes=10, patch_size=16)(nhwc, y)
    collate = create_mixer('cutmix', cutmix_alpha=1.0, num_classes=10, collate=True)
    images = [((nhwc[i] * 255).to(torch.uint8).numpy(), int(y[i])) for i in range(4)]
    with pytest.raises(ValueError, match='batch: .* looks like a channels-last'):
        collate(images)
    with pytest.raises(ValueError, match='batch_inputs: .* looks like a channels-last'):
        TACutMix(alpha=1.0, patch_size=16)(nhwc, torch.eye(10)[y])
    nchw = torch.rand(4, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    out, target = create_mixer('cutmix', cutmix_alpha=1.0, num_classes=10)(nchw, y)
    assert out.shape == (4, 3, 64, 64) and target.shape == (4, 10)


def test_mix_target_deepcopy_and_timm_attributes_are_live():
    import copy

    mixer = create_mixer(
        'tokenmix_block',
        cutmix_alpha=1.0,
        mixup_alpha=0.0,
        num_classes=4,
        patch_size=8,
        tokenmix_lam=0.5,
        label_smoothing=0.0,
    )
    _, t = mixer(torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3]))
    c = copy.deepcopy(t)
    assert isinstance(c, MixTarget) and torch.equal(c.as_tensor(), t.as_tensor())
    assert torch.equal(c.mix.token_share, t.mix.token_share) and c.mix is not t.mix
    # a loop that schedules timm's attributes reaches the sampler
    mixer.mix_prob = 0.0
    x = torch.randn(4, 3, 16, 16)
    xm, t = mixer(x, torch.tensor([0, 1, 2, 3]))
    assert torch.equal(xm, x) and torch.equal(t.as_tensor(), torch.eye(4))
    collate = create_mixer('cutmix', cutmix_alpha=1.0, num_classes=4, patch_size=8, collate=True)
    collate.mix_prob = 0.0
    batch = [(np.full((3, 16, 16), i, dtype=np.uint8), i) for i in range(4)]
    out, t = collate(batch)
    assert collate.mixer.sampler.mix_prob == 0.0
    assert torch.equal(out, torch.from_numpy(np.stack([b[0] for b in batch])))


def test_cutmix_kind_without_cutmix_alpha_is_mixup_only_as_in_timm():
    mixer = create_mixer('cutmix', mixup_alpha=0.8, cutmix_alpha=0.0, num_classes=4, patch_size=8, mode='elem')
    x = torch.randn(8, 3, 16, 16)
    _, t = mixer(x, torch.arange(8) % 4)
    assert not mixer.sampler.has_cut and t.shape == (8, 4)


def test_mixup_off_reaches_non_persistent_workers(tmp_path):
    """tokenaug-train builds its loader with persistent_workers=False when --mixup-off-epoch is set:
    each epoch's workers then get the collate function with mixing switched off."""
    ds = create_dataset('', root=str(_image_folder(tmp_path / 'train')), is_training=True)
    collate = create_mixer(
        'tokenmix_random',
        cutmix_alpha=1.0,
        mixup_alpha=0.0,
        num_classes=3,
        patch_size=8,
        collate=True,
        label_smoothing=0.0,
        tokenmix_lam=0.5,
    )
    loader = create_loader(
        ds,
        input_size=(3, 32, 32),
        batch_size=4,
        is_training=True,
        use_prefetcher=True,
        collate_fn=collate,
        num_workers=2,
        persistent_workers=False,
        device=torch.device('cpu'),
        no_aug=True,
    )
    assert all(torch.all(t.mix.lam == 0.5) for _, t in loader)
    loader.mixup_enabled = False
    assert all(torch.all(t.mix.lam == 1) and t.mix.kind == 'none' for _, t in loader)


def test_collate_names_its_argument():
    collate = create_mixer('cutmix', cutmix_alpha=1.0, num_classes=4, patch_size=8, collate=True)
    with pytest.raises(ValueError, match='batch: .*even.*got batch size 3'):
        collate([(np.zeros((3, 16, 16), np.uint8), 0)] * 3)


TIMM_ARG_SETS = [  # timm train.py's mixup_args, as its docs and recipes use them
    dict(mixup_alpha=0.8, cutmix_alpha=1.0, cutmix_minmax=None, prob=1.0, switch_prob=0.5, mode='batch',
         label_smoothing=0.1, num_classes=10),
    dict(mixup_alpha=0.2, cutmix_alpha=0.0, label_smoothing=0.1, num_classes=10),
    dict(mixup_alpha=0.0, cutmix_alpha=1.0, mode='elem', label_smoothing=0.0, num_classes=10),
    dict(mixup_alpha=0.0, cutmix_alpha=0.0, cutmix_minmax=(0.2, 0.8), mode='pair', num_classes=10),
    dict(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=10, multi_label=True),
]  # fmt: skip


@pytest.mark.parametrize('args', TIMM_ARG_SETS)
def test_create_mixer_takes_timms_mixup_arguments_and_matches_its_targets(args):
    """The argument sets timm's Mixup takes construct create_mixer too (the kind inferred as timm does), and at the
    λ each draws the target is timm's mixup_target and the images its blend or box."""
    from timm.data.mixup import Mixup, mixup_target

    from shared_core.mix import mix_images

    Mixup(**args)  # timm accepts the set
    mixer = create_mixer(**args)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 32, 32, generator=g)
    if args.get('multi_label'):
        y = (torch.rand(6, 10, generator=g) < 0.3).float()
    else:
        y = torch.arange(6) % 10
    for _ in range(5):
        mix = mixer.sample(x, y)
        target = mixer.make_target(y, mix)
        for i in range(6):  # timm's formula for each sample's own λ with its partner B-1-i
            lam = float(mix.lam[i])
            both = torch.stack([y[i], y[5 - i]])
            expect = mixup_target(both, 10, lam, args.get('label_smoothing', 0.1), args.get('multi_label', False))[0]
            torch.testing.assert_close(target[i], expect)
        out = mix_images(x, mix)
        if mix.boxes is None:  # a blend
            lam = mix.lam.view(-1, 1, 1, 1)
            torch.testing.assert_close(out, lam * x + (1 - lam) * x.flip(0))


@pytest.mark.parametrize('args', TIMM_ARG_SETS)
def test_timms_positional_order_is_taken_too(args):
    """``Mixup(0.8, 1.0)`` works, so ``create_mixer(0.8, 1.0)`` does (and the classes, and after a kind): each
    argument set given positionally in timm's order builds the mixer its keywords build, attribute for attribute."""
    import inspect

    from timm.data.mixup import Mixup

    from timm_plugin.mixup import TIMM_POSITIONAL, FastCollateTokenMixup, TokenAwareMixup

    assert TIMM_POSITIONAL == tuple(inspect.signature(Mixup).parameters)  # timm's order, read from timm
    full = {name: p.default for name, p in inspect.signature(Mixup).parameters.items()} | args
    positional = [full[name] for name in TIMM_POSITIONAL]
    attrs = ('mixup_alpha', 'cutmix_alpha', 'cutmix_minmax', 'mix_prob', 'switch_prob', 'mode', 'correct_lam',
             'label_smoothing', 'num_classes', 'multi_label', 'mix_kind')  # fmt: skip
    want = create_mixer(**args)
    for got in (create_mixer(*positional), TokenAwareMixup(*positional), create_mixer(want.mix_kind, *positional)):
        assert [getattr(got, a) for a in attrs] == [getattr(want, a) for a in attrs]
    timm_mixer = Mixup(*positional)
    assert [getattr(want, a) for a in attrs[:-2]] == [getattr(timm_mixer, a) for a in attrs[:-2]]
    if not args.get('multi_label'):
        collate = FastCollateTokenMixup(*positional)
        assert (collate.mixup_alpha, collate.num_classes) == (full['mixup_alpha'], full['num_classes'])
    with pytest.raises(TypeError, match="create_mixer: got multiple values for argument 'mixup_alpha'"):
        create_mixer(0.8, mixup_alpha=0.5)
    with pytest.raises(TypeError, match='at most 10 positional arguments after the mixing kind'):
        create_mixer(*positional, 0)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    kind=st.sampled_from(['mixup', 'cutmix', 'switch']),
    prob=st.sampled_from([1.0, 0.5]),
    correct_lam=st.booleans(),
    box_rounding=st.sampled_from(['timm', 'public']),
    enabled=st.booleans(),
    size=st.sampled_from([(32, 32), (30, 20)]),
)
def test_plain_batch_path_equals_the_mix_path(seed, kind, prob, correct_lam, box_rounding, enabled, size):
    """Batch-mode MixUp / CutMix into a plain target skip the Mix (timm's path: λ and the box on the host, mixed
    against x.flip(0)): the same images and target, bit for bit, as drawing the Mix and applying it, from the same
    generator state; the input is left as it was."""
    alphas = {'mixup': (0.8, 0.0), 'cutmix': (0.0, 1.0), 'switch': (0.8, 1.0)}[kind]
    args = dict(
        mixup_alpha=alphas[0],
        cutmix_alpha=alphas[1],
        prob=prob,
        correct_lam=correct_lam,
        box_rounding=box_rounding,
        num_classes=10,
        patch_size=8,
    )
    fast = create_mixer(generator=torch.Generator().manual_seed(seed), **args)
    slow = create_mixer(generator=torch.Generator().manual_seed(seed), **args)
    fast.mixup_enabled = slow.mixup_enabled = enabled
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(6, 3, *size, generator=g)
    y = torch.randint(0, 10, (6,), generator=g)
    x0 = x.clone()
    for _ in range(3):
        xa, ta = fast(x, y)
        mix = slow.sample(x, y)
        tb = slow.make_target(y, mix)
        assert type(ta) is torch.Tensor and torch.equal(ta, tb)
        assert torch.equal(xa, mix_images(x, mix))
        assert torch.equal(x, x0)
