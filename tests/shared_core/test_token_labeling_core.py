"""shared_core.token_labeling's MixToken step (:func:`mixtoken_applied`, the one both adapters run) against Eq. 5
written out: the patch tokens inside the box are the partner's, the images of a model without a patch embedding
are mixed instead, the un-mixing gives every sample its own tokens back, and the hook is gone afterwards."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from shared_core.token_labeling import draw_mixtoken, mixtoken_applied, mixtoken_sampler, unmix_tokens


class _Embed(nn.Module):
    """A patch embedding: ``(B, 3, H, W)`` -> ``(B, N, D)`` tokens of 4x4 patches."""

    def forward(self, x):
        B, C, H, W = x.shape
        return x.unfold(2, 4, 4).unfold(3, 4, 4).permute(0, 2, 3, 1, 4, 5).reshape(B, (H // 4) * (W // 4), -1)


def _mix(B=4, size=(16, 16), seed=0):
    sampler = mixtoken_sampler(1.0, 1.0, 'pair', (4, 4), 'timm')
    g = torch.Generator().manual_seed(seed)
    mix = None
    while mix is None:  # a batch the draw mixes
        mix = draw_mixtoken(sampler, B, size, 'cpu', g)
    return mix


def test_the_patch_tokens_inside_the_box_are_the_partners_and_unmixing_gives_them_back():
    embed, x, mix = _Embed(), torch.randn(4, 3, 16, 16), _mix()
    plain = embed(x)
    with mixtoken_applied(x, mix, embed) as (images, swap):
        assert images is x  # the tokens are mixed, not the images
        mixed = embed(images)
    inside = mix.token_share_flat() > 0.5  # (B, N): the tokens of the box (MixToken's box is whole tokens)
    for b in range(4):
        for n in range(plain.shape[1]):
            want = plain[mix.partner[b], n] if inside[b, n] else plain[b, n]  # Eq. 5, token by token
            assert torch.equal(mixed[b, n], want)
    assert torch.equal(unmix_tokens(mixed, swap), plain)  # Eq. 6: each sample's own tokens, in place
    assert not embed._forward_hooks and torch.equal(embed(x), plain)  # the hook is gone


def test_without_a_patch_embedding_the_images_are_mixed_and_without_a_mix_nothing_is():
    x, mix = torch.randn(4, 3, 16, 16), _mix(seed=1)
    with mixtoken_applied(x, mix, None) as (images, swap):
        share = mix.pixel_share()[:, 0]
        for b in range(4):
            want = torch.where(share[b] > 0.5, x[mix.partner[b]], x[b])
            assert torch.equal(images[b], want)
        assert swap is not None
    embed = _Embed()
    with mixtoken_applied(x, None, embed) as (images, swap):
        assert images is x and swap is None and not embed._forward_hooks


def test_the_hook_is_removed_when_the_forward_fails():
    embed, x = _Embed(), torch.randn(4, 3, 16, 16)
    with pytest.raises(RuntimeError, match='the forward failed'):
        with mixtoken_applied(x, _mix(), embed):
            raise RuntimeError('the forward failed')
    assert not embed._forward_hooks
