"""TL-Align on timm's ``VisionTransformerSAM``: windowed and global attention with the decomposed relative position
bias (or RoPE), and the conv neck, against a reference in image cells: every attention call recorded from a plain
forward and applied in float64 by loops over each token's window, the neck's 3x3 conv as its stencil by loops."""

import pytest
import timm
import torch

from timm_plugin.tl_align import SamViTTracer, TLAlign, timm_tracer

from .test_tl_align import C, random_token_labels, sharpen
from .test_tl_align_beyond_vit import _stencil_mix
from .test_tl_align_sdpa import RecordAttention
from .tl_align_checks import mean_abs_stencil, window_mix


def sam_reference(model, x, Y_tok, grid):
    """The token path's output and the label of its mean token: per block, the head-mean attention of its
    recorded call (heads folded into the batch, windows in row-major order) applied to the labels of each token's
    window, averaged with the shortcut (Eq. 11); then the neck's k x k convs as ``mean |K|`` stencils."""
    with RecordAttention() as rec, torch.no_grad():
        out = model(x)
    B, (H, W) = x.shape[0], grid
    Y = Y_tok.double().view(B, H, W, -1)
    assert len(rec.calls) == len(model.blocks)
    for blk, (q, k, mask, scale) in zip(model.blocks, rec.calls):
        heads, N = blk.attn.num_heads, q.shape[1]
        logits = (q.double() @ k.double().transpose(-1, -2)) * scale
        if mask is not None:
            logits = logits + mask.double()
        A = logits.softmax(-1).view(-1, heads, N, N).mean(1)  # (B · windows, N, N)
        Y = (Y + window_mix(Y, A, blk.window_size or H)) / 2  # a global block: one window, the (square) grid
    for part in model.neck if isinstance(model.neck, torch.nn.Sequential) else []:
        if isinstance(part, torch.nn.Conv2d) and part.kernel_size != (1, 1):
            Y = _stencil_mix(Y, mean_abs_stencil(part.weight), part.padding[0])
    return out, Y.flatten(1, 2).mean(1)


#: name -> (timm model, kwargs): 64 px, a 4x4 patch grid, 2x2 windows in block 0 and 2, global block 1
MODELS = {
    'rel pos, neck': ('samvit_base_patch16', dict(neck_chans=16)),
    'rel pos, no neck (224 head)': ('samvit_base_patch16_224', dict()),
    'rope': ('samvit_base_patch16', dict(use_rel_pos=False, use_rope=True, use_abs_pos=False)),
}


@pytest.mark.parametrize('name', list(MODELS))
def test_the_tracer_is_the_reference_in_image_cells(name):
    arch, kw = MODELS[name]
    torch.manual_seed(0)
    model = timm.create_model(
        arch, img_size=64, depth=3, embed_dim=32, num_heads=2, window_size=2, global_attn_indexes=(1,),
        num_classes=C, **kw,
    )  # fmt: skip
    model = sharpen(model).eval()
    assert type(timm_tracer(model)) is SamViTTracer and [b.window_size for b in model.blocks] == [2, 0, 2]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 64, 64, generator=g)
    Y = random_token_labels(2, 16, g)
    ref_out, ref_label = sam_reference(model, x, Y, (4, 4))
    for fused in (True, False):  # measured max |d| 1.5e-8 to 6e-8
        out, label = TLAlign(model, fused=fused).trace(x, Y)
        assert (label.double() - ref_label).abs().max() < 1e-6
        assert torch.equal(out, model(x)) and torch.allclose(out, ref_out, atol=1e-5)  # the token path's own
    assert (ref_label - Y.double().mean(1)).abs().max() > 1e-3  # the labels moved


def test_sam_refusals():
    torch.manual_seed(0)
    kw = dict(img_size=64, depth=1, embed_dim=32, num_heads=2, num_classes=C)
    with pytest.raises(ValueError, match="VisionTransformerSAM with global_pool='max'"):
        TLAlign(timm.create_model('samvit_base_patch16', global_pool='max', **kw))
    model = timm.create_model('samvit_base_patch16', window_size=3, **kw).eval()  # 4x4 grid in 3x3 windows: padded
    with pytest.raises(ValueError, match='4x4 token grid is padded to 3x3 windows'):
        TLAlign(model).trace(torch.randn(1, 3, 64, 64), torch.full((1, 16, C), 1 / C))
