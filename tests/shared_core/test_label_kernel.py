"""The Triton label-attention kernel (shared_core.label_kernel), run here by Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, set by conftest.py before Triton is imported; on a machine with a GPU the same tests run
the compiled kernel on CUDA tensors).

Forward output, log-sum-exp and labels against ``scaled_dot_product_attention`` and an explicit loop over heads;
gradients against SDPA's; a whole TL-Align step with the kernel forced against the explicit reference; one graph
under ``torch.compile``. The interpreter executes each tile with numpy (about 2 s for a (2, 3, 197, 64) call), so
the shapes are small: few samples and heads, but the real token counts (197, 50) and head dims (32, 64).
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from timm.loss import SoftTargetCrossEntropy

from shared_core import label_kernel
from shared_core.label_attention import (
    FUSED_ENV,
    LabelBackend,
    LabelColumns,
    LabelPath,
    _env_choice,
    fused_label_attn,
    use_label_kernel,
)
from shared_core.label_kernel import label_attention, label_only_attention
from timm_plugin import create_mixer
from timm_plugin.tl_align import TLAlign

from ..timm_plugin.test_tl_align import tiny_vit
from ..timm_plugin.test_tl_align_shared import KINDS, C, _batch, _reference_target

DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'


def checked(kind, *head_dims, dtype=torch.float32):
    """Run the kernel's self-check for these head dims now (once per process), so that a test counting the kernel's
    launches counts the training's only."""
    for head_dim in head_dims:
        assert label_kernel.self_check(kind, DEVICE, dtype, head_dim) is None


def _inputs(B, H, T, D, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # a stacked qkv, as a timm block makes it: the kernel reads views with strides
    qkv = (torch.randn(B, T, 3, H, D, generator=g) * 1.5).permute(2, 0, 3, 1, 4).to(DEVICE, dtype)
    labels = torch.softmax(torch.randn(B, T, K, generator=g) * 2, -1).to(DEVICE)
    return qkv, labels


def _reference(q, k, v, labels, scale):
    """The attention materialised in fp32 from the inputs as given, its rows' log-sum-exp, and Eq. 9's sum over
    heads as an explicit loop."""
    logits = (q.double() @ k.double().transpose(-1, -2)) * scale
    A = logits.softmax(-1)
    heads = sum(A[:, h] @ labels.double() for h in range(q.shape[1]))
    return A @ v.double(), logits.logsumexp(-1), heads


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('T, D, K', [(197, 64, 1), (197, 32, 1), (50, 64, 3), (50, 32, 1)])
def test_forward_equals_sdpa_and_the_label_rule(T, D, K, dtype):
    qkv, labels = _inputs(2, 2, T, D, K, dtype, seed=T + D + K)
    q, k, v = qkv.unbind(0)
    scale = D**-0.5
    out, lse, heads = label_attention(q, k, v, labels, scale)
    ref_out, ref_lse, ref_heads = _reference(q, k, v, labels, scale)
    sdpa = F.scaled_dot_product_attention(q, k, v, scale=scale)
    assert out.shape == sdpa.shape and out.dtype == dtype and lse.dtype == heads.dtype == torch.float32
    # the labels in fp32 from the unrounded probabilities: fp32 agreement with the exact rule in every dtype
    # (measured max |d| 6e-7), and the rows' log-sum-exp likewise (1e-6)
    assert (heads.double() - ref_heads).abs().max() < 1e-5
    assert (lse.double() - ref_lse).abs().max() < 1e-5
    if dtype == torch.float32:  # measured 3e-7
        assert (out.double() - ref_out).abs().max() < 1e-5
        assert torch.allclose(out, sdpa, atol=1e-5, rtol=0)
    else:  # P rounded to bf16 before P·V, as GPU flash kernels do (the CPU's SDPA keeps it in fp32): within
        # about one bf16 ulp of the largest output, of the exact attention and of SDPA's (measured 0.020 and 0.016
        # for outputs up to 4.0-4.8, bound 2^-7 * max = 0.031-0.038)
        bound = 2**-7 * ref_out.abs().max().item()
        assert (out.double() - ref_out).abs().max() <= bound
        assert (out.float() - sdpa.float()).abs().max() <= bound


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('T, D, keys', [(197, 64, 'plain'), (50, 32, 'plain'), (197, 64, 'growing')])
def test_gradients_are_the_backward_of_the_exact_attention_within_what_the_forward_rounds(T, D, keys, dtype):
    """The op's gradients are PyTorch's attention backward fed the kernel's output and log-sum-exp. Against the same
    backward fed the exact forward's (float64, rounded as the kernel's are stored), the gradients can differ only
    through ``δO`` and ``δlse``, the forward's own rounding (``P`` rounded to the input's dtype before ``P · V``, as
    flash kernels do): to first order ``δdS = −P ∘ ((dP − D) δlse + δD)`` with ``δD = rowsum(dO ∘ δO)``, so
    ``|δdQ| ≤ |δdS| |K| · scale``, ``|δdK| ≤ |δdS|ᵀ |Q| · scale``, ``|δdV| ≤ (P |δlse|)ᵀ |dO|``; the bound is twice
    that, plus each side's backward rounding ``P`` and ``dS`` to the dtype before its matmuls (``2 u`` of the same
    sums of magnitudes each) and its results (``u``). It holds on any input: ``'growing'`` key norms along the
    tokens (peaked rows, where a bound relative to the largest gradient held only for its seeds). fp32: equal to
    SDPA's to 1e-5."""
    qkv, labels = _inputs(2, 2, T, D, 1, dtype, seed=7)
    if keys == 'growing':
        ramp = torch.linspace(0.2, 3.0, T, device=qkv.device)[:, None]
        qkv = torch.stack([qkv[0], (qkv[1].float() * ramp).to(dtype), qkv[2]])
    qkv.requires_grad_(True)
    labels.requires_grad_(True)  # detached by the op: no gradient reaches it
    grad = torch.randn(2, 2, T, D, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    scale = D**-0.5
    out, lse, heads = label_attention(*qkv.unbind(0), labels, scale)
    assert not heads.requires_grad
    (mine,) = torch.autograd.grad(out, qkv, grad)
    assert labels.grad is None
    q, k, v = qkv.detach().unbind(0)
    qd, kd, vd, g = (t.double() for t in (q, k, v, grad))
    logits = (qd @ kd.transpose(-1, -2)) * scale
    P, exact_lse = logits.softmax(-1), logits.logsumexp(-1)
    exact_out = (P @ vd).to(dtype)  # stored as the kernel's output is
    theirs = torch.stack(
        label_kernel._label_attention_backward_op(grad, q, k, v, exact_out, exact_lse.float(), scale)
    ).double()
    d_out, d_lse = (out.double() - exact_out.double()), (lse.double() - exact_lse).abs()[..., None]
    dP_minus_D = g @ vd.transpose(-1, -2) - (g * exact_out.double()).sum(-1, keepdim=True)
    d_dS = P * (dP_minus_D.abs() * d_lse + (g * d_out).sum(-1, keepdim=True).abs())
    moved = torch.stack([(d_dS @ kd.abs()) * scale, (d_dS.transpose(-1, -2) @ qd.abs()) * scale,
                         (P * d_lse).transpose(-1, -2) @ g.abs()])  # fmt: skip
    # and each side's own backward rounds P and dS to the dtype before its matmuls (unit roundoff u), and its results
    dS = P * dP_minus_D
    spread = torch.stack([(dS.abs() @ kd.abs()) * scale, (dS.abs().transpose(-1, -2) @ qd.abs()) * scale,
                          P.transpose(-1, -2) @ g.abs()])  # fmt: skip
    u = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    bound = 2 * moved + 4 * u * spread + 2 * u * theirs.abs() + 1e-6 * theirs.abs().max()
    assert ((mine.double() - theirs).abs() <= bound).all(), ((mine.double() - theirs).abs() / bound).max()
    if dtype == torch.float32:  # the same backward on an output equal to 3e-7 (measured 8e-7)
        (sdpa,) = torch.autograd.grad(F.scaled_dot_product_attention(*qkv.unbind(0), scale=scale), qkv, grad)
        assert (mine - sdpa).abs().max() <= 1e-5 * max(1.0, sdpa.abs().max().item())


def test_the_recomputing_backward_equals_sdpas():
    """The backward CUDA takes in fp32 or at head dims flash does not take: the attention recomputed and its
    backward written out (a custom op runs below autograd; run here on CPU tensors through the same function)."""
    from shared_core.label_kernel import _recomputed_backward

    qkv, labels = _inputs(2, 2, 50, 24, 1, torch.float32, seed=1)
    qkv.requires_grad_(True)
    grad = torch.randn(2, 2, 50, 24, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    (theirs,) = torch.autograd.grad(F.scaled_dot_product_attention(*qkv.unbind(0), scale=0.2), qkv, grad)
    mine = torch.stack(_recomputed_backward(grad, *qkv.detach().unbind(0), 0.2))
    assert torch.allclose(mine, theirs, atol=1e-5, rtol=0)  # the formulas written out against SDPA's fused kernel


@pytest.mark.parametrize('kind', ['cls', 'qk-norm', 'registers', 'avg-no-cls'])
def test_a_tl_align_step_with_the_kernel_forced_is_the_reference(kind, monkeypatch):
    """``TLAlign(model, fused='triton')``: the targets of the explicit reference (dense one-hot labels, loops over
    heads), the plain model's logits, and the plain step's gradients."""
    model = tiny_vit(depth=3, **KINDS[kind]).to(DEVICE).eval()
    (xm, target), y = _batch(11)
    xm, target, y = xm.to(DEVICE), target.to(DEVICE), y.to(DEVICE)
    ref = _reference_target(model, xm, target, y)
    checked('fused', 8)  # the self-check's own launch, before the count
    launches = []
    forward = label_kernel._forward
    monkeypatch.setattr(label_kernel, '_forward', lambda *a: launches.append(1) or forward(*a))
    out, aligned = TLAlign(model, fused='triton')(xm, target)
    assert len(launches) == 3  # one kernel per block
    assert torch.allclose(aligned, ref, atol=1e-5, rtol=0)  # measured 1e-7
    assert torch.allclose(out, model(xm), atol=1e-5, rtol=0)

    def grads(fn):
        model.zero_grad(set_to_none=True)
        SoftTargetCrossEntropy()(fn(), ref).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = grads(lambda: model(xm))
    kernel = grads(lambda: TLAlign(model, fused='triton')(xm, target)[0])
    for n in plain:
        assert torch.allclose(plain[n], kernel[n], atol=1e-5, rtol=1e-4), n


def test_bf16_autocast_step_with_the_kernel():
    model = tiny_vit(depth=3).to(DEVICE).eval()
    (xm, target), y = _batch(12)
    xm, target, y = xm.to(DEVICE), target.to(DEVICE), y.to(DEVICE)
    ref = _reference_target(model, xm, target, y)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out, aligned = TLAlign(model, fused='triton')(xm, target)
        plain = model(xm)
    # the labels: fp32 from the kernel's unrounded probabilities of bf16 logits; the logits: the plain bf16 model's
    # up to another kernel's rounding
    assert aligned.dtype == torch.float32 and (aligned - ref).abs().max() < 2e-3
    assert torch.allclose(out.float(), plain.float(), atol=0.1, rtol=0.02)


def test_one_graph_under_torch_compile():
    """The custom op with its fake implementation: ``fullgraph=True`` compiles forward and backward, and the
    compiled function equals the eager one."""
    qkv, labels = _inputs(2, 2, 50, 32, 1, torch.float32, seed=5)

    def step(qkv, labels):
        out, _, heads = label_attention(*qkv.unbind(0), labels, 0.25)
        return (out * out).sum(), heads

    eager_qkv, compiled_qkv = qkv.clone().requires_grad_(), qkv.clone().requires_grad_()
    loss_e, heads_e = step(eager_qkv, labels)
    loss_e.backward()
    torch._dynamo.reset()
    loss_c, heads_c = torch.compile(step, fullgraph=True, dynamic=False)(compiled_qkv, labels)
    loss_c.backward()
    assert torch.allclose(loss_c, loss_e, rtol=1e-5) and torch.allclose(heads_c, heads_e, atol=1e-6)
    assert torch.allclose(compiled_qkv.grad, eager_qkv.grad, atol=1e-5)


#: the path of the kernel, not forced (the default on CUDA)
KERNEL = LabelPath('kernel', 'sdpa')


def test_the_kernel_columns_keep_the_state_in_fp32_without_a_buffer():
    columns = LabelColumns(torch.rand(2, 17, 1), num_heads=4, head_dim=8, dtype=torch.bfloat16, path=KERNEL)
    assert columns.kernel and not columns.split and columns.z.dtype == torch.float32
    assert not hasattr(columns, 'buf')


def test_dispatch_the_kernel_on_cuda_by_default_and_forced_by_the_variable(monkeypatch):
    assert not use_label_kernel('cpu')
    with fused_label_attn('triton'):
        assert use_label_kernel('cpu')
    with fused_label_attn(True):  # an explicit True keeps the SDPA call with label columns
        assert not use_label_kernel('cuda')
    for value, expected in (('triton', 'triton'), ('1', True), ('0', False), ('', None), (' TRITON ', 'triton')):
        monkeypatch.setenv(FUSED_ENV, value)
        assert _env_choice() == expected, value
    monkeypatch.setenv(FUSED_ENV, 'fast')
    with pytest.raises(ValueError, match=f'\\${FUSED_ENV}: expected 1, 0, triton, labels or auto'):
        _env_choice()
    # the variable as a process reads it at import
    code = 'from shared_core.label_attention import use_label_kernel as u; print(u("cpu"), u("cuda"))'
    env = {**os.environ, FUSED_ENV: 'triton'}
    out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == 'True True', (out.stdout, out.stderr)
    with pytest.raises(ValueError, match="fused: expected True, False, 'triton', 'labels', 'auto' or None"):
        TLAlign(tiny_vit(depth=1), fused='cuda')


def test_a_forced_kernel_is_honoured_or_refused_never_replaced(monkeypatch):
    """``fused='triton'`` (or the variable) where the shared path does not run: attention dropout active in
    training (the recomputing path ran instead, silently: 0 launches), ``shared=False``, dense labels, a block
    given a mask, TransMix, another family: one ValueError saying why. In eval mode the same model launches the
    kernel. ``'Triton'`` is the choice in any case, as the variable takes it."""
    from timm.models.mlp_mixer import MlpMixer

    from timm_plugin.tl_align import TransMix

    checked('fused', 8)  # the self-check's own launch, before the count
    launches = []
    forward = label_kernel._forward
    monkeypatch.setattr(label_kernel, '_forward', lambda *a: launches.append(1) or forward(*a))
    (xm, target), y = _batch(13)
    xm, target = xm.to(DEVICE), target.to(DEVICE)
    model = tiny_vit(depth=2, attn_drop_rate=0.3).to(DEVICE).train()
    for forced in (dict(fused='Triton'), dict(fused=' TRITON ')):
        with pytest.raises(ValueError, match="^fused='triton': the Triton label kernel does not run here: block 0's "):
            TLAlign(model, **forced)(xm, target)
    assert not launches
    monkeypatch.setenv(FUSED_ENV, 'Triton')  # the process's choice: as the variable sets it at import
    monkeypatch.setattr('shared_core.label_attention._FUSED', _env_choice())
    with pytest.raises(ValueError, match=r"^'triton' \(\$TOKENAUG_FUSED_LABEL_ATTN or set_fused_label_attn\): "):
        TLAlign(model)(xm, target)
    with pytest.raises(ValueError, match='shared=False keeps the model.s own attention'):
        TLAlign(model.eval(), shared=False)(xm, target)
    with pytest.raises(ValueError, match="TransMix reads the last block's attention"):
        TransMix(model)(xm, target)
    mixer = MlpMixer(num_classes=model.num_classes, img_size=32, patch_size=8, num_blocks=1, embed_dim=16)
    with pytest.raises(ValueError, match='MlpMixer is traced by MlpMixerTracer, which computes the labels apart'):
        TLAlign(mixer.to(DEVICE))(xm, target)
    dense = torch.softmax(torch.randn(xm.shape[0], 16, 10), -1).to(DEVICE)  # 10 columns: wider than the shared path's
    with pytest.raises(ValueError, match='a label state 10 wide'):
        TLAlign(model).trace(xm, dense)
    assert not launches
    model.eval()  # no dropout: the kernel runs, once per block
    TLAlign(model, fused='TRITON')(xm, target)
    assert len(launches) == 2
    # an explicit True or False runs the recomputing path under dropout (exact, as before)
    monkeypatch.setattr('shared_core.label_attention._FUSED', None)
    model.train()
    for fused in (True, False):
        TLAlign(model, fused=fused)(xm, target)
    assert len(launches) == 2


def test_a_forced_kernel_refuses_a_block_given_an_attention_mask():
    labels, qkv, mask = torch.rand(1, 5, 1), torch.randn(3, 1, 2, 5, 8), torch.ones(5, 5, dtype=torch.bool)
    forced = LabelBackend('triton').path('cpu', torch.float32)
    columns = LabelColumns(labels, num_heads=2, head_dim=8, dtype=torch.float32, path=forced)
    with pytest.raises(
        ValueError, match="^fused='triton': the Triton label kernel does not run here: .*attention mask"
    ):
        columns.attend(qkv, 0.3, mask)
    columns = LabelColumns(labels, num_heads=2, head_dim=8, dtype=torch.float32, path=KERNEL)
    out, heads = columns.attend(qkv, 0.3, mask)  # the default: the attention materialised once
    assert out.shape == (1, 2, 5, 8) and heads.shape == (1, 5, 1)


def test_cpu_tensors_without_the_interpreter_are_refused_plainly(monkeypatch):
    monkeypatch.setenv('TRITON_INTERPRET', '0')
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match='CUDA tensors, or on CPU tensors under Triton.s interpreter'):
        label_attention(q, q, q, torch.rand(1, 4, 1), 0.3)


def test_a_kernel_that_fails_here_warns_once_and_the_default_goes_on_without_it(monkeypatch):
    """On a machine where the kernel does not build or launch, the default path warns once, gives the materialised
    attention's result for that call and the SDPA columns afterwards; a forced 'triton' raises the error."""
    import shared_core.label_attention as la

    monkeypatch.setattr(la, '_KERNEL_FAILED', None)
    monkeypatch.setattr(label_kernel, '_forward', lambda *a: (_ for _ in ()).throw(RuntimeError('no kernel here')))
    qkv, labels = _inputs(2, 2, 17, 16, 1, torch.float32, seed=2)
    backend = LabelBackend()
    monkeypatch.setattr(la, '_TRITON', True)
    monkeypatch.setattr(label_kernel, 'self_check', lambda *a: None)  # it passed, as on a GPU where it builds
    monkeypatch.setattr(la, 'time_label_paths', lambda c, *a: {p: 1.0 if p == 'kernel' else 2.0 for p in c})
    shape = (2, 2, 17, 16)
    path = backend.path('cuda', torch.float32, shape)  # the default on CUDA: auto, here the kernel (CPU tensors)
    assert path == KERNEL
    columns = LabelColumns(labels, num_heads=2, head_dim=16, dtype=torch.float32, path=path, backend=backend)
    with pytest.warns(RuntimeWarning, match='kernel failed here .RuntimeError: no kernel here.*SDPA label columns'):
        out, heads = columns.attend(qkv, 0.25)
    assert backend.path('cuda', torch.float32, shape).shared == 'columns'  # this wrapper's next forwards
    _, _, ref_heads = _reference(*qkv.unbind(0), labels, 0.25)
    assert torch.allclose(out, F.scaled_dot_product_attention(*qkv.unbind(0), scale=0.25), atol=1e-5)
    assert (heads.double() - ref_heads).abs().max() < 1e-5
    assert not use_label_kernel('cuda')  # the rest of the process: the SDPA columns
    assert LabelBackend().path('cuda', torch.float32, shape).shared == 'columns'  # other wrappers' too: no auto
    forced = LabelBackend('triton')
    path = forced.path('cpu', torch.float32)
    with pytest.raises(RuntimeError, match='no kernel here'):
        LabelColumns(labels, 2, 16, torch.float32, path=path, backend=forced).attend(qkv, 0.25)


def test_a_flash_backward_that_refuses_falls_back_to_the_recomputed_one(monkeypatch):
    """The CUDA flash backward called where it does not run (here: CPU tensors) warns once and recomputes: the
    gradients are still SDPA's."""
    monkeypatch.setattr(label_kernel, '_flash_backward_applies', lambda q: True)
    monkeypatch.setattr(label_kernel, '_FLASH_BACKWARD_WARNED', False)
    qkv, labels = _inputs(1, 2, 50, 32, 1, torch.float32, seed=8)
    qkv.requires_grad_(True)
    grad = torch.randn(1, 2, 50, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    out, _, _ = label_attention(*qkv.unbind(0), labels, 32**-0.5)
    with pytest.warns(RuntimeWarning, match='flash attention backward refused'):
        (mine,) = torch.autograd.grad(out, qkv, grad)
    (theirs,) = torch.autograd.grad(F.scaled_dot_product_attention(*qkv.unbind(0), scale=32**-0.5), qkv, grad)
    assert torch.allclose(mine, theirs, atol=1e-5)


# ---------------------------------------------------------------------------------------------- the label-only kernel


def _reference_label_sum(q, k, labels, scale, mask=None):
    """Eq. 9's sum over heads as an explicit loop, the attention materialised in float64 (``mask``: an additive bias
    or a boolean mask, broadcast to ``(B, H, T_q, T_k)``)."""
    logits = (q.double() @ k.double().transpose(-1, -2)) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, float('-inf')) if mask.dtype == torch.bool else logits + mask.double()
    A = logits.softmax(-1)
    return sum(A[:, h] @ labels.double() for h in range(q.shape[1]))


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    'TQ, TK, D, K',
    [(197, 197, 64, 1), (197, 197, 32, 1), (50, 50, 64, 10), (65, 65, 32, 1), (1, 65, 32, 2), (65, 17, 64, 1)],
)
def test_the_label_only_kernel_is_the_label_rule(TQ, TK, D, K, dtype):
    """``label_only_attention``: the token counts of DeiT (197), a 7x7 grid with a class token (50) and an odd one
    (65), one query row (TransMix's class token), spatial-reduction keys (17), head dims 32 and 64, the compact
    state and dense labels, fp32 and bf16 ``q``/``k``: the rule's sum over heads in fp32 (the products of the bf16
    values are exact in fp32; measured max |d| 2e-7)."""
    g = torch.Generator().manual_seed(TQ + TK + D + K)
    q = (torch.randn(2, 2, TQ, D, generator=g) * 1.5).to(DEVICE, dtype)
    k = (torch.randn(2, 2, TK, D, generator=g) * 1.5).to(DEVICE, dtype)
    labels = torch.softmax(torch.randn(2, TK, K, generator=g) * 2, -1).to(DEVICE)
    heads = label_only_attention(q, k, labels, D**-0.5)
    assert heads.shape == (2, TQ, K) and heads.dtype == torch.float32
    assert (heads.double() - _reference_label_sum(q, k, labels, D**-0.5)).abs().max() < 1e-5


def test_the_label_only_kernel_takes_a_bias_or_a_mask():
    """An additive bias broadcast over the batch (a relative position bias) and a boolean mask (Swin's shifted
    windows): in the logits as the token path adds them."""
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(4, 2, 49, 32, generator=g).to(DEVICE) for _ in range(2))
    labels = torch.softmax(torch.randn(4, 49, 1, generator=g), -1).to(DEVICE)
    bias = (torch.randn(1, 2, 49, 49, generator=g) * 2).to(DEVICE)
    mask = (torch.rand(49, 49, generator=g) > 0.3) | torch.eye(49, dtype=torch.bool)
    for m in (bias, mask.to(DEVICE)):
        heads = label_only_attention(q, k, labels, 0.2, m)
        assert (heads.double() - _reference_label_sum(q, k, labels, 0.2, m)).abs().max() < 1e-5


@pytest.mark.parametrize('kind', ['cls', 'qk-norm', 'avg-no-cls'])
def test_fused_labels_leaves_the_token_path_to_the_model(kind, monkeypatch):
    """``TLAlign(model, fused='labels')``: the model's own forward (its logits and gradients bit for bit: no
    attention replaced), one label-only launch per block, and the explicit reference's target."""
    model = tiny_vit(depth=3, **KINDS[kind]).to(DEVICE).eval()
    (xm, target), y = _batch(14)
    xm, target, y = xm.to(DEVICE), target.to(DEVICE), y.to(DEVICE)
    ref = _reference_target(model, xm, target, y)
    checked('labels', 8)  # the self-check's own launch, before the count
    launches = []
    forward = label_kernel._label_only_forward
    monkeypatch.setattr(label_kernel, '_label_only_forward', lambda *a: launches.append(1) or forward(*a))
    out, aligned = TLAlign(model, fused='labels')(xm, target)
    assert len(launches) == 3 and torch.equal(out, model(xm))
    assert torch.allclose(aligned, ref, atol=1e-5, rtol=0)

    def grads(fn):
        model.zero_grad(set_to_none=True)
        SoftTargetCrossEntropy()(fn(), ref).backward()
        return [p.grad.clone() for p in model.parameters()]

    plain, labels_only = grads(lambda: model(xm)), grads(lambda: TLAlign(model, fused='labels')(xm, target)[0])
    assert all(torch.equal(a, b) for a, b in zip(plain, labels_only, strict=True))


def test_fused_labels_on_the_recomputing_families(monkeypatch):
    """Every family whose rule recomputes an attention takes ``'labels'``: EVA (RoPE, read at its SDPA call), Swin
    with fused window attention (relative position bias and shift mask) and PVT v2 (spatial-reduction keys) give
    the transient softmax's targets, with their own logits; the variable spells it ``labels``."""
    import timm

    models = [
        (timm.create_model('vit_small_patch16_rope_224', img_size=32, patch_size=8, depth=2, num_classes=C), 32, 8),
        (
            timm.create_model(
                'swin_tiny_patch4_window7_224',
                img_size=56,
                window_size=7,
                depths=(2,),
                num_heads=(2,),
                embed_dim=32,
                num_classes=C,
            ),
            56,
            4,
        ),  # fmt: skip
        (timm.create_model('pvt_v2_b0', num_classes=C, depths=(1, 1, 1, 1)), 64, 4),
    ]
    for model, img, patch in models:
        model = model.to(DEVICE).eval()
        for m in model.modules():
            if hasattr(m, 'fused_attn'):
                m.fused_attn = True
        mixer = create_mixer('cutmix', cutmix_alpha=1.0, num_classes=C, patch_size=patch, carry_mix=True)
        xm, target = mixer(torch.randn(2, 3, img, img, generator=torch.Generator().manual_seed(1)), torch.arange(2))
        xm, target = xm.to(DEVICE), target.to(DEVICE)
        out, aligned = TLAlign(model, fused='labels')(xm, target)
        assert torch.equal(out, model(xm)), type(model).__name__
        _, softmax = TLAlign(model, fused=False)(xm, target)
        assert torch.allclose(aligned, softmax, atol=1e-5, rtol=0), type(model).__name__
    monkeypatch.setenv(FUSED_ENV, ' Labels ')
    assert _env_choice() == 'labels'


# ---------------------------------------------------------------------------------------------- the self-check


@pytest.mark.parametrize('kind', ['fused', 'labels'])
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_the_self_check_passes_for_the_real_kernels(kind, dtype, monkeypatch):
    monkeypatch.setattr(label_kernel, '_CHECKS', {})
    for head_dim in (32, 64):
        assert label_kernel.self_check(kind, DEVICE, dtype, head_dim) is None


def test_a_wrong_kernel_is_caught_warned_and_never_trained_on(monkeypatch):
    """A test double of the fused kernel whose labels are off by 0.01: the default path (here auto, as on CUDA, with
    timings that make the kernel the fastest) warns once, naming what differed and by how much, leaves it out, and
    the step runs on the SDPA label columns, which give the explicit reference's target; a chosen kernel raises
    instead. The label-only kernel likewise."""
    import shared_core.label_attention as la

    monkeypatch.setattr(label_kernel, '_CHECKS', {})
    monkeypatch.setattr(la, 'use_label_kernel', lambda device: True)  # the default: the kernel, on any device
    forward = label_kernel._forward
    monkeypatch.setattr(
        label_kernel, '_forward', lambda *a: (lambda out, lse, heads: (out, lse, heads + 0.01))(*forward(*a))
    )
    # the default (auto) would time the kernel fastest, the columns next
    monkeypatch.setattr(la, 'time_label_paths', lambda c, *a: {p: {'kernel': 1, 'columns': 2}.get(p, 3) for p in c})
    model = tiny_vit(depth=2).to(DEVICE).eval()
    (xm, target), y = _batch(15)
    xm, target, y = xm.to(DEVICE), target.to(DEVICE), y.to(DEVICE)
    wrapped = TLAlign(model)
    with pytest.warns(RuntimeWarning, match=r'failed its self-check on cpu in float32 at head dim 8 .differs from '
                                            r'SDPA and the rule: labels by 0.01 .allowed 0.0001..; TL-Align leaves it '
                                            r'out'):  # fmt: skip
        out, aligned = wrapped(xm, target)
    assert wrapped.backend.path(xm.device, xm.dtype).shared == 'columns'
    # the columns' target, the reference's (the wrong kernel's labels would be 0.01 off in every block)
    assert torch.allclose(aligned, _reference_target(model, xm, target, y), atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="^fused='triton': the Triton label kernel failed its self-check on cpu"):
        TLAlign(model, fused='triton')(xm, target)
    only = label_kernel._label_only_forward
    monkeypatch.setattr(label_kernel, '_label_only_forward', lambda *a: only(*a) * 1.01)
    monkeypatch.setattr(label_kernel, '_CHECKS', {})  # (auto checked the real label-only kernel above)
    with pytest.raises(RuntimeError, match="^fused='labels': the label-only Triton kernel failed its self-check"):
        TLAlign(model, fused='labels')(xm, target)
