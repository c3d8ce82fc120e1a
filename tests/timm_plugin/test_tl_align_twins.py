"""TL-Align on timm's Twins against a reference in image cells: the labels in a dict keyed by cell, windows and
sub-sampled keys built from their definitions (window ``(a, b)`` holds cells ``(a·ws + u, b·ws + v)`` in row-major
order; key ``(a, b)`` of the sub-sampling covers cells ``(a·sr + u, b·sr + v)``), the attention of each recorded
SDPA call applied by loops over heads, queries and keys in float64, the position encoding's depthwise conv by
loops over its stencil."""

import pytest
import timm
import torch

from timm_plugin import create_mixer
from timm_plugin.tl_align import TLAlign, TwinsTracer, timm_tracer

from ..timm_plugin.test_tl_align_sdpa import RecordAttention, dense_start, sharpen

C = 5


def reference(model, x, Y0, grid):
    with RecordAttention() as rec, torch.no_grad():
        model(x)
    calls = iter(rec.calls)
    H, W = grid
    B = Y0.shape[0]
    lab = {(i, j): Y0[:, i * W + j].double() for i in range(H) for j in range(W)}

    def mean_of(cells):
        return sum(lab[c] for c in cells) / len(cells)

    for s, (embed, stage, pos) in enumerate(zip(model.patch_embeds, model.blocks, model.pos_block)):
        if s > 0:
            p = embed.proj.stride[0]
            H, W = H // p, W // p
            lab = {(a, b): mean_of([(a * p + u, b * p + v) for u in range(p) for v in range(p)])
                   for a in range(H) for b in range(W)}  # fmt: skip
        for j, blk in enumerate(stage):
            q, k, _, scale = next(calls)
            branch = {}
            if hasattr(blk.attn, 'ws'):  # windows of ws x ws cells
                ws = blk.attn.ws
                for wi in range(H // ws):
                    for wj in range(W // ws):
                        win = wi * (W // ws) + wj
                        cells = [(wi * ws + u, wj * ws + v) for u in range(ws) for v in range(ws)]
                        A = ((q[:, win].double() @ k[:, win].double().transpose(-1, -2)) * scale).softmax(-1)
                        for qi, qc in enumerate(cells):
                            acc = torch.zeros(B, Y0.shape[-1], dtype=torch.float64)
                            for h in range(A.shape[1]):
                                for ki, kc in enumerate(cells):
                                    acc += A[:, h, qi, ki, None] * lab[kc]
                            branch[qc] = acc / A.shape[1]
            else:  # every cell's query over the sub-sampled keys
                sr = blk.attn.sr.stride[0] if blk.attn.sr is not None else 1
                keys = [mean_of([(a * sr + u, b * sr + v) for u in range(sr) for v in range(sr)])
                        for a in range(H // sr) for b in range(W // sr)]  # fmt: skip
                A = ((q.double() @ k.double().transpose(-1, -2)) * scale).softmax(-1)
                for i in range(H):
                    for jj in range(W):
                        acc = sum(A[:, :, i * W + jj, kk, None].mean(1) * keys[kk] for kk in range(len(keys)))
                        branch[(i, jj)] = acc
            lab = {c: (lab[c] + branch[c]) / 2 for c in lab}
            if j == 0:  # the position encoding: x + dwconv3x3(x), as a stencil over in-grid cells
                S = pos.proj[0].weight.detach().double().abs().mean((0, 1))
                r = S.shape[-1] // 2
                new = {}
                for i in range(H):
                    for jj in range(W):
                        num, den = 0, 0
                        for du in range(-r, r + 1):
                            for dv in range(-r, r + 1):
                                if (i + du, jj + dv) in lab:
                                    num = num + S[du + r, dv + r] * lab[(i + du, jj + dv)]
                                    den = den + S[du + r, dv + r]
                        new[(i, jj)] = (lab[(i, jj)] + num / den) / 2
                lab = new
    return sum(lab.values()) / len(lab)


@pytest.mark.parametrize('arch', ['twins_svt_small', 'twins_pcpvt_small'])
def test_the_tracer_is_the_reference_in_image_cells(arch):
    torch.manual_seed(0)
    kw = dict(img_size=128, num_classes=C, depths=[1, 2, 1, 1], embed_dims=[16, 32, 32, 64], num_heads=[1, 2, 2, 4])
    if arch.startswith('twins_svt'):
        kw['wss'] = [4, 4, 4, 4]
    model = sharpen(timm.create_model(arch, **kw))
    assert isinstance(timm_tracer(model), TwinsTracer)
    g = torch.Generator().manual_seed(5)
    mixer = create_mixer(
        'cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=4, mode='elem', generator=g,
        carry_mix=True, label_smoothing=0.0,
    )  # fmt: skip
    x, y = torch.randn(4, 3, 128, 128, generator=g), torch.randint(0, C, (4,), generator=g)
    xm, target = mixer(x, y)
    Y0 = dense_start(target.mix, y, 0)
    expected = reference(model, xm, Y0, (32, 32))
    out, aligned = TLAlign(model)(xm, target)
    assert (aligned.double() - expected).abs().max() < 1e-6  # measured 3e-8 (PCPVT), 6e-8 (SVT)
    assert torch.equal(out, model(xm))
    assert (reference(model, xm, Y0.flip(1), (32, 32)) - expected).abs().max() > 1e-3  # places matter


def test_a_grid_the_windows_do_not_tile_is_refused():
    model = timm.create_model('twins_svt_small', img_size=96, num_classes=C, depths=[1, 1, 1, 1], wss=[5, 5, 5, 5])
    mixer = create_mixer('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=4, carry_mix=True)
    xm, target = mixer(torch.randn(2, 3, 96, 96), torch.arange(2))
    with pytest.raises(ValueError, match='not tiled by 5x5 windows'):
        TLAlign(model)(xm, target)
