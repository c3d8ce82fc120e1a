"""Token labeling's objective and MixToken, framework-free (the Token Labeling paper, Sec. 3.2-3.3).

- MixToken (Eq. 5): the patch tokens of two images are swapped inside a box on the token grid, right
  after patch embedding (:func:`swap_tokens` with a ``'token_box'`` :class:`Mix`).
- Dense targets (Eq. 6) stay each sample's own: the model's dense outputs are *un-mixed*
  (:func:`unmix_tokens`), so the output at a token position of sample ``i`` is the prediction for the
  content that came from sample ``i``. For the pairwise mixes of MixToken (partner ``B-1-i``, the
  same box for both members of a pair) this is a permutation of the (output, target) pairs of Eq. 6,
  so the loss is the same as mixing the targets.
- The class target (Eq. 7) is mixed by the box's area: ``M̄ · y_i + (1 - M̄) · y_partner``, ``M̄`` the
  share of the sample's own tokens (``mix.lam``).
- Loss (Eq. 3-4): ``H(cls, y_cls) + β · mean_tokens H(aux_i, y_i)``, ``H`` the soft-target cross
  entropy, ``β = 0.5`` in the paper.

The class target can be the ground truth (the paper's Eq. 1/7), the annotator's pooled label over the
crop (the public code's default; ReLabel, :func:`shared_core.label_maps.crop_targets`) or a blend.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .checks import check_int, check_real
from .label_maps import CropMaps, SparseTokenTargets, crop_logit_targets, crop_targets, token_targets_sparse
from .mix import Mix, check_labels, mix_images, mix_rows, one_hot, own_lam
from .options import CLS_TARGET_POOLS, HEAD_RULES
from .samplers import MixSampler

__all__ = [
    'CLS_TARGETS',
    'HEAD_RULES',
    'AUX_WEIGHT',
    'MIXTOKEN_MODES',
    'check_pairwise_swap',
    'unmix_tokens',
    'TokenSwap',
    'token_swap',
    'swap_tokens',
    'mix_dense_targets',
    'mix_class_target',
    'class_target',
    'TokenTargetSpec',
    'token_labeling_targets',
    'inference_logits',
    'check_head_rule',
    'mixtoken_sampler',
    'draw_mixtoken',
    'mixtoken_applied',
    'mix_patch_embed_output',
    'soft_cross_entropy',
    'token_labeling_loss',
]

#: where the class token's target comes from
CLS_TARGETS = ('gt', 'annotator', 'mix')
#: weight of the aux term in the ``'cls+aux'`` rule (public code: ``x_cls + 0.5 * x_aux.max(1)[0]``)
AUX_WEIGHT = 0.5
#: MixToken's un-mixing needs pairwise swaps: one box per batch (the public code) or per pair (i, B-1-i)
MIXTOKEN_MODES = ('batch', 'pair')


def check_pairwise_swap(mix: Mix) -> None:
    """Refuse a mix that :func:`unmix_tokens` cannot undo (call it on the CPU mix, before moving it). A
    batch-mode token mask of the samplers (flipped partners, one 0/1 mask for all) is a pairwise swap by
    construction."""
    if (
        mix.reversed_pairs
        and mix.batch_lam is not None
        and mix.kind in ('token_box', 'tokenmix_block', 'tokenmix_random', 'none')
    ):
        return
    partner = mix.partner
    ar = torch.arange(len(partner), device=partner.device)
    share = mix.token_share_flat()
    if (
        not torch.equal(partner[partner], ar)
        or not torch.equal(share, share[partner])
        or not ((share == 0) | (share == 1)).all()
    ):
        raise ValueError(
            'mix: un-mixing needs a pairwise token swap (partner of the partner is the sample, '
            'both members with the same 0/1 token mask: MixToken in batch or pair mode)'
        )


class TokenSwap(NamedTuple):
    """A pairwise token swap on the training device (:func:`token_swap`): ``swapped (B, N, 1)`` bool, where sample
    ``i`` takes the token of ``partner[i]`` (``partner`` None: the reversed batch, the samplers' pairing)."""

    swapped: torch.Tensor
    partner: Optional[torch.Tensor]


def token_swap(mix: Mix, device) -> TokenSwap:
    """The :class:`TokenSwap` of a MixToken ``mix`` on ``device``, made once per step for the patch-embedding hook
    and the un-mixing. The mix must be a pairwise swap (:func:`check_pairwise_swap`): checked here when it is on the
    CPU; on an accelerator that is the caller's job (a check there would stall the step on a device sync), and
    :func:`draw_mixtoken` checks the mix before moving it."""
    if mix.partner.device.type == 'cpu':
        check_pairwise_swap(mix)
    device = torch.device(device)
    return TokenSwap(
        mix.token_share_flat().to(device).bool().unsqueeze(-1), None if mix.reversed_pairs else mix.partner.to(device)
    )


def swap_tokens(tokens: torch.Tensor, swap: Union[Mix, TokenSwap], name: str = 'tokens') -> torch.Tensor:
    """MixToken's token swap (Eq. 5) on ``(B, N, D)`` tokens: sample ``i`` takes its partner's token where its
    0/1 mask is set (``swap``: a :class:`TokenSwap`, or a MixToken :class:`Mix`, made one by :func:`token_swap`).
    A pairwise swap is its own inverse: the same call un-mixes outputs (:func:`unmix_tokens`), and its backward
    is the swap of the gradient (two ops where autograd's chain of ``where`` and ``flip`` takes six)."""
    if isinstance(swap, Mix):
        swap = token_swap(swap, tokens.device)
    B, N = swap.swapped.shape[:2]
    if tokens.dim() != 3 or tuple(tokens.shape[:2]) != (B, N):
        raise ValueError(f'{name}: expected (B={B}, N={N}, D) tokens, got {tuple(tokens.shape)}')
    return _TokenSwap.apply(tokens, swap.swapped, swap.partner)


def unmix_tokens(tokens: torch.Tensor, swap: Union[Mix, TokenSwap]) -> torch.Tensor:
    """Undo a pairwise token swap on per-token outputs ``(B, N, D)``: where sample ``i`` received its
    partner's token, take the output of the partner's row, which holds ``i``'s own token there. A pairwise
    swap is its own inverse, so this is :func:`swap_tokens`."""
    return swap_tokens(tokens, swap, 'tokens')


class _TokenSwap(torch.autograd.Function):
    """``where(swapped, tokens[partner], tokens)`` (``partner`` None: the reversed batch) for a pairwise swap,
    whose backward is the same swap of the gradient."""

    @staticmethod
    def forward(ctx, tokens, swapped, partner):
        ctx.save_for_backward(swapped, partner)
        return _swap(tokens, swapped, partner)

    @staticmethod
    def backward(ctx, grad):
        swapped, partner = ctx.saved_tensors
        return _swap(grad, swapped, partner), None, None


def _swap(t: torch.Tensor, swapped: torch.Tensor, partner: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.where(swapped, t.flip(0) if partner is None else t[partner], t)


def mix_dense_targets(targets: torch.Tensor, mix: Mix) -> torch.Tensor:
    """Eq. 6: ``Ŷ = Y_i ⊙ (1 - s) + Y_partner ⊙ s`` for dense targets ``(B, N, C)`` (any mix)."""
    return mix_rows(targets, mix.partner, mix.token_share_flat(), mix.reversed_pairs)


def mix_class_target(target: torch.Tensor, mix: Optional[Mix]) -> torch.Tensor:
    """Eq. 7: ``M̄ · y + (1 - M̄) · y[partner]`` with ``M̄ = mix.lam`` (own share); rows still sum to 1."""
    if mix is None:
        return target
    return mix_rows(target, mix.partner, 1.0 - own_lam(mix), mix.reversed_pairs)


def class_target(
    gt: torch.Tensor, annotator: Optional[torch.Tensor], kind: str = 'gt', mix_weight: float = 0.5
) -> torch.Tensor:
    """The class token's target ``(B, C)`` before mixing: ``'gt'`` the (smoothed) ground truth,
    ``'annotator'`` the annotator's pooled label over the crop, ``'mix'`` ``w · annotator + (1 - w) · gt``."""
    if kind not in CLS_TARGETS:
        raise ValueError(f'cls_target: expected one of {CLS_TARGETS}, got {kind!r}')
    if kind == 'gt':
        return gt
    if annotator is None:
        raise ValueError(f"cls_target={kind!r} needs the annotator's label maps (no maps were given)")
    if kind == 'annotator':
        return annotator
    if not 0.0 <= mix_weight <= 1.0:
        raise ValueError(f'cls_target_mix: expected a weight in [0, 1], got {mix_weight}')
    return annotator * mix_weight + gt * (1.0 - mix_weight)


@dataclasses.dataclass(frozen=True)
class TokenTargetSpec:
    """What token labeling's targets are made of, checked once, where an adapter builds it (timm's
    ``TokenLabelingLoss``, mm's ``TokenLabelingHead``): the one place these options are checked.

    Attributes:
        num_classes: C (at least 2).
        smoothing: ε of the class and the token targets, ``(1 - ε) · p + ε / C``, in ``[0, 1)``.
        cls_target: the class token's target: ``'gt'`` (the paper), ``'annotator'`` (the annotator's label pooled
            over the crop, ReLabel) or ``'mix'`` (``cls_target_mix · annotator + (1 - cls_target_mix) · gt``).
        cls_target_mix: the weight of ``'mix'``, in ``[0, 1]``.
        cls_target_pool: how the annotator's class target pools the crop: ``'distributions'`` (their mean,
            :func:`~shared_core.label_maps.crop_targets`, ReLabel) or ``'logits'`` (softmax of the mean logits, the
            public code, :func:`~shared_core.label_maps.crop_logit_targets`).
        dense: the per-token targets too (the dense term of Eq. 3 is on).
        smoothing_name: how the adapter spells ``smoothing`` in its errors (mm's config key: ``label_smoothing``).
    """

    num_classes: int
    smoothing: float = 0.0
    cls_target: str = 'gt'
    cls_target_mix: float = 0.5
    cls_target_pool: str = 'distributions'
    dense: bool = True
    smoothing_name: str = 'smoothing'

    def __post_init__(self):
        if self.cls_target_pool not in CLS_TARGET_POOLS:
            raise ValueError(f'cls_target_pool: expected one of {CLS_TARGET_POOLS}, got {self.cls_target_pool!r}')
        if self.cls_target not in CLS_TARGETS:
            raise ValueError(f'cls_target: expected one of {CLS_TARGETS}, got {self.cls_target!r}')
        mix_weight = check_real(self.cls_target_mix, 'cls_target_mix', lo=0.0, hi=1.0)
        smoothing = check_real(self.smoothing, self.smoothing_name, lo=0.0, hi=1.0, hi_open=True)
        num_classes = check_int(self.num_classes, 'num_classes', lo=2)
        for name, value in (('num_classes', num_classes), ('cls_target_mix', mix_weight), ('smoothing', smoothing)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, 'dense', bool(self.dense))

    @property
    def needs_maps(self) -> bool:
        """Whether the targets read the label maps (dense targets or an annotator class target)."""
        return self.dense or self.cls_target != 'gt'


def token_labeling_targets(
    labels: torch.Tensor,
    spec: TokenTargetSpec,
    mix: Optional[Mix] = None,
    maps: Optional[CropMaps] = None,
    grid: Optional[Tuple[int, int]] = None,
    name: str = 'labels',
):
    """Token labeling's targets for a batch by ``spec``: ``(class target (B, C), per-token targets or None)``.

    One-hot (smoothed) ground truth → the annotator's label pooled over each crop where ``spec.cls_target``
    asks for it (ReLabel) → :func:`class_target` → Eq. 7's mix by the MixToken ``mix`` → with ``spec.dense``,
    the sparse per-token targets of the crops on the token ``grid`` (Eq. 2;
    :class:`~shared_core.label_maps.SparseTokenTargets`, ``.dense()`` is ``(B, N, C)``). ``maps``: the batch's
    :class:`~shared_core.label_maps.CropMaps` on the training device (needed where ``spec.needs_maps``).
    Every row sums to 1."""
    num_classes, smoothing, cls_target = spec.num_classes, spec.smoothing, spec.cls_target
    check_labels(labels, num_classes, name, values=False)  # the range: one_hot's scatter below, on the CPU
    if maps is None and spec.needs_maps:
        raise ValueError(
            'maps: token labeling needs the label maps of the batch (dense token targets or an '
            f'annotator class target, cls_target={cls_target!r}); none were given'
        )
    if maps is not None and maps.num_classes != num_classes:
        raise ValueError(f'maps: the label maps are for {maps.num_classes} classes, the targets for {num_classes}')
    annotator = None
    if cls_target != 'gt':  # ReLabel: the map's mean over the crop (of the distributions, or of the logits)
        pool = crop_targets if spec.cls_target_pool == 'distributions' else crop_logit_targets
        annotator = pool(maps, smoothing)
    gt = one_hot(labels, num_classes, smoothing, name)
    y_cls = mix_class_target(class_target(gt, annotator, cls_target, spec.cls_target_mix), mix)  # Eq. 7
    tokens = None
    if spec.dense:
        if grid is None:
            raise ValueError('grid: dense token targets need the token grid (gh, gw)')
        tokens = _token_targets(maps, num_classes, tuple(grid), float(smoothing))
    return y_cls, tokens


def _token_targets(maps: CropMaps, num_classes: int, grid: Tuple[int, int], smoothing: float) -> SparseTokenTargets:
    """The batch's sparse token targets: the ones ``maps`` carries where a loader built them (``.tokens``, for
    ``.token_grid`` at ``.token_smoothing``: they do not depend on MixToken's mix, which un-mixes the logits
    instead), checked to be for this grid, smoothing and number of classes; else built here."""
    built = maps.tokens
    if built is None:
        return token_targets_sparse(maps, grid, smoothing)
    made_for = (tuple(maps.token_grid), float(maps.token_smoothing), built.num_classes)
    if made_for != (grid, smoothing, num_classes):
        raise ValueError(
            f'maps: its token targets were built in the loader for a {made_for[0][0]}x{made_for[0][1]} token grid, '
            f'smoothing {made_for[1]} and {made_for[2]} classes; the step needs a {grid[0]}x{grid[1]} grid, '
            f"smoothing {smoothing} and {num_classes} classes (build the collate with the model's token stride "
            "and the loss's smoothing)"
        )
    if built.base.shape != (maps.values.shape[0], grid[0] * grid[1]):
        raise ValueError(
            f'maps: its token targets are {tuple(built.base.shape)} (samples, tokens); the batch has '
            f'{maps.values.shape[0]} samples of {grid[0] * grid[1]} tokens'
        )
    return built


def check_head_rule(head_rule: str, name: str = 'head_rule') -> str:
    if head_rule not in HEAD_RULES:
        raise ValueError(f'{name}: expected one of {HEAD_RULES}, got {head_rule!r}')
    return head_rule


def inference_logits(cls: torch.Tensor, aux: Optional[torch.Tensor], head_rule: str = 'cls+aux') -> torch.Tensor:
    """The prediction of a model with an aux head: ``cls + AUX_WEIGHT · max_tokens(aux)`` (``'cls+aux'``,
    the public code's rule; ``aux`` ``(B, N, C)``) or ``cls`` (``'cls'``, or no aux logits)."""
    if check_head_rule(head_rule) == 'cls+aux' and aux is not None:
        return cls + AUX_WEIGHT * aux.max(1).values
    return cls


def mixtoken_sampler(
    beta: float = 1.0, prob: float = 1.0, mode: str = 'batch', patch_size=16, box_rounding: str = 'timm'
) -> MixSampler:
    """MixToken's sampler (Eq. 5): a box on the token grid, ``λ ~ Beta(beta, beta)``, mixing a batch with
    probability ``prob``, one box per ``mode`` unit (``'batch'`` or ``'pair'``: un-mixing needs pairwise
    swaps); ``box_rounding='public'`` rounds the box as the public code (:data:`~shared_core.options.BOX_ROUNDINGS`)."""
    if mode not in MIXTOKEN_MODES:
        raise ValueError(f'mode: MixToken un-mixes pairwise swaps, expected one of {MIXTOKEN_MODES}, got {mode!r}')
    if not beta > 0:
        raise ValueError(f'beta: expected > 0, got {beta}')
    return MixSampler(
        'token_box',
        mixup_alpha=0.0,
        cutmix_alpha=beta,
        prob=prob,
        mode=mode,
        patch_size=patch_size,
        box_rounding=box_rounding,
    )


def draw_mixtoken(
    sampler: MixSampler, batch_size: int, img_size: Tuple[int, int], device, generator: Optional[torch.Generator] = None
) -> Optional[Mix]:
    """The batch's MixToken mix on ``device``, or ``None`` when the batch is not mixed (off, ``prob`` missed,
    or mixing switched off by ``sampler.mixup_enabled``). Drawn and checked on the CPU
    (:func:`check_pairwise_swap`), then copied pinned and non-blocking: no device sync."""
    if not sampler.mix_prob or not sampler.mixup_enabled:
        return None
    mix = sampler.sample(batch_size, tuple(img_size), generator=generator)
    if (mix.batch_lam >= 1.0) if mix.batch_lam is not None else not bool((mix.lam < 1).any()):
        return None
    check_pairwise_swap(mix)
    device = torch.device(device)
    return mix.pin_memory().to(device, non_blocking=True) if device.type == 'cuda' else mix.to(device)


@contextlib.contextmanager
def mixtoken_applied(x: torch.Tensor, mix: Optional[Mix], patch_embed: Optional[torch.nn.Module]):
    """MixToken's step around one forward of the token path, as both adapters run it: with the batch's ``mix``
    (:func:`draw_mixtoken`; ``None``: not mixed), yields ``(images, swap)``, ``swap`` its :class:`TokenSwap` (one
    mask for the mixing and the un-mixing of the token outputs, :func:`unmix_tokens`), or ``None``. The patch
    tokens are mixed (Eq. 5) by a forward hook on ``patch_embed``, removed when the block ends however it ends;
    without a patch embedding (CNNs) the images are mixed instead, in a box of whole final-stride cells."""
    if mix is None:
        yield x, None
        return
    swap = token_swap(mix, x.device)
    if patch_embed is None:
        yield mix_images(x, mix), swap
        return
    handle = patch_embed.register_forward_hook(lambda m, i, out: mix_patch_embed_output(out, swap))
    try:
        yield x, swap
    finally:
        handle.remove()


def mix_patch_embed_output(out, mix: Union[Mix, TokenSwap]):
    """Eq. 5 on a patch embedding's output, for a forward hook (:func:`swap_tokens`; pass the step's
    :class:`TokenSwap`, so that a compiled model's graph holds no check of the mix): timm's ``(B, N, D)`` or
    ``(B, gh, gw, D)`` (dynamic image size), or mmcv's ``(tokens (B, N, D), hw_shape)``."""
    if isinstance(out, tuple):
        return (swap_tokens(out[0], mix, 'out'),) + tuple(out[1:])
    if out.dim() == 4:
        B, gh, gw, D = out.shape
        return swap_tokens(out.reshape(B, gh * gw, D), mix, 'out').view(B, gh, gw, D)
    return swap_tokens(out, mix, 'out')


def soft_cross_entropy(logits: torch.Tensor, target: Union[torch.Tensor, SparseTokenTargets]) -> torch.Tensor:
    """Mean over rows of ``-Σ_c t_c log softmax(z)_c``: ``target`` a tensor of the logits' shape (last dim C),
    or per-token :class:`~shared_core.label_maps.SparseTokenTargets` for ``(B, N, C)`` logits. The sparse form
    never builds the target nor ``log_softmax(z)``: with ``t = base + Σ_j w_j · onehot(c_j)``,
    ``Σ_c t_c log p_c = base · Σ_c z_c + Σ_j w_j z_{c_j} - lse(z) · (C · base + Σ_j w_j)``."""
    if isinstance(target, SparseTokenTargets):
        if logits.dim() != 3 or tuple(logits.shape) != (*target.base.shape, target.num_classes):
            raise ValueError(
                f'logits: expected (B, N, C) = {(*target.base.shape, target.num_classes)} for these '
                f'token targets, got {tuple(logits.shape)}'
            )
        if target.base.requires_grad or target.weight.requires_grad:
            raise ValueError('target: sparse token targets are constants of the loss; got tensors that require grad')
        return _SparseSoftCrossEntropy.apply(logits, target.base, target.cls, target.weight, target.num_classes)
    if logits.shape != target.shape:
        raise ValueError(f"target: expected the logits' shape {tuple(logits.shape)}, got {tuple(target.shape)}")
    return -(target * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


class _SparseSoftCrossEntropy(torch.autograd.Function):
    """:func:`soft_cross_entropy` on sparse token targets, the mean over the ``B · N`` rows, with its gradient
    written out: ``∂/∂z = (mass · softmax(z) - base - Σ_j w_j · onehot(c_j)) / rows``, ``mass = C · base + Σ_j w_j``
    (the target's sum). Fewer ops than autograd's chain of the forward's expression (counted by
    ``bench/bench_ops.py``, in ``bench/RESULTS.md``). The backward recomputes ``softmax`` from the logits as given
    (bf16 stays bf16 until then) instead of keeping an fp32 copy of the ``(B, N, C)`` logits."""

    @staticmethod
    def forward(ctx, logits, base, cls, weight, num_classes: int):
        z = logits.to(_loss_dtype(logits))  # bf16/fp16 in fp32
        lse = torch.logsumexp(z, -1)
        mass = weight.sum(-1).add_(base, alpha=num_classes)
        dot = torch.addcmul((weight * z.gather(-1, cls)).sum(-1), base, z.sum(-1))
        ctx.save_for_backward(logits, mass, base, cls, weight)
        return lse.mul_(mass).sub_(dot).mean()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        logits, mass, base, cls, weight = ctx.saved_tensors
        dtype = _loss_dtype(logits)
        g = torch.softmax(logits, -1, dtype=dtype).mul_(mass.unsqueeze(-1)).sub_(base.unsqueeze(-1))
        g = g.scatter_add_(-1, cls, weight.neg().to(dtype)).mul_(grad / base.numel())
        return g.to(logits.dtype), None, None, None, None


def _loss_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32 for half-precision and fp32 logits, fp64 for fp64 (a Python branch: ``torch.promote_types`` is an op)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def token_labeling_loss(
    cls_logits: torch.Tensor,
    cls_target: torch.Tensor,
    aux_logits: Optional[torch.Tensor] = None,
    dense_target: Optional[torch.Tensor] = None,
    dense_weight: float = 0.5,
) -> torch.Tensor:
    """Eq. 3-4: ``H(cls, y_cls) + β · (1/N) Σ_i H(aux_i, y_i)`` averaged over the batch. ``aux_logits``
    ``(B, N, C)`` and ``dense_target`` its targets (dense, or :class:`SparseTokenTargets`), already aligned
    (un-mixed outputs, own targets)."""
    loss = soft_cross_entropy(cls_logits, cls_target)
    if dense_weight:
        if aux_logits is None or dense_target is None:
            raise ValueError('dense_weight > 0 needs aux_logits and dense_target')
        loss = loss + dense_weight * soft_cross_entropy(aux_logits, dense_target)
    return loss
