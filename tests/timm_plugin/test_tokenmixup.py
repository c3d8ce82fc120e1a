"""TokenMixup on timm (timm_plugin.TokenMixup / TokenMixupTask, CCT) against an explicit reference that runs the
blocks one by one with materialised per-head attention, the brute-force matching and loops for the token swap,
the relabelling and VTM's gather and cross-attention."""

import csv
import math

import pytest
import timm
import torch
from timm.loss import SoftTargetCrossEntropy

import timm_plugin  # noqa: F401  (registers cct_*)
from timm_plugin import TokenMixup, TokenMixupTask, create_mixer

from ..helpers.observers import record_into
from ..shared_core.test_tokenmixup_core import ref_plan, token_margin

C = 5


def tiny_vit(class_token=True, depth=4, seed=0):
    torch.manual_seed(seed)
    kw = {} if class_token else dict(class_token=False, global_pool='avg', fc_norm=False)
    model = timm.create_model(
        'vit_tiny_patch16_224', img_size=32, patch_size=8, embed_dim=32, depth=depth, num_heads=2, num_classes=C, **kw
    )
    with torch.no_grad():  # peaked attention, so that saliency differs clearly between tokens and samples
        for blk in model.blocks:
            blk.attn.qkv.weight.mul_(6.0)
    return model.train()


def heads_attention(blk, h, kv=None):
    """Per-head softmax(q kᵀ · scale) of ``blk`` with queries from ``h`` and keys from ``kv`` (both normalised)."""
    a = blk.attn
    kv = h if kv is None else kv
    B, T, D = h.shape
    W = a.qkv.weight
    bias = a.qkv.bias if a.qkv.bias is not None else torch.zeros(3 * D)
    q = h @ W[:D].T + bias[:D]
    k = kv @ W[D : 2 * D].T + bias[D : 2 * D]
    v = kv @ W[2 * D :].T + bias[2 * D :]
    hd = a.head_dim
    outs, attns = [], []
    for head in range(a.num_heads):
        sl = slice(head * hd, (head + 1) * hd)
        A = (q[..., sl] @ k[..., sl].transpose(1, 2) * a.scale).softmax(-1)
        attns.append(A)
        outs.append(A @ v[..., sl])
    return torch.stack(attns, 1), a.proj(torch.cat(outs, -1))


def saliency_of(A, P, mode):
    A = A.mean(1)
    return A[:, 0, P:] if mode == 'cls' else A[:, :, P:].mean(1)


def reference(
    model, x, y, htm=(), vtm=(), rho=0.0, tau=float('inf'), kappa=2, mode='cls', chosen=None, vtm_memory='mixed'
):
    """The model run block by block with TokenMixup applied explicitly; returns logits, target, difficulties.

    ``chosen``: per HTM block, the partners the code under test picked; the reference takes that plan where it is
    an optimal assignment (``ref_plan``: the optimum may be tied, and a solver's pick among tied optima depends
    on float rounding). Each row's mask must not depend on float noise either: the reference refuses a case where
    a matched token sits within 1e-4 (relative) of the threshold. ``vtm_memory='public'``: the memory of an HTM
    block is chosen by HTM's pre-mix saliency and gathered from the mixed input."""
    P = model.num_prefix_tokens
    h = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
    inputs, diffs, premix = {}, {}, {}
    for idx, blk in enumerate(model.blocks):
        if idx in htm:
            scores = model.tokenmixup_scorenet[str(idx)](h)
            ce = -(y * scores.log_softmax(-1)).sum(-1)
            diffs[idx] = 0.1 * ce.detach()
            easy = (diffs[idx] <= tau).tolist()
            with torch.no_grad():
                A, _ = heads_attention(blk, blk.norm1(h))
            S = saliency_of(A, P, mode)
            premix[idx] = S
            pick = None if chosen is None else chosen.get(idx)
            partner, swap, lam, _ = ref_plan(S, easy, rho, chosen=pick, tol=1e-5)
            assert token_margin(S, partner, swap, rho) > 1e-4, 'a matched token sits on the mask threshold'
            rows = []
            for i in range(h.shape[0]):
                toks = [h[partner[i], P + t] if swap[i, t] else h[i, P + t] for t in range(swap.shape[1])]
                rows.append(torch.cat([h[i, :P], torch.stack(toks)], 0))
            h = torch.stack(rows)
            y = torch.stack([lam[i] * y[i] + (1 - lam[i]) * y[partner[i]] for i in range(y.shape[0])]).float()
        inputs[idx] = h
        if idx in vtm:
            memory = []
            for src in range(idx):
                if vtm_memory == 'public' and src in premix:
                    S = premix[src]
                else:
                    with torch.no_grad():
                        A, _ = heads_attention(model.blocks[src], model.blocks[src].norm1(inputs[src]))
                    S = saliency_of(A, P, mode)
                top = S.argsort(1, descending=True)[:, :kappa]
                memory.append(torch.stack([inputs[src][b, P + top[b]] for b in range(h.shape[0])]))
            n = blk.norm1(h)
            _, out = heads_attention(blk, n, torch.cat([n, blk.norm1(torch.cat(memory, 1))], 1))
            h = h + out
            h = h + blk.mlp(blk.norm2(h))
        else:
            h = blk(h)
    return model.forward_head(model.norm(h)), y, diffs


def soft(y):
    return torch.nn.functional.one_hot(y, C).float() * 0.9 + 0.1 / C


@pytest.mark.parametrize('class_token', [True, False])
@pytest.mark.parametrize('B', [4, 5])
def test_htm_matches_the_explicit_reference(class_token, B):
    model = tiny_vit(class_token)
    mode = 'cls' if class_token else 'mean'
    tm = TokenMixup(model, htm_layers=(2,), rho=0.0, tau=1.0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(B, 3, 32, 32, generator=g), soft(torch.arange(B) % C)
    _, _, diffs = reference(model, x, y, htm=(2,), tau=-math.inf, mode=mode)  # nothing easy: the difficulties
    tau = float(diffs[2].median())  # some samples easy, some not
    tm.tau = tau
    logits, target = tm(x, y)
    chosen = {2: target.mixes[0].partner}
    ref_logits, ref_y, _ = reference(model, x, y, htm=(2,), tau=tau, mode=mode, chosen=chosen)
    stats = target.stats['htm2']
    assert 0 < stats['easy'] < B and stats['mixed'] > 0  # the case is not trivial
    assert torch.allclose(logits, ref_logits, atol=1e-4)
    assert torch.allclose(target, ref_y, atol=1e-5) and torch.allclose(target.sum(1), torch.ones(B))
    assert target.aux_loss.requires_grad and torch.isfinite(target.aux_loss)
    mix = target.mixes[0]
    assert not torch.equal(mix.partner, torch.arange(B))  # rows kept in place, partners elsewhere


@pytest.mark.parametrize('class_token', [True, False])
def test_vtm_gathers_the_salient_tokens_at_the_right_index(class_token):
    """The memory token of block l is x_l[P + argmax]: with a class token, P = 1 (the public code takes one before)."""
    model = tiny_vit(class_token)
    mode = 'cls' if class_token else 'mean'
    tm = TokenMixup(model, vtm_layers=(3,), kappa=2)
    x, y = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2)), soft(torch.arange(4))
    logits, target = tm(x, y)
    ref_logits, _, _ = reference(model, x, y, vtm=(3,), kappa=2, mode=mode)
    assert torch.allclose(logits, ref_logits, atol=1e-4)
    assert torch.equal(target.as_subclass(torch.Tensor), y)  # VTM alone does not relabel
    assert float(target.aux_loss) == 0.0
    # an off-by-one gather (the public code's, with a class token) gives other logits
    if class_token:
        off = reference_off_by_one(model, x, y)
        assert not torch.allclose(logits, off, atol=1e-3)
    assert 'forward' not in model.blocks[3].attn.__dict__  # the override is gone after the call
    with torch.no_grad():
        assert torch.equal(tm.eval()(x), model.eval()(x))


def reference_off_by_one(model, x, y):
    """The public ViT VTM: the token one position before each salient patch (class token accounted wrongly)."""
    P = model.num_prefix_tokens
    h = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
    inputs = {}
    for idx, blk in enumerate(model.blocks):
        inputs[idx] = h
        if idx == 3:
            memory = []
            for src in range(idx):
                with torch.no_grad():
                    A, _ = heads_attention(model.blocks[src], model.blocks[src].norm1(inputs[src]))
                top = saliency_of(A, P, 'cls').argsort(1, descending=True)[:, :2]
                memory.append(torch.stack([inputs[src][b, top[b]] for b in range(h.shape[0])]))
            n = blk.norm1(h)
            _, out = heads_attention(blk, n, torch.cat([n, blk.norm1(torch.cat(memory, 1))], 1))
            h = h + out
            h = h + blk.mlp(blk.norm2(h))
        else:
            h = blk(h)
    return model.forward_head(model.norm(h))


@pytest.mark.parametrize('vtm_memory', ['mixed', 'public'])
def test_htm_then_vtm_memory_is_each_rows_own(vtm_memory):
    """HTM at block 1, VTM at block 3: the memory of blocks 1-2 is gathered from the mixed rows, in place. Every row
    is easy at ρ = 0, so the optimal assignment is tied (a reversed cycle has the same total): the reference takes
    the one the code picked where it is optimal. ``vtm_memory='public'`` picks block 1's memory by HTM's pre-mix
    saliency (the public code) and changes the mixed rows' logits only."""
    model = tiny_vit(True)
    tm = TokenMixup(model, htm_layers=(1,), vtm_layers=(3,), rho=0.0, tau=float('inf'), kappa=1, vtm_memory=vtm_memory)
    x, y = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(3)), soft(torch.arange(5) % C)
    logits, target = tm(x, y)
    chosen = {1: target.mixes[0].partner}
    ref_logits, ref_y, _ = reference(
        model, x, y, htm=(1,), vtm=(3,), tau=float('inf'), kappa=1, chosen=chosen, vtm_memory=vtm_memory
    )
    assert target.stats['htm1']['mixed'] > 0
    assert torch.allclose(logits, ref_logits, atol=1e-4) and torch.allclose(target, ref_y, atol=1e-5)
    other = 'public' if vtm_memory == 'mixed' else 'mixed'
    other_logits, _, _ = reference(
        model, x, y, htm=(1,), vtm=(3,), tau=float('inf'), kappa=1, chosen=chosen, vtm_memory=other
    )
    mixed = target.mixes[0].token_share_flat().bool().any(1)
    assert torch.allclose(other_logits[~mixed], logits[~mixed], atol=1e-4)  # unmixed rows: the same tokens
    assert not torch.allclose(other_logits[mixed], logits[mixed], atol=1e-3)  # the rule is a real switch


def test_the_reference_takes_any_optimal_assignment_and_no_other(monkeypatch):
    """The tie of the HTM + VTM case above, decided the other way, as another CPU's rounding may: a solver that
    returns the last of the tied optima makes another plan, and it passes the same comparison; a solver that
    returns a sub-optimal assignment fails it."""
    import itertools

    import numpy as np

    import shared_core.tokenmixup as core

    scipy_solve = core.linear_sum_assignment

    def solver(worse):  # brute force: an optimal assignment other than scipy's, or the best sub-optimal one
        def solve(gain, maximize=False):
            G = np.asarray(gain)
            rows = np.arange(G.shape[0])
            cols = [np.asarray(c) for c in itertools.permutations(range(G.shape[1]), G.shape[0])]
            totals = np.array([G[rows, c].sum() for c in cols])
            best = totals.max()
            if worse:
                return rows, cols[int(np.argmax(np.where(totals < best - 1e-6, totals, -np.inf)))]
            theirs = scipy_solve(G, maximize=True)[1]
            tied = [c for c, t in zip(cols, totals) if t >= best - 1e-9 and not np.array_equal(c, theirs)]
            return rows, (tied[0] if tied else theirs)

        return solve

    model = tiny_vit(True)
    x, y = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(3)), soft(torch.arange(5) % C)
    args = dict(htm_layers=(1,), vtm_layers=(3,), rho=0.0, tau=float('inf'), kappa=1)

    def run():
        logits, target = TokenMixup(model, **args)(x, y)
        partner = target.mixes[0].partner
        ref_logits, ref_y, _ = reference(model, x, y, htm=(1,), vtm=(3,), kappa=1, chosen={1: partner})
        same = torch.allclose(logits, ref_logits, atol=1e-4) and torch.allclose(target, ref_y, atol=1e-5)
        return partner, same

    scipy_partner, same = run()
    assert same
    monkeypatch.setattr(core, 'linear_sum_assignment', solver(worse=False))
    other_partner, same = run()
    assert same and not torch.equal(other_partner, scipy_partner)  # the tie is real, and either optimum passes
    monkeypatch.setattr(core, 'linear_sum_assignment', solver(worse=True))
    _, same = run()
    assert not same


def test_gradients_reach_the_row_and_its_partner_at_swapped_positions():
    model = tiny_vit(True)
    tm = TokenMixup(model, htm_layers=(2,), rho=0.0, tau=float('inf'))
    kept = {}

    def keep(m, args):  # registered before TokenMixup's hook: the pre-mix input of block 2
        args[0].retain_grad()
        kept['x'] = args[0]

    handle = model.blocks[2].register_forward_pre_hook(keep)
    x, y = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(4)), soft(torch.arange(4))
    logits, target = tm(x, y)
    handle.remove()
    mix = target.mixes[0]
    i = int(mix.token_share_flat().sum(1).argmax())
    j, swapped = int(mix.partner[i]), mix.token_share_flat()[i].bool()
    assert swapped.any() and j != i
    logits[i].sum().backward()
    grad = kept['x'].grad[:, 1:].abs().sum(-1)  # (B, N) over patch tokens
    assert (grad[i, swapped] == 0).all() and (grad[i, ~swapped] > 0).all()  # row i: its kept tokens only
    assert (grad[j, swapped] > 0).all()  # the partner's tokens that row i took
    others = [b for b in range(4) if b not in (i, j)]
    assert (grad[others] == 0).all()


def test_eval_and_no_target_are_the_plain_model_bit_for_bit():
    model = tiny_vit(True)
    tm = TokenMixup(model, htm_layers=(1,), vtm_layers=(2,))
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        train_plain = tm(x)  # training mode, no target
        assert torch.equal(train_plain, model(x))
        tm.eval()
        logits, target = tm(x, soft(torch.arange(3)))  # a pair in eval too: B = 2 cannot unpack the logits' rows
        assert torch.equal(logits, model(x)) and torch.equal(target.as_subclass(torch.Tensor), soft(torch.arange(3)))
        assert float(target.aux_loss) == 0.0 and target.stats == {} and target.mixes == []
        assert torch.equal(tm(x), model(x))


def test_nothing_easy_changes_nothing():
    model = tiny_vit(True)
    tm = TokenMixup(model, htm_layers=(2,), tau=0.0)  # 0.1 · CE > 0 for a smoothed target: nothing easy
    x, y = torch.randn(4, 3, 32, 32), soft(torch.arange(4))
    logits, target = tm(x, y)
    with torch.no_grad():
        assert torch.allclose(logits, model(x), atol=1e-6)
    assert torch.equal(target.as_subclass(torch.Tensor), y) and target.stats['htm2']['mixed'] == 0


def test_cct_parameters_and_tokenmixup_task_in_a_timm_loop():
    """CCT-7/3x1 for CIFAR-100 has the paper's 3.78M parameters; HTM + VTM through TokenMixupTask with a mixer."""
    model = timm.create_model('cct_7_3x1_32')
    assert sum(p.numel() for p in model.parameters()) == 3_783_269  # tokenmixup.md Table 1: 3.78M
    fixed = timm.create_model('cct_7_3x1_32_sine', positional='sine')
    assert sum(p.numel() for p in fixed.parameters()) < 3_783_269  # no learnt positions (tests/timm_plugin/test_cct.py)
    torch.manual_seed(0)
    model = timm.create_model('cct_7_3x1_32', num_classes=C, depth=3)
    task = TokenMixupTask(
        model,
        SoftTargetCrossEntropy(),
        htm_layers=(1,),
        vtm_layers=(2,),
        rho=0.005,
        tau=10.0,
        kappa=3,
        scorenet_weight=0.001,
        verbose=False,
    )
    assert 'tokenmixup_scorenet.1.attn.weight' in model.state_dict()  # the ScoreNet is saved with the model
    mixer = create_mixer('cutmix', mixup_alpha=0.8, cutmix_alpha=1.0, num_classes=C, patch_size=2)
    optimizer = torch.optim.AdamW(task.get_trainable_module().parameters(), lr=1e-3)
    task.train()
    for step in range(2):
        x, y = mixer(torch.randn(4, 3, 32, 32), torch.arange(4) % C)
        result = task(x, y)
        optimizer.zero_grad()
        result['loss'].backward()
        optimizer.step()
        assert torch.isfinite(result['loss']) and result['scorenet_loss'] > 0
        assert torch.allclose(result['target'].sum(1), torch.ones(4), atol=1e-5)
        # the logged share: the samples block 1 mixed, over the batch (τ 10: every sample is easy)
        assert result['htm_mixed'] == result['target'].stats['htm1']['mixed'] / 4
        assert result['target'].stats['htm1']['easy'] == 4
    assert model.tokenmixup_scorenet['1'].fc.weight.grad is not None
    task.eval()
    with torch.no_grad():
        assert torch.equal(task.get_eval_model()(x), model(x))


def test_bad_input():
    model = tiny_vit(True)
    with pytest.raises(ValueError, match='htm_layers'):
        TokenMixup(model, htm_layers=(9,))
    with pytest.raises(ValueError, match='htm_layers, vtm_layers'):
        TokenMixup(model)
    with pytest.raises(ValueError, match='vtm_layers: block 0'):
        TokenMixup(model, vtm_layers=(0,))
    with pytest.raises(ValueError, match='TokenMixup supports'):
        TokenMixup(timm.create_model('resnet18'), htm_layers=(1,))
    with pytest.raises(ValueError, match="'cls' reads the class token"):
        TokenMixup(tiny_vit(False), htm_layers=(1,), scorenet='cls')
    with pytest.raises(ValueError, match='target'):
        TokenMixup(model, htm_layers=(1,))(torch.randn(2, 3, 32, 32), torch.zeros(2, 3))
    assert math.isfinite(TokenMixup(model, htm_layers=(1,)).tau)


@pytest.mark.slow
def test_tokenaug_train_runs_the_world_tokenmixup_config(tiny_world, tmp_path):
    """tokenaug-train with HTM + VTM on a CCT at 32 px (the world config), checkpoints that timm loads (the
    ScoreNet with them), the refused combination with TL-Align."""
    from timm_plugin.train import run

    from ..conftest import REPO

    config = str(REPO / 'configs' / 'timm' / 'world_cct_tokenmixup.yaml')
    argv = [
        '-c',
        config,
        '--data-dir',
        str(tiny_world / 'imagenet'),
        '--epochs',
        '1',
        '-b',
        '8',
        '--workers',
        '0',
        '--output',
        str(tmp_path),
        '--experiment',
        'run',
    ]
    metrics = run(argv)
    assert set(metrics) == {'loss', 'top1', 'top5'} and 0 <= metrics['top1'] <= 100
    # the share of samples HTM mixed, per epoch (the paper's Fig. 4): in the log line and in summary.csv
    with open(tmp_path / 'run' / 'summary.csv') as f:
        (row,) = list(csv.DictReader(f))
    assert 0 <= float(row['train_htm_mixed']) <= 1
    ckpt = torch.load(tmp_path / 'run' / 'last.pth.tar', map_location='cpu', weights_only=True)
    assert any(k.startswith('tokenmixup_scorenet.1.') for k in ckpt['state_dict'])
    model = timm.create_model('cct_7_3x1_32', depth=3, num_classes=10)
    missing, unexpected = model.load_state_dict(ckpt['state_dict'], strict=False)
    assert not missing and all(k.startswith('tokenmixup_scorenet.') for k in unexpected)
    with pytest.raises(ValueError, match='TokenMixup relabels each sample from several sources'):
        run(argv[:-2] + ['--experiment', 'refused', '--method', 'tl_align'])


def test_bf16_autocast_gives_the_fp32_decisions():
    """The saliency runs in fp32 with autocast off: on the same block input, bf16 autocast gives bit-identical
    attention (so the same plan). End to end at block 0, whose input differs only by the patch embedding's bf16
    rounding, the saliency moves by that rounding only, the plan is the one its fp32 saliency makes, and that plan
    is optimal for the fp32 run's saliency up to what the rounding can move a total (not necessarily the same plan:
    a token at the margin ρ or a near-tied assignment can flip with the rounding, as between two GPUs)."""
    from shared_core.tokenmixup import htm_plan, qk_saliency
    from timm_plugin.tokenmixup import block_qk

    from ..shared_core.test_tokenmixup_core import gain

    model = tiny_vit(True)
    h = torch.randn(6, 17, 32)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        under_autocast = qk_saliency(*block_qk(model.blocks[2], h), model.blocks[2].attn.scale, 1, 'cls')
    plain = qk_saliency(*block_qk(model.blocks[2], h), model.blocks[2].attn.scale, 1, 'cls')
    assert under_autocast.dtype == torch.float32 and torch.equal(under_autocast, plain)
    rho = 0.01
    tm = TokenMixup(model, htm_layers=(0,), rho=rho, tau=float('inf'))
    for seed in range(4):
        x, y = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(seed)), soft(torch.arange(6) % C)
        with tm.hooks.observing(record_into(record := {})):
            _, t32 = tm(x, y)
            S32 = record[0]['saliency']
            with torch.autocast('cpu', dtype=torch.bfloat16):
                logits16, t16 = tm(x, y)
            S16, easy = record[0]['saliency'], record[0]['easy']
        assert logits16.dtype == torch.bfloat16 and S16.dtype == torch.float32 and t32.stats['htm0']['mixed'] > 0
        noise = (S16 - S32).abs()
        assert float(noise.max()) < 1e-3  # the patch embedding's rounding only (measured: 1.8e-4 at most)
        partner, swap, _ = htm_plan(S16, easy, rho)
        m16 = t16.mixes[0]
        assert torch.equal(m16.partner, partner) and torch.equal(m16.token_share_flat().bool(), swap)
        assert torch.allclose(t16.sum(1), torch.ones(6), atol=1e-5)
        # optimal for S32 up to what the rounding can move two assignments' totals (each by at most 2 Σ|ΔS|)
        sigma = [int(p) for p in partner]
        m32 = t32.mixes[0]
        total = sum(gain(S32, i, j, rho) for i, j in enumerate(sigma) if j != i)
        best = sum(gain(S32, i, int(j), rho) for i, j in enumerate(m32.partner) if int(j) != i)
        assert total >= best - 4 * float(noise.sum()) - 1e-9
