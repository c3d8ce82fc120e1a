"""TL-Align on timm ViTs against an explicit reference (materialised attention, dense labels, head loops)."""

import pytest
import torch
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import VisionTransformer

from shared_core.mixing import MixSampler, mix_target, one_hot
from shared_core.tl_align import residual_labels
from timm_plugin import MixTarget, create_mixer
from timm_plugin.tl_align import TLAlign

C = 6


def sharpen(model, std=0.3):
    """Random init gives near-uniform attention (q, k tiny); larger weights make every attention peaked,
    so a wrong index, head or shift anywhere shows in the labels."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.normal_(0, std)
    return model


def tiny_vit(cls=VisionTransformer, **kw):
    torch.manual_seed(0)
    args = dict(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=4, num_classes=C, mlp_ratio=2.0)
    args.update(kw)
    return sharpen(cls(**args))


def reference(model, x, Y, layers=None, normalise=True, attns=None, final=None):
    """The ViT forward written out with explicit attention matrices; the labels follow Eq. 9 (a loop over
    heads) and Eq. 11 (average with the residual) at every block (or at ``layers`` only)."""
    P = model.num_prefix_tokens
    t = model.norm_pre(model._pos_embed(model.patch_embed(x)))
    for i, blk in enumerate(model.blocks):
        a = blk.attn
        h = blk.norm1(t)
        B, T, D = h.shape
        qkv = a.qkv(h).reshape(B, T, 3, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = a.q_norm(qkv[0]), a.k_norm(qkv[1]), qkv[2]
        A = torch.softmax(q @ k.transpose(-1, -2) * a.head_dim**-0.5, dim=-1)  # (B, H, T, T)
        if attns is not None:
            attns.append(A)
        lam = getattr(blk, 'skip_lam', 1.0)  # LV-ViT's residual scale: x + F(x) / skip_lam
        t = t + blk.ls1(a.proj((A @ v).transpose(1, 2).reshape(B, T, D))) / lam
        t = t + blk.ls2(blk.mlp(blk.norm2(t))) / lam
        if layers is not None and i not in layers:
            continue
        Y_hat = torch.zeros_like(Y)
        for head in range(a.num_heads):
            Y_hat = Y_hat + A[:, head] @ Y
        Y = (Y + Y_hat / a.num_heads) / 2 if normalise else Y_hat / a.num_heads
    out = model.forward_head(model.norm(t))
    if final is not None:
        final.append(Y)
    if isinstance(model, VisionTransformerDistilled):
        return out, (Y[:, 0] + Y[:, 1]) / 2
    return out, Y[:, 0] if model.global_pool == 'token' else Y[:, P:].mean(1)


def random_token_labels(B, N, generator):
    return torch.softmax(torch.randn(B, N, C, generator=generator) * 3, dim=-1)


@pytest.mark.parametrize(
    'kw',
    [
        dict(),
        dict(global_pool='avg', class_token=False),
        dict(global_pool='avg'),
        dict(reg_tokens=2),
        dict(qk_norm=True),
    ],
    ids=['cls', 'avg-no-cls', 'avg-with-cls', 'registers', 'qk-norm'],
)
def test_dense_trace_matches_materialised_reference(kw):
    model = tiny_vit(**kw).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 32, 32, generator=g)
    Y_tok = random_token_labels(4, 16, g)
    P = model.num_prefix_tokens
    Y0 = torch.cat([Y_tok.mean(1, keepdim=True).expand(-1, P, -1), Y_tok], 1)
    ref_out, ref_label = reference(model, x, Y0)
    for fused in (True, False):
        out, label = TLAlign(model, fused=fused).trace(x, Y_tok)
        assert torch.allclose(out, ref_out, atol=1e-5)
        assert torch.allclose(label, ref_label, atol=1e-6)
        assert torch.allclose(label.sum(1), torch.ones(4), atol=1e-6)


@pytest.mark.parametrize('skip_lam', [2.0, 1.0])
def test_lvvit_blocks_follow_the_vit_rule(skip_lam):
    """LV-ViT (``LVBlock``: ``x + F(x) / skip_lam`` on both branches): the ViT rule, the residual scale a scalar on
    the branch that leaves the labels (Eq. 11 averages them, as with layer scale); its conv stem is not traced: the
    labels start on its 16-pixel patch grid. Shared, fused and recomputed paths alike."""
    from timm_plugin.lvvit import LVViT

    torch.manual_seed(0)
    model = LVViT(
        img_size=64, embed_dim=32, depth=3, num_heads=4, num_classes=C, stem_chans=8, skip_lam=skip_lam,
        head_rule='cls',
    )  # fmt: skip
    model = sharpen(model).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 64, 64, generator=g)
    Y_tok = random_token_labels(2, 16, g)
    ref_out, ref_label = reference(model, x, torch.cat([Y_tok.mean(1, keepdim=True), Y_tok], 1))
    for fused in (True, False):
        for shared in (True, False):
            out, label = TLAlign(model, fused=fused, shared=shared).trace(x, Y_tok)
            assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(label, ref_label, atol=1e-6)
    assert (ref_label - Y_tok.mean(1)).abs().max() > 1e-3


def test_geglu_mlps_are_per_token():
    """ViTamin's ``GeGluMlp`` (a norm, ``gelu(w0 x) * w1 x``, ``w2``) acts on each token alone, as ``Mlp`` and the
    GLU MLPs: the ViT rule, against the explicit reference; timm's ViTamin (its conv stem not traced) is taken."""
    import timm
    from timm.models.vitamin import GeGluMlp

    model = tiny_vit(mlp_layer=GeGluMlp).eval()
    g = torch.Generator().manual_seed(1)
    x, Y_tok = torch.randn(2, 3, 32, 32, generator=g), random_token_labels(2, 16, g)
    ref_out, ref_label = reference(model, x, torch.cat([Y_tok.mean(1, keepdim=True), Y_tok], 1))
    out, label = TLAlign(model).trace(x, Y_tok)
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(label, ref_label, atol=1e-6)
    assert (ref_label - Y_tok.mean(1)).abs().max() > 1e-3
    with torch.device('meta'):
        assert type(TLAlign(timm.create_model('vitamin_small_224', num_classes=C)).tracer).__name__ == 'ViTTracer'


def test_distilled_deit_reads_both_tokens():
    model = tiny_vit(VisionTransformerDistilled).eval()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 32, 32, generator=g)
    Y_tok = random_token_labels(2, 16, g)
    cls_label = torch.softmax(torch.randn(2, C, generator=g), -1)
    out, label = TLAlign(model).trace(x, Y_tok, cls_label)
    Y0 = torch.cat([cls_label[:, None].expand(-1, 2, -1), Y_tok], 1)
    ref_out, ref_label = reference(model, x, Y0)
    assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(label, ref_label, atol=1e-6)
    model.set_distilled_training(True)
    model.train()
    out, label = TLAlign(model).trace(x, Y_tok, cls_label)
    final = []
    reference(model, x, Y0, final=final)
    # distilled training: two outputs, and the class head's target is the class token's label alone
    assert isinstance(out, tuple) and torch.allclose(label, final[0][:, 0], atol=1e-6)
    assert not torch.allclose(label, (final[0][:, 0] + final[0][:, 1]) / 2, atol=1e-4)


@pytest.mark.parametrize('kind', ['cutmix', 'mixup', 'tokenmix_block', 'tokenmix_random', 'token_box'])
def test_compact_and_dense_labels_give_the_same_target(kind):
    """Labels are affine in the two sources and attention rows sum to 1: carrying the partner share per
    token gives the dense result."""
    model = tiny_vit(drop_path_rate=0.0).train()
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
    # dense: per-token labels from the same mix, smoothed one-hots of both sources
    mix = target.mix
    y_own, y_partner = one_hot(y, C, 0.1), one_hot(y[mix.partner], C, 0.1)
    s = mix.token_share_flat()[..., None]
    Y_tok = (1 - s) * y_own[:, None] + s * y_partner[:, None]
    torch.manual_seed(5)
    out_dense, label = wrapped.trace(xm, Y_tok, cls_label=mix_target(y, mix, C, 0.1))
    assert torch.equal(out, out_dense)
    assert torch.allclose(aligned, label, atol=1e-6)
    assert torch.allclose(aligned.sum(1), torch.ones(6), atol=1e-6) and aligned.min() >= 0
    assert not aligned.requires_grad


def test_eval_is_the_plain_model_and_training_logits_are_unchanged():
    model = tiny_vit()
    wrapped = TLAlign(model)
    x = torch.randn(4, 3, 32, 32)
    wrapped.eval()
    assert torch.equal(wrapped(x), model(x))
    assert all(not blk.attn.q_norm._forward_hooks for blk in model.blocks)  # nothing left registered
    wrapped.train()
    mixer = create_mixer('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=8, carry_mix=True)
    xm, target = mixer(x, torch.tensor([0, 1, 2, 3]))
    torch.manual_seed(0)
    plain = model(xm)
    # the recomputing path leaves the token path as it is, bit for bit
    torch.manual_seed(0)
    assert torch.equal(TLAlign(model, shared=False)(xm, target)[0], plain)
    # the shared attention (one attention for tokens and labels) is the same computation by another kernel:
    # equal up to float rounding (measured max |diff| 4.8e-7 fused, 9.5e-7 unfused here)
    for fused in (True, False):
        torch.manual_seed(0)
        out, _ = TLAlign(model, fused=fused)(xm, target)
        assert torch.allclose(out, plain, atol=1e-5, rtol=0)
    assert all('forward' not in blk.attn.__dict__ and not blk._forward_hooks for blk in model.blocks)


def test_no_mixing_gives_the_plain_target():
    """Mixing probability 0: the aligned target is the (smoothed) one-hot, so the loss is plain training's."""
    model = tiny_vit().train()
    mixer = create_mixer(
        'cutmix',
        mixup_alpha=0.0,
        cutmix_alpha=1.0,
        prob=0.0,
        num_classes=C,
        patch_size=8,
        carry_mix=True,
        label_smoothing=0.1,
    )
    y = torch.tensor([0, 1, 2, 3])
    xm, target = mixer(torch.randn(4, 3, 32, 32), y)
    _, aligned = TLAlign(model)(xm, target)
    assert torch.allclose(aligned, one_hot(y, C, 0.1), atol=1e-6)


@pytest.mark.parametrize('shared', [True, False])
@pytest.mark.parametrize('fused', [True, False])
def test_one_attention_per_block_or_the_fused_token_path_kept(fused, shared):
    """Shared (the default for timm ViTs): one attention per block for tokens and labels, a fused call with
    the labels as value columns (head_dim + 1 padded to a multiple of 8) or, unfused, one materialised softmax.
    ``shared=False``: the token path stays on the model's scaled_dot_product_attention (3 calls, head_dim-wide
    values) and the label path adds one fused call per block with 1-wide values padded to 8, or one transient
    softmax. All give the same target. Counted at the kernels PyTorch dispatches (forward and backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = tiny_vit().train()
    assert all(blk.attn.fused_attn for blk in model.blocks)
    fwd, bwd, softmaxes = [], [], []

    class Kernels(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if name == 'aten._scaled_dot_product_flash_attention_for_cpu':
                fwd.append(args[2].shape[-1])  # the value width
            elif name == 'aten._scaled_dot_product_flash_attention_for_cpu_backward':
                bwd.append(args[3].shape[-1])
            elif name == 'aten._softmax':
                softmaxes.append(args[0].shape)
            return func(*args, **(kwargs or {}))

    mixer = create_mixer('tokenmix_block', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=8)
    xm, target = mixer(torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3]))
    with Kernels():
        logits, aligned = TLAlign(model, fused=fused, shared=shared)(xm, target)
        (logits * aligned).sum().backward()
    head_dim = model.blocks[0].attn.head_dim
    if shared and fused:  # one wide forward per block; the backward at the head dim (the plain one, on the CPU)
        assert fwd == [head_dim + 8] * 3 and bwd == [head_dim] * 3 and softmaxes == []
    elif shared:
        assert fwd == [] and len(softmaxes) == 3
    elif fused:  # the label values (1 wide) are padded to 8 columns for the aligned fused kernels
        assert fwd == [head_dim] * 3 + [8] * 3 and bwd == [head_dim] * 3 and softmaxes == []
    else:
        assert fwd == [head_dim] * 3 and bwd == [head_dim] * 3 and len(softmaxes) == 3
    for other_fused, other_shared in ((True, True), (False, True), (True, False), (False, False)):
        _, other = TLAlign(model, fused=other_fused, shared=other_shared)(xm, target)
        assert torch.allclose(aligned, other, atol=1e-6)


def test_label_path_is_fp32_under_autocast():
    model = tiny_vit().train()
    mixer = create_mixer('tokenmix_random', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=8)
    xm, target = mixer(torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3]))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out, aligned = TLAlign(model)(xm, target)
    assert out.dtype == torch.bfloat16 and aligned.dtype == torch.float32
    assert torch.allclose(aligned.sum(1), torch.ones(4), atol=1e-5)


def test_align_only_at_chosen_layers_and_no_residual():
    model = tiny_vit().eval()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 32, 32, generator=g)
    Y_tok = random_token_labels(2, 16, g)
    cls = Y_tok.mean(1)
    # no layer aligned: the class token keeps its initial label
    _, label = TLAlign(model, layers=[]).trace(x, Y_tok)
    assert torch.allclose(label, cls, atol=1e-6)
    Y0 = torch.cat([cls[:, None], Y_tok], 1)
    for layers, normalise in [([2], False), ([0, 2], True), (None, False)]:
        _, label = TLAlign(model, layers=layers, residual=normalise).trace(x, Y_tok)
        _, ref = reference(model, x, Y0, layers, normalise)
        assert torch.allclose(label, ref, atol=1e-6) and torch.allclose(label.sum(1), torch.ones(2), atol=1e-6)
    with pytest.raises(ValueError, match='layers'):
        TLAlign(model, layers=[3])


def test_dropped_branch_keeps_labels():
    Y = torch.softmax(torch.randn(3, 5, C), -1)
    branch = torch.softmax(torch.randn(3, 5, C), -1)
    out = residual_labels(Y, branch, keep=torch.tensor([True, False, True]))
    assert torch.equal(out[1], Y[1]) and torch.allclose(out[0], (Y[0] + branch[0]) / 2)
    model = tiny_vit(drop_path_rate=0.9).train()  # stochastic depth on: targets stay normalised
    mixer = create_mixer('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=8, carry_mix=True)
    xm, target = mixer(torch.randn(8, 3, 32, 32), torch.arange(8) % C)
    _, aligned = TLAlign(model)(xm, target)
    assert torch.allclose(aligned.sum(1), torch.ones(8), atol=1e-6)


def test_bad_input():
    import timm

    with pytest.raises(
        ValueError,
        match=r'no tracer for .*EdgeNeXt \(supported: .*VisionTransformerDistilled, '
        r'.*VisionTransformer, .*SwinTransformer.*ConvNeXt, .*ResNet\), and .*graph route does not read EdgeNeXt',
    ):
        with torch.device('meta'):  # its attention: no family tracer, and the graph route for conv nets stops there
            TLAlign(timm.create_model('edgenext_small', num_classes=C))
    with pytest.raises(ValueError, match="global_pool='map'"):
        TLAlign(tiny_vit(global_pool='map'))
    wrapped = TLAlign(tiny_vit()).train()
    with pytest.raises(ValueError, match='target: TLAlign needs the MixTarget'):
        wrapped(torch.randn(2, 3, 32, 32), torch.eye(C)[:2])
    dynamic = TLAlign(tiny_vit(dynamic_img_size=True))
    with pytest.raises(ValueError, match='labels: 17 token labels for 5 tokens'):
        dynamic.trace(torch.randn(2, 3, 16, 16), torch.full((2, 16, C), 1 / C))  # 16 patch labels, 4 patches


def test_mix_target_carries_its_sources():
    mixer = create_mixer('tokenmix_block', cutmix_alpha=1.0, num_classes=C, patch_size=8, label_smoothing=0.2)
    y = torch.tensor([0, 1, 2, 3])
    _, t = mixer(torch.randn(4, 3, 32, 32), y)
    assert isinstance(t, MixTarget) and torch.equal(t.labels, y) and t.num_classes == C and t.smoothing == 0.2
    assert torch.allclose(mix_target(t.labels, t.mix, C, 0.2), t.as_tensor())
    sampler = MixSampler('tokenmix_block', cutmix_alpha=1.0, patch_size=8)
    assert sampler.sample(4, 32).token_share.shape == (4, 4, 4)


# ---------------------------------------------------------------- Swin


def tiny_swin(**kw):
    from timm.models.swin_transformer import SwinTransformer

    torch.manual_seed(0)
    args = dict(
        img_size=32,
        patch_size=2,
        window_size=4,
        embed_dim=16,
        depths=(2, 2),
        num_heads=(2, 2),
        num_classes=C,
        drop_path_rate=0.0,
    )
    args.update(kw)
    return sharpen(SwinTransformer(**args))


def swin_logits(attn, xw):
    """Swin's window attention logits ``(B · nW, heads, N, N)`` from its qkv: scaled dot products plus the
    relative position bias."""
    Bw, N, _ = xw.shape
    q, k, _ = attn.qkv(xw).reshape(Bw, N, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    return (q * attn.scale) @ k.transpose(-2, -1) + attn._get_rel_pos_bias()


def swin_reference_labels(model, x, Y_tok, logits=swin_logits, stages=None):
    """Swin's label geometry written out with index arithmetic: for every token, the window it falls in
    after the cyclic shift, and every key of that window mapped back to its unshifted position; patch
    merging as the mean of the 2x2 labels. Attention: recomputed from each block's own qkv on the windows
    it was given (``logits(attn, windows)``: Swin's by default), with the shift mask, materialised,
    head-averaged. ``stages``: the model's stages (default ``model.layers``)."""
    attns = []

    def recompute(attn, args, kwargs):
        xw, mask = args[0], kwargs.get('mask')
        Bw, N, _ = xw.shape
        lg = logits(attn, xw)
        if mask is not None:
            nw = mask.shape[0]
            lg = (lg.view(Bw // nw, nw, attn.num_heads, N, N) + mask[None, :, None]).view(Bw, -1, N, N)
        attns.append(lg.softmax(-1).mean(1).detach())

    stages = model.layers if stages is None else stages
    blocks = [b for s in stages for b in s.blocks]
    hooks = [b.attn.register_forward_pre_hook(recompute, with_kwargs=True) for b in blocks]
    out = model(x)
    for h in hooks:
        h.remove()
    B = x.shape[0]
    H = W = int(Y_tok.shape[1] ** 0.5)
    Y = Y_tok.view(B, H, W, -1).clone()
    idx = 0
    for stage in stages:
        if not isinstance(stage.downsample, torch.nn.Identity):
            H, W = H // 2, W // 2
            merged = torch.zeros(B, H, W, Y.shape[-1])
            for i in range(H):
                for j in range(W):
                    merged[:, i, j] = (
                        Y[:, 2 * i, 2 * j]
                        + Y[:, 2 * i + 1, 2 * j]
                        + Y[:, 2 * i, 2 * j + 1]
                        + Y[:, 2 * i + 1, 2 * j + 1]
                    ) / 4
            Y = merged
        for blk in stage.blocks:
            A = attns[idx]
            ws, ss = blk.window_size[0], blk.shift_size[0]
            nwh, nww = H // ws, W // ws
            new = torch.zeros_like(Y)
            for b in range(B):
                for i in range(H):
                    for j in range(W):
                        si, sj = (i - ss) % H, (j - ss) % W  # where the cyclic shift moved this token
                        win = b * nwh * nww + (si // ws) * nww + sj // ws
                        n = (si % ws) * ws + sj % ws
                        acc = torch.zeros(Y.shape[-1])
                        for m in range(ws * ws):
                            mi, mj = (si // ws) * ws + m // ws, (sj // ws) * ws + m % ws
                            acc += A[win, n, m] * Y[b, (mi + ss) % H, (mj + ss) % W]
                        new[b, i, j] = acc
            Y = (Y + new) / 2
            idx += 1
    return out, Y.flatten(1, 2).mean(1)


def test_swin_dense_trace_matches_index_reference():
    model = tiny_swin().eval()
    assert any(b.shift_size[0] for s in model.layers for b in s.blocks)  # shifted windows are exercised
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 32, 32, generator=g)
    Y_tok = random_token_labels(2, 256, g)
    ref_out, ref_label = swin_reference_labels(model, x, Y_tok)
    out, label = TLAlign(model).trace(x, Y_tok)
    assert torch.allclose(out, ref_out, atol=1e-6) and torch.allclose(label, ref_label, atol=1e-6)
    # with timm's fused window attention on, q/k/bias/shift mask are captured and give the same labels
    for blk in (b for s in model.layers for b in s.blocks):
        blk.attn.fused_attn = True
    for fused in (True, False):
        out, label = TLAlign(model, fused=fused).trace(x, Y_tok)
        assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(label, ref_label, atol=1e-6)


def test_swin_compact_equals_dense_and_training_call():
    model = tiny_swin(drop_path_rate=0.2).train()
    mixer = create_mixer(
        'cutmix',
        mixup_alpha=0.0,
        cutmix_alpha=1.0,
        num_classes=C,
        patch_size=2,
        mode='elem',
        carry_mix=True,
        generator=torch.Generator().manual_seed(1),
    )
    y = torch.arange(4) % C
    xm, target = mixer(torch.randn(4, 3, 32, 32), y)
    wrapped = TLAlign(model)
    torch.manual_seed(3)
    out, aligned = wrapped(xm, target)
    mix = target.mix
    s = mix.token_share_flat()[..., None]
    Y_tok = (1 - s) * one_hot(y, C, 0.1)[:, None] + s * one_hot(y[mix.partner], C, 0.1)[:, None]
    torch.manual_seed(3)
    out_d, label = wrapped.trace(xm, Y_tok)
    assert torch.equal(out, out_d) and torch.allclose(aligned, label, atol=1e-6)
    wrapped.eval()
    assert torch.equal(wrapped(xm), model(xm))


def test_swin_padded_grid_is_refused():
    model = tiny_swin(strict_img_size=False).eval()
    TLAlign(model).trace(torch.randn(1, 3, 32, 32), torch.full((1, 256, C), 1 / C))  # 16x16 then 8x8: fine
    with pytest.raises(ValueError, match='6x6 token grid is padded'):  # 12x12 then 6x6 in 4x4 windows
        TLAlign(model).trace(torch.randn(1, 3, 24, 24), torch.full((1, 144, C), 1 / C))


# ---------------------------------------------------------------- TransMix


@pytest.mark.parametrize('mode', ['paper', 'average'])
def test_transmix_reads_the_class_attention_over_the_box(mode):
    from timm_plugin.tl_align import TransMix

    model = tiny_vit().eval()
    mixer = create_mixer(
        'cutmix',
        mixup_alpha=0.0,
        cutmix_alpha=1.0,
        num_classes=C,
        patch_size=8,
        mode='elem',
        carry_mix=True,
        label_smoothing=0.0,
        generator=torch.Generator().manual_seed(2),
    )
    y = torch.tensor([0, 1, 2, 3])
    xm, target = mixer(torch.randn(4, 3, 32, 32), y)
    attns = []
    reference(model, xm, torch.zeros(4, 17, 1), attns=attns)
    A = attns[-1].mean(1)[:, 0, 1:]  # class token -> patches, last block, head mean
    A = A / A.sum(-1, keepdim=True)  # renormalised over the patches
    if mode == 'paper':  # the paper: each patch's fractional share of the box
        share = (A * target.mix.token_share_flat()).sum(-1)
    else:  # the public code: the pixel box mask, nearest-downsampled to the patch grid, mean with the area
        boxes = target.mix.boxes
        pixel = torch.zeros(4, 1, 32, 32)
        for b in range(4):
            y0, y1, x0, x1 = boxes[b].tolist()
            for i in range(y0, y1):
                for j in range(x0, x1):
                    pixel[b, 0, i, j] = 1.0
        M = torch.nn.functional.interpolate(pixel, size=(4, 4), mode='nearest').flatten(1)
        frac = target.mix.token_share_flat()
        assert ((frac > 0) & (frac < 1)).any() and not torch.equal(M, frac)  # unaligned boxes: the rules differ
        share = ((A * M).sum(-1) + 1 - target.mix.lam) / 2
    wrapped = TransMix(model, mode=mode).train()
    out, t = wrapped(xm, target)
    expected = (1 - share)[:, None] * one_hot(y, C) + share[:, None] * one_hot(y[target.mix.partner], C)
    assert torch.allclose(t, expected, atol=1e-6) and torch.allclose(t.sum(1), torch.ones(4), atol=1e-6)
    wrapped.eval()
    assert torch.equal(wrapped(xm), model(xm))


def test_transmix_extension_without_class_token():
    from timm_plugin.tl_align import TransMix

    model = tiny_vit(global_pool='avg', class_token=False).eval()
    mixer = create_mixer(
        'tokenmix_block',
        mixup_alpha=0.0,
        cutmix_alpha=1.0,
        num_classes=C,
        patch_size=8,
        mode='elem',
        label_smoothing=0.0,
        generator=torch.Generator().manual_seed(4),
    )
    y = torch.tensor([0, 1, 2, 3])
    xm, target = mixer(torch.randn(4, 3, 32, 32), y)
    attns = []
    reference(model, xm, torch.zeros(4, 16, 1), attns=attns)
    A = attns[-1].mean(1).mean(1)  # mean over queries of the last block's head-mean attention
    share = (A * target.mix.token_share_flat()).sum(-1)
    _, t = TransMix(model).train()(xm, target)
    expected = (1 - share)[:, None] * one_hot(y, C) + share[:, None] * one_hot(y[target.mix.partner], C)
    assert torch.allclose(t, expected, atol=1e-6)
    _, t = TransMix(tiny_swin()).train()(
        *create_mixer('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=2, carry_mix=True)(xm, y)
    )
    assert torch.allclose(t.sum(1), torch.ones(4), atol=1e-6) and t.min() >= 0
    with pytest.raises(ValueError, match='mode'):
        TransMix(model, mode='mean')


def test_swin_label_path_is_fp32_under_autocast():
    model = tiny_swin().train()
    mixer = create_mixer(
        'cutmix',
        mixup_alpha=0.0,
        cutmix_alpha=1.0,
        num_classes=C,
        patch_size=2,
        carry_mix=True,
        generator=torch.Generator().manual_seed(0),
    )
    xm, target = mixer(torch.randn(4, 3, 32, 32), torch.arange(4))
    _, ref = TLAlign(model)(xm, target)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out, aligned = TLAlign(model)(xm, target)
    assert out.dtype == torch.bfloat16 and aligned.dtype == torch.float32
    assert torch.allclose(aligned, ref, atol=2e-2)  # the token path ran in bf16, the labels did not


@pytest.mark.parametrize('mix_kind', ['cutmix', 'mixup', 'tokenmix_random', 'tokenmix_block'])
def test_tl_align_mixer_api(mix_kind):
    """x, mix = create_mixer(mix_kind, method='tl_align', ...)(x, y); logits, target = TLAlign(model)(x, mix):
    the method and the mixing kind are two parameters."""
    kw = dict(mixup_alpha=0.8) if mix_kind == 'mixup' else dict(mixup_alpha=0.8, cutmix_alpha=1.0)
    mixer = create_mixer(mix_kind, method='tl_align', num_classes=C, patch_size=8, **kw)
    x, mix = mixer(torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3]))
    assert isinstance(mix, MixTarget) and mix.mix.kind in (mix_kind, 'mixup')
    logits, target = TLAlign(tiny_vit()).train()(x, mix)
    assert logits.shape == target.shape == (4, C) and torch.allclose(target.sum(1), torch.ones(4), atol=1e-6)
    with pytest.raises(ValueError, match="mix_kind: 'tl_align' is a method"):
        create_mixer('tl_align')
    with pytest.raises(ValueError, match='method: expected one of'):
        create_mixer('cutmix', method='cutmix', cutmix_alpha=1.0)
    with pytest.raises(ValueError, match="cutmix_alpha: tl_align over mix_kind='cutmix' needs cutmix_alpha > 0"):
        create_mixer('cutmix', method='tl_align', num_classes=C)  # timm's defaults: MixUp only, nothing to align


def test_token_grid_step_of_timm_models():
    import timm

    from timm_plugin.token_grid import token_stride

    assert token_stride(timm.create_model('vit_tiny_patch16_224')) == (16, 16)
    assert token_stride(timm.create_model('swin_tiny_patch4_window7_224')) == (4, 4)
    assert token_stride(timm.create_model('pvt_v2_b0')) == (4, 4)  # 7x7 overlapping embedding, stride 4


@pytest.mark.parametrize('drop_path', ['kept', 'public'])
def test_stochastic_depth_keeps_match_the_reference(drop_path):
    """Samples whose attention branch DropPath dropped keep their labels; the others average (Eq. 11).
    ``drop_path='public'``: every sample averages, dropped or not (the public code). The reference recomputes
    each block's attention from the normalised input the block saw."""
    model = tiny_vit(drop_path_rate=0.6).train()
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 3, 32, 32, generator=g)
    Y_tok = random_token_labels(6, 16, g)
    seen, keeps = [], []
    hooks = [
        h
        for blk in model.blocks
        for h in (
            blk.norm1.register_forward_hook(lambda m, i, o: seen.append(o.detach())),
            blk.drop_path1.register_forward_hook(lambda m, i, o: keeps.append((o.flatten(1) != 0).any(1))),
        )
    ]
    torch.manual_seed(0)
    _, label = TLAlign(model, drop_path=drop_path).trace(x, Y_tok)
    for h in hooks:
        h.remove()
    kept = torch.stack(keeps)
    assert kept.any() and not kept.all()  # both cases occur
    Y = torch.cat([Y_tok.mean(1, keepdim=True), Y_tok], 1)
    Y_public = Y
    for blk, h, keep in zip(model.blocks, seen, keeps):
        a = blk.attn
        B, T, D = h.shape
        q, k, _ = a.qkv(h).reshape(B, T, 3, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4)
        A = torch.softmax(q @ k.transpose(-1, -2) * a.head_dim**-0.5, dim=-1).mean(1)
        Y = torch.where(keep[:, None, None], (Y + A @ Y) / 2, Y)
        Y_public = (Y_public + A @ Y_public) / 2
    expect = Y if drop_path == 'kept' else Y_public
    assert torch.allclose(label, expect[:, 0], atol=1e-6)
    assert (Y[:, 0] - Y_public[:, 0]).abs().max() > 1e-3  # the two rules differ here


def test_label_states_are_the_label_path_after_each_block():
    """``TLAlign.label_states`` (what ``tokenaug-viz tl-align`` draws): the training path's output and aligned
    label, and one state per block equal to the explicit reference's labels after that block (a ViT: the
    reference aligning at blocks 0..d-1 only leaves the state after block d-1); Swin: one state per block on its
    stage's grid, the last one's mean the aligned label; a model without kept states is refused by name."""
    from shared_core.tl_align import compact_labels

    model = tiny_vit().eval()
    mixer = create_mixer('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=8, carry_mix=True,
                         generator=torch.Generator().manual_seed(2))  # fmt: skip
    xm, target = mixer(torch.randn(4, 3, 32, 32), torch.arange(4) % C)
    vit_batch = xm, target
    wrapped = TLAlign(model)
    with torch.no_grad():
        out, share, states = wrapped.label_states(xm, target)
        out_a, _ = wrapped(xm, target)
        assert torch.equal(out, out_a) and len(states) == len(model.blocks)
        Y0 = compact_labels(target.mix, model.num_prefix_tokens)
        for d in range(1, len(model.blocks) + 1):
            final = []
            _, label = reference(model, xm, Y0.clone(), layers=set(range(d)), final=final)
            labels, grid = states[d - 1]
            assert grid is None  # a ViT's patch tokens are on the mix's grid, which the tracer does not keep
            torch.testing.assert_close(labels, final[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(share, label, atol=1e-6, rtol=0)  # the class token's label after the last block

    swin = TLAlign(tiny_swin().eval())
    mixer = create_mixer('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=2, carry_mix=True,
                         generator=torch.Generator().manual_seed(2))  # fmt: skip
    xm, target = mixer(torch.randn(4, 3, 32, 32), torch.arange(4) % C)
    with torch.no_grad():
        _, share, states = swin.label_states(xm, target)
    depths = [len(stage.blocks) for stage in swin.model.layers]
    assert len(states) == sum(depths) and states[0][1] == (16, 16) and states[-1][1] == (8, 8)
    assert states[0][0].shape == (4, 256, 1) and states[-1][0].shape == (4, 64, 1)
    torch.testing.assert_close(share, states[-1][0].mean(1), atol=1e-6, rtol=0)
    # the recomputing path observes the same states (the driver's observer), up to another kernel's rounding
    _, share_r, states_r = TLAlign(model, shared=False).label_states(*vit_batch)
    _, share_s, states_s = wrapped.label_states(*vit_batch)
    torch.testing.assert_close(share_r, share_s, atol=1e-6, rtol=0)
    for (r, _), (s_, _) in zip(states_r, states_s, strict=True):
        torch.testing.assert_close(r, s_, atol=1e-6, rtol=0)
