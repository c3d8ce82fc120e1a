"""TL-Align on timm's ``ConVit``: the gated positional self-attention and the plain attention written out from each
block's weights, applied by a loop over heads; the class token joining after the local blocks with the patches'
mean label; TransMix's class attention."""

import pytest
import timm
import torch

from timm_plugin import create_mixer
from timm_plugin.tl_align import ConViTTracer, TLAlign, TransMix, timm_tracer

from .test_tl_align import C, random_token_labels, sharpen


def tiny(**kw):
    torch.manual_seed(0)
    args = dict(img_size=64, depth=4, local_up_to_layer=2, embed_dim=48, num_heads=4, num_classes=C) | kw
    model = sharpen(timm.create_model('convit_tiny', **args))
    with torch.no_grad():  # gates away from 0 and of both signs, so content and position both count
        for blk in model.blocks[: model.local_up_to_layer]:
            blk.attn.gating_param.copy_(torch.tensor([-2.0, -0.5, 0.5, 2.0]))
    return model


def attention(attn, x):
    """A block's attention ``(B, H, N, N)`` from its weights: GPSA's gated mix of the content and positional
    softmaxes, renormalised, or MHSA's softmax."""
    B, N, D = x.shape
    h = attn.num_heads
    if hasattr(attn, 'gating_param'):  # GPSA
        q, k = attn.qk(x).reshape(B, N, 2, h, D // h).permute(2, 0, 3, 1, 4)
        content = ((q @ k.transpose(-2, -1)) * attn.scale).softmax(-1)
        position = attn.pos_proj(attn.get_rel_indices(N)).permute(0, 3, 1, 2).softmax(-1)
        gate = torch.sigmoid(attn.gating_param).view(1, h, 1, 1)
        A = (1 - gate) * content + gate * position
        return A / A.sum(-1, keepdim=True)
    q, k, _ = attn.qkv(x).reshape(B, N, 3, h, D // h).permute(2, 0, 3, 1, 4)
    return ((q @ k.transpose(-2, -1)) * attn.scale).softmax(-1)


def reference(model, x, Y_tok):
    """The forward written out, and the labels by Eq. 9 (a loop over heads) and Eq. 11; the class token's label,
    when it joins, the mean of the patches'."""
    t = model.patch_embed(x) + model.pos_embed
    Y = Y_tok.clone()
    last = None
    for u, blk in enumerate(model.blocks):
        if u == model.local_up_to_layer:
            t = torch.cat([model.cls_token.expand(t.shape[0], -1, -1), t], 1)
            Y = torch.cat([Y.mean(1, keepdim=True), Y], 1)
        A = attention(blk.attn, blk.norm1(t))
        t = t + blk.attn(blk.norm1(t))  # (the token path: the module's own attention output)
        t = t + blk.mlp(blk.norm2(t))
        mixed = sum(A[:, head] @ Y for head in range(A.shape[1])) / A.shape[1]
        Y = (Y + mixed) / 2
        last = A
    out = model.forward_head(model.norm(t))
    return out, (Y[:, 0] if model.global_pool == 'token' else Y[:, 1:].mean(1)), last


@pytest.mark.parametrize('pool', ['token', 'avg'])
def test_the_tracer_is_the_explicit_reference(pool):
    model = tiny(global_pool=pool).eval()
    assert type(timm_tracer(model)) is ConViTTracer
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 64, 64, generator=g)
    Y = random_token_labels(2, 16, g)
    with torch.no_grad():
        ref_out, ref_label, _ = reference(model, x, Y)
    out, label = TLAlign(model).trace(x, Y)
    assert torch.equal(out, model(x)) and torch.allclose(out, ref_out, atol=1e-5)
    assert torch.allclose(label, ref_label, atol=1e-6) and (label - Y.mean(1)).abs().max() > 1e-3


def test_transmix_reads_the_class_attention_of_the_last_block():
    """TransMix's share: the class token's head-mean attention over the patches in the last block, renormalised,
    times each patch's partner share."""
    model = tiny().train()
    mixer = create_mixer(
        'cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=16, carry_mix=True, label_smoothing=0.0
    )
    y = torch.tensor([0, 1])
    xm, target = mixer(torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2)), y)
    model.eval()  # (no dropout either way; eval for the reference's forward)
    with torch.no_grad():
        _, _, A = reference(model, xm, torch.full((2, 16, C), 1 / C))
    a = A.mean(1)[:, 0, 1:]
    share = (a * target.mix.token_share_flat()).sum(1) / a.sum(1)
    _, aligned = TransMix(model.train())(xm, target)
    eye = torch.eye(C)
    expected = (1 - share)[:, None] * eye[y] + share[:, None] * eye[y[target.mix.partner]]
    assert torch.allclose(aligned, expected, atol=1e-6)


def test_convit_refusals():
    with pytest.raises(ValueError, match='ConVit blocks'):
        model = tiny()
        model.blocks[0] = timm.models.vision_transformer.Block(48, 4)
        TLAlign(model)
