"""The mix description and how to apply it (MixUp, CutMix, MixToken, TokenMix all produce one).

A :class:`Mix` says who is mixed with whom and where: the partner index of each sample, the share of
each patch token that comes from the partner (fractional where a pixel box cuts a patch, 0/1 for
token masks, the constant ``1 - λ`` for MixUp), and the image-level λ (the share of the sample's own
image, the weight of its own label in the area target). Images, token sequences and targets are all
mixed *from* a mix (:func:`mix_images`, :func:`mix_tokens`, :func:`mix_target`), so a method that
changes only the target (TL-Align, TokenMix's activation targets) reuses the same images. Every
pairwise combination ``t · (1 - s) + t[partner] · s`` goes through :func:`mix_rows`.

Conventions (as in timm): λ is the weight of the sample itself; the partner of sample ``i`` is
``B - 1 - i`` (so the batch must be even); pixel boxes are ``(y0, y1, x0, x1)`` half-open.
The samplers live in :mod:`shared_core.samplers`, the token masks in :mod:`shared_core.token_masks`.

This module imports neither timm nor any OpenMMLab package.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional, Sequence, Tuple, Union

import torch

__all__ = [
    'Mix',
    'identity_mix',
    'mix_rows',
    'own_lam',
    'mix_images',
    'mix_images_reversed',
    'mix_tokens',
    'mix_target',
    'multi_label_target',
    'pair_target',
    'partner_target',
    'one_hot',
    'check_labels',
    'check_pairwise_batch',
    'check_image_batch',
    'check_image_size',
    'grid_size',
    'to_2tuple',
    'IntPair',
]

#: one int for both axes, or ``(h, w)``
IntPair = Union[int, Sequence[int]]


def to_2tuple(value: IntPair, name: str) -> Tuple[int, int]:
    """``16 -> (16, 16)``; ``(h, w)`` stays; anything else is a ``ValueError`` naming ``name``."""
    if isinstance(value, int) and not isinstance(value, bool):
        out = (value, value)
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        out = (int(value[0]), int(value[1]))
    else:
        raise ValueError(f'{name} must be an int or a pair of ints (h, w), got {value!r}')
    if min(out) <= 0:
        raise ValueError(f'{name} must be positive, got {value!r}')
    return out


# ----------------------------------------------------------------------------------------------
# The mix description
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Mix:
    """Who is mixed with whom, and where.

    Attributes:
        partner: ``(B,)`` int64, the sample each sample takes its partner content from.
        lam: ``(B,)`` float32, image-level λ: the share of the sample's own image (weight of its own
            label in the area target). 1 means "not mixed".
        token_share: ``(B, gh, gw)`` float32 in [0, 1], the share of each patch token that comes from
            the partner (row-major over the patch grid).
        boxes: ``(B, 4)`` int64 pixel boxes ``(y0, y1, x0, x1)`` for samples mixed by a pixel box
            (CutMix), else ``None``. Their pixel region is the box, not a patch-aligned region.
        box_valid: ``(B,)`` bool, which rows of ``boxes`` apply (the others are blends or token masks).
        img_size: ``(H, W)`` of the images.
        patch_size: ``(ph, pw)`` of the token grid.
        kind: the sampler kind that produced it (``'mixup'``, ``'cutmix'``, ...; ``'none'``).
        reversed_pairs: host-side facts the samplers know (default: unknown): the partners are the reversed batch
            (``partner[i] = B - 1 - i``), so the images and targets mix against ``x.flip(0)`` (timm's fast
            path: no gather of partners, no per-token share on the device).
        blend: every sample is a blend or unmixed (``token_share[i] ≡ 1 - lam[i]``, no boxes).
        batch_lam: every sample has this λ (``mode='batch'``), on the host; with ``boxes`` they share one box.
    """

    partner: torch.Tensor
    lam: torch.Tensor
    token_share: torch.Tensor
    img_size: Tuple[int, int]
    patch_size: Tuple[int, int]
    kind: str = 'none'
    boxes: Optional[torch.Tensor] = None
    box_valid: Optional[torch.Tensor] = None
    reversed_pairs: bool = False
    blend: bool = False
    batch_lam: Optional[float] = None

    @property
    def batch_size(self) -> int:
        return self.partner.shape[0]

    @property
    def grid_size(self) -> Tuple[int, int]:
        return tuple(self.token_share.shape[1:])

    @property
    def num_tokens(self) -> int:
        gh, gw = self.grid_size
        return gh * gw

    def token_share_flat(self) -> torch.Tensor:
        """Partner share per patch token, ``(B, N)``, row-major over the grid."""
        return self.token_share.flatten(1)

    def pixel_share(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Partner share per pixel, ``(B, 1, H, W)``: token shares upsampled to their patches, and the
        exact pixel box for CutMix samples."""
        ph, pw = self.patch_size
        share = self.token_share.to(dtype)
        H, W = self.img_size
        share = share.repeat_interleave(ph, dim=1).repeat_interleave(pw, dim=2)[:, :H, :W]
        if self.boxes is not None:
            ys = torch.arange(H, device=share.device)
            xs = torch.arange(W, device=share.device)
            y0, y1, x0, x1 = self.boxes.unbind(1)
            inside = (
                (ys[None, :, None] >= y0[:, None, None])
                & (ys[None, :, None] < y1[:, None, None])
                & (xs[None, None, :] >= x0[:, None, None])
                & (xs[None, None, :] < x1[:, None, None])
            )
            share = torch.where(self.box_valid[:, None, None], inside.to(dtype), share)
        return share.unsqueeze(1)

    def _map(self, fn) -> 'Mix':
        return replace(
            self,
            **{
                f.name: fn(getattr(self, f.name))
                for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )

    def to(self, device, non_blocking: bool = False) -> 'Mix':
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> 'Mix':
        return self._map(lambda t: t.pin_memory())


def identity_mix(batch_size: int, img_size: IntPair, patch_size: IntPair = 16, device=None) -> Mix:
    """The mix that mixes nothing (λ = 1 everywhere)."""
    img_size, patch_size = to_2tuple(img_size, 'img_size'), to_2tuple(patch_size, 'patch_size')
    gh, gw = grid_size(img_size, patch_size)
    return Mix(
        partner=torch.arange(batch_size, device=device),
        lam=torch.ones(batch_size, device=device),
        token_share=torch.zeros(batch_size, gh, gw, device=device),
        img_size=img_size,
        patch_size=patch_size,
        kind='none',
    )


# ----------------------------------------------------------------------------------------------
# Input checks shared by every adapter
# ----------------------------------------------------------------------------------------------


def check_pairwise_batch(batch_size: int, name: str = 'x', allow_odd: bool = False) -> None:
    """A non-empty batch, even unless ``allow_odd`` (then the middle sample of an odd batch partners itself: mixed
    with itself, it stays as it is; mmpretrain's augments take any batch size)."""
    if allow_odd:
        if batch_size < 1:
            raise ValueError(f'{name}: mixing needs a non-empty batch; got batch size {batch_size}')
        return
    if batch_size % 2 != 0 or batch_size == 0:
        raise ValueError(
            f'{name}: pairwise mixing pairs sample i with B-1-i and needs an even, '
            f'non-empty batch; got batch size {batch_size}'
        )


#: the channel counts of an image (grey, RGB, RGBA): a batch with one of them last and none second is channels-last
IMAGE_CHANNELS = (1, 3, 4)


def check_image_batch(x, name: str = 'x') -> None:
    """A ``(B, C, H, W)`` image tensor. A channels-last ``(B, H, W, C)`` batch (its last dimension an image's
    channel count, its second not) is refused naming the layout: mixed as it is, CutMix and the token kinds would
    take ``W x C`` for the image plane (timm's ``Mixup`` does; tokenaug departs, ``docs/departures.md``). A
    ``channels_last`` memory format is a ``(B, C, H, W)`` tensor and is taken."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(
            f'{name}: expected a (B, C, H, W) image tensor, got '
            f'{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}'
        )
    if x.shape[-1] in IMAGE_CHANNELS and x.shape[1] not in IMAGE_CHANNELS:
        raise ValueError(
            f'{name}: {tuple(x.shape)} looks like a channels-last (B, H, W, C) batch; the mixers take (B, C, H, W) '
            f'(mixed as it is, CutMix would cut the W x C plane): pass {name}.permute(0, 3, 1, 2)'
        )


def check_labels(labels: torch.Tensor, num_classes: int, name: str = 'target', values: bool = True) -> None:
    """A 1-d integer tensor of class indices in ``[0, num_classes)``. The range is checked where the labels
    are on the CPU (the collates and loaders of tokenaug check them there): on an accelerator the check
    would stall every training step on a device sync, and the device's own index check still fails loudly.
    ``values=False``: the dtype and shape only, for labels that go straight into :func:`one_hot` (its scatter
    checks the range on the CPU, and a failure is reported by this function, with the same message)."""
    if labels.dim() != 1 or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(
            f'{name}: expected a 1-d integer tensor of class indices, '
            f'got dtype {labels.dtype} and shape {tuple(labels.shape)}'
        )
    if values and labels.numel() and labels.device.type == 'cpu':
        lo, hi = (int(v) for v in torch.aminmax(labels))
        if lo < 0 or hi >= num_classes:
            raise ValueError(
                f'{name}: class indices must lie in [0, num_classes={num_classes}), got min {lo} and max {hi}'
            )


def grid_size(img_size: Tuple[int, int], patch_size: Tuple[int, int]) -> Tuple[int, int]:
    """The token grid over an image: whole patches, plus a clipped last row/column where the patch size
    does not divide the image (only blends and pixel boxes are defined there, see :class:`MixSampler`)."""
    return (-(-img_size[0] // patch_size[0]), -(-img_size[1] // patch_size[1]))


def check_image_size(img_size: Tuple[int, int], patch_size: Tuple[int, int], name: str = 'x') -> None:
    if img_size[0] % patch_size[0] or img_size[1] % patch_size[1]:
        raise ValueError(
            f'{name}: image size {img_size[0]}x{img_size[1]} is not divisible by '
            f'patch_size {patch_size[0]}x{patch_size[1]}; token-aware mixing needs a whole '
            f'patch grid'
        )


# ----------------------------------------------------------------------------------------------
# Applying a mix
# ----------------------------------------------------------------------------------------------


def mix_images(x: torch.Tensor, mix: Mix) -> torch.Tensor:
    """Mixed images: each pixel is ``x · (1 - s) + x[partner] · s`` with ``s`` its partner share.

    Where ``s`` is 0 or 1 the output pixel is exactly the sample's or the partner's (boxes and token
    masks copy, no arithmetic); blends are ``torch.lerp(x, x[partner], 1 - λ)``, equal to timm's
    ``x · λ + x_flip · (1 - λ)`` up to float rounding. Integer images (uint8, the fast-collate path)
    are selected directly and blended in float then rounded, as timm's fast collate does.
    ``x`` is not modified.
    """
    if x.dim() != 4 or tuple(x.shape[-2:]) != tuple(mix.img_size) or x.shape[0] != mix.batch_size:
        raise ValueError(
            f'x: expected images (B={mix.batch_size}, C, {mix.img_size[0]}, {mix.img_size[1]}) '
            f'for this mix, got {tuple(x.shape)}'
        )
    dev = x.device
    if mix.reversed_pairs and x.dtype.is_floating_point:  # timm's fast paths: the partners are x.flip(0)
        if mix.blend:  # MixUp (or unmixed) rows: one lerp, λ a scalar in batch mode
            if mix.batch_lam is not None:
                return mix_images_reversed(x, mix.batch_lam)
            return x.flip(0).lerp_(x, mix.lam.to(dev, x.dtype, non_blocking=True).view(-1, 1, 1, 1))
        if mix.batch_lam is not None and mix.boxes is not None:  # batch mode CutMix: one box for all
            return mix_images_reversed(x, mix.batch_lam, tuple(mix.boxes[0].tolist()))
    partner = mix.partner.to(dev, non_blocking=True)
    share = mix.token_share.to(dev, non_blocking=True)
    # the row plan reads the mix where it lives (the samplers build it on the CPU: no device sync)
    n_box = int(mix.box_valid.sum()) if mix.boxes is not None else 0
    is_box = mix.box_valid.to(dev, non_blocking=True) if n_box else None
    if n_box == mix.batch_size:  # every row a pixel box: copy, then paste the boxes
        out = x.clone()
    else:  # token shares (blends, masks, token boxes) on a patch view; box rows keep their own pixels here
        if n_box:
            share = share.masked_fill(is_box[:, None, None], 0.0)
        out = _mix_token_rows(x, partner, share, mix.patch_size)
    if n_box:
        boxes, valid = mix.boxes.tolist(), mix.box_valid.tolist()
        if n_box == mix.batch_size and all(b == boxes[0] for b in boxes):  # batch mode: one box
            y0, y1, x0, x1 = boxes[0]
            out[:, :, y0:y1, x0:x1] = x[:, :, y0:y1, x0:x1].index_select(0, partner)
        else:
            for b, (p, (y0, y1, x0, x1), v) in enumerate(zip(mix.partner.tolist(), boxes, valid)):
                if v:
                    out[b, :, y0:y1, x0:x1] = x[p, :, y0:y1, x0:x1]
    return out


def mix_images_reversed(x: torch.Tensor, lam: float, box: Optional[Tuple[int, int, int, int]] = None) -> torch.Tensor:
    """Batch-mode MixUp / CutMix against the reversed batch, timm's fast path (float images): the blend ``λ · x +
    (1 - λ) · x.flip(0)`` as one ``lerp``, or CutMix's pixel ``box`` ``(y0, y1, x0, x1)`` copied from ``x.flip(0)``
    into a copy of ``x`` (λ is then the box's complement, not used here). ``x`` is not modified."""
    if box is None:
        return x.clone() if lam == 1.0 else x.flip(0).lerp_(x, lam)
    y0, y1, x0, x1 = box
    out = x.clone()
    out[:, :, y0:y1, x0:x1] = x[:, :, y0:y1, x0:x1].flip(0)
    return out


def _mix_token_rows(x: torch.Tensor, partner: torch.Tensor, share: torch.Tensor, patch_size) -> torch.Tensor:
    """Mix images by a per-token partner share, on a patch view (no per-pixel share is materialised),
    writing into the gathered partners ``xp`` (a fresh tensor): large fresh allocations cost page
    faults on the CPU, so the result reuses that buffer."""
    xp = x.index_select(0, partner)
    B, C, H, W = x.shape
    gh, gw = share.shape[1:]
    ph, pw = patch_size
    if gh * ph == H and gw * pw == W:
        x6, xp6 = x.view(B, C, gh, ph, gw, pw), xp.view(B, C, gh, ph, gw, pw)
        s6 = share.view(B, 1, gh, 1, gw, 1)
    else:  # clipped grid: only MixUp/CutMix get here, whose token rows are constant (blends)
        x6, xp6, s6 = x, xp, share[:, :1, :1].view(B, 1, 1, 1)
    if x.dtype.is_floating_point:
        # xp + (x - xp) · (1 - s): exactly xp where s = 1 and exactly x where s = 0 (torch.lerp's rule)
        xp6.lerp_(x6, (1.0 - s6).to(x.dtype))
    else:  # integer images: select where every share of a chunk is 0/1, else blend in float and round
        binary = ((share == 0) | (share == 1)).flatten(1).all(1)
        if x6 is not x and bool(binary.all()):  # token masks: a bitwise select with a per-pixel all-ones mask
            bits = (-(share > 0.5).to(torch.int64)).to(x.dtype)  # 0 or all bits set (255 for uint8)
            mask = bits.view(B, 1, gh, 1, gw, 1).expand(B, 1, gh, ph, gw, pw).reshape(B, 1, H, W)
            xp &= mask
            xp |= x & ~mask
            return xp
        # rows whose share is one number (blends; box rows, 0 here) blend with a per-row weight on the plain
        # (B, C, H, W) layout: the same lerp, element by element, without the patch view's 6-d broadcast
        const = (share == share[:, :1, :1]).flatten(1).all(1).tolist()
        binary = binary.tolist()
        s4 = share[:, :1, :1].reshape(B, 1, 1, 1)
        for i in range(0, B, 8):  # a few rows at a time: small, reused float buffers
            sl = slice(i, i + 8)
            if all(binary[sl]):
                torch.where(s6[sl] > 0.5, xp6[sl], x6[sl], out=xp6[sl])
            elif all(const[sl]):
                xp[sl] = torch.lerp(x[sl].float(), xp[sl].float(), s4[sl]).round_().to(x.dtype)
            else:
                xp6[sl] = torch.lerp(x6[sl].float(), xp6[sl].float(), s6[sl]).round_().to(x.dtype)
    return xp


def mix_rows(t: torch.Tensor, partner: torch.Tensor, share, reversed_pairs: bool = False) -> torch.Tensor:
    """The pairwise combination every mix uses: ``t · (1 - s) + t[partner] · s`` over the first dim of
    ``t`` (rows = samples). ``share`` is the *partner's* weight: a float, or a tensor that broadcasts against
    ``t`` (``(B,)``, ``(B, 1)``, ``(B, N, 1)``, ...; trailing singleton dims are added), moved to ``t``'s device
    and dtype. ``reversed_pairs``: the partners are the reversed batch (the samplers' pairing,
    :attr:`Mix.reversed_pairs`): one ``lerp(t, t.flip(0), s)``, as timm mixes, without gathering the partners
    (exact at ``s`` = 0 and 1).
    ``t`` is not modified."""
    if not isinstance(share, float):
        share = torch.as_tensor(share).to(t.device, t.dtype, non_blocking=True)
        if share.dim() < t.dim():
            share = share.reshape(*share.shape, *([1] * (t.dim() - share.dim())))
    if reversed_pairs:
        return torch.lerp(t, t.flip(0), share)
    return torch.addcmul(t * (1.0 - share), t[partner.to(t.device)], share)


def own_lam(mix: Mix):
    """Each sample's own share λ: a float in batch mode (the samplers' one λ, on the host: no tensor op), else
    ``mix.lam`` ``(B,)``. The partner weight of :func:`mix_rows` is ``1 - own_lam(mix)``."""
    return mix.batch_lam if mix.reversed_pairs and mix.batch_lam is not None else mix.lam


def mix_tokens(tokens: torch.Tensor, mix: Mix) -> torch.Tensor:
    """Mix patch-token sequences ``(B, N, D)`` (row-major grid, no class token) by the token shares:
    ``t · (1 - s) + t[partner] · s``. For 0/1 token masks this is the token swap of MixToken/TokenMix."""
    if tokens.dim() != 3 or tokens.shape[0] != mix.batch_size or tokens.shape[1] != mix.num_tokens:
        raise ValueError(
            f'tokens: expected (B={mix.batch_size}, N={mix.num_tokens}, D) patch tokens, got {tuple(tokens.shape)}'
        )
    return mix_rows(tokens, mix.partner, mix.token_share_flat(), mix.reversed_pairs)


def one_hot(labels: torch.Tensor, num_classes: int, smoothing: float = 0.0, name: str = 'target') -> torch.Tensor:
    """Label-smoothed one-hot rows (timm's convention: off = ε/C, on = 1 - ε + ε/C); rows sum to 1. A label out of
    ``[0, num_classes)`` fails with :func:`check_labels`'s error naming ``name`` (checked when the CPU's scatter
    refuses an index, so a valid batch pays no separate range check)."""
    off = smoothing / num_classes
    out = torch.full((labels.shape[0], num_classes), off, device=labels.device)
    try:
        return out.scatter_(1, labels.long().view(-1, 1), 1.0 - smoothing + off)
    except RuntimeError:
        check_labels(labels, num_classes, name)
        raise


def pair_target(
    labels: torch.Tensor,
    partner: torch.Tensor,
    lam,
    num_classes: int,
    smoothing: float = 0.0,
    reversed_pairs: bool = False,
) -> torch.Tensor:
    """``λ · y + (1 - λ) · y[partner]`` with label smoothing: ``(B, C)`` float32, rows sum to 1.
    ``lam`` is the weight of each sample's own label (a scalar or ``(B,)``). ``reversed_pairs``: the partners are the
    reversed batch (the samplers' pairing, :attr:`Mix.reversed_pairs`): one ``lerp`` against ``y.flip(0)``, as timm's
    ``mixup_target``, instead of gathering the partners."""
    if not isinstance(lam, float):
        lam = torch.as_tensor(lam, dtype=torch.float32)
    return partner_target(labels, partner, 1.0 - lam, num_classes, smoothing, reversed_pairs)


def partner_target(
    labels: torch.Tensor,
    partner: torch.Tensor,
    share,
    num_classes: int,
    smoothing: float = 0.0,
    reversed_pairs: bool = False,
) -> torch.Tensor:
    """:func:`pair_target` given each sample's *partner* share ``s = 1 - λ`` (a float or ``(B,)``):
    ``(1 - s) · y + s · y[partner]``, smoothed, ``(B, C)`` float32 (what TL-Align's readout gives, with no
    ``1 - s`` to take twice)."""
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f'label_smoothing must be in [0, 1), got {smoothing}')
    check_labels(labels, num_classes, values=False)
    y = one_hot(labels, num_classes, smoothing)  # checks the range where the labels are on the CPU
    if not isinstance(share, float):
        share = torch.as_tensor(share, dtype=torch.float32).to(y.device).reshape(-1)
    return mix_rows(y, partner, share, reversed_pairs)


def mix_target(labels: torch.Tensor, mix: Mix, num_classes: int, smoothing: float = 0.0) -> torch.Tensor:
    """The area target ``λ · y + (1 - λ) · y[partner]`` with label smoothing: ``(B, C)`` float32,
    every row sums to 1 (with the samplers' flipped partners one ``lerp``, a scalar λ in batch mode)."""
    return pair_target(labels, mix.partner, own_lam(mix), num_classes, smoothing, reversed_pairs=mix.reversed_pairs)


def multi_label_target(target: torch.Tensor, mix: Mix, num_classes: int, smoothing: float = 0.0) -> torch.Tensor:
    """timm's ``multi_label`` target: dense ``(B, C)`` targets smoothed towards 0.5 (``y (1 - ε) + 0.5 ε``) and
    mixed by each sample's own share λ with its partner's."""
    if not torch.is_tensor(target) or target.dim() != 2 or target.shape[1] != num_classes:
        raise ValueError(
            f'target: multi-label mixing expects dense targets (batch, num_classes={num_classes}), '
            f'got {tuple(target.shape) if torch.is_tensor(target) else type(target).__name__}'
        )
    y = target.float() * (1.0 - smoothing) + 0.5 * smoothing
    return mix_rows(y, mix.partner, 1.0 - own_lam(mix), mix.reversed_pairs)
