"""TL-Align on timm CaiT and PVT v2 against explicit references (materialised attention, head loops, window
loops), compact-vs-dense agreement, the unchanged token path, and the refusals."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models.cait import Cait
from timm.models.pvt_v2 import PyramidVisionTransformerV2

from shared_core.mixing import mix_target, one_hot
from timm_plugin import create_mixer
from timm_plugin.tl_align import TLAlign, TransMix

from ..timm_plugin.test_tl_align import C, random_token_labels
from .tl_align_checks import check_compact_equals_dense


def _sharpen(model, std=0.3):
    """Random init gives near-uniform attention (q, k tiny); larger weights make every attention peaked,
    so a wrong index or head anywhere shows in the labels."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0, std)
    return model


# ---------------------------------------------------------------- CaiT


def tiny_cait(**kw):
    torch.manual_seed(0)
    args = dict(
        img_size=32,
        patch_size=8,
        embed_dim=32,
        depth=2,
        depth_token_only=1,
        num_heads=4,
        num_classes=C,
        mlp_ratio=2.0,
        mlp_ratio_token_only=2.0,
        init_values=1.0,
    )
    args.update(kw)
    return _sharpen(Cait(**args))


def _talking_heads(a, h):
    """TalkingHeadAttn written out: head mixing before (proj_l) and after (proj_w) the softmax, loops over
    heads; returns the output and the per-head attention that multiplies v ``(B, H, N, N)``."""
    B, N, D = h.shape
    H, d = a.num_heads, D // a.num_heads
    qkv = a.qkv(h).reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4)
    S = (qkv[0] * a.scale) @ qkv[1].transpose(-1, -2)
    L = torch.stack([sum(a.proj_l.weight[i, j] * S[:, j] for j in range(H)) + a.proj_l.bias[i] for i in range(H)], 1)
    P = L.softmax(-1)
    A = torch.stack([sum(a.proj_w.weight[i, j] * P[:, j] for j in range(H)) + a.proj_w.bias[i] for i in range(H)], 1)
    return a.proj((A @ qkv[2]).transpose(1, 2).reshape(B, N, D)), A


def cait_reference(model, x, Y, layers=None, normalise=True, absolute=True, keeps=None):
    """CaiT's forward with explicit attention; labels ``Y`` ``(B, 1 + N, K)`` (class label first):
    self-attention stage on the patch labels with ``Norm(|mean_h A'_h|)`` (``absolute=False``: the literal
    ``Norm(mean_h A'_h)``), class-attention stage on the class label over ``[cls; patches]``."""
    t = model.pos_drop(model.patch_embed(x) + model.pos_embed)
    y_cls, Yp = Y[:, :1], Y[:, 1:]
    B, N, D = t.shape
    for i, blk in enumerate(model.blocks):
        o, A = _talking_heads(blk.attn, blk.norm1(t))
        t = t + blk.gamma_1 * o
        t = t + blk.gamma_2 * blk.mlp(blk.norm2(t))
        if layers is not None and i not in layers:
            continue
        Wm = sum(A[:, h] for h in range(blk.attn.num_heads)) / blk.attn.num_heads
        if absolute:
            Wm = Wm.abs()
        Wm = Wm / Wm.sum(-1, keepdim=True)
        new = sum(Wm[:, :, m, None] * Yp[:, None, m] for m in range(N))
        new = (Yp + new) / 2 if normalise else new
        Yp = new if keeps is None else torch.where(keeps[i][:, None, None], new, Yp)
    c = model.cls_token.expand(B, -1, -1)
    for j, blk in enumerate(model.blocks_token_only):
        a, H, d = blk.attn, blk.attn.num_heads, D // blk.attn.num_heads
        h = blk.norm1(torch.cat([c, t], 1))
        q = a.q(h[:, 0]).reshape(B, 1, H, d).permute(0, 2, 1, 3)
        k = a.k(h).reshape(B, N + 1, H, d).permute(0, 2, 1, 3)
        v = a.v(h).reshape(B, N + 1, H, d).permute(0, 2, 1, 3)
        A = ((q * a.scale) @ k.transpose(-1, -2)).softmax(-1)  # (B, H, 1, 1 + N)
        c = c + blk.gamma_1 * a.proj((A @ v).transpose(1, 2).reshape(B, 1, D))
        c = c + blk.gamma_2 * blk.mlp(blk.norm2(c))
        if layers is not None and len(model.blocks) + j not in layers:
            continue
        Yfull = torch.cat([y_cls, Yp], 1)
        branch = sum(A[:, head] @ Yfull for head in range(H)) / H
        new = (y_cls + branch) / 2 if normalise else branch
        if keeps is not None and keeps[len(model.blocks) + j] is not None:
            new = torch.where(keeps[len(model.blocks) + j][:, None, None], new, y_cls)
        y_cls = new
    out = model.forward_head(model.norm(torch.cat([c, t], 1)))
    return out, y_cls[:, 0] if model.global_pool == 'token' else Yp.mean(1)


@pytest.mark.parametrize(
    'kw',
    [dict(), dict(global_pool='avg'), dict(depth_token_only=2), dict(qkv_bias=False)],
    ids=['token', 'avg', 'two-class-attn-blocks', 'no-qkv-bias'],
)
def test_cait_dense_trace_matches_materialised_reference(kw):
    model = tiny_cait(**kw).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 3, 32, 32, generator=g)
    Y_tok = random_token_labels(3, 16, g)
    cls_label = torch.softmax(torch.randn(3, C, generator=g), -1)
    ref_out, ref_label = cait_reference(model, x, torch.cat([cls_label[:, None], Y_tok], 1))
    for fused in (True, False):
        out, label = TLAlign(model, fused=fused).trace(x, Y_tok, cls_label)
        assert torch.allclose(out, ref_out, atol=1e-5)
        assert torch.allclose(label, ref_label, atol=1e-6)
        assert torch.allclose(label.sum(1), torch.ones(3), atol=1e-6) and label.min() >= 0


def test_cait_talking_heads_norm():
    """The head-mean of the signed post-proj_w attention has mixed signs here; its magnitudes are normalised.
    With a non-negative head mixing the rule is Table 9's literal Norm(W)."""
    model = tiny_cait().eval()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 32, 32, generator=g)
    Y_tok = random_token_labels(2, 16, g)
    Y0 = torch.cat([Y_tok.mean(1, keepdim=True), Y_tok], 1)
    _, A = _talking_heads(model.blocks[0].attn, model.blocks[0].norm1(model.patch_embed(x) + model.pos_embed))
    assert (A.mean(1) < 0).any() and (A.mean(1) > 0).any()
    _, label = TLAlign(model).trace(x, Y_tok)
    _, literal = cait_reference(model, x, Y0, absolute=False)
    assert not torch.allclose(label, literal, atol=1e-4)  # the reference below is not vacuous
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.proj_w.weight.abs_()
            blk.attn.proj_w.bias.abs_()
    _, label = TLAlign(model).trace(x, Y_tok)
    _, literal = cait_reference(model, x, Y0, absolute=False)
    assert torch.allclose(label, literal, atol=1e-6)


def test_cait_layers_and_no_residual():
    model = tiny_cait(depth_token_only=2).eval()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 32, 32, generator=g)
    Y_tok = random_token_labels(2, 16, g)
    Y0 = torch.cat([Y_tok.mean(1, keepdim=True), Y_tok], 1)
    _, label = TLAlign(model, layers=[]).trace(x, Y_tok)
    assert torch.allclose(label, Y_tok.mean(1), atol=1e-6)  # the class label starts at the area label
    _, label = TLAlign(model, layers=[0, 1]).trace(x, Y_tok)  # patches aligned, class label never updated
    assert torch.allclose(label, Y_tok.mean(1), atol=1e-6)
    for layers, normalise in [([3], False), ([1, 2], True), (None, False)]:
        _, label = TLAlign(model, layers=layers, residual=normalise).trace(x, Y_tok)
        _, ref = cait_reference(model, x, Y0, layers, normalise)
        assert torch.allclose(label, ref, atol=1e-6) and torch.allclose(label.sum(1), torch.ones(2), atol=1e-6)
    assert TLAlign(model).depth == 4
    with pytest.raises(ValueError, match=r'layers: block indices must be in \[0, 4\)'):
        TLAlign(model, layers=[4])


def test_cait_stochastic_depth_uses_the_attention_branch_call():
    """A CaiT self-attention block calls its one drop_path module twice; the first call is the attention
    residual's (timm gives the class-attention blocks no stochastic depth)."""
    model = tiny_cait(drop_path_rate=0.5).train()
    blocks = list(model.blocks)
    assert all(isinstance(b.drop_path, nn.Identity) for b in model.blocks_token_only)
    calls = {id(b): [] for b in blocks}
    hooks = [
        b.drop_path.register_forward_hook(
            lambda m, i, o, b=b: calls[id(b)].append(((o.flatten(1) != 0).any(1)).clone())
        )
        for b in blocks
    ]
    wrapped = TLAlign(model)
    torch.manual_seed(11)
    _, captures = wrapped.tracer.capture(lambda: model(torch.randn(16, 3, 32, 32)))
    for h in hooks:
        h.remove()
    assert any(not torch.equal(calls[id(b)][0], calls[id(b)][1]) for b in blocks)  # the two calls differ
    for b, cap in zip(blocks, captures):
        assert len(calls[id(b)]) == 2 and torch.equal(cap.keep, calls[id(b)][0])
    assert all(cap.keep is None for cap in captures[len(blocks) :])
    # the labels of dropped samples stay: the reference with the same keeps (on the eval path's attention)
    model.eval()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 3, 32, 32, generator=g)
    Y_tok = random_token_labels(16, 16, g)
    Y0 = torch.cat([Y_tok.mean(1, keepdim=True), Y_tok], 1)
    keeps = [cap.keep for cap in captures[: len(blocks)]] + [torch.arange(16) % 2 == 0]  # and there
    assert all(not k.all() for k in keeps)
    wrapped = TLAlign(model)
    _, caps = wrapped.tracer.capture(lambda: model(x))
    for cap, keep in zip(caps, keeps):
        cap.keep = keep
    label = wrapped.tracer.label_path(caps, None, Y0)
    _, ref = cait_reference(model, x, Y0, keeps=keeps)
    assert torch.allclose(label, ref, atol=1e-6)


@pytest.mark.parametrize('kind', ['cutmix', 'mixup', 'tokenmix_block', 'tokenmix_random', 'token_box'])
def test_cait_compact_and_dense_labels_give_the_same_target(kind):
    model = tiny_cait(drop_path_rate=0.2).train()
    g = torch.Generator().manual_seed(3)
    kw = dict(mixup_alpha=1.0) if kind == 'mixup' else dict(mixup_alpha=0.0, cutmix_alpha=1.0)
    mixer = create_mixer(
        kind, num_classes=C, patch_size=8, mode='elem', label_smoothing=0.1, generator=g, carry_mix=True, **kw
    )
    x = torch.randn(6, 3, 32, 32, generator=g)
    y = torch.randint(0, C, (6,), generator=g)
    xm, target = mixer(x, y)
    wrapped = TLAlign(model)
    torch.manual_seed(5)
    out, aligned = wrapped(xm, target)
    mix = target.mix
    s = mix.token_share_flat()[..., None]
    Y_tok = (1 - s) * one_hot(y, C, 0.1)[:, None] + s * one_hot(y[mix.partner], C, 0.1)[:, None]
    torch.manual_seed(5)
    out_dense, label = wrapped.trace(xm, Y_tok, cls_label=mix_target(y, mix, C, 0.1))
    assert torch.equal(out, out_dense)
    assert torch.allclose(aligned, label, atol=1e-6)
    assert torch.allclose(aligned.sum(1), torch.ones(6), atol=1e-6) and aligned.min() >= 0
    assert not aligned.requires_grad


# ---------------------------------------------------------------- PVT v2


def tiny_pvt(**kw):
    torch.manual_seed(0)
    args = dict(depths=(1, 1), embed_dims=(16, 32), num_heads=(1, 2), sr_ratios=(2, 1), mlp_ratios=2.0, num_classes=C)
    args.update(kw)
    return _sharpen(PyramidVisionTransformerV2(**args))


def _window_mean(Y, k, s, p):
    """``(B, H, W, K)`` → mean of the in-grid labels of every ``k x k`` window (stride ``s``, padding ``p``)."""
    B, H, W, K = Y.shape
    Ho, Wo = (H + 2 * p - k) // s + 1, (W + 2 * p - k) // s + 1
    out = torch.zeros(B, Ho, Wo, K)
    for i in range(Ho):
        for j in range(Wo):
            cells = [
                (r, c)
                for r in range(i * s - p, i * s - p + k)
                for c in range(j * s - p, j * s - p + k)
                if 0 <= r < H and 0 <= c < W
            ]
            out[:, i, j] = sum(Y[:, r, c] for r, c in cells) / len(cells)
    return out


def _adaptive_mean(Y, size):
    """``(B, H, W, K)`` → ``(B, size, size, K)``: bin ``i`` covers rows ``floor(iH/size) .. ceil((i+1)H/size)``."""
    B, H, W, K = Y.shape
    out = torch.zeros(B, size, size, K)
    for i in range(size):
        for j in range(size):
            r0, r1 = (i * H) // size, -((-(i + 1) * H) // size)
            c0, c1 = (j * W) // size, -((-(j + 1) * W) // size)
            out[:, i, j] = Y[:, r0:r1, c0:c1].mean((1, 2))
    return out


def pvt_reference(model, x, Y_tok, layers=None, normalise=True):
    """PVT v2's forward written out with explicit attention matrices; labels pooled by window loops."""
    t = model.patch_embed(x)  # (B, H, W, C)
    B, H, W, _ = t.shape
    Y = Y_tok.reshape(B, H, W, -1)
    idx = 0
    for stage in model.stages:
        if stage.downsample is not None:
            t = stage.downsample(t)  # (B, C, H, W) -> (B, H, W, C)
            Y = _window_mean(Y, 3, 2, 1)
        B, H, W, Cd = t.shape
        assert Y.shape[1:3] == (H, W)
        t = t.reshape(B, H * W, Cd)
        for blk in stage.blocks:
            a = blk.attn
            h = blk.norm1(t)
            q = a.q(h).reshape(B, H * W, a.num_heads, a.head_dim).permute(0, 2, 1, 3)
            xm = h.permute(0, 2, 1).reshape(B, Cd, H, W)
            if a.pool is not None:
                xs = a.act(a.norm(a.sr(a.pool(xm)).reshape(B, Cd, -1).permute(0, 2, 1)))
                Yk = _adaptive_mean(Y, 7)
            elif a.sr is not None:
                xs = a.norm(a.sr(xm).reshape(B, Cd, -1).permute(0, 2, 1))
                r = a.sr.kernel_size[0]
                Yk = _window_mean(Y, r, r, 0)
            else:
                xs, Yk = h, Y
            kv = a.kv(xs).reshape(B, -1, 2, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4)
            A = ((q * a.scale) @ kv[0].transpose(-1, -2)).softmax(-1)  # (B, heads, N, N_k)
            t = t + a.proj((A @ kv[1]).transpose(1, 2).reshape(B, H * W, Cd))
            t = t + blk.mlp(blk.norm2(t), (H, W))
            if layers is None or idx in layers:
                Yf, Ykf = Y.reshape(B, H * W, -1), Yk.reshape(B, -1, Y.shape[-1])
                branch = sum(A[:, head] @ Ykf for head in range(a.num_heads)) / a.num_heads
                Y = ((Yf + branch) / 2 if normalise else branch).reshape(B, H, W, -1)
            idx += 1
        t = stage.norm(t).reshape(B, H, W, Cd).permute(0, 3, 1, 2)
    return model.forward_head(t), Y.flatten(1, 2).mean(1)


PVT_CASES = {
    'sr': (dict(), 32),
    'linear': (dict(linear=True), 32),  # AdaptiveAvgPool2d(7) keys: 8x8 -> 7x7, then 4x4 -> 7x7
    'three-stages-odd-grids': (
        dict(depths=(1, 2, 1), embed_dims=(8, 16, 16), num_heads=(1, 2, 2), sr_ratios=(2, 2, 1)),
        40,
    ),  # 10x10 -> 5x5 (sr drops a row) -> 3x3
}


@pytest.mark.parametrize('case', list(PVT_CASES))
def test_pvt_dense_trace_matches_materialised_reference(case):
    kw, size = PVT_CASES[case]
    model = tiny_pvt(**kw).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, size, size, generator=g)
    n = (size // 4) ** 2
    Y_tok = random_token_labels(2, n, g)
    ref_out, ref_label = pvt_reference(model, x, Y_tok)
    for fused in (True, False):
        out, label = TLAlign(model, fused=fused).trace(x, Y_tok)
        assert torch.allclose(out, ref_out, atol=1e-5)
        assert torch.allclose(label, ref_label, atol=1e-6)
        assert torch.allclose(label.sum(1), torch.ones(2), atol=1e-6) and label.min() >= 0
    if case == 'three-stages-odd-grids':
        for layers, normalise in [([], True), ([1, 3], False), ([0, 2], True)]:
            _, label = TLAlign(model, layers=layers, residual=normalise).trace(x, Y_tok)
            _, ref = pvt_reference(model, x, Y_tok, layers, normalise)
            assert torch.allclose(label, ref, atol=1e-6)
        assert TLAlign(model).depth == 4


@pytest.mark.parametrize('kind', ['cutmix', 'mixup', 'tokenmix_block', 'token_box'])
def test_pvt_compact_and_dense_labels_give_the_same_target(kind):
    g = torch.Generator().manual_seed(3)
    kw = dict(mixup_alpha=1.0) if kind == 'mixup' else dict(mixup_alpha=0.0, cutmix_alpha=1.0)
    mixer = create_mixer(
        kind, num_classes=C, patch_size=4, mode='elem', label_smoothing=0.1, generator=g, carry_mix=True, **kw
    )
    x, y = torch.randn(6, 3, 32, 32, generator=g), torch.randint(0, C, (6,), generator=g)
    check_compact_equals_dense(tiny_pvt(drop_path_rate=0.2).train(), mixer, x, y, C)


# ---------------------------------------------------------------- both


MODELS = {'cait': (tiny_cait, 8), 'pvt': (tiny_pvt, 4)}


@pytest.mark.parametrize('name', list(MODELS))
def test_eval_is_the_plain_model_and_training_logits_are_unchanged(name):
    build, patch = MODELS[name]
    model = build(drop_path_rate=0.2)
    wrapped = TLAlign(model)
    x = torch.randn(4, 3, 32, 32)
    wrapped.eval()
    assert torch.equal(wrapped(x), model(x))
    wrapped.train()
    mixer = create_mixer('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=patch, carry_mix=True)
    xm, target = mixer(x, torch.tensor([0, 1, 2, 3]))
    torch.manual_seed(0)
    out, _ = wrapped(xm, target)
    torch.manual_seed(0)
    assert torch.equal(out, model(xm))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())  # nothing left
    if name == 'cait':  # TransMix has no CaiT rule (its class token lives in the class-attention stage)
        with pytest.raises(ValueError, match='Cait has none there: its last blocks are class attention'):
            TransMix(model)
        return
    for mode in ('paper', 'average'):  # PVT v2: TransMix's class-free extension, last block only
        _, t = TransMix(model, mode=mode).train()(xm, target)
        assert torch.allclose(t.sum(1), torch.ones(4), atol=1e-6) and t.min() >= 0


@pytest.mark.parametrize('name', list(MODELS))
def test_label_path_is_fp32_under_autocast(name):
    build, patch = MODELS[name]
    model = build().train()
    mixer = create_mixer('tokenmix_random', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=patch)
    xm, target = mixer(torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3]))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out, aligned = TLAlign(model)(xm, target)
    assert out.dtype == torch.bfloat16 and aligned.dtype == torch.float32
    assert torch.allclose(aligned.sum(1), torch.ones(4), atol=1e-5)
    _, full = TLAlign(model)(xm, target)
    assert torch.allclose(aligned, full, atol=0.05)  # same rule, bf16 attention


@pytest.mark.parametrize('name', list(MODELS))
def test_fused_label_attention(name):
    """fused=True: the label attention (class attention / spatial-reduction attention) is one SDPA call per
    block with 1-wide values (padded to 8 columns); the token path's own calls are unchanged. Both settings agree."""
    build, patch = MODELS[name]
    model = build().train()
    calls, sdpa = [], F.scaled_dot_product_attention

    def count(*a, **k):
        calls.append(a[2].shape[-1])
        return sdpa(*a, **k)

    mixer = create_mixer('tokenmix_block', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=patch)
    xm, target = mixer(torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3]))
    try:
        F.scaled_dot_product_attention = count
        _, aligned = TLAlign(model, fused=True)(xm, target)
    finally:
        F.scaled_dot_product_attention = sdpa
    if name == 'cait':  # talking heads: no SDPA (the token path's own materialised attention is used)
        assert calls == [8, 8]  # token path (head dim 8), then the label values padded to 8 columns
    else:
        assert calls == [16, 16, 8, 8]  # token path, then the label values padded to 8 columns
    _, other = TLAlign(model, fused=False)(xm, target)
    assert torch.allclose(aligned, other, atol=1e-6)


def test_bad_input():
    import timm

    with pytest.raises(
        ValueError,
        match=r'no tracer for .*EdgeNeXt \(supported: .*VisionTransformerDistilled, '
        r'.*VisionTransformer, .*SwinTransformer, timm\.models\.swin_transformer_v2\.SwinTransformerV2, '
        r'timm\.models\.swin_transformer_v2_cr\.SwinTransformerV2Cr, timm\.models\.cait\.Cait, '
        r'timm\.models\.pvt_v2\.PyramidVisionTransformerV2, timm\.models\.mlp_mixer\.MlpMixer, '
        r'timm\.models\.eva\.Eva, timm\.models\.beit\.Beit, '
        r'timm\.models\.vision_transformer_relpos\.VisionTransformerRelPos, '
        r'timm\.models\.vision_transformer_sam\.VisionTransformerSAM, timm\.models\.convit\.ConVit, '
        r'timm\.models\.efficientformer\.EfficientFormer, timm\.models\.davit\.DaVit, '
        r'timm\.models\.metaformer\.MetaFormer, '
        r'timm\.models\.hiera\.Hiera, timm\.models\.twins\.Twins, timm\.models\.mvitv2\.MultiScaleVit, '
        r'timm\.models\.convnext\.ConvNeXt, timm\.models\.resnet\.ResNet\), and TL-Align\'s graph route does not '
        r'read EdgeNeXt: node matmul .*a product of tokens over their positions',
    ):
        with torch.device('meta'):
            TLAlign(timm.create_model('edgenext_small', num_classes=C))
    with pytest.raises(ValueError, match="CaiT with global_pool=''"):
        TLAlign(tiny_cait(global_pool=''))
    with pytest.raises(ValueError, match="PVT v2 with global_pool=''"):
        TLAlign(tiny_pvt(global_pool=''))
    with pytest.raises(ValueError, match='labels: 16 token labels for 64 tokens'):  # CaiT's patches, PVT's grid
        TLAlign(tiny_pvt()).trace(torch.randn(1, 3, 32, 32), torch.full((1, 16, C), 1 / C))
    with pytest.raises(ValueError, match='labels: 65 token labels for 17 tokens'):
        TLAlign(tiny_cait()).trace(torch.randn(1, 3, 32, 32), torch.full((1, 64, C), 1 / C))


def test_cct_labels_match_an_explicit_reference():
    """CCT (TokenMixup's CIFAR model): per block the ViT rule with materialised per-head attention, the target
    SeqPool's weighted mean of the token labels with the weights the classifier used."""
    import timm

    import timm_plugin  # noqa: F401  (registers cct_*)

    torch.manual_seed(0)
    model = timm.create_model('cct_7_3x1_32', num_classes=C, depth=3, drop_path_rate=0.0).eval()
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.qkv.weight.mul_(4.0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 3, 32, 32, generator=g)
    Y = torch.rand(3, 256, C, generator=g).softmax(-1)
    out, label = TLAlign(model).trace(x, Y)
    with torch.no_grad():
        h = model.pos_drop(model.patch_embed(x) + model.pos_embed)
        Yr = Y.clone()
        for blk in model.blocks:
            a, n = blk.attn, blk.norm1(h)
            B, T, D = n.shape
            qkv = a.qkv(n).reshape(B, T, 3, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4)
            A = sum((qkv[0][:, hh] @ qkv[1][:, hh].transpose(1, 2) * a.scale).softmax(-1) for hh in range(a.num_heads))
            Yr = (Yr + (A / a.num_heads) @ Yr) / 2
            h = blk(h)
        w = model.attention_pool(model.norm(h)).softmax(1)
        ref = (w * Yr).sum(1)
        assert torch.allclose(out, model(x), atol=1e-5)
    assert torch.allclose(label, ref, atol=1e-5) and torch.allclose(label.sum(1), torch.ones(3), atol=1e-5)
