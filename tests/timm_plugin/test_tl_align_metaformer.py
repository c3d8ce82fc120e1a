"""TL-Align on timm's MetaFormer family (PoolFormer, ConvFormer, CAFormer) against an explicit reference: every
spatial op written as its dense ``(N_out, N)`` matrix by loops over positions (the average pool's window, the
depthwise and downsampling convs' stencils, the attention materialised from the recorded call), rows normalised,
Eq. 11 per block in float64."""

import pytest
import timm
import torch
from timm.layers import GroupNorm1
from timm.models.metaformer import Attention, LayerNorm2dNoBias, LayerNormNoBias, MetaFormer, Pooling, SepConv

from shared_core.mixing import one_hot
from timm_plugin.tl_align import MetaFormerTracer, TLAlign, timm_tracer

from ..timm_plugin.test_tl_align_sdpa import RecordAttention, dense_start, sharpen

C = 5


def tiny_metaformer(kind):
    torch.manual_seed(0)
    mixers = {
        'poolformer': dict(token_mixers=Pooling, norm_layers=GroupNorm1, downsample_norm=None, use_mlp_head=False),
        'convformer': dict(token_mixers=SepConv),
        'caformer': dict(token_mixers=[SepConv, SepConv, Attention, Attention], norm_layers=[
            LayerNorm2dNoBias, LayerNorm2dNoBias, LayerNormNoBias, LayerNormNoBias]),
    }[kind]  # fmt: skip
    model = MetaFormer(num_classes=C, depths=(1, 1, 2, 1), dims=(16, 24, 64, 64), **mixers)
    return sharpen(model)


def stencil_matrix(S, H, W, stride, pad):
    """The conv's equivalent matrix for a non-negative stencil ``S`` ``(k, k)``, rows normalised over in-grid
    cells."""
    S, k = S.detach().double(), S.shape[-1]
    Ho, Wo = (H + 2 * pad - k) // stride + 1, (W + 2 * pad - k) // stride + 1
    M = torch.zeros(Ho * Wo, H * W, dtype=torch.float64)
    for i in range(Ho):
        for j in range(Wo):
            for u in range(H):
                for v in range(W):
                    a, b = u - stride * i + pad, v - stride * j + pad
                    if 0 <= a < k and 0 <= b < k:
                        M[i * Wo + j, u * W + v] = S[a, b]
    return M / M.sum(1, keepdim=True), (Ho, Wo)


def reference(model, x, Y):
    """The label state through the model by dense matrices, ``Y`` ``(B, N, K)`` on the stem's grid."""
    with RecordAttention() as rec, torch.no_grad():
        grid = model.stem(x).shape[-2:]
        model(x)
    calls = iter(rec.calls)
    H, W = grid
    Y = Y.double()
    for stage in model.stages:
        if not isinstance(stage.downsample, torch.nn.Identity):
            conv = stage.downsample.conv
            M, (H, W) = stencil_matrix(conv.weight.abs().mean((0, 1)), H, W, conv.stride[0], conv.padding[0])
            Y = M @ Y
        for blk in stage.blocks:
            mixer = blk.token_mixer
            if isinstance(mixer, Pooling):
                r = mixer.pool.kernel_size // 2
                M, _ = stencil_matrix(torch.ones(2 * r + 1, 2 * r + 1), H, W, 1, r)
                branch = M @ Y
            elif isinstance(mixer, SepConv):
                M, _ = stencil_matrix(mixer.dwconv.weight.abs().mean((0, 1)), H, W, 1, mixer.dwconv.padding[0])
                branch = M @ Y
            else:
                q, k, _, scale = next(calls)
                A = ((q.double() @ k.double().transpose(-1, -2)) * scale).softmax(-1)
                branch = sum(A[:, h] @ Y for h in range(A.shape[1])) / A.shape[1]
            Y = (Y + branch) / 2
    return Y.mean(1)


@pytest.mark.parametrize('kind', ['poolformer', 'convformer', 'caformer'])
def test_the_tracer_is_the_explicit_reference(kind):
    from timm_plugin import create_mixer

    model = tiny_metaformer(kind)
    assert isinstance(timm_tracer(model), MetaFormerTracer)
    g = torch.Generator().manual_seed(3)
    mixer = create_mixer(
        'cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=4, mode='elem', generator=g,
        carry_mix=True, label_smoothing=0.0,
    )  # fmt: skip
    x, y = torch.randn(4, 3, 64, 64, generator=g), torch.randint(0, C, (4,), generator=g)
    xm, target = mixer(x, y)
    expected = reference(model, xm, dense_start(target.mix, y, 0))
    out, aligned = TLAlign(model)(xm, target)
    assert (aligned.double() - expected).abs().max() < 1e-6  # measured 4e-8
    assert torch.equal(out, model(xm))
    assert torch.allclose(aligned.sum(1), torch.ones(4), atol=1e-6)
    own, partner = one_hot(y, C), one_hot(y[target.mix.partner], C)
    assert not torch.allclose(aligned, target.mix.lam[:, None] * own + (1 - target.mix.lam)[:, None] * partner)


def test_named_metaformers_are_traced_and_other_mixers_refused():
    for name in ('poolformer_s12', 'poolformerv2_s12', 'convformer_s18', 'caformer_s18'):
        with torch.device('meta'):
            model = timm.create_model(name, num_classes=C)
        assert isinstance(timm_tracer(model), MetaFormerTracer), name
    model = tiny_metaformer('convformer')
    model.stages[1].blocks[0].token_mixer = torch.nn.Conv2d(24, 24, 3, padding=1)
    with pytest.raises(ValueError, match='stage 1 block 0: token_mixer is a Conv2d'):
        TLAlign(model)
    model = timm.create_model('caformer_s18', num_classes=C, global_pool='max')
    with pytest.raises(ValueError, match="head pooling 'max' has no TL-Align rule"):
        TLAlign(model)
