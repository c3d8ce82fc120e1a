"""The methods on a ``torch.compile``d model: the training step through the compiled module
(as timm's ``task.compile`` runs it, the method's hooks on the bare model) gives the eager step's logits, targets,
loss and gradients, batch after batch (a label state baked into the graph would show as stale targets), and
compiles once, not once per step.

``aot_eager`` traces with dynamo and AOTAutograd as ``inductor`` does, without generating code, so these tests are
quick; one ``inductor`` run (slow) checks the generated kernels' rounding.
"""

import pytest
import timm
import torch
from timm.loss import SoftTargetCrossEntropy
from torch._dynamo.utils import counters

from shared_core.label_maps import CropMaps
from timm_plugin import create_mixer
from timm_plugin.tl_align import TLAlign, TransMix
from timm_plugin.token_label_data import TokenLabelTarget
from timm_plugin.token_labeling import TokenLabeling, TokenLabelingLoss, attach_aux_head
from timm_plugin.tokenmixup import TokenMixup

from ..helpers.observers import record_into
from ..shared_core.test_tokenmixup_core import tie_free

C = 10


def vit(depth=2, aux=False):
    torch.manual_seed(0)
    model = timm.create_model('vit_tiny_patch16_224', img_size=64, depth=depth, num_classes=C)
    return (attach_aux_head(model) if aux else model).train()


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def same_step(eager, compiled, model, atol):
    """Run ``eager()`` and ``compiled()`` (each returns ``(loss, *tensors)``), backward each, compare."""
    results = []
    for step in (eager, compiled):
        model.zero_grad(set_to_none=True)
        loss, *outs = step()
        loss.backward()
        results.append((loss.detach(), [o.detach() for o in outs], grads(model)))
    (l0, o0, g0), (l1, o1, g1) = results
    assert torch.allclose(l0, l1, atol=atol, rtol=0), (l0, l1)
    for a, b in zip(o0, o1):
        assert torch.allclose(a, b, atol=atol, rtol=0), (a - b).abs().max()
    assert g0.keys() == g1.keys() and len(g0) > 10
    for n in g0:
        assert torch.allclose(g0[n], g1[n], atol=atol, rtol=1e-4), (n, (g0[n] - g1[n]).abs().max())


def compiled_frames():
    return counters['stats']['unique_graphs']


def aligned_steps(wrapper, model, compiled, kind, steps, seed, atol):
    """``steps`` CutMix batches through ``wrapper.align`` (TL-Align / TransMix), eager against compiled; the number
    of compiled graphs after each step."""
    mixer = create_mixer('cutmix', method=kind, mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=16)
    loss_fn = SoftTargetCrossEntropy()
    g = torch.Generator().manual_seed(seed)
    graphs = []
    for _ in range(steps):
        x, y = torch.randn(4, 3, 64, 64, generator=g), torch.randint(0, C, (4,), generator=g)
        xm, target = mixer(x, y)

        def step(forward=None):
            out, aligned = wrapper.align(xm, target, forward)
            return loss_fn(out, aligned), out, aligned

        same_step(step, lambda: step(lambda: compiled(xm)), model, atol=atol)
        graphs.append(compiled_frames())
    return graphs


@pytest.mark.parametrize('method', ['tl_align', 'tl_align_recompute', 'transmix'])
def test_tl_align_and_transmix_on_a_compiled_model(method):
    torch._dynamo.reset()
    model = vit()
    wrapper = {
        'tl_align': lambda: TLAlign(model),
        'tl_align_recompute': lambda: TLAlign(model, shared=False),
        'transmix': lambda: TransMix(model),
    }[method]()
    compiled = torch.compile(model, backend='aot_eager')
    graphs = aligned_steps(wrapper, model, compiled, 'transmix' if method == 'transmix' else 'tl_align', 3, 1, 1e-5)
    assert graphs[0] >= 1 and graphs[-1] == graphs[0], graphs  # compiled once, reused by the next steps


@pytest.mark.parametrize('method', ['tl_align', 'transmix'])
def test_tl_align_under_bf16_autocast_compiles_to_one_graph(method):
    """Under autocast the label columns travel as an fp32 hi + lo pair; the whole step stays one graph with no
    break, reused batch after batch (found on an H200: an ``out=`` view in the pair's write and torch 2.11's
    ``ContextVar.get`` broke the graph in every block, and the label scale, a float, then recompiled a frame per
    block until dynamo fell back to eager: the compiled TL-Align step cost 1.36x the plain one). The wrapper's own
    ``fused=`` scope is a guard, not a break."""
    torch._dynamo.reset()
    counters.clear()
    model = vit()
    wrapper = TransMix(model) if method == 'transmix' else TLAlign(model, fused=True)
    compiled = torch.compile(model, backend='aot_eager')
    mixer = create_mixer('cutmix', method=method, mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=16)
    g = torch.Generator().manual_seed(2)
    graphs = []
    for _ in range(3):
        x, y = torch.randn(4, 3, 64, 64, generator=g), torch.randint(0, C, (4,), generator=g)
        xm, target = mixer(x, y)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            out, aligned = wrapper.align(xm, target, lambda: compiled(xm))
            ref_out, ref = wrapper.align(xm, target)
        SoftTargetCrossEntropy()(out, aligned).backward()
        assert torch.allclose(aligned, ref, atol=1e-3), (aligned - ref).abs().max()
        graphs.append(compiled_frames())
    assert sum(counters['graph_break'].values()) == 0, dict(counters['graph_break'])
    assert graphs == [1, 1, 1], graphs


def test_token_labeling_on_a_compiled_model():
    torch._dynamo.reset()
    model = vit(aux=True)
    compiled = torch.compile(model, backend='aot_eager')
    loss_fn = TokenLabelingLoss(C)
    g = torch.Generator().manual_seed(2)
    graphs = []
    for i in range(3):
        x, y = torch.randn(4, 3, 64, 64, generator=g), torch.randint(0, C, (4,), generator=g)
        target = TokenLabelTarget.of(
            y,
            CropMaps(
                torch.rand(4, 3, 4, 4, generator=g).softmax(1).half(),
                torch.randint(0, C, (4, 3, 4, 4), generator=g),
                C,
                torch.tensor([[0.1, 0.0, 0.9, 1.0]]).repeat(4, 1),
                torch.tensor([False, True, False, True]),
            ),
        )
        # the same MixToken box for both runs: two wrappers with equally seeded generators
        eager_w = TokenLabeling(model, generator=torch.Generator().manual_seed(i))
        compiled_w = TokenLabeling(model, generator=torch.Generator().manual_seed(i))

        def step(w, forward=None):
            out = w.outputs(x, forward)
            return loss_fn(out, target), out.cls, out.aux

        same_step(lambda: step(eager_w), lambda: step(compiled_w, compiled), model, atol=1e-5)
        graphs.append(compiled_frames())
    assert graphs[-1] == graphs[0], graphs


@pytest.mark.parametrize('vtm', [False, True], ids=['htm', 'htm+vtm'])
def test_tokenmixup_on_a_compiled_model_is_one_graph(vtm):
    """HTM's plan keeps every shape known before the data (the assignment is a custom op on a square gain) and its
    statistics stay tensors until the forward is over, so the compiled model is one graph without a break: no
    frame per block (each block's drop-path probability would be a guard), batches with all, some and no easy
    samples (τ changed between steps, as a schedule does) reuse it, and every step equals the eager one."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)  # stochastic depth: a drop-path probability per block (0 to 0.3)
    model = timm.create_model('vit_tiny_patch16_224', img_size=64, depth=4, num_classes=C, drop_path_rate=0.3).train()
    method = TokenMixup(model, htm_layers=(1,), vtm_layers=(3,) if vtm else (), tau=100.0, kappa=2)
    compiled = torch.compile(model, backend='aot_eager')
    mixer = create_mixer('cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=16, carry_mix=True)
    loss_fn = SoftTargetCrossEntropy()
    g = torch.Generator().manual_seed(3)
    graphs, easy = [], []
    for tau in (100.0, 0.2302, 0.0, 100.0):
        method.tau = tau
        x, y = torch.randn(6, 3, 64, 64, generator=g), torch.randint(0, C, (6,), generator=g)
        xm, target = mixer(x, y)

        def step(forward=None):
            out, mixed = method.mix_forward(xm, target, forward)
            soft = mixed.as_subclass(torch.Tensor)
            return loss_fn(out, soft) + mixed.aux_loss, out, soft

        def seeded(fn):  # the same stochastic-depth draws in both
            torch.manual_seed(11)
            return fn()

        with method.hooks.observing(record_into(record := {})):
            same_step(lambda: seeded(step), lambda: seeded(lambda: step(lambda: compiled(xm))), model, atol=1e-5)
        seen = record[1]  # the case has one plan, whatever float noise the two paths have
        assert tie_free(seen['saliency'], seen['easy'].tolist(), method.hooks.rho, tol=1e-4, margin=1e-3)
        easy.append(int(seen['easy'].sum()))
        graphs.append(compiled_frames())
    assert easy[0] == 6 and easy[2] == 0 and 0 < easy[1] < 6, easy  # all, some and no easy samples
    assert counters['graph_break'] == {} or not sum(counters['graph_break'].values()), dict(counters['graph_break'])
    assert graphs[0] == 1 and graphs[-1] <= 2, graphs  # one graph; τ may turn into a symbol once


@pytest.mark.slow
def test_tl_align_on_an_inductor_compiled_model():
    """The generated kernels (inductor, C++ on this CPU): logits, aligned targets and gradients as eager within
    float rounding."""
    torch._dynamo.reset()
    model = vit()
    wrapper = TLAlign(model)
    aligned_steps(wrapper, model, torch.compile(model), 'tl_align', 2, 4, 1e-4)


def test_a_plain_step_compiled_first_does_not_hide_the_methods_hooks():
    """The methods make dynamo guard on module hooks (shared_core.compiling): after a plain compiled step (mixing
    off), a step with TL-Align's hooks or MixToken's hook compiles its own graph instead of silently reusing the
    hook-free one (MixToken would then leave the tokens unmixed), and steps with and without a MixToken box (prob
    0.5) each reuse theirs."""
    torch._dynamo.reset()
    model = vit(aux=True)
    recompute = TLAlign(model, shared=False)  # built before the first compiled call, as tokenaug-train does
    draws = [TokenLabeling(model, prob=0.5, generator=torch.Generator().manual_seed(0)) for _ in range(2)]
    compiled = torch.compile(model, backend='aot_eager')
    x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(5))
    assert torch.allclose(compiled(x), model(x), atol=1e-5)  # the plain step first
    mixer = create_mixer('cutmix', method='tl_align', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=16)
    xm, target = mixer(x, torch.arange(4))
    out, aligned = recompute.align(xm, target, lambda: compiled(xm))
    ref_out, ref = recompute.align(xm, target)
    assert torch.allclose(aligned, ref, atol=1e-6) and torch.allclose(out, ref_out, atol=1e-5)
    mixed, graphs = 0, []
    for _ in range(6):
        a, b = draws[0].outputs(x, compiled), draws[1].outputs(x)
        assert (a.mix is None) == (b.mix is None) and torch.allclose(a.cls, b.cls, atol=1e-5)
        assert torch.allclose(a.aux, b.aux, atol=1e-5)
        mixed += a.mix is not None
        graphs.append(compiled_frames())
    assert 0 < mixed < 6 and graphs[-1] == graphs[2], graphs  # both kinds of step seen, then no new graphs


@pytest.mark.parametrize('fastest', ['columns', 'labels'])
def test_auto_chooses_before_the_compiled_forward_and_breaks_no_graph(fastest, monkeypatch):
    """``fused='auto'`` (injected timings): the path is chosen before the compiled model runs, once, and stays a
    constant of the graph: no break, the graph reused batch after batch, the eager step's targets."""
    import shared_core.label_attention as la
    from shared_core import label_kernel

    monkeypatch.setattr(label_kernel, 'self_check', lambda *a: None)
    timed = []
    monkeypatch.setattr(
        la, 'time_label_paths', lambda c, *a: timed.append(c) or {p: 1.0 if p == fastest else 2.0 for p in c}
    )
    torch._dynamo.reset()
    counters.clear()
    model = vit()
    wrapper = TLAlign(model, fused='auto')
    compiled = torch.compile(model, backend='aot_eager')
    graphs = aligned_steps(wrapper, model, compiled, 'tl_align', 3, 3, 1e-5)
    assert len(timed) == 1 and graphs[-1] == graphs[0] >= 1, (timed, graphs)
    assert sum(counters['graph_break'].values()) == 0, dict(counters['graph_break'])
