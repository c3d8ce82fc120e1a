"""TL-Align on timm's ``EfficientFormer`` (v1): the pooling blocks, the strided downsampling convs and the last
stage's attention with its learnt biases, against a reference in image cells by loops (the attention recomputed from
each block's weights)."""

import torch
from timm.models.efficientformer import EfficientFormer, MetaBlock1d, MetaBlock2d

from timm_plugin.tl_align import EfficientFormerTracer, TLAlign, timm_tracer

from .test_tl_align import C, random_token_labels, sharpen
from .test_tl_align_beyond_vit import _stencil_mix
from .tl_align_checks import mean_abs_stencil


def tiny():
    """224 px (its attention biases are for a 7x7 last grid), narrow stages, one attention block at the end."""
    torch.manual_seed(0)
    model = EfficientFormer(depths=(1, 1, 1, 2), embed_dims=(8, 8, 16, 16), num_vit=1, num_classes=C)
    sharpen(model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # downsampling kernels of strongly non-uniform magnitude per position
        for stage in model.stages[1:]:
            stage.downsample.conv.weight.mul_(torch.rand(3, 3, generator=g) ** 3 * 4)
    return model


def attention_weights(attn, x):
    """``softmax(q kᵀ · scale + biases)`` ``(B, H, N, N)`` from the block's weights."""
    B, N, _ = x.shape
    q, k, _ = (
        attn.qkv(x)
        .reshape(B, N, attn.num_heads, -1)
        .permute(0, 2, 1, 3)
        .split([attn.key_dim, attn.key_dim, attn.val_dim], dim=3)
    )
    biases = attn.attention_biases[:, attn.attention_bias_idxs]
    return ((q @ k.transpose(-2, -1)) * attn.scale + biases).softmax(-1)


def reference(model, x, Y_tok):
    """The labels on the image cells: the downsampling conv's ``mean |K|`` stencil at stride 2, the 3x3 average
    pool (in-grid cells), the attention by a loop over heads, each averaged with its shortcut (Eq. 11); the mean."""
    feats = {}
    hooks = [
        b.token_mixer.register_forward_pre_hook(lambda m, a, b=b: feats.__setitem__(b, a[0]))
        for s in model.stages
        for b in s.blocks
        if isinstance(b, MetaBlock1d)
    ]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    B = x.shape[0]
    Y = Y_tok.view(B, 56, 56, -1)
    for stage in model.stages:
        if not isinstance(stage.downsample, torch.nn.Identity):
            Y = _stencil_mix(Y, mean_abs_stencil(stage.downsample.conv.weight).float(), 1, 2)
        for b in stage.blocks:
            if isinstance(b, MetaBlock2d):
                Y = (Y + _stencil_mix(Y, torch.ones(3, 3), 1)) / 2
            elif isinstance(b, MetaBlock1d):
                A = attention_weights(b.token_mixer, feats[b]).detach()
                rows = Y.flatten(1, 2)
                mixed = sum(A[:, h] @ rows for h in range(A.shape[1])) / A.shape[1]
                Y = ((rows + mixed) / 2).view_as(Y)
    return Y.flatten(1, 2).mean(1)


def test_the_tracer_is_the_reference_in_image_cells():
    model = tiny().eval()
    assert type(timm_tracer(model)) is EfficientFormerTracer
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, 224, 224, generator=g)
    Y = random_token_labels(1, 56 * 56, g)
    out, label = TLAlign(model).trace(x, Y)
    ref = reference(model, x, Y)
    assert torch.equal(out, model(x)) and torch.allclose(label, ref, atol=1e-6)
    assert (label - Y.mean(1)).abs().max() > 1e-3
