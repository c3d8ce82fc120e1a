"""TL-Align on timm's ``DaVit``: the conv position encodings, the spatial blocks' window attention (recorded at its
SDPA call, applied in float64 by loops over each token's window), the channel blocks and the downsampling, against
a reference in image cells."""

import pytest
import timm
import torch
from timm.models.davit import SpatialBlock

from timm_plugin.tl_align import DaViTTracer, TLAlign, timm_tracer

from .test_tl_align import C, random_token_labels, sharpen
from .test_tl_align_beyond_vit import _stencil_mix
from .test_tl_align_sdpa import RecordAttention
from .tl_align_checks import mean_abs_stencil, window_mix


def tiny(**kw):
    torch.manual_seed(0)
    args = dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 32, 32), num_heads=(2, 2, 2, 2), window_size=2)
    model = sharpen(timm.create_model('davit_tiny', num_classes=C, **(args | kw)))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # depthwise kernels of strongly non-uniform magnitude per position
        for m in model.modules():
            if isinstance(m, torch.nn.Conv2d) and m.groups == m.in_channels and m.kernel_size == (3, 3):
                m.weight.mul_(torch.rand(3, 3, generator=g) ** 3 * 4)
    return model


def reference(model, x, Y_tok, grid):
    with RecordAttention() as rec, torch.no_grad():
        model(x)
    calls = iter(rec.calls)
    B, (H, W) = x.shape[0], grid
    Y = Y_tok.double().view(B, H, W, -1)
    for stage in model.stages:
        if not isinstance(stage.downsample, torch.nn.Identity):
            Y = _stencil_mix(Y, torch.ones(2, 2), 0, 2)  # the mean of each 2x2 window
            H, W = H // 2, W // 2
        for pair in stage.blocks:
            for blk in pair:
                Y = (Y + _stencil_mix(Y, mean_abs_stencil(blk.cpe1.proj.weight), 1)) / 2
                if isinstance(blk, SpatialBlock):
                    q, k, _, scale = next(calls)
                    A = ((q.double() @ k.double().transpose(-1, -2)) * scale).softmax(-1).mean(1)  # (B·nW, N, N)
                    Y = (Y + window_mix(Y, A, blk.window_size[0])) / 2
                Y = (Y + _stencil_mix(Y, mean_abs_stencil(blk.cpe2.proj.weight), 1)) / 2
    return Y.flatten(1, 2).mean(1)


def test_the_tracer_is_the_reference_in_image_cells():
    model = tiny().eval()
    assert type(timm_tracer(model)) is DaViTTracer
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 64, 64, generator=g)
    Y = random_token_labels(2, 256, g)
    ref = reference(model, x, Y, (16, 16))
    for fused in (True, False):
        out, label = TLAlign(model, fused=fused).trace(x, Y)
        assert torch.equal(out, model(x)) and (label.double() - ref).abs().max() < 1e-6
    assert (ref - Y.double().mean(1)).abs().max() > 1e-3


def test_davit_refusals_and_transmix():
    from timm_plugin.tl_align import TransMix

    with pytest.raises(ValueError, match="DaVit with head pooling 'max'"):
        TLAlign(tiny(global_pool='max'))
    with pytest.raises(ValueError, match='its last block is a channel block'):
        TransMix(tiny())
    with pytest.raises(ValueError, match='token grid is padded'):  # 16x16 then 8x8, 4x4, 2x2 in 3x3 windows
        TLAlign(tiny(window_size=3).eval()).trace(torch.randn(1, 3, 64, 64), torch.full((1, 256, C), 1 / C))
