"""TL-Align on timm's MViTv2 against a reference in image cells: the labels in a dict keyed by cell (and
``'cls'``), every pooling (the q/k/v convs' stencils, the shortcut's windows) by loops over output cells and kernel
offsets, the attention probabilities recorded from the token path's softmax applied by loops over heads, queries
and keys in float64, residual pooling and Eq. 11 as written."""

import pytest
import timm
import torch
from torch.overrides import TorchFunctionMode

from timm_plugin import create_mixer
from timm_plugin.tl_align import MViTv2Tracer, TLAlign, timm_tracer

from ..timm_plugin.test_tl_align_sdpa import dense_start, sharpen

C = 5


class RecordSoftmax(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.outs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.Tensor.softmax, torch.softmax, torch.nn.functional.softmax):
            self.outs.append(out.detach())
        return out


def pool_cells(lab, H, W, pool):
    """``lab`` on an H x W grid through one pooling: a conv as its stencil mean_c |K| (rows normalised over in-grid
    cells), a max/avg pool as its window mean; returns the labels and the new grid."""
    if pool is None:
        return lab, H, W
    k, s, p = (pool.kernel_size, pool.stride, pool.padding)
    k, s, p = [(t, t) if isinstance(t, int) else tuple(t) for t in (k, s, p)]
    S = pool.weight.detach().double().abs().mean((0, 1)) if isinstance(pool, torch.nn.Conv2d) else torch.ones(k)
    Ho, Wo = (H + 2 * p[0] - k[0]) // s[0] + 1, (W + 2 * p[1] - k[1]) // s[1] + 1
    out = {}
    for i in range(Ho):
        for j in range(Wo):
            num, den = 0, 0
            for a in range(k[0]):
                for b in range(k[1]):
                    cell = (i * s[0] - p[0] + a, j * s[1] - p[1] + b)
                    if 0 <= cell[0] < H and 0 <= cell[1] < W:
                        num, den = num + S[a, b] * lab[cell], den + S[a, b]
            out[(i, j)] = num / den
    return out, Ho, Wo


def reference(model, x, Y0, grid):
    with RecordSoftmax() as rec, torch.no_grad():
        model(x)
    attns = iter(rec.outs)
    H, W = grid
    P = model.num_prefix_tokens
    lab = {(i, j): Y0[:, P + i * W + j].double() for i in range(H) for j in range(W)}
    cls = Y0[:, 0].double() if P else None
    for stage in model.stages:
        for blk in stage.blocks:
            a = blk.attn
            short, Hs, Ws = pool_cells(lab, H, W, blk.shortcut_pool_attn)
            q_lab, Hq, Wq = pool_cells(lab, H, W, a.pool_q)
            v_lab, Hv, Wv = pool_cells(lab, H, W, a.pool_v)
            keys = ([cls] if P else []) + [v_lab[(i, j)] for i in range(Hv) for j in range(Wv)]
            queries = (['cls'] if P else []) + [(i, j) for i in range(Hq) for j in range(Wq)]
            A = next(attns).double()  # (B, heads, T_q, T_kv)
            assert A.shape[-2:] == (len(queries), len(keys))
            new = {}
            for qi, qc in enumerate(queries):
                branch = sum(A[:, h, qi, ki, None] * keys[ki] for h in range(A.shape[1]) for ki in range(len(keys)))
                branch = branch / A.shape[1]
                q_label = cls if qc == 'cls' else q_lab[qc]
                branch = (branch + q_label) / 2 if a.residual_pooling else branch
                new[qc] = ((cls if qc == 'cls' else short[qc]) + branch) / 2
            cls = new.pop('cls', None)
            lab, H, W = new, Hq, Wq
    if model.global_pool == 'token':
        return cls
    return sum(lab.values()) / len(lab)


@pytest.mark.parametrize('arch', ['mvitv2_tiny', 'mvitv2_small_cls'])
def test_the_tracer_is_the_reference_in_image_cells(arch):
    torch.manual_seed(0)
    model = sharpen(timm.create_model(arch, num_classes=C, img_size=(64, 64)))
    assert isinstance(timm_tracer(model), MViTv2Tracer)
    g = torch.Generator().manual_seed(6)
    mixer = create_mixer(
        'cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=4, mode='elem', generator=g,
        carry_mix=True, label_smoothing=0.0,
    )  # fmt: skip
    x, y = torch.randn(2, 3, 64, 64, generator=g), torch.randint(0, C, (2,), generator=g)
    xm, target = mixer(x, y)
    Y0 = dense_start(target.mix, y, model.num_prefix_tokens)
    expected = reference(model, xm, Y0, (16, 16))
    out, aligned = TLAlign(model)(xm, target)
    assert (aligned.double() - expected).abs().max() < 1e-6  # measured 4.4e-8, 3.0e-8 (with a class token)
    assert torch.equal(out, model(xm))
    P = model.num_prefix_tokens
    flipped = torch.cat([Y0[:, :P], Y0[:, P:].flip(1)], 1)
    assert (reference(model, xm, flipped, (16, 16)) - expected).abs().max() > 1e-3  # places matter
