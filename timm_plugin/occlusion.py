"""Occlusion robustness (TokenMix, Sec. 5.3, Fig. 4-5): accuracy of a timm classifier when a growing fraction
of its patches is dropped; ``tokenaug-occlusion`` (:mod:`timm_plugin.tools.occlusion_cli`) runs the sweep.

The protocol (what "dropping a patch" means here)
-------------------------------------------------
* **Patch grid.** The model's token grid: ``patch_embed.token_stride`` if present, else
  ``patch_embed.img_size / patch_embed.grid_size`` (hybrid ViTs included), else ``patch_embed.proj.stride``,
  else ``patch_embed.patch_size`` (:func:`timm_plugin.token_grid.token_stride`). Models without a patch embedding
  (CNNs) use 16 x 16 px, DeiT's grid, so CNN and ViT curves blank out the same pixels. ``--patch-size`` overrides
  (zero mode only; drop mode must use the token grid). The input size must be a multiple of it.
* **Which patches.** Image ``index`` (its position in the dataset: ``timm.data.create_dataset`` sorts
  classes and files) gets, per repeat ``r``, a random order of its N patches from a ``torch.Generator``
  seeded with ``SeedSequence((seed, r, index))`` (:func:`patch_ranks`). At ratio rho the first
  ``k = round(rho * N)`` (half up, :func:`num_dropped`) patches of that order are dropped
  (:func:`occlusion_mask`). So the masks do not depend on batch size, workers, device or checkpoint
  (every checkpoint sees the same occlusions), and they are nested: the patches dropped at 10 % are
  also dropped at 20 % ("gradually drop 10% more patches"). ``--repeats R`` averages R independent
  draws (``*_std`` columns: their standard deviation).
* **``--mode zero``** (default; any model, CNNs included): the pixels of the dropped patches are set to
  zero *in the normalised input space* (``--fill zero``, default), i.e. to the dataset mean colour; this is
  zeroing the tensor that the eval loader yields, and for a ViT it makes every dropped patch embed to the
  same content-free token (the patch-embedding bias), whatever the normalisation constants.
  ``--fill black`` zeroes the raw pixels instead (0 before normalisation, ``-mean / std`` after), the
  literal reading of "set the pixels inside to zero".
* **``--mode drop``** (timm ``VisionTransformer`` and subclasses: ViT, DeiT, DeiT-distilled, LV-ViT ...):
  the dropped patch tokens are removed from the sequence. A forward hook on ``model.patch_drop`` (which
  runs right after ``_pos_embed``, so every token already carries its own position embedding) keeps the
  prefix tokens (class / distillation / register tokens) and the kept patch tokens in their original
  order (:func:`token_drop`). At ratio 0 this is the plain forward.

Evaluation: ``create_dataset`` + ``resolve_data_config`` + ``create_transform`` (eval: resize, centre
crop, normalise), a DataLoader in dataset order, ``torch.inference_mode``; each batch is loaded once and
evaluated at every ratio and repeat.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.nn as nn
from timm.data import resolve_data_config
from timm.models.vision_transformer import VisionTransformer
from torch.utils.data import DataLoader, Dataset

from shared_core.options import OCCLUSION_FILLS, OCCLUSION_MODES, OCCLUSION_RATIOS
from shared_core.token_masks import batch_masks, num_dropped, occlusion_mask, patch_ranks

from .image_data import read_sample
from .token_grid import DEFAULT_STRIDE, patch_embedding, token_stride

__all__ = [
    'DEFAULT_RATIOS',
    'MODES',
    'FILLS',
    'num_dropped',
    'patch_ranks',
    'occlusion_mask',
    'batch_masks',
    'patch_grid',
    'fill_values',
    'zero_patches',
    'keep_indices',
    'token_drop',
    'occluded_logits',
    'evaluate',
    'check_ratios',
    'check_drop_model',
    'data_config',
    'Indexed',
    'rows_from_counts',
]

DEFAULT_RATIOS, MODES, FILLS = OCCLUSION_RATIOS, OCCLUSION_MODES, OCCLUSION_FILLS
CSV_FIELDS = ('ratio', 'dropped_patches', 'num_patches', 'top1', 'top5', 'top1_std', 'top5_std', 'images')


# -------------------------------------------------------------------------------------- patch grid
def patch_grid(
    model: nn.Module, input_hw: Sequence[int], patch_size: int | None = None, mode: str = 'zero'
) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((grid_h, grid_w), (patch_h, patch_w))`` of the occlusion grid for an ``input_hw`` input."""
    stride = token_stride(model) if patch_embedding(model) is not None else None  # CNNs: none
    if mode == 'drop' and patch_size is not None and stride is not None and (patch_size, patch_size) != stride:
        raise ValueError(
            f"--patch-size {patch_size}: --mode drop removes tokens, so the grid is the model's "
            f'token stride {stride}; leave --patch-size out or use --mode zero'
        )
    patch = (patch_size, patch_size) if patch_size is not None else stride or DEFAULT_STRIDE
    h, w = int(input_hw[0]), int(input_hw[1])
    if h % patch[0] or w % patch[1]:
        raise ValueError(
            f'input size {h}x{w} is not divisible by the patch size {patch[0]}x{patch[1]}; '
            'pass --img-size (a multiple of it) or --patch-size'
        )
    return (h // patch[0], w // patch[1]), patch


# ------------------------------------------------------------------------------------- zero mode
def fill_values(fill: str, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Per-channel value ``(C,)`` of a dropped pixel in normalised input space (see the module doc)."""
    if fill == 'zero':
        return torch.zeros(len(mean))
    if fill == 'black':
        return -torch.tensor(mean, dtype=torch.float32) / torch.tensor(std, dtype=torch.float32)
    raise ValueError(f'--fill: expected one of {FILLS}, got {fill!r}')


def zero_patches(
    images: torch.Tensor, masks: torch.Tensor, patch: tuple[int, int], fill: torch.Tensor | None = None
) -> torch.Tensor:
    """``images`` (B, C, H, W) with the pixels of dropped patches (``masks`` (B, h, w), True) set to ``fill``."""
    b, c, height, width = images.shape
    if masks.shape != (b, height // patch[0], width // patch[1]) or height % patch[0] or width % patch[1]:
        raise ValueError(
            f'masks {tuple(masks.shape)} do not tile images {tuple(images.shape)} with {patch[0]}x{patch[1]} patches'
        )
    pixels = masks.to(images.device).repeat_interleave(patch[0], 1).repeat_interleave(patch[1], 2)[:, None]
    value = torch.zeros(c) if fill is None else fill
    return torch.where(pixels, value.to(images).view(1, c, 1, 1), images)


# ------------------------------------------------------------------------------------- drop mode
def keep_indices(masks: torch.Tensor) -> torch.Tensor:
    """Kept patch indices ``(B, N - k)`` in ascending order from drop masks ``(B, h, w)`` (same k per row)."""
    flat = masks.flatten(1)
    counts = flat.sum(1)
    if (counts != counts[0]).any():
        raise ValueError('every image of a batch must drop the same number of patches')
    order = torch.argsort(flat.to(torch.int8), dim=1, stable=True)  # kept (0) first, in patch order
    return order[:, : flat.shape[1] - int(counts[0])]


def check_drop_model(model: nn.Module) -> None:
    if not isinstance(model, VisionTransformer):
        raise ValueError(
            f'--mode drop: {type(model).__name__} is not a timm VisionTransformer (ViT / DeiT / LV-ViT '
            'and subclasses), so its tokens cannot be removed; use --mode zero'
        )


class _TokenDropHook:
    """Forward hook on ``model.patch_drop``: keeps prefix tokens + ``self.keep`` patch tokens."""

    def __init__(self, num_prefix_tokens: int):
        self.num_prefix_tokens = num_prefix_tokens
        self.keep: torch.Tensor | None = None
        self.calls = 0

    def __call__(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: Any) -> Any:
        self.calls += 1
        if self.keep is None:
            return output
        x, p = inputs[0], self.num_prefix_tokens  # after _pos_embed: tokens carry their own position embedding
        index = self.keep.to(x.device)[..., None].expand(-1, -1, x.shape[-1])
        return torch.cat([x[:, :p], x[:, p:].gather(1, index)], dim=1)


@contextlib.contextmanager
def token_drop(model: nn.Module) -> Iterator[_TokenDropHook]:
    """Within the block, set ``hook.keep = keep_indices(masks)`` to drop tokens in the next forward."""
    check_drop_model(model)
    hook = _TokenDropHook(model.num_prefix_tokens)
    handle = model.patch_drop.register_forward_hook(hook)
    try:
        yield hook
    finally:
        handle.remove()


def occluded_logits(
    model: nn.Module,
    images: torch.Tensor,
    masks: torch.Tensor,
    patch: tuple[int, int],
    *,
    mode: str = 'zero',
    fill: torch.Tensor | None = None,
    hook: _TokenDropHook | None = None,
) -> torch.Tensor:
    """Logits of ``model`` on ``images`` with the patches in ``masks`` (B, h, w) dropped (zeroed or removed)."""
    if mode == 'zero':
        return model(zero_patches(images, masks, patch, fill))
    if mode != 'drop':
        raise ValueError(f'--mode: expected one of {MODES}, got {mode!r}')
    with contextlib.ExitStack() as stack:
        if hook is None:
            hook = stack.enter_context(token_drop(model))
        calls = hook.calls
        hook.keep = keep_indices(masks) if masks.any() else None  # nothing dropped: the plain forward
        try:
            logits = model(images)
        finally:
            hook.keep = None
        if hook.calls != calls + 1:
            raise ValueError(
                f'--mode drop: {type(model).__name__}.forward ran patch_drop {hook.calls - calls} '
                'times (expected once); use --mode zero'
            )
    return logits


# -------------------------------------------------------------------------------------- evaluation
class Indexed(Dataset):
    """(image, target, index) of a dataset, index = the position the masks are seeded with."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        image, target = read_sample(self.dataset, index)  # this index's own image (unreadable: named, fatal)
        return image, target, index


def data_config(model: nn.Module, img_size: int | None, crop_pct: float | None) -> dict:
    """timm's eval data config; a fixed-size ViT (e.g. ``img_size=112``) gets its own size, not the cfg's 224."""
    args: dict[str, Any] = {'crop_pct': crop_pct}
    embed = getattr(model, 'patch_embed', None)
    if img_size is not None:
        args['input_size'] = (3, img_size, img_size)
    elif (
        embed is not None
        and getattr(embed, 'img_size', None) is not None
        and not getattr(model, 'dynamic_img_size', False)
    ):
        args['input_size'] = (3, *embed.img_size)
    return resolve_data_config(args, model=model)


def _topk_correct(logits: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    if int(target.max()) >= logits.shape[-1]:
        raise ValueError(
            f'the data has class index {int(target.max())} but the model has {logits.shape[-1]} '
            'classes; check --num-classes / --data-dir'
        )
    k = min(5, logits.shape[-1])
    top = logits.topk(k, dim=-1).indices
    hits = top == target[:, None]
    return int(hits[:, 0].sum()), int(hits.any(dim=1).sum())


def _autocast(device: torch.device, amp: bool):
    if not amp:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.float16 if device.type == 'cuda' else torch.bfloat16)


def check_ratios(ratios: Sequence[float]) -> list[float]:
    if not ratios:
        raise ValueError('--ratios: give at least one ratio')
    bad = [r for r in ratios if not 0 <= r < 1]
    if bad:
        raise ValueError(f'--ratios: each ratio must be in [0, 1), got {bad[0]}')
    return sorted(set(float(r) for r in ratios))


def evaluate(
    model: nn.Module,
    loader: DataLoader,
    *,
    grid: tuple[int, int],
    patch: tuple[int, int],
    ratios: Sequence[float] = DEFAULT_RATIOS,
    mode: str = 'zero',
    fill: torch.Tensor | None = None,
    seed: int = 0,
    repeats: int = 1,
    device: torch.device | str = 'cpu',
    amp: bool = False,
    progress: bool = False,
) -> list[dict]:
    """One row per ratio (``CSV_FIELDS``): top-1 / top-5 accuracy in % over ``loader``'s (image, target, index)."""
    if mode not in MODES:
        raise ValueError(f'--mode: expected one of {MODES}, got {mode!r}')
    if repeats < 1:
        raise ValueError(f'--repeats must be >= 1, got {repeats}')
    ratios = check_ratios(ratios)
    device = torch.device(device)
    n = grid[0] * grid[1]
    correct = np.zeros((repeats, len(ratios), 2), dtype=np.int64)
    seen = 0
    with contextlib.ExitStack() as stack:
        hook = stack.enter_context(token_drop(model)) if mode == 'drop' else None
        stack.enter_context(torch.inference_mode())
        batches = loader
        if progress:
            from tqdm import tqdm

            batches = tqdm(loader, desc='occlusion', unit='batch')
        for images, target, index in batches:
            images, target = images.to(device), target.to(device)
            ranks = [torch.stack([patch_ranks(n, seed, int(i), r) for i in index]) for r in range(repeats)]
            for j, ratio in enumerate(ratios):
                draws = ranks if num_dropped(n, ratio) else ranks[:1]  # nothing dropped: all repeats alike
                for r, rank in enumerate(draws):
                    masks = batch_masks(rank, grid, ratio)
                    with _autocast(device, amp):
                        logits = occluded_logits(model, images, masks, patch, mode=mode, fill=fill, hook=hook)
                    counts = _topk_correct(logits.float(), target)
                    correct[slice(None) if len(draws) == 1 else r, j] += counts  # 1 draw: every repeat
            seen += len(target)
    return rows_from_counts(correct, seen, ratios, n)


def rows_from_counts(correct: np.ndarray, seen: int, ratios: Sequence[float], num_patches: int) -> list[dict]:
    acc = 100.0 * correct / max(seen, 1)  # (repeats, ratios, 2)
    rows = []
    for j, ratio in enumerate(ratios):
        rows.append(
            {
                'ratio': ratio,
                'dropped_patches': num_dropped(num_patches, ratio),
                'num_patches': num_patches,
                'top1': float(acc[:, j, 0].mean()),
                'top5': float(acc[:, j, 1].mean()),
                'top1_std': float(acc[:, j, 0].std()),
                'top5_std': float(acc[:, j, 1].std()),
                'images': seen,
            }
        )
    return rows
