"""TL-Align on timm's Swin V2, both variants (``SwinTransformerV2``, ``SwinTransformerV2Cr``): the labels against
Swin's index-arithmetic reference with the scaled cosine attention and the continuous position bias written out
from each block's own weights; stochastic depth; the refusals."""

import math

import pytest
import torch
import torch.nn.functional as F
from timm.models.swin_transformer_v2 import SwinTransformerV2
from timm.models.swin_transformer_v2_cr import SwinTransformerV2Cr

from timm_plugin import create_mixer
from timm_plugin.tl_align import SwinV2Tracer, TLAlign, timm_tracer

from .test_tl_align import C, random_token_labels, sharpen, swin_reference_labels
from .tl_align_checks import check_compact_equals_dense


def tiny(variant, **kw):
    torch.manual_seed(0)
    args = dict(patch_size=2, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 2), num_classes=C)
    args.update(kw)
    if variant == 'v2':
        return sharpen(SwinTransformerV2(img_size=32, **args))
    return sharpen(SwinTransformerV2Cr(img_size=(32, 32), **args))


def cosine_logits(q, k, logit_scale, heads):
    """``cos(q, k) · τ_h``, ``τ_h = exp(min(logit_scale_h, ln 100))``, by explicit norms."""
    cos = (q / q.norm(dim=-1, keepdim=True)) @ (k / k.norm(dim=-1, keepdim=True)).transpose(-2, -1)
    return cos * logit_scale.reshape(1, heads, 1, 1).clamp(max=math.log(100.0)).exp()


def v2_logits(attn, xw):
    """``SwinTransformerV2``'s window attention written out: q and v biases (k none), the cosine, and the
    continuous position bias ``16 σ(CPB-MLP(log coords))`` looked up by the relative position index."""
    Bw, N, _ = xw.shape
    h = attn.num_heads
    bias = None if attn.q_bias is None else torch.cat((attn.q_bias, attn.k_bias, attn.v_bias))
    q, k, _ = F.linear(xw, attn.qkv.weight, bias).reshape(Bw, N, 3, h, -1).permute(2, 0, 3, 1, 4)
    table = attn.cpb_mlp(attn.relative_coords_table).view(-1, h)
    rel = table[attn.relative_position_index.view(-1)].view(N, N, h).permute(2, 0, 1)
    return cosine_logits(q, k, attn.logit_scale, h) + 16 * torch.sigmoid(rel)[None]


def cr_logits(attn, xw):
    """``SwinTransformerV2Cr``'s window attention written out: the cosine and the meta-MLP position bias of the
    log-spaced relative coordinates."""
    Bw, N, _ = xw.shape
    h = attn.num_heads
    q, k, _ = attn.qkv(xw).view(Bw, N, 3, h, -1).permute(2, 0, 3, 1, 4)
    rel = attn.meta_mlp(attn.relative_coordinates_log).transpose(1, 0).reshape(h, N, N)
    return cosine_logits(q, k, attn.logit_scale, h) + rel[None]


VARIANTS = {'v2': (v2_logits, lambda m: m.layers), 'cr': (cr_logits, lambda m: m.stages)}


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_swin_v2_labels_match_the_index_reference(variant):
    """Both variants, shifted windows and a patch merging included, exact to 1e-6; the labels moved."""
    model = tiny(variant).eval()
    logits, stages = VARIANTS[variant]
    assert any(any(b.shift_size) for s in stages(model) for b in s.blocks)  # shifted windows are exercised
    assert type(timm_tracer(model)) is SwinV2Tracer
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 32, 32, generator=g)
    Y = random_token_labels(2, 256, g)
    ref_out, ref_label = swin_reference_labels(model, x, Y, logits, stages(model))
    out, label = TLAlign(model).trace(x, Y)
    assert torch.equal(out, model(x)) and torch.allclose(out, ref_out, atol=1e-6)
    assert torch.allclose(label, ref_label, atol=1e-6)
    assert torch.allclose(label.sum(1), torch.ones(2), atol=1e-6) and (label - Y.mean(1)).abs().max() > 1e-3
    if variant == 'cr':  # the recomputed attention, fused on the CPU too
        assert torch.allclose(TLAlign(model, fused=True).trace(x, Y)[1], ref_label, atol=1e-6)


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_swin_v2_training_call_is_the_dense_trace_with_stochastic_depth(variant):
    """A CutMix batch in training, stochastic depth on: the aligned targets are the dense trace of the mix's
    token labels, with the same drops."""
    model = tiny(variant, drop_path_rate=0.3).train()
    mixer = create_mixer(
        'cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=2, mode='elem', carry_mix=True,
        generator=torch.Generator().manual_seed(1),
    )  # fmt: skip
    check_compact_equals_dense(model, mixer, torch.randn(4, 3, 32, 32), torch.arange(4) % C, C)


@pytest.mark.parametrize('variant', sorted(VARIANTS))
def test_swin_v2_refusals(variant):
    with pytest.raises(ValueError, match="Swin V2 with global_pool='max'"):
        TLAlign(tiny(variant, global_pool='max'))
    if variant == 'v2':
        model = tiny(variant, strict_img_size=False).eval()
        with pytest.raises(ValueError, match='6x6 token grid is padded'):  # 12x12 then 6x6 in 4x4 windows
            TLAlign(model).trace(torch.randn(1, 3, 24, 24), torch.full((1, 144, C), 1 / C))
