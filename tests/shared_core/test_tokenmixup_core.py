"""shared_core.tokenmixup against explicit references: saliency by loops over hand-set attention, the matching by
brute force over every assignment, each row's mask and λ by loops (tokenmixup.md Eq. 3, 6-11)."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared_core.mix import mix_tokens
from shared_core.tokenmixup import (
    difficulty,
    htm_gain,
    htm_mix,
    htm_plan,
    mix_soft_target,
    token_saliency,
    vtm_select,
)


def ref_saliency(attn, P, mode):
    B, H, T, _ = attn.shape
    out = torch.zeros(B, T - P)
    for b in range(B):
        for t in range(T - P):
            if mode == 'cls':
                out[b, t] = sum(attn[b, h, 0, P + t] for h in range(H)) / H
            else:
                out[b, t] = sum(attn[b, h, q, P + t] for h in range(H) for q in range(T)) / (H * T)
    return out


def gain(S, i, j, rho):
    return sum(max(float(S[j, t] - S[i, t]) - rho, 0.0) for t in range(S.shape[1]))


def plan_of(S, rows, sigma, rho):
    """Each easy row's mask from its own saliency against its partner's and Eq. 11's λ, by loops."""
    B, N = S.shape
    partner = list(range(B))
    swap = torch.zeros(B, N, dtype=torch.bool)
    lam = [1.0] * B
    for i in rows:
        j = sigma[i]
        for t in range(N):
            swap[i, t] = float(S[j, t] - S[i, t]) > rho
        if swap[i].any():
            partner[i] = j
            kept = sum(float(S[i, t]) for t in range(N) if not swap[i, t])
            given_ = sum(float(S[j, t]) for t in range(N) if swap[i, t])
            lam[i] = kept / (kept + given_)
    return torch.tensor(partner), swap, torch.tensor(lam)


def assignments(S, easy, rho):
    """Brute force: every injective map of the easy rows into all columns, with its total gain (Eq. 6)."""
    B = S.shape[0]
    rows = [i for i in range(B) if easy[i]]
    scored = []
    for cols in itertools.permutations(range(B), len(rows)):
        scored.append((sum(gain(S, i, j, rho) for i, j in zip(rows, cols)), dict(zip(rows, cols))))
    return rows, scored


def ref_plan(S, easy, rho, chosen=None, tol=1e-9):
    """The plan of an optimal assignment (brute force), each row's mask from its own saliency and Eq. 11 by loops:
    ``(partner, swap, lam, best total)``.

    The optimum can be tied, so that which optimal assignment a solver returns depends on float rounding (at
    ρ = 0 every cycle of an assignment can be reversed at the same total). Given ``chosen``, the partners the code
    under test picked, the reference takes that plan where it is optimal (within ``tol`` of the best total): the
    test then checks that the code picked *an* optimal assignment and built its masks, λ and tokens right. Else,
    or where ``chosen`` is not optimal, the first optimal assignment in enumeration order."""
    rows, scored = assignments(S, easy, rho)
    best = max(total for total, _ in scored)
    plans = [plan_of(S, rows, sigma, rho) for total, sigma in scored if total >= best - tol]
    pick = plans[0]
    if chosen is not None:
        pick = next((p for p in plans if torch.equal(p[0], chosen.cpu())), pick)
    return (*pick, best)


def token_margin(S, partner, swap, rho):
    """The smallest distance of a row's saliency difference to the mask's threshold, relative to the two
    saliencies (``|S[j, t] − S[i, t] − ρ| / max(S[i, t], S[j, t])`` over the easy rows' tokens): where it is
    far above float32's 1e-7, two computations of ``S`` that agree to float noise make the same masks."""
    B, N = S.shape
    worst = math.inf
    for i in range(B):
        j = int(partner[i])
        if j == i:
            continue
        for t in range(N):
            d = abs(float(S[j, t] - S[i, t]) - rho) / max(float(S[i, t]), float(S[j, t]), 1e-30)
            worst = min(worst, d)
    return worst


def tie_free(S, easy, rho, tol=1e-5, margin=1e-4):
    """Whether a case has one plan that any two computations of ``S`` agreeing to float noise both make: every
    assignment within ``tol`` of the optimal total gives the same plan, and no matched token sits within
    ``margin`` (relative) of the mask's threshold. Tests that compare two implementations' plans assert it first
    (with a ``tol`` and ``margin`` above the noise between them)."""
    rows, scored = assignments(S, easy, rho)
    best = max(total for total, _ in scored)
    plans = [plan_of(S, rows, sigma, rho) for total, sigma in scored if total >= best - tol]
    same = all(torch.equal(p[0], plans[0][0]) and torch.equal(p[1], plans[0][1]) for p in plans)
    return same and token_margin(S, plans[0][0], plans[0][1], rho) > margin


def random_attention(B, H, T, g):
    return torch.randn(B, H, T, T, generator=g).mul(2).softmax(-1)


@pytest.mark.parametrize('P, mode', [(1, 'cls'), (1, 'mean'), (0, 'mean'), (2, 'cls')])
def test_saliency_matches_loops(P, mode):
    attn = random_attention(3, 4, P + 6, torch.Generator().manual_seed(0))
    S = token_saliency(attn, P, mode)
    assert S.shape == (3, 6) and S.dtype == torch.float32
    assert torch.allclose(S, ref_saliency(attn, P, mode), atol=1e-6)
    with pytest.raises(ValueError, match='mode'):
        token_saliency(attn, 0, 'cls') if P == 0 else token_saliency(attn, P, 'rollout')


def test_saliency_on_designed_attention():
    """Hand-set attention: the class token looks at patch 2 only; every query looks at patch 0 half the time."""
    B, H, P, N = 1, 2, 1, 4
    attn = torch.zeros(B, H, P + N, P + N)
    attn[:, :, 0, P + 2] = 1.0
    attn[:, :, 1:, P + 0] = 0.5
    attn[:, :, 1:, P + 1] = 0.5
    assert token_saliency(attn, P, 'cls').tolist() == [[0.0, 0.0, 1.0, 0.0]]
    assert torch.allclose(token_saliency(attn, P, 'mean'), torch.tensor([[0.4, 0.4, 0.2, 0.0]]))


@pytest.mark.parametrize('seed', range(6))
@pytest.mark.parametrize('B', [4, 5])
def test_plan_is_the_optimal_assignment_with_each_rows_own_mask(seed, B):
    g = torch.Generator().manual_seed(seed)
    S = torch.rand(B, 6, generator=g).softmax(-1)
    easy = torch.rand(B, generator=g) < 0.6
    rho = 0.01
    partner, swap, lam = htm_plan(S, easy, rho)
    r_partner, r_swap, r_lam, best = ref_plan(S, easy.tolist(), rho, chosen=partner)
    # an optimal assignment (the brute force's, where it is tied), and each row's mask and λ as the loops
    assert torch.equal(partner, r_partner) and torch.equal(swap, r_swap)
    assert torch.allclose(lam, r_lam.float(), atol=1e-6)
    total = sum(gain(S, i, int(partner[i]), rho) for i in range(B) if swap[i].any())
    assert math.isclose(total, best, rel_tol=1e-9, abs_tol=1e-12)
    assert not swap[~easy].any() and torch.equal(partner[~easy], torch.arange(B)[~easy])  # rows in place


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 7),
    N=st.integers(1, 9),
    rho=st.sampled_from([0.0, 0.005, 0.1]),
    seed=st.integers(0, 2**16),
    peaked=st.booleans(),
)
def test_the_gain_by_cdist_is_the_clamp_sum(B, N, rho, seed, peaked):
    """Eq. 6's gain built as one L1 distance plus row sums equals the explicit clamp-sum loops (float64)."""
    g = torch.Generator().manual_seed(seed)
    S = (torch.randn(B, N, generator=g) * (6 if peaked else 1)).softmax(-1)
    G = htm_gain(S, rho)
    assert G.shape == (B, B) and G.dtype == torch.float64
    for i in range(B):
        for j in range(B):
            assert math.isclose(float(G[i, j]), gain(S.double(), i, j, rho), rel_tol=1e-12, abs_tol=1e-14)


@pytest.mark.parametrize('seed', range(3))
def test_the_plan_at_full_size_reaches_the_optimal_total_of_the_explicit_gain(seed):
    """B = 128, N = 64, most rows easy: the plan's total gain, measured by the explicit clamp-sum, is the optimum
    of an assignment solved on the explicit (b', B, N) gain (today's construction), and each row's mask and λ
    follow Eq. 9 and 11 from the chosen partner."""
    from scipy.optimize import linear_sum_assignment

    g = torch.Generator().manual_seed(seed)
    B, N, rho = 128, 64, 0.005
    S = (torch.randn(B, N, generator=g) * 3).softmax(-1)
    easy = torch.rand(B, generator=g) < 0.8
    partner, swap, lam = htm_plan(S, easy, rho)
    s = S.double()
    rows = easy.nonzero().flatten()
    explicit = (s[None, :, :] - s[rows][:, None, :] - rho).clamp_min(0).sum(-1)  # (b', B)
    r, c = linear_sum_assignment(explicit.numpy(), maximize=True)
    best = float(explicit.numpy()[r, c].sum())
    sigma = torch.arange(B)
    sigma[rows] = partner[rows]
    # rows that swap nothing kept partner = i; their matched column's gain is 0 either way
    mine = sum(float(explicit[a, sigma[i]]) for a, i in enumerate(rows.tolist()) if swap[i].any())
    assert math.isclose(mine, best, rel_tol=1e-12)
    expected = easy[:, None] & (s[partner] - s > rho)
    assert torch.equal(swap, expected)
    kept, given = (s * ~swap).sum(1), (s[partner] * swap).sum(1)
    assert torch.allclose(lam.double(), torch.where(swap.any(1), kept / (kept + given), 1.0), atol=1e-7)


def test_optimal_matching_beats_greedy():
    """Easy rows A, B; partners X, Y. Greedy in row order gives A the best partner X (gain 3) and B then Y (0.9):
    3.9. The optimum gives A Y (2.9) and B X (2): 4.9."""
    S = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],  # A
            [0.0, 0.0, 1.0, 1.0],  # B
            [1.0, 1.0, 0.5, 0.5],  # X
            [0.0, 0.0, 1.45, 1.45],
        ]
    )  # Y
    easy = torch.tensor([True, True, False, False])
    partner, swap, lam = htm_plan(S, easy, 0.0)
    assert partner.tolist() == [3, 2, 2, 3]
    r_partner, r_swap, _, best = ref_plan(S, easy.tolist(), 0.0)
    assert torch.equal(partner, r_partner) and torch.equal(swap, r_swap) and math.isclose(best, 4.9, rel_tol=1e-6)
    greedy, used = 0.0, set()
    for i in (0, 1):
        j = max((j for j in range(4) if j not in used), key=lambda j: gain(S, i, j, 0.0))
        used.add(j)
        greedy += gain(S, i, j, 0.0)
    assert math.isclose(greedy, 3.9, rel_tol=1e-6)


def test_each_row_uses_its_own_saliency_not_the_first_easy_rows():
    """Two easy rows matched with each other. Row 1's own mask swaps its tokens 0 and 1 (where row 0 is more
    salient); the public code masks row 1 with the FIRST easy row's saliency, S[σ(1)] − S[0] = 0: nothing."""
    S = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]])
    partner, swap, lam = htm_plan(S, torch.ones(2, dtype=torch.bool), 0.05)
    assert partner.tolist() == [1, 0]
    assert swap.tolist() == [[False, False, True, True], [True, True, False, False]]
    public_mask_row1 = S[partner[1]] - S[0] > 0.05
    assert not public_mask_row1.any() and not torch.equal(swap[1], public_mask_row1)
    assert torch.allclose(
        lam, torch.tensor([(0.4 + 0.3) / (0.4 + 0.3 + 0.3 + 0.4), (0.3 + 0.4) / (0.3 + 0.4 + 0.4 + 0.3)])
    )


def test_tokens_and_targets_follow_the_plan_in_place():
    """Token ids encoded in the features: each output position shows which sample and patch it came from."""
    g = torch.Generator().manual_seed(3)
    B, N = 5, 4
    S = torch.rand(B, N, generator=g).softmax(-1)
    easy = torch.tensor([True, False, True, True, False])
    partner, swap, lam = htm_plan(S, easy, 0.0)
    mix = htm_mix(partner, swap, lam, (2, 2))
    ids = torch.stack([torch.stack([torch.tensor([b, t]).float() for t in range(N)]) for b in range(B)])  # (B,N,2)
    out = mix_tokens(ids, mix)
    for b in range(B):
        for t in range(N):
            src = int(partner[b]) if swap[b, t] else b
            assert out[b, t].tolist() == [src, t]
    y = torch.nn.functional.one_hot(torch.arange(B), B).float() * 0.9 + 0.1 / B
    mixed = mix_soft_target(y, mix)
    for b in range(B):
        expected = lam[b] * y[b] + (1 - lam[b]) * y[partner[b]]
        assert torch.allclose(mixed[b], expected)
    assert torch.allclose(mixed.sum(1), torch.ones(B))


def test_difficulty_and_vtm_select():
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    target = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    ce = [-math.log(math.exp(2) / (math.exp(2) + 2)), math.log(3)]
    assert torch.allclose(difficulty(logits, target), 0.1 * torch.tensor(ce))
    S = torch.tensor([[0.1, 0.5, 0.2, 0.2], [0.4, 0.1, 0.3, 0.2]])
    assert vtm_select(S, 2).tolist() == [[1, 2], [0, 2]] or vtm_select(S, 2).tolist() == [[1, 3], [0, 2]]
    assert vtm_select(S, 1).tolist() == [[1], [0]]
    with pytest.raises(ValueError, match='kappa'):
        vtm_select(S, 5)


def test_bad_input():
    S = torch.rand(4, 3)
    with pytest.raises(ValueError, match='easy'):
        htm_plan(S, torch.ones(3, dtype=torch.bool), 0.0)
    with pytest.raises(ValueError, match='rho'):
        htm_plan(S, torch.ones(4, dtype=torch.bool), -0.1)
    with pytest.raises(ValueError, match='grid'):
        htm_mix(*htm_plan(S, torch.ones(4, dtype=torch.bool), 0.0), (2, 2))
    with pytest.raises(ValueError, match='target'):
        difficulty(torch.zeros(2, 3), torch.zeros(2, 4))


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 7),
    N=st.integers(1, 9),
    seed=st.integers(0, 10**6),
    rho=st.floats(0.0, 0.2),
    p_easy=st.floats(0.0, 1.0),
)
def test_plan_properties(B, N, seed, rho, p_easy):
    g = torch.Generator().manual_seed(seed)
    S = torch.rand(B, N, generator=g).softmax(-1)
    easy = torch.rand(B, generator=g) < p_easy
    partner, swap, lam = htm_plan(S, easy, rho)
    assert partner.dtype == torch.int64 and swap.dtype == torch.bool and lam.dtype == torch.float32
    assert ((lam >= 0) & (lam <= 1)).all()
    assert torch.equal(lam[~swap.any(1)], torch.ones(int((~swap.any(1)).sum())))
    assert not swap[~easy].any()
    assert len(set(partner[swap.any(1)].tolist())) == int(swap.any(1).sum())  # distinct partners
    y = torch.rand(B, 3, generator=g).softmax(-1)
    assert torch.allclose(mix_soft_target(y, htm_mix(partner, swap, lam, (1, N))).sum(1), torch.ones(B), atol=1e-6)


def test_a_chain_takes_partner_tokens_from_the_pre_mix_batch():
    """Row 0 takes tokens from row 1 while row 1 takes the same positions from row 2: row 0 must receive row 1's
    ORIGINAL tokens, not the ones row 1 got from row 2 (the optimum here is the chain 0 <- 1 <- 2)."""
    S = torch.tensor([[0.2, 0.3, 0.7], [0.9, 0.4, 0.9], [0.4, 0.6, 1.0]])
    partner, swap, lam = htm_plan(S, torch.tensor([True, True, False]), 0.05)
    assert partner.tolist() == [1, 2, 2]
    assert swap.tolist() == [[True, True, True], [False, True, True], [False, False, False]]
    ids = torch.tensor([[[b, t] for t in range(3)] for b in range(3)], dtype=torch.float32)
    out = mix_tokens(ids, htm_mix(partner, swap, lam, (1, 3)))
    assert out[0].tolist() == [[1, 0], [1, 1], [1, 2]]  # row 1's own tokens, also at positions 1 and 2
    assert out[1].tolist() == [[1, 0], [2, 1], [2, 2]]
