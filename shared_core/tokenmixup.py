"""TokenMixup (the TokenMixup paper): attention-guided token mixing inside the network, framework-free.

Horizontal TokenMixup (HTM, Sec. 3.2-3.4) acts on the input of one block ``L``:

- difficulty: a sample is *easy* when ``scale · CE(ScoreNet(x).detach(), y) ≤ τ`` (:func:`difficulty`; the
  public code's ``scale = 0.1`` and ``≤``; the paper writes ``CE < τ``, so τ is in units of ``0.1 · CE``);
- saliency ``S (B, N)`` of the patch tokens from block ``L``'s own attention on the pre-mix tokens
  (:func:`token_saliency`: the class-token query row, or Eq. 3's mean over all queries);
- optimal matching (Eq. 6-8): gain ``G[i, j] = Σ_t max(S[j, t] − S[i, t] − ρ, 0)`` for easy rows ``i`` and all
  columns ``j``; ``σ`` the optimal rectangular assignment of easy rows to distinct columns
  (``scipy.optimize.linear_sum_assignment``);
- token mask (Eq. 9-10): row ``i`` takes its partner's token at ``t`` where ``S[σ(i), t] − S[i, t] > ρ`` — with
  row ``i``'s OWN saliency (the public code uses the first easy row's for every row);
- label (Eq. 11): ``λ_i = Σ_{kept} S[i] / (Σ_{kept} S[i] + Σ_{swapped} S[σ(i)])``, ``y_i ← λ_i y_i + (1 − λ_i) y_σ(i)``.

Rows are never reordered (the public code moves mixed rows first). A plan is a :class:`~shared_core.mix.Mix`
(:func:`htm_mix`) whose shares are 0/1 per patch token, so tokens mix with :func:`~shared_core.mix.mix_tokens`
and soft targets with :func:`mix_soft_target`. It describes a *token-space* mix at block ``L``: its
``img_size``/``pixel_share`` mean nothing for images.

Vertical TokenMixup (VTM, Sec. 3.5) lets block ``L`` attend, besides its own tokens, to the ``κ`` most salient
tokens of each earlier block's input (:func:`vtm_select`). Where an earlier block is an HTM block, its input is
the mixed one, and the tokens are chosen by the block's own attention on that mixed input (``vtm_memory='mixed'``,
ours); the public code chooses them by the saliency HTM computed on the *pre-mix* input and takes them from the
mixed input (``vtm_memory='public'``).
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Callable, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
from scipy.optimize import linear_sum_assignment

from .checks import check_layers, check_real
from .mix import Mix, mix_rows, mix_tokens, own_lam
from .options import VTM_MEMORY

__all__ = [
    'SALIENCY_MODES',
    'DIFFICULTY_SCALE',
    'VTM_MEMORY',
    'token_saliency',
    'qk_saliency',
    'difficulty',
    'check_tau',
    'htm_gain',
    'assignment',
    'htm_plan',
    'htm_mix',
    'mix_soft_target',
    'vtm_select',
    'SCORENETS',
    'ScoreNet',
    'scorenets',
    'TokenMixupAdapter',
    'TokenMixupHooks',
]

#: how a block's attention becomes patch saliency: the class-token query row, or Eq. 3's mean over all queries
SALIENCY_MODES = ('cls', 'mean')
#: the public code's scale of the difficulty (``0.1 · CE ≤ τ``)
DIFFICULTY_SCALE = 0.1


def token_saliency(attn: torch.Tensor, num_prefix_tokens: int, mode: str) -> torch.Tensor:
    """``(B, N)`` fp32 saliency of the ``N`` patch tokens from one block's attention probabilities
    ``attn (B, H, T_q, T)`` (prefix tokens first, ``T = P + N``): head mean, then ``'cls'``: the class-token
    query row over the patch keys, ``attn.mean(1)[:, 0, P:]`` (``T_q`` may be 1: that row alone); ``'mean'``
    (Eq. 3): the mean over all queries, ``attn.mean(1)[:, :, P:].mean(1)`` (``T_q = T``)."""
    if mode not in SALIENCY_MODES:
        raise ValueError(f'mode: expected one of {SALIENCY_MODES}, got {mode!r}')
    if attn.dim() != 4 or (mode == 'mean' and attn.shape[-1] != attn.shape[-2]):
        raise ValueError(f'attn: expected (B, H, T, T) attention probabilities, got {tuple(attn.shape)}')
    P = int(num_prefix_tokens)
    if not 0 <= P < attn.shape[-1]:
        raise ValueError(f'num_prefix_tokens: expected in [0, {attn.shape[-1]}), got {num_prefix_tokens}')
    if mode == 'cls' and P < 1:
        raise ValueError("mode: 'cls' reads the class-token row; this attention has no prefix token (use 'mean')")
    A = attn.detach().float().mean(1)
    return A[:, 0, P:] if mode == 'cls' else A[:, :, P:].mean(1)


def qk_saliency(q: torch.Tensor, k: torch.Tensor, scale: float, num_prefix_tokens: int, mode: str) -> torch.Tensor:
    """:func:`token_saliency` of ``softmax(q kᵀ · scale)`` for ``q``, ``k`` ``(B, H, T, d)`` of one block, in fp32
    with autocast off and no gradient. ``'cls'`` computes only the class-token query row, ``(B, H, 1, T)``: the
    full ``(B, H, T, T)`` attention is materialised for Eq. 3 (``'mean'``) only."""
    with torch.no_grad(), torch.autocast(device_type=q.device.type, enabled=False):
        q, k = q.detach().float(), k.detach().float()
        if mode == 'cls':
            q = q[:, :, :1]
        return token_saliency((q @ k.transpose(-2, -1) * scale).softmax(-1), num_prefix_tokens, mode)


def check_tau(tau) -> float:
    """τ as a float: a number ``>= 0``, ``inf`` for every sample easy (NaN or a negative τ would mark no sample
    easy, switching HTM off without a word)."""
    if isinstance(tau, bool) or not isinstance(tau, numbers.Real) or not tau >= 0:
        raise ValueError(f'tau: expected a number >= 0 (inf: every sample easy), got {tau!r}')
    return float(tau)


def difficulty(logits: torch.Tensor, target: torch.Tensor, scale: float = DIFFICULTY_SCALE) -> torch.Tensor:
    """``(B,)`` detached ``scale · CE(logits, target)`` per sample, ``target`` a soft ``(B, C)`` target; a sample is
    easy where it is ``≤ τ``."""
    if logits.shape != target.shape or logits.dim() != 2:
        raise ValueError(
            f"target: expected a soft target of the logits' shape {tuple(logits.shape)}, got {tuple(target.shape)}"
        )
    logp = torch.log_softmax(logits.detach().float(), -1)
    return -(target.detach().float() * logp).sum(-1) * scale


def htm_gain(S: torch.Tensor, rho: float) -> torch.Tensor:
    """Eq. 6's gain ``G[i, j] = Σ_n max(S_j[n] − S_i[n] − ρ, 0)`` ``(B, B)`` in float64 on ``S``'s device. The
    clamp-sum is an L1 distance in disguise: ``max(a − c, 0) = (|a − c| + a − c) / 2`` with ``c = b + ρ``, so ``G =
    (cdist_1(S_i + ρ, S_j) + ΣS_j − ΣS_i − Nρ) / 2``: one ``torch.cdist(p=1)`` and row sums instead of a
    ``(B, B, N)`` tensor."""
    s = S.detach().double()
    dist = torch.cdist(s + rho, s, p=1)
    return (dist + s.sum(1)[None, :] - (s.sum(1) + rho * s.shape[1])[:, None]).mul_(0.5).clamp_min_(0.0)


@torch.library.custom_op('tokenaug::assignment', mutates_args=())
def assignment(gain: torch.Tensor) -> torch.Tensor:
    """``σ`` ``(R,)`` int64: each row's column in an assignment of the ``R ≤ C`` rows of ``gain`` ``(R, C)`` to
    distinct columns that maximises the total gain (``scipy.optimize.linear_sum_assignment`` on the host; the
    matrix goes to the host, the ``(R,)`` answer comes back). A custom op (its shape is known without running it),
    so a compiled model keeps the rest of its graph around it."""
    r, c = linear_sum_assignment(gain.detach().cpu().numpy(), maximize=True)
    sigma = np.empty(gain.shape[0], dtype=np.int64)
    sigma[r] = c
    return torch.from_numpy(sigma).to(gain.device)


@assignment.register_fake
def _(gain):
    return gain.new_empty(gain.shape[0], dtype=torch.long)


def htm_plan(S: torch.Tensor, easy: torch.Tensor, rho: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HTM's plan from saliency ``S (B, N)`` and the easy rows ``easy (B,)`` bool: ``(partner (B,) int64,
    swap (B, N) bool, lam (B,) float32)`` on ``S``'s device (see the module docstring). The gain is built on
    ``S``'s device in float64 (:func:`htm_gain`), with the rows of samples that are not easy set to 0: they then
    take what columns the easy rows leave, at no gain, so the square assignment gives the easy rows an optimum of
    the rectangular one, and every shape is known before the data (no host sync but the assignment's own, one
    graph under ``torch.compile``). Rows stay in place; a row with nothing swapped has ``partner = i`` and
    ``lam = 1``."""
    if S.dim() != 2:
        raise ValueError(f'S: expected (B, N) saliency, got {tuple(S.shape)}')
    if easy.shape != S.shape[:1] or easy.dtype != torch.bool:
        raise ValueError(f'easy: expected a (B,) = ({S.shape[0]},) bool tensor, got {easy.dtype} {tuple(easy.shape)}')
    if not rho >= 0:
        raise ValueError(f'rho: expected a saliency margin >= 0, got {rho}')
    s = S.detach().double()
    e = easy.to(s.device)
    identity = torch.arange(s.shape[0], device=s.device)
    sigma = torch.where(e, assignment(htm_gain(s, rho) * e[:, None]), identity)
    swap = e[:, None] & (s[sigma] - s > rho)  # Eq. 9: each row with its own saliency
    mixed = swap.any(1)
    partner = torch.where(mixed, sigma, identity)
    kept = (s * ~swap).sum(1)
    given = (s[partner] * swap).sum(1)
    lam = torch.where(mixed, kept / (kept + given).clamp_min(torch.finfo(torch.float64).tiny), 1.0)
    return partner, swap, lam.float()


def htm_mix(
    partner: torch.Tensor,
    swap: torch.Tensor,
    lam: torch.Tensor,
    grid: Tuple[int, int],
    patch_size: Tuple[int, int] = (1, 1),
) -> Mix:
    """An HTM plan as a :class:`Mix` on the ``grid`` of patch tokens (0/1 shares: ``swap``), so the token swap is
    :func:`~shared_core.mix.mix_tokens` and the label :func:`mix_soft_target`."""
    B, N = swap.shape
    gh, gw = int(grid[0]), int(grid[1])
    if gh * gw != N:
        raise ValueError(f'grid: {gh}x{gw} tokens for a plan over {N} patch tokens')
    ph, pw = int(patch_size[0]), int(patch_size[1])
    return Mix(
        partner=partner,
        lam=lam.float(),
        token_share=swap.float().view(B, gh, gw),
        img_size=(gh * ph, gw * pw),
        patch_size=(ph, pw),
        kind='tokenmixup',
    )


def mix_soft_target(target: torch.Tensor, mix: Mix) -> torch.Tensor:
    """``λ · y + (1 − λ) · y[partner]`` for soft targets ``(B, C)`` (HTM relabels targets that MixUp/CutMix
    already mixed); rows keep summing to 1."""
    if target.dim() != 2 or target.shape[0] != mix.batch_size:
        raise ValueError(f'target: expected (B={mix.batch_size}, C) soft targets, got {tuple(target.shape)}')
    return mix_rows(target.float(), mix.partner, 1.0 - own_lam(mix), mix.reversed_pairs)


def vtm_select(S: torch.Tensor, kappa: int) -> torch.Tensor:
    """``(B, κ)`` int64 indices into the ``N`` patch tokens, the most salient first (add the number of prefix
    tokens before gathering from a sequence that has them)."""
    if S.dim() != 2:
        raise ValueError(f'S: expected (B, N) saliency, got {tuple(S.shape)}')
    if not isinstance(kappa, int) or not 1 <= kappa <= S.shape[1]:
        raise ValueError(f'kappa: expected an int in [1, {S.shape[1]}], got {kappa!r}')
    return S.topk(kappa, dim=1, sorted=True).indices


# ----------------------------------------------------------------------------------------------
# The driver: what every adapter runs (hooks on the blocks -> the model's forward -> the relabelled target)
# ----------------------------------------------------------------------------------------------

#: how a ScoreNet pools a block's tokens before its linear classifier
SCORENETS = ('cls', 'attn_pool', 'avg')


class ScoreNet(nn.Module):
    """TokenMixup's difficulty classifier on a block's input tokens ``(B, P + N, D)``: a pooling (``'cls'``: the
    class token; ``'avg'``: the patch-token mean; ``'attn_pool'``: ``softmax(Linear(D, 1)(x))ᵀ x`` over the patch
    tokens, the public CCT code's) and one linear layer to the classes."""

    def __init__(self, dim: int, num_classes: int, pool: str = 'cls', num_prefix_tokens: int = 1):
        super().__init__()
        if pool not in SCORENETS:
            raise ValueError(f'scorenet: expected one of {SCORENETS}, got {pool!r}')
        if pool == 'cls' and num_prefix_tokens < 1:
            raise ValueError("scorenet: 'cls' reads the class token; this model has none (use 'attn_pool' or 'avg')")
        self.pool, self.num_prefix_tokens = pool, int(num_prefix_tokens)
        self.attn = nn.Linear(dim, 1) if pool == 'attn_pool' else None
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool == 'cls':
            return self.fc(x[:, 0])
        tokens = x[:, self.num_prefix_tokens :]
        if self.pool == 'avg':
            return self.fc(tokens.mean(1))
        w = self.attn(tokens).softmax(1)  # (B, N, 1)
        return self.fc((w * tokens).sum(1))


def scorenets(
    container: nn.Module,
    layers: Sequence[int],
    dim: int,
    num_classes: int,
    num_prefix_tokens: int,
    has_class_token: bool,
    scorenet: str = 'auto',
    attr: str = 'tokenmixup_scorenet',
) -> nn.ModuleDict:
    """``container.<attr>``: one :class:`ScoreNet` per HTM block (kept where present), so the optimizer, EMA and
    checkpoints of ``container`` hold them. ``scorenet='auto'``: ``'cls'`` with a class token, else ``'attn_pool'``."""
    pool = ('cls' if has_class_token else 'attn_pool') if scorenet == 'auto' else scorenet
    nets = getattr(container, attr, None)
    if nets is None:
        nets = nn.ModuleDict()
        setattr(container, attr, nets)
    device = next(container.parameters()).device
    for idx in layers:
        if str(idx) not in nets:
            nets[str(idx)] = ScoreNet(dim, num_classes, pool, num_prefix_tokens).to(device)
    return nets


class TokenMixupAdapter(Protocol):
    """What a framework gives the driver (one per model family; see the adapters).

    - ``blocks``: the transformer blocks; a forward pre-hook's first argument is the block's input ``(B, T, D)``;
    - ``num_prefix_tokens``, ``has_class_token``, ``embed_dims`` (the token width, for the ScoreNets);
    - ``qk(idx, x)``: the ``q``, ``k`` ``(B, H, T, d)`` block ``idx`` computes from input ``x`` (no grad, autocast
      off; its norm and projections, before the softmax);
    - ``capture_qk(idx, sink)``: hooks that put the detached ``q``, ``k`` block ``idx`` computes in the forward
      into ``sink['q']``, ``sink['k']``; returns the handles; ``scale(idx)`` the attention's scale;
    - ``attend_with_memory(idx, memory)``: make the next call of block ``idx``'s attention take ``memory``
      ``(B, M, D)`` (the residual stream, before the block's norm) as extra keys and values; returns a function
      that undoes it.
    """

    blocks: Sequence[nn.Module]
    num_prefix_tokens: int
    has_class_token: bool
    embed_dims: int

    def qk(self, idx: int, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]: ...

    def capture_qk(self, idx: int, sink: dict) -> list: ...

    def scale(self, idx: int) -> float: ...

    def attend_with_memory(self, idx: int, memory: torch.Tensor) -> Callable[[], None]: ...


class TokenMixupHooks:
    """HTM and VTM on any model an adapter describes (the module docstring's rules).

    :meth:`run` registers the hooks, runs ``forward()`` (the token path) and removes them; it returns the output, the
    relabelled soft target, the ScoreNet loss (with gradient), the statistics and the HTM plans. Nothing is kept
    between calls.
    """

    def __init__(
        self,
        adapter: TokenMixupAdapter,
        nets: Optional[nn.ModuleDict],
        htm_layers: Sequence[int] = (),
        vtm_layers: Sequence[int] = (),
        rho: float = 0.005,
        tau: float = 0.2,
        kappa: int = 3,
        saliency: str = 'cls',
        scorenet_weight: float = 1e-3,
        scorenet_stopgrad: bool = False,
        vtm_stopgrad: bool = False,
        difficulty_scale: float = DIFFICULTY_SCALE,
        vtm_memory: str = 'mixed',
    ):
        depth = len(adapter.blocks)
        self.htm_layers = sorted(check_layers(htm_layers, depth, 'htm_layers'))
        self.vtm_layers = sorted(check_layers(vtm_layers, depth, 'vtm_layers'))
        if not self.htm_layers and not self.vtm_layers:
            raise ValueError('htm_layers, vtm_layers: give at least one block for HTM or VTM')
        if self.vtm_layers and self.vtm_layers[0] == 0:
            raise ValueError('vtm_layers: block 0 has no earlier block to take tokens from')
        P = adapter.num_prefix_tokens
        token_saliency(torch.zeros(1, 1, P + 1, P + 1), P, saliency)  # the mode against the model
        rho = check_real(rho, 'rho', lo=0.0)  # a finite margin (ρ = inf would swap nothing)
        tau = check_tau(tau)
        if isinstance(kappa, bool) or not isinstance(kappa, int) or kappa < 1:
            raise ValueError(f'kappa: expected an int >= 1, got {kappa!r}')
        scorenet_weight = check_real(scorenet_weight, 'scorenet_weight', lo=0.0)
        difficulty_scale = check_real(difficulty_scale, 'difficulty_scale', lo=0.0, lo_open=True)
        if vtm_memory not in VTM_MEMORY:
            raise ValueError(f'vtm_memory: expected one of {VTM_MEMORY}, got {vtm_memory!r}')
        self.vtm_memory = vtm_memory
        self.adapter, self.nets, self.saliency = adapter, nets, saliency
        self.rho, self.tau, self.kappa = float(rho), float(tau), kappa
        self.scorenet_weight, self.scorenet_stopgrad = float(scorenet_weight), scorenet_stopgrad
        self.vtm_stopgrad, self.difficulty_scale = vtm_stopgrad, float(difficulty_scale)

        self._observe: Optional[Callable] = None

    @contextlib.contextmanager
    def observing(self, observe: Callable):
        """Inside the ``with`` block, ``observe(index, saliency, easy, difficulty)`` after each HTM block's plan of
        every forward (its saliency ``(B, N)``, easy rows ``(B,)`` and difficulty ``(B,)``, detached on the CPU):
        what ``tokenaug-viz tokenmixup`` draws, from any adapter's forward (a timm wrapper's, mm's ``loss``)."""
        outer, self._observe = self._observe, observe
        try:
            yield
        finally:
            self._observe = outer

    def run(self, y: torch.Tensor, forward: Callable[[], torch.Tensor]):
        """``(output, target (B, C), aux_loss, stats, mixes)`` of one training forward with soft target ``y``."""
        state = dict(y=y, aux=[], stats={}, mixes=[], inputs={}, qk={}, premix={}, undo=[], observe=self._observe)
        handles = []
        need_memory = set(range(self.vtm_layers[-1])) if self.vtm_layers else set()
        for idx, blk in enumerate(self.adapter.blocks):
            if idx in self.htm_layers:
                handles.append(blk.register_forward_pre_hook(self._htm_hook(idx, state, idx in need_memory)))
            if idx in need_memory:  # after HTM's hook: the block's actual (mixed) input
                handles.append(
                    blk.register_forward_pre_hook(lambda m, args, i=idx: state['inputs'].__setitem__(i, args[0]))
                )
                if not (self.vtm_memory == 'public' and idx in self.htm_layers):  # else HTM's pre-mix saliency
                    handles += self.adapter.capture_qk(idx, state['qk'].setdefault(idx, {}))
            if idx in self.vtm_layers:
                handles.append(blk.register_forward_pre_hook(self._vtm_hook(idx, state)))
        try:
            output = forward()
        finally:
            for h in handles:
                h.remove()
            for undo in state['undo']:
                undo()
        aux = torch.stack(state['aux']).sum() if state['aux'] else torch.zeros((), device=state['y'].device)
        stats = {
            name: dict(easy=int(v['easy']), mixed=int(v['mixed']), swapped=float(v['swapped']))
            for name, v in state['stats'].items()
        }
        return output, state['y'], aux, stats, state['mixes']

    def _htm_hook(self, idx: int, state: dict, memory: bool = False):
        P = self.adapter.num_prefix_tokens
        keep_premix = memory and self.vtm_memory == 'public'

        def hook(module, args):
            x = args[0]
            scores = self.nets[str(idx)](x.detach() if self.scorenet_stopgrad else x)
            y = state['y']
            state['aux'].append(self.scorenet_weight * -(y * torch.log_softmax(scores.float(), -1)).sum(-1).mean())
            hardness = difficulty(scores, y, self.difficulty_scale)
            easy = hardness <= self.tau
            S = qk_saliency(*self.adapter.qk(idx, x), self.adapter.scale(idx), P, self.saliency)
            partner, swap, lam = htm_plan(S, easy, self.rho)
            if keep_premix:  # VTM's memory of this block, chosen as the public code does
                state['premix'][idx] = S
            if state['observe'] is not None:
                state['observe'](idx, S.detach().float().cpu(), easy.detach().cpu(), hardness.detach().cpu())
            mix = htm_mix(partner, swap, lam, (1, S.shape[1]))
            state['mixes'].append(mix)
            mixed = swap.any(1)
            # tensors here (read as numbers after the forward: no host sync inside a compiled model); a batch with
            # nothing swapped mixes too, exactly as nothing (shares 0, λ 1)
            swapped = swap.sum(1)
            state['stats'][f'htm{idx}'] = dict(
                easy=easy.sum(), mixed=mixed.sum(), swapped=swapped.sum() / mixed.sum().clamp_min(1)
            )
            state['y'] = mix_soft_target(y, mix)
            tokens = mix_tokens(x[:, P:], mix)  # partner tokens from the pre-mix batch
            return (torch.cat([x[:, :P], tokens], 1),) + tuple(args[1:])

        return hook

    def _vtm_hook(self, idx: int, state: dict):
        P = self.adapter.num_prefix_tokens

        def hook(module, args):
            memory = []
            for src in range(idx):
                x_src = state['inputs'][src]
                if src in state['premix']:
                    S = state['premix'][src]
                else:
                    qk = state['qk'][src]
                    S = qk_saliency(qk['q'], qk['k'], self.adapter.scale(src), P, self.saliency)
                top = vtm_select(S, self.kappa) + P
                tokens = x_src.gather(1, top[:, :, None].expand(-1, -1, x_src.shape[-1]))
                memory.append(tokens.detach() if self.vtm_stopgrad else tokens)
            state['undo'].append(self.adapter.attend_with_memory(idx, torch.cat(memory, 1)))
            return None

        return hook
