"""TL-Align's shared attention on timm ViTs (one attention per block for tokens and labels): the same
targets as the explicit reference, the plain model's logits and gradients, under fp32 and bf16 autocast.
(``tests/timm_plugin/test_tl_align.py``'s dense references run through the shared path too: its widths are <= 8.)"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from timm.loss import SoftTargetCrossEntropy
from timm.models.deit import VisionTransformerDistilled

from shared_core.label_attention import (
    FUSED_ENV,
    fused_label_attn,
    set_fused_label_attn,
    shared_attention,
    use_fused_label_attn,
)
from shared_core.mixing import one_hot
from timm_plugin import create_mixer
from timm_plugin.tl_align import SharedAttentionViT, TLAlign

from ..timm_plugin.test_tl_align import C, reference, tiny_vit

KINDS = {
    'cls': dict(),
    'avg-no-cls': dict(global_pool='avg', class_token=False),
    'registers': dict(reg_tokens=2),
    'qk-norm': dict(qk_norm=True),
}


def _batch(seed=0, B=6, kind='cutmix'):
    g = torch.Generator().manual_seed(seed)
    mixer = create_mixer(
        kind,
        mixup_alpha=0.0,
        cutmix_alpha=1.0,
        num_classes=C,
        patch_size=8,
        mode='elem',
        generator=g,
        carry_mix=True,
        label_smoothing=0.0,
    )
    x = torch.randn(B, 3, 32, 32, generator=g)
    y = torch.randint(0, C, (B,), generator=g)
    return mixer(x, y), y


def _reference_target(model, xm, target, y):
    """The aligned target from the explicit reference (dense one-hot labels of both sources, head loops)."""
    mix = target.mix
    P = model.num_prefix_tokens
    s = mix.token_share_flat()[..., None]
    y_own, y_partner = one_hot(y, C), one_hot(y[mix.partner], C)
    Y_tok = (1 - s) * y_own[:, None] + s * y_partner[:, None]
    cls = (1 - (1 - mix.lam)[:, None]) * y_own + (1 - mix.lam)[:, None] * y_partner
    Y0 = torch.cat([cls[:, None].expand(-1, P, -1), Y_tok], 1)
    with torch.no_grad():
        _, label = reference(model, xm, Y0)
    return label


@pytest.mark.parametrize('fused', [True, False])
@pytest.mark.parametrize('kind', list(KINDS))
def test_fp32_targets_and_logits_match_the_reference(kind, fused):
    model = tiny_vit(depth=4, **KINDS[kind]).eval()  # eval: no stochastic depth, so the reference is exact
    (xm, target), y = _batch(1)
    ref = _reference_target(model, xm, target, y)
    out, aligned = TLAlign(model, fused=fused)(xm, target)
    assert torch.allclose(aligned, ref, atol=1e-5, rtol=0)  # measured max |diff| ~1e-7
    assert torch.allclose(out, model(xm), atol=1e-5, rtol=0)


@pytest.mark.parametrize('fused', [True, False])
@pytest.mark.parametrize('kind', ['cls', 'avg-no-cls'])
def test_bf16_autocast_targets_within_2e_3_of_the_fp32_reference(kind, fused):
    model = tiny_vit(depth=4, **KINDS[kind]).eval()
    (xm, target), y = _batch(2)
    ref = _reference_target(model, xm, target, y)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out, aligned = TLAlign(model, fused=fused)(xm, target)
        plain = model(xm)
    assert aligned.dtype == torch.float32
    assert (aligned - ref).abs().max() < 2e-3
    # the logits: as the plain bf16 model's, up to another kernel's bf16 rounding
    assert torch.allclose(out.float(), plain.float(), atol=0.1, rtol=0.02)


def test_distilled_deit_and_stochastic_depth_match_the_recomputing_path():
    """Training mode with stochastic depth, layers and no residual: the shared path gives the recomputing
    path's target (itself held against the explicit reference in test_tl_align.py)."""
    for cls, kw in ((VisionTransformerDistilled, {}), (None, dict(drop_path_rate=0.5))):
        model = (tiny_vit(cls, **kw) if cls else tiny_vit(**kw)).train()
        (xm, target), _ = _batch(3)
        for opts in (dict(), dict(layers=[0, 2]), dict(residual=False), dict(drop_path='public')):
            for fused in (True, False):
                torch.manual_seed(7)
                out_a, a = TLAlign(model, fused=fused, **opts)(xm, target)
                torch.manual_seed(7)
                out_b, b = TLAlign(model, fused=fused, shared=False, **opts)(xm, target)
                assert torch.allclose(a, b, atol=1e-6), opts
                out_a = out_a[0] if isinstance(out_a, tuple) else out_a
                out_b = out_b[0] if isinstance(out_b, tuple) else out_b
                assert torch.allclose(out_a, out_b, atol=1e-5, rtol=0), opts


@pytest.mark.parametrize(
    'fused, amp, wide', [(True, False, False), (False, False, False), (True, True, False), (True, False, True)]
)
def test_gradients_of_a_step_are_the_plain_steps(fused, amp, wide, monkeypatch):
    """The label columns carry no gradient: the same loss on the same logits gives the plain step's gradients (the
    CPU's fused path runs the plain attention backward: measured max |diff| 8.7e-6 of gradients up to 8.8 in fp32,
    0 under bf16 autocast; the unfused path computes its attention in fp32, so under bf16 it is not the plain
    step's kernel and is left out there). ``wide``: the plain wide ``scaled_dot_product_attention`` call that
    accelerators and compiled graphs run (its backward at the wider head dim), here in eager on the CPU."""
    if wide:
        monkeypatch.setattr('shared_core.label_attention._CPU_FLASH', False)
    model = tiny_vit(depth=3).train()
    (xm, target), _ = _batch(4)
    soft = torch.softmax(torch.randn(xm.shape[0], C, generator=torch.Generator().manual_seed(9)), -1)

    def grads(fn):
        model.zero_grad(set_to_none=True)
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=amp):
            logits = fn()
        (-(soft * F.log_softmax(logits.float(), -1)).sum(-1).mean()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads(lambda: model(xm))
    shared = grads(lambda: TLAlign(model, fused=fused)(xm, target)[0])
    tol = dict(atol=1e-3, rtol=1e-2) if amp else dict(atol=1e-5, rtol=1e-4)
    for n in plain:
        assert torch.allclose(plain[n], shared[n], **tol), n


def test_attention_dropout_keeps_the_recomputing_path_and_overrides_are_removed():
    model = tiny_vit(attn_drop_rate=0.1).train()
    (xm, target), _ = _batch(5)
    assert not SharedAttentionViT.applies(TLAlign(model).tracer, torch.zeros(1, 17, 1), None)
    torch.manual_seed(3)
    a = TLAlign(model)(xm, target)
    torch.manual_seed(3)
    b = TLAlign(model, shared=False)(xm, target)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # a failing forward leaves no override behind
    model = tiny_vit().train()
    with pytest.raises(ValueError, match='token labels for'):
        TLAlign(model).trace(torch.randn(2, 3, 32, 32), torch.full((2, 9, C), 1 / C))
    assert all('forward' not in blk.attn.__dict__ and not blk._forward_hooks for blk in model.blocks)


def test_shared_attention_against_a_materialised_reference():
    """The function itself: token output as scaled_dot_product_attention's, branch as mean_h softmax · labels,
    with an additive mask and a boolean one, fused and not, and the hi/lo columns under bf16."""
    g = torch.Generator().manual_seed(0)
    B, H, T, d = 2, 3, 7, 16
    q, k, v = (torch.randn(B, H, T, d, generator=g) for _ in range(3))
    labels = torch.softmax(torch.randn(B, T, 3, generator=g), -1)
    bias = torch.randn(1, 1, T, T, generator=g)
    keep = torch.rand(1, 1, T, T, generator=g) > 0.3
    keep[..., 0] = True
    for mask in (None, bias, keep):
        ref_logits = q @ k.transpose(-1, -2) * 0.25
        if mask is not None:
            ref_logits = ref_logits + bias if mask.dtype != torch.bool else ref_logits.masked_fill(~keep, -1e9)
        A = ref_logits.softmax(-1)
        ref_branch = sum(A[:, h] @ labels for h in range(H)) / H
        for fused in (True, False):
            out, branch = shared_attention(q, k, v, labels, 0.25, mask, fused=fused)
            assert torch.allclose(out, A @ v, atol=1e-5) and torch.allclose(branch, ref_branch, atol=1e-6)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            out, branch = shared_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), labels, 0.25, mask, fused=True)
        # the kernel rounds the attention weights to bf16 before applying them (hi/lo keeps the labels exact):
        # one call's branch is within a few bf16 ulps of 1
        assert branch.dtype == torch.float32 and (branch - ref_branch).abs().max() < 5e-3


def test_the_one_switch_defaults_by_device_and_path_and_its_overrides():
    """``use_fused_label_attn``: the shared path fused on every device (the CPU included: bench/RESULTS.md), a
    separate label attention fused on accelerators only; a scope, the process-wide setting and the environment
    variable override both paths."""
    assert use_fused_label_attn('cpu', shared=True) and not use_fused_label_attn('cpu')
    assert use_fused_label_attn('cuda') and use_fused_label_attn('cuda', shared=True)
    with fused_label_attn(False):
        assert not use_fused_label_attn('cpu', shared=True) and not use_fused_label_attn('cuda')
    set_fused_label_attn(True)
    try:
        assert use_fused_label_attn('cpu')
        with fused_label_attn(False):  # the innermost scope first
            assert not use_fused_label_attn('cuda', shared=True)
    finally:
        set_fused_label_attn(None)
    code = 'from shared_core.label_attention import use_fused_label_attn as u; print(u("cpu", shared=True), u("cuda"))'
    for value, expected in (('0', 'False False'), ('1', 'True True')):
        env = {**os.environ, FUSED_ENV: value}
        out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected, (value, out.stdout, out.stderr)


def test_the_default_on_the_cpu_is_the_fused_shared_call():
    """``TLAlign(model)`` on the CPU runs the labels as value columns of the token path's fused call: the same
    logits and target, bit for bit, as ``fused=True``, and the plain model's logits within float rounding (the wider
    call's kernel adds in another order)."""
    model = tiny_vit(depth=3).train()
    (xm, target), _ = _batch(6)
    torch.manual_seed(1)
    out, aligned = TLAlign(model)(xm, target)
    torch.manual_seed(1)
    out_f, aligned_f = TLAlign(model, fused=True)(xm, target)
    assert torch.equal(out, out_f) and torch.equal(aligned, aligned_f)
    torch.manual_seed(1)
    assert torch.allclose(out, model(xm), atol=1e-5, rtol=0)  # measured 1.9e-6 (logits up to 5.4)


@pytest.mark.parametrize('amp', [False, True])
def test_one_more_block_adds_at_most_six_aten_ops_to_the_step(amp):
    """The launch-overhead proxy, per block: what one more block adds to a TL-Align training step (forward,
    loss, backward; every aten op PyTorch dispatches, views included) beyond what it adds to the plain step. The
    shared call's share is 6 (the concatenation with the label columns, the wide q/k/v, the split of the output,
    the token columns' copy, the head sum and the in-place Eq. 11 update); under bf16 autocast 3 more (the hi/lo
    column pairs viewed for the fp32 sum, the state's hi/lo pair rewritten after each block)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    (xm, target), _ = _batch(6)
    soft_ce = SoftTargetCrossEntropy()

    def ops(step) -> int:
        Count.n = 0
        with Count(), torch.autocast('cpu', dtype=torch.bfloat16, enabled=amp):
            loss = step()
        with Count():
            loss.backward()
        return Count.n

    added = {}
    for depth in (2, 3):
        model = tiny_vit(depth=depth).train()
        plain = ops(lambda: soft_ce(model(xm), target))
        aligned = ops(lambda w=TLAlign(model): soft_ce(*w(xm, target)))
        added[depth] = aligned - plain
    per_block = added[3] - added[2]
    assert 0 < per_block <= (9 if amp else 6), added  # measured: 6 and 9 (torch 2.14.1)
