"""The mix sampler (``shared_core.samplers.MixSampler``): batch, pair and element modes, switches off, and the
host sampler against the vector one."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared_core.mixing import (
    MIX_KINDS,
    MixSampler,
    identity_mix,
    mix_images,
    mix_target,
    one_hot,
)

KINDS_KW = {k: (dict(mixup_alpha=1.0) if k == 'mixup' else dict(mixup_alpha=0.8, cutmix_alpha=1.0)) for k in MIX_KINDS}


def test_pair_mode_is_symmetric_and_batch_mode_shared():
    g = torch.Generator().manual_seed(2)
    m = MixSampler('tokenmix_block', mixup_alpha=0.0, cutmix_alpha=1.0, mode='pair', patch_size=4).sample(8, 16, g)
    assert torch.equal(m.lam, m.lam.flip(0)) and torch.equal(m.token_share, m.token_share.flip(0))
    m = MixSampler('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, mode='batch', patch_size=4).sample(8, 16, g)
    assert torch.all(m.lam == m.lam[0]) and torch.all(m.boxes == m.boxes[0])


def test_disabled_or_zero_prob_is_identity():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 16, 16)
    y = torch.tensor([0, 1, 2, 3])
    for s in [MixSampler('tokenmix_block', cutmix_alpha=1.0, prob=0.0, patch_size=8)]:
        mix = s.sample(4, 16, g)
        assert torch.equal(mix_images(x, mix), x)
        assert torch.allclose(mix_target(y, mix, 4, 0.1), one_hot(y, 4, 0.1))
    s = MixSampler('cutmix', cutmix_alpha=1.0, patch_size=8)
    s.mixup_enabled = False
    mix = s.sample(4, 16, g)
    assert mix.kind == 'none' and torch.equal(mix_images(x, mix), x)
    ident = identity_mix(4, 16, 8)
    assert torch.equal(mix_images(x, ident), x)


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(['mixup', 'cutmix', 'token_box']),
    alphas=st.sampled_from([(0.8, 0.0), (0.0, 1.0), (0.8, 1.0), (0.2, 0.5)]),
    prob=st.sampled_from([1.0, 0.6]),
    correct_lam=st.booleans(),
    rounding=st.sampled_from(['timm', 'public']),
    H=st.integers(8, 40),
    W=st.integers(8, 40),
    B=st.sampled_from([2, 4, 7]),
    seed=st.integers(0, 2**31 - 1),
)
def test_batch_mode_host_sampler_draws_what_the_vector_sampler_draws(
    kind, alphas, prob, correct_lam, rounding, H, W, B, seed
):
    """``mode='batch'`` MixUp/CutMix/MixToken boxes are drawn on the host in Python numbers; it consumes the
    generator as the vector path does and gives the same mix: the vector path's one-unit case is ``mode='pair'``
    with B = 2."""
    if kind == 'mixup' and alphas[1] > 0:
        alphas = (alphas[0] or 0.5, 0.0)
    if kind == 'token_box':  # token kinds need whole patches
        H, W = H - H % 4 or 4, W - W % 8 or 8
    kw = dict(mixup_alpha=alphas[0], cutmix_alpha=alphas[1], prob=prob, correct_lam=correct_lam)
    kw.update(patch_size=(4, 8), box_rounding=rounding)
    fast = MixSampler(kind, mode='batch', **kw).sample(B, (H, W), torch.Generator().manual_seed(seed), allow_odd=True)
    ref = MixSampler(kind, mode='pair', **kw).sample(2, (H, W), torch.Generator().manual_seed(seed))
    assert fast.reversed_pairs and fast.batch_lam is not None and fast.blend == ref.blend
    if fast.blend:  # the flag's promise: a constant share 1 - λ
        assert torch.allclose(fast.token_share, 1 - fast.lam[:, None, None].expand_as(fast.token_share), atol=1e-6)
    assert torch.equal(fast.partner, torch.arange(B - 1, -1, -1))
    assert torch.equal(fast.lam, ref.lam[:1].expand(B)) and fast.batch_lam == pytest.approx(float(ref.lam[0]))
    assert torch.equal(fast.token_share, ref.token_share[:1].expand(B, *ref.grid_size))
    if fast.boxes is None:
        assert ref.boxes is None or not bool(ref.box_valid.any())
    else:
        assert torch.equal(fast.boxes, ref.boxes[:1].expand(B, 4)) and bool(fast.box_valid.all())
