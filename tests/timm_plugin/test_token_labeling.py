"""Token labeling + MixToken on timm: un-mixing, the loss against a hand computation, the inference rule."""

import math

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F

from shared_core.label_maps import CropMaps, crop_logit_targets, dense_maps
from shared_core.mixing import Mix, MixSampler
from shared_core.token_labeling import mix_dense_targets, token_labeling_loss, unmix_tokens
from timm_plugin.token_label_data import TokenLabelTarget
from timm_plugin.token_labeling import TokenLabeling, TokenLabelingLoss, TokenLabelingOutput, attach_aux_head


def tiny_vit(depth=2, num_classes=5, **kw):
    torch.manual_seed(0)
    m = timm.create_model('vit_tiny_patch16_224', img_size=64, num_classes=num_classes, depth=depth, **kw)
    return attach_aux_head(m)


def box_mix(B=4, grid=(4, 4), seed=0, mode='batch'):
    return MixSampler('token_box', mixup_alpha=0.0, cutmix_alpha=1.0, mode=mode, patch_size=16).sample(
        B, (grid[0] * 16, grid[1] * 16), generator=torch.Generator().manual_seed(seed)
    )


def test_unmixed_outputs_are_each_samples_own_tokens():
    """Without blocks no token sees another: after MixToken and un-mixing, every sample's dense output
    must equal the unmixed model's output for that sample, position by position."""
    m = tiny_vit(depth=0)
    w = TokenLabeling(m, generator=torch.Generator().manual_seed(3))
    x = torch.randn(6, 3, 64, 64)
    out = w(x)
    assert out.mix is not None and 0 < out.mix.token_share.sum() < out.mix.token_share.numel()
    with torch.no_grad():
        plain = m.aux_head(m.forward_features(x)[:, 1:])
    torch.testing.assert_close(out.aux, plain, atol=1e-6, rtol=0)
    # and the mix did something: before un-mixing, the box rows hold the partner's outputs
    s = out.mix.token_share_flat().bool()
    raw = torch.where(s[..., None], plain[out.mix.partner], plain)
    assert not torch.allclose(raw, plain)
    assert torch.equal(unmix_tokens(raw, out.mix), plain)


@pytest.mark.parametrize('mode', ['batch', 'pair'])
def test_unmixing_gives_the_loss_of_eq6_mixed_targets(mode):
    """Un-mixed outputs vs own targets == mixed outputs vs mixed targets (Eq. 6), for a deep model."""
    mix = box_mix(B=6, mode=mode, seed=1)
    out = torch.randn(6, 16, 5)
    tgt = torch.softmax(torch.randn(6, 16, 5), -1)
    a = -(tgt * F.log_softmax(unmix_tokens(out, mix), -1)).sum(-1).mean()
    b = -(mix_dense_targets(tgt, mix) * F.log_softmax(out, -1)).sum(-1).mean()
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize('mode', ['batch', 'pair'])
@pytest.mark.parametrize('seed', [0, 1, 2])
def test_token_swap_and_its_backward_against_loops(mode, seed):
    """MixToken's swap (the patch-embedding hook) and the un-mixing are one op whose backward is the swap of the
    gradient: values and gradients equal an explicit loop over samples and tokens (flipped partners in batch
    mode, gathered ones in pair mode)."""
    from shared_core.token_labeling import mix_patch_embed_output

    mix = box_mix(B=6, mode=mode, seed=seed)
    share = mix.token_share_flat()
    t = torch.randn(6, 16, 3, dtype=torch.float64, requires_grad=True)
    g = torch.randn(6, 16, 3, dtype=torch.float64)

    def loop(x):
        rows = [
            torch.stack([x[int(mix.partner[i]), n] if share[i, n] else x[i, n] for n in range(16)]) for i in range(6)
        ]
        return torch.stack(rows)

    for fn in (mix_patch_embed_output, unmix_tokens):
        out = fn(t, mix)
        torch.testing.assert_close(out, loop(t.detach()), atol=0, rtol=0)
        (grad,) = torch.autograd.grad(out, t, g)
        (ref,) = torch.autograd.grad(loop(t), t, g)
        torch.testing.assert_close(grad, ref, atol=0, rtol=0)
    assert torch.equal(unmix_tokens(mix_patch_embed_output(t, mix), mix), t)  # its own inverse
    torch.autograd.gradcheck(lambda x: unmix_tokens(x, mix), (t,))


def test_unmixing_refuses_a_mix_that_is_not_a_pairwise_swap():
    mix = MixSampler('token_box', mixup_alpha=0.0, cutmix_alpha=1.0, mode='elem', patch_size=16).sample(
        4, (64, 64), generator=torch.Generator().manual_seed(0)
    )
    assert not torch.equal(mix.token_share, mix.token_share[mix.partner])  # elem mode: each sample its own box
    with pytest.raises(ValueError, match='pairwise'):
        unmix_tokens(torch.zeros(4, 16, 3), mix)


def test_loss_against_a_hand_computation():
    """Eq. 3-4 and 7 written out with explicit loops over samples, tokens and classes."""
    C, B, N = 3, 2, 4
    torch.manual_seed(0)
    cls, aux = torch.randn(B, C), torch.randn(B, N, C)
    y = torch.tensor([0, 2])
    dense = torch.softmax(torch.randn(B, N, C), -1)
    share = torch.tensor([[[0.0, 1.0], [0.0, 0.0]], [[0.0, 1.0], [0.0, 0.0]]])
    mix = Mix(
        partner=torch.tensor([1, 0]),
        lam=torch.tensor([0.75, 0.75]),
        token_share=share,
        img_size=(32, 32),
        patch_size=(16, 16),
        kind='token_box',
    )
    eps, beta = 0.1, 0.5
    # hand: smoothed one-hot, mixed by the own share 3/4 (Eq. 7)
    onehot = [[(1 - eps + eps / C) if c == y[b] else eps / C for c in range(C)] for b in range(B)]
    loss_cls = 0.0
    for b in range(B):
        p = [0.75 * onehot[b][c] + 0.25 * onehot[1 - b][c] for c in range(C)]
        lse = math.log(sum(math.exp(float(cls[b, c])) for c in range(C)))
        loss_cls += -sum(p[c] * (float(cls[b, c]) - lse) for c in range(C))
    loss_tok = 0.0
    for b in range(B):
        for n in range(N):
            lse = math.log(sum(math.exp(float(aux[b, n, c])) for c in range(C)))
            t = [(1 - eps) * float(dense[b, n, c]) + eps / C for c in range(C)]
            loss_tok += -sum(t[c] * (float(aux[b, n, c]) - lse) for c in range(C))
    hand = loss_cls / B + beta * loss_tok / (B * N)

    y_cls = TokenLabelingLoss(C, dense_weight=0.0, cls_target='gt', smoothing=eps).targets(
        TokenLabelingOutput(cls, None, mix, (2, 2)), y
    )[0]
    got = token_labeling_loss(cls, y_cls, aux, dense * (1 - eps) + eps / C, beta)
    assert abs(float(got) - hand) < 1e-5


def maps_target(labels, C, B, k=2, h=4, w=4, seed=0, crops=None, flips=None):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(C), size=(B, h, w))
    order = np.argsort(-p, -1)[..., :k]
    val = torch.from_numpy(np.take_along_axis(p, order, -1).astype(np.float16)).permute(0, 3, 1, 2).contiguous()
    idx = torch.from_numpy(order).permute(0, 3, 1, 2).contiguous()
    crops = torch.tensor([[0.0, 0.0, 1.0, 1.0]] * B) if crops is None else crops
    flips = torch.zeros(B, dtype=torch.bool) if flips is None else flips
    return TokenLabelTarget.of(labels, CropMaps(val, idx, C, crops, flips))


def test_loss_module_uses_the_maps_targets_and_the_class_target_choice():
    C, B = 5, 4
    m = tiny_vit(num_classes=C)
    w = TokenLabeling(m, generator=torch.Generator().manual_seed(0))
    x, y = torch.randn(B, 3, 64, 64), torch.tensor([0, 1, 2, 3])
    tgt = maps_target(y, C, B)
    out = w(x)
    for kind in ('gt', 'annotator', 'mix'):
        lossf = TokenLabelingLoss(C, dense_weight=0.5, cls_target=kind, smoothing=0.1)
        y_cls, sparse = lossf.targets(out, tgt)
        dense = sparse.dense()
        torch.testing.assert_close(y_cls.sum(1), torch.ones(B))
        torch.testing.assert_close(dense.sum(-1), torch.ones(B, 16))
        assert dense.shape == (B, 16, C)
        loss = lossf(out, tgt)
        assert torch.isfinite(loss)
    loss.backward()
    assert m.aux_head.weight.grad is not None and m.patch_embed.proj.weight.grad is not None
    # the annotator's label is the mean of its map over the crop (here the whole image), mixed by Eq. 7
    lossf = TokenLabelingLoss(C, dense_weight=0.5, cls_target='annotator', smoothing=0.0)
    y_cls, _ = lossf.targets(out, tgt)
    pooled = dense_maps(tgt.maps.values, tgt.maps.indices, C).mean((2, 3))
    lam = out.mix.lam.view(-1, 1)
    torch.testing.assert_close(y_cls, lam * pooled + (1 - lam) * pooled[out.mix.partner], atol=1e-5, rtol=0)
    # cls_target_pool='logits': the softmax of the mean logit map (the public code), mixed the same way
    lossf = TokenLabelingLoss(C, dense_weight=0.5, cls_target='annotator', smoothing=0.0, cls_target_pool='logits')
    y_cls, _ = lossf.targets(out, tgt)
    pooled = crop_logit_targets(tgt.maps)
    torch.testing.assert_close(y_cls, lam * pooled + (1 - lam) * pooled[out.mix.partner], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match='cls_target_pool: expected one of'):
        TokenLabelingLoss(C, cls_target_pool='probabilities')


def test_plain_labels_need_no_maps_only_without_dense_term():
    C = 5
    m = tiny_vit(num_classes=C)
    w = TokenLabeling(m, aux=False, generator=torch.Generator().manual_seed(0))
    out = w(torch.randn(2, 3, 64, 64))
    assert out.aux is None
    TokenLabelingLoss(C, dense_weight=0.0)(out, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match='label maps'):
        TokenLabelingLoss(C, dense_weight=0.5)(out, torch.tensor([1, 2]))


def test_mix_prob_zero_gives_the_plain_training_loss():
    """Method on, mixing probability 0, no dense term, ground-truth class target: plain smoothed CE."""
    C = 5
    m = tiny_vit(num_classes=C, drop_path_rate=0.0)
    w = TokenLabeling(m, prob=0.0, aux=True)
    x, y = torch.randn(4, 3, 64, 64), torch.tensor([0, 1, 2, 3])
    out = w(x)
    assert out.mix is None
    loss = TokenLabelingLoss(C, dense_weight=0.0, smoothing=0.1)(out, y)
    m.train()
    ref = F.cross_entropy(m(x), y, label_smoothing=0.1)
    torch.testing.assert_close(loss, ref)


def test_eval_rule_cls_plus_half_max_aux_or_cls_only():
    m = tiny_vit()
    x = torch.randn(2, 3, 64, 64)
    w = TokenLabeling(m).eval()
    with torch.no_grad():
        f = m.forward_features(x)
        cls = m.head(f[:, 0])
        aux = m.aux_head(f[:, 1:])
        torch.testing.assert_close(w(x), cls + 0.5 * aux.max(1).values)
        w.head_rule = 'cls'
        torch.testing.assert_close(w(x), cls)
        m.eval()
        torch.testing.assert_close(w(x), m(x))  # the plain class head is the unwrapped model


def test_bad_arguments_name_themselves():
    m = timm.create_model('vit_tiny_patch16_224', img_size=64, num_classes=5, depth=1)
    with pytest.raises(ValueError, match='aux_head'):
        TokenLabeling(m)
    attach_aux_head(m)
    with pytest.raises(ValueError, match='head_rule'):
        TokenLabeling(m, head_rule='max')
    with pytest.raises(ValueError, match='mode'):
        TokenLabeling(m, mode='elem')
    with pytest.raises(ValueError, match='cls_target'):
        TokenLabelingLoss(5, cls_target='teacher')
    with pytest.raises(ValueError, match='patch_embed'):
        TokenLabeling(torch.nn.Linear(3, 3))


@pytest.mark.parametrize('smoothing', [0.0, 0.1])
def test_sparse_soft_cross_entropy_equals_the_dense_one_with_gradients(smoothing):
    """The loss on SparseTokenTargets (no (B, N, C) target, no log_softmax tensor) equals the dense soft CE,
    value and gradient, also for bf16 logits."""
    from shared_core.label_maps import token_targets_sparse
    from shared_core.token_labeling import soft_cross_entropy

    C, B = 7, 3
    tgt = maps_target(
        torch.tensor([0, 1, 2]),
        C,
        B,
        k=3,
        crops=torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.2, 0.1, 0.7, 0.9], [0.5, 0.0, 1.0, 0.5]]),
        flips=torch.tensor([False, True, True]),
    )
    sparse = token_targets_sparse(tgt.maps, (3, 4), smoothing)
    dense = sparse.dense()
    torch.testing.assert_close(dense.sum(-1), torch.ones(B, 12))
    for dtype in (torch.float32, torch.bfloat16):
        z1 = torch.randn(B, 12, C).to(dtype).requires_grad_()
        z2 = z1.detach().clone().requires_grad_()
        a, b = soft_cross_entropy(z1, sparse), soft_cross_entropy(z2, dense)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        a.backward(), b.backward()
        torch.testing.assert_close(
            z1.grad.float(), z2.grad.float(), atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-3
        )
    with pytest.raises(ValueError, match='logits'):
        soft_cross_entropy(torch.randn(B, 11, C), sparse)


def test_sparse_soft_cross_entropy_gradcheck_and_constant_targets():
    """The sparse loss's written-out backward against finite differences (float64), with repeated classes in a
    token's support (its scatter adds them up); targets that require grad are refused, not silently cut off."""
    from shared_core.label_maps import SparseTokenTargets
    from shared_core.token_labeling import soft_cross_entropy

    torch.manual_seed(0)
    B, N, C, M = 2, 5, 6, 4
    weight = torch.rand(B, N, M, dtype=torch.float64)
    base = torch.rand(B, N, dtype=torch.float64) / C
    cls = torch.randint(0, C, (B, N, M))
    cls[0, 0] = 2  # one class taken four times
    target = SparseTokenTargets(base, cls, weight, C)
    z = torch.randn(B, N, C, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x: soft_cross_entropy(x, target), (z,))
    dense = target.dense()
    torch.testing.assert_close(soft_cross_entropy(z, target), -(dense * F.log_softmax(z, -1)).sum(-1).mean())
    with pytest.raises(ValueError, match='target.*require grad'):
        soft_cross_entropy(z, SparseTokenTargets(base.requires_grad_(), cls, weight, C))


def test_token_labeling_step_adds_at_most_125_aten_ops():
    """The launch-overhead proxy for token labeling + MixToken: every aten op a training step dispatches
    (MixToken's box, forward, class and sparse token targets, loss, backward; views included) beyond the plain
    cross-entropy step of the same aux-head model, in the steady state (after one step: the targets' constants are
    made once). Measured 120 (torch 2.14.1; 177 before the written-out loss and token-swap backwards, the targets'
    RoIs in one addmm and their resampling by two bmm); 14 of them are the crops' value checks, which run on the
    CPU only."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    C = 10
    m = tiny_vit(num_classes=C).train()
    x, y = torch.randn(4, 3, 64, 64), torch.tensor([1, 2, 3, 4])
    target = maps_target(y, C, 4, k=3, crops=torch.tensor([[0.1, 0.0, 0.9, 1.0]]).repeat(4, 1))
    loss_fn = TokenLabelingLoss(C)
    wrapper = TokenLabeling(m, generator=torch.Generator().manual_seed(0))

    def ops(step) -> int:
        step().backward()  # the steady state
        m.zero_grad(set_to_none=True)
        Count.n = 0
        with Count():
            step().backward()
        m.zero_grad(set_to_none=True)
        return Count.n

    plain = ops(lambda: F.cross_entropy(m(x), y, label_smoothing=0.1))
    added = ops(lambda: loss_fn(wrapper(x), target)) - plain
    assert wrapper.sampler.mix_prob == 1.0
    assert 0 < added <= 125, added


# ---------------------------------------------------------------- MLP-Mixer family (Token Labeling Table 5)


def tiny_mixer(num_blocks=2, num_classes=5, **kw):
    from timm.models.mlp_mixer import MlpMixer

    torch.manual_seed(0)
    m = MlpMixer(num_classes=num_classes, img_size=64, patch_size=16, num_blocks=num_blocks, embed_dim=32, **kw)
    return attach_aux_head(m)


def test_mixer_mixtoken_after_the_stem_and_unmixed_outputs():
    """MLP-Mixer: MixToken mixes the stem's tokens (no prefix token); without blocks no token sees another, so
    the un-mixed aux logits are each sample's own, position by position."""
    m = tiny_mixer(num_blocks=0)
    w = TokenLabeling(m, generator=torch.Generator().manual_seed(3))
    assert w.num_prefix_tokens == 0 and not any(n.startswith('embed') for n in w.state_dict())
    x = torch.randn(6, 3, 64, 64)
    out = w(x)
    assert out.mix is not None and 0 < out.mix.token_share.sum() < out.mix.token_share.numel()
    with torch.no_grad():
        plain = m.aux_head(m.forward_features(x))
    assert out.aux.shape == (6, 16, 5)
    torch.testing.assert_close(out.aux, plain, atol=1e-6, rtol=0)
    # the class logits are those of the mixed tokens: the mean over tokens after the swap, then the head
    s = out.mix.token_share_flat().bool()[..., None]
    with torch.no_grad():
        tokens = m.stem(x)
        mixed = m.norm(torch.where(s, tokens[out.mix.partner], tokens))
        torch.testing.assert_close(out.cls, m.head(mixed.mean(1)), atol=1e-5, rtol=0)


def test_mixer_eval_rule_and_loss():
    C = 5
    m = tiny_mixer(num_classes=C)
    x, y = torch.randn(2, 3, 64, 64), torch.tensor([1, 3])
    w = TokenLabeling(m).eval()
    with torch.no_grad():
        f = m.forward_features(x)
        cls, aux = m.head(f.mean(1)), m.aux_head(f)
        torch.testing.assert_close(w(x), cls + 0.5 * aux.max(1).values)
    # mixing off, no dense term: the plain smoothed CE of the mixer
    w = TokenLabeling(m, prob=0.0).train()
    loss = TokenLabelingLoss(C, dense_weight=0.0, smoothing=0.1)(w(x), y)
    torch.testing.assert_close(loss, F.cross_entropy(m.train()(x), y, label_smoothing=0.1))


# ---------------------------------------------------------------- CNNs (Token Labeling Table 5: ResNeSt-50)


def tiny_cnn(name, num_classes=5):
    """A small randomly initialised timm CNN: a one-block-per-stage ResNet, or ConvNeXt-atto."""
    torch.manual_seed(0)
    if name == 'resnet':
        from timm.models.resnet import BasicBlock, ResNet

        m = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=num_classes)
    else:
        m = timm.create_model('convnext_atto', num_classes=num_classes)
    return attach_aux_head(m.train())


def loop_mixed_images(x, mix, stride):
    """The reference MixToken on images: for each sample and each stride x stride cell of the final grid, copy
    the partner's pixels where the cell's partner share is 1."""
    out = x.clone()
    gh, gw = mix.grid_size
    for b in range(x.shape[0]):
        for i in range(gh):
            for j in range(gw):
                if mix.token_share[b, i, j] == 1:
                    p = int(mix.partner[b])
                    out[b, :, i * stride : (i + 1) * stride, j * stride : (j + 1) * stride] = x[
                        p, :, i * stride : (i + 1) * stride, j * stride : (j + 1) * stride
                    ]
                else:
                    assert mix.token_share[b, i, j] == 0
    return out


@pytest.mark.parametrize('name', ['resnet', 'convnext'])
@pytest.mark.parametrize('mode', ['batch', 'pair'])
def test_cnn_mixtoken_in_image_space_and_unmixed_aux_logits_against_loops(name, mode):
    """CNNs: MixToken pastes the partner's pixels in a box of whole final-stride (32 px) cells; the aux head is a
    1x1 conv on the final map (ConvNeXt: after the head's per-position norm); un-mixing takes, at each box cell,
    the partner's row. Reference: explicit loops over samples and cells, a per-position matrix product."""
    m = tiny_cnn(name)
    w = TokenLabeling(m, mode=mode, generator=torch.Generator().manual_seed(4))
    assert w.label_stride == (32, 32) and w.num_prefix_tokens == 0
    x = torch.randn(6, 3, 96, 128)
    out = w(x)
    mix = out.mix
    assert out.grid == (3, 4) and mix.grid_size == (3, 4) and out.aux.shape == (6, 12, 5)
    assert 0 < mix.token_share.sum() < mix.token_share.numel()
    xm = loop_mixed_images(x, mix, 32)
    with torch.no_grad():
        feats = m.forward_features(xm)
        torch.testing.assert_close(out.cls, m.forward_head(feats), atol=1e-5, rtol=0)
        if name == 'convnext':
            feats = m.head.norm(feats)
        W, bias = m.aux_head.weight, m.aux_head.bias
        ref = torch.zeros(6, 12, 5)
        for b in range(6):
            for i in range(3):
                for j in range(4):
                    src = int(mix.partner[b]) if mix.token_share[b, i, j] == 1 else b
                    ref[b, i * 4 + j] = W @ feats[src, :, i, j] + bias
    torch.testing.assert_close(out.aux, ref, atol=1e-5, rtol=0)


def test_convnext_image_space_mixtoken_is_mixtoken_after_its_patchify_stem():
    """ConvNeXt's stem is a patchify conv (kernel = stride = 4): pasting whole 32-px cells in the image is exactly
    swapping the stem's tokens inside the box (MixToken after patch embedding, as for ViTs)."""
    m = tiny_cnn('convnext')
    mix = TokenLabeling(m, generator=torch.Generator().manual_seed(1)).sampler.sample(
        4, (64, 96), generator=torch.Generator().manual_seed(1)
    )
    x = torch.randn(4, 3, 64, 96)
    with torch.no_grad():
        t = m.stem(x)
        s = mix.token_share.repeat_interleave(8, 1).repeat_interleave(8, 2)[:, None].bool()
        torch.testing.assert_close(m.stem(loop_mixed_images(x, mix, 32)), torch.where(s, t[mix.partner], t))


@pytest.mark.parametrize('name', ['resnet', 'convnext'])
def test_cnn_eval_rule_loss_and_gradients(name):
    """Eval: ``cls + 0.5 · max over positions of a 1x1 conv`` of the final map; training: Eq. 3-4 with targets on
    the final grid, gradients reach the aux head and the stem."""
    C, B = 5, 4
    m = tiny_cnn(name, C)
    w = TokenLabeling(m).eval()
    x, y = torch.randn(B, 3, 64, 64), torch.tensor([0, 1, 2, 3])
    with torch.no_grad():
        f = m.eval().forward_features(x)
        g = m.head.norm(f) if name == 'convnext' else f
        aux = F.conv2d(g, m.aux_head.weight[:, :, None, None], m.aux_head.bias)  # (B, C, 2, 2)
        torch.testing.assert_close(w(x), m.forward_head(f) + 0.5 * aux.flatten(2).max(-1).values, atol=1e-5, rtol=0)
    w = TokenLabeling(m, generator=torch.Generator().manual_seed(0)).train()
    out = w(x)
    tgt = maps_target(y, C, B)
    lossf = TokenLabelingLoss(C, dense_weight=0.5, smoothing=0.1)
    _, sparse = lossf.targets(out, tgt)
    assert sparse.dense().shape == (B, 4, C)
    lossf(out, tgt).backward()
    stem = m.conv1 if name == 'resnet' else m.stem[0]
    assert m.aux_head.weight.grad.abs().sum() > 0 and stem.weight.grad.abs().sum() > 0


def test_cnn_refusals_name_what_is_supported():
    m = tiny_cnn('resnet')
    with pytest.raises(ValueError, match='112x112 is not divisible by patch_size 32x32'):
        TokenLabeling(m)(torch.randn(2, 3, 112, 112))
    eff = timm.create_model('efficientnet_b0', num_classes=5)
    with pytest.raises(ValueError, match='ResNet, ConvNeXt'):
        TokenLabeling(attach_aux_head(eff))


def test_targets_constants_are_made_once_per_device_and_never_kept_fake():
    """The targets' RoIAlign constants are made once per device (later steps reuse them), and a fake tensor made
    under a ``FakeTensorMode`` (what compilers trace with) is not kept for the real steps after it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import shared_core.label_maps as lm

    C = 5
    target = maps_target(torch.tensor([0, 1]), C, 2, k=2, crops=torch.tensor([[0.1, 0.2, 0.8, 0.9]] * 2))

    def targets():
        return lm.token_targets_sparse(target.maps, (3, 3), 0.1)

    lm._CONSTANTS.clear()
    with FakeTensorMode():
        offset, matrix = lm._span_rois('cpu', (4, 4), ((0, 2), (1, 3)))
    assert type(matrix) is not torch.Tensor and not lm._CONSTANTS
    first = targets()
    kept = dict(lm._CONSTANTS)
    assert kept and all(type(v) is torch.Tensor for c in kept.values() for v in (c if isinstance(c, tuple) else (c,)))
    again = targets()
    assert all(lm._CONSTANTS[k] is v for k, v in kept.items())
    torch.testing.assert_close(again.dense(), first.dense(), atol=0, rtol=0)
