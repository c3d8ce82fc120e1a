"""``tokenaug-occlusion``: top-1 / top-5 accuracy vs the fraction of dropped patches (TokenMix, Fig. 5).

TokenMix (tokenmix.md, Sec. 5.3 "TokenMix enhances the occlusion robustness of vision transformers",
Fig. 4 and Fig. 5) evaluates a converged DeiT-S on ImageNet val while "we gradually drop 10% more
patches and set the pixels inside to zero": top-1 vs drop ratio 0 %, 10 %, ..., 90 %. This is the
random PatchDrop protocol of Naseer et al. 2021, "Intriguing Properties of Vision Transformers" (random
patches of the model's 16 x 16 px patch grid are blanked out). This tool runs that sweep for any timm
classifier and checkpoint::

    tokenaug-occlusion --data-dir DIR [--split val] --model NAME [--checkpoint FILE [--use-ema]]
                       [--model-kwargs k=v ...] [--num-classes N] [--ratios 0 0.1 ... 0.9]
                       [--mode zero|drop] [--fill zero|black] [--patch-size P] [--img-size S]
                       [--seed 0] [--repeats 1] [-b 64] [-j 2] [--device cpu|cuda] [--amp] [--out DIR]

and writes ``OUT/occlusion.csv``, ``OUT/occlusion.md`` and ``OUT/occlusion.png`` (and prints the table).

The protocol (what "dropping a patch" means here)
-------------------------------------------------
* **Patch grid.** The model's token grid: ``patch_embed.token_stride`` if present, else
  ``patch_embed.img_size / patch_embed.grid_size`` (hybrid ViTs included), else ``patch_embed.proj.stride``,
  else ``patch_embed.patch_size`` (:func:`token_stride`). Models without a patch embedding (CNNs) use
  16 x 16 px, DeiT's grid, so CNN and ViT curves blank out the same pixels. ``--patch-size`` overrides
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

import argparse
import contextlib
import csv
import math
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

from timm.data import create_dataset, create_transform, resolve_data_config
from timm.models.vision_transformer import VisionTransformer

from timm_plugin.maps import add_data_model_args, create_annotator, parse_model_kwargs

__all__ = ['DEFAULT_RATIOS', 'MODES', 'FILLS', 'num_dropped', 'patch_ranks', 'occlusion_mask', 'batch_masks',
           'token_stride', 'patch_grid', 'fill_values', 'zero_patches', 'keep_indices', 'token_drop',
           'occluded_logits', 'evaluate', 'write_results', 'format_table', 'parse_args', 'main']

DEFAULT_RATIOS = tuple(i / 10 for i in range(10))
MODES = ('zero', 'drop')
FILLS = ('zero', 'black')
CNN_PATCH = 16  # DeiT's grid, used for models without a patch embedding
CSV_FIELDS = ('ratio', 'dropped_patches', 'num_patches', 'top1', 'top5', 'top1_std', 'top5_std', 'images')


# ------------------------------------------------------------------------------------------- masks
def num_dropped(num_patches: int, ratio: float) -> int:
    """Patches dropped at ``ratio``: ``round(ratio * num_patches)``, halves rounded up."""
    if not 0 <= ratio < 1:
        raise ValueError(f'--ratios: each ratio must be in [0, 1), got {ratio}')
    return int(math.floor(round(ratio * num_patches, 9) + 0.5))


def _generator(seed: int, index: int, repeat: int) -> torch.Generator:
    if min(seed, index, repeat) < 0:
        raise ValueError(f'--seed, image index and repeat must be >= 0, got {seed}, {index}, {repeat}')
    state = np.random.SeedSequence((seed, repeat, index)).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def patch_ranks(num_patches: int, seed: int, index: int, repeat: int = 0) -> torch.Tensor:
    """Position of each patch in image ``index``'s random drop order, ``(num_patches,)`` int64.

    Patch p is dropped at ratio rho iff ``rank[p] < num_dropped(num_patches, rho)``."""
    order = torch.randperm(num_patches, generator=_generator(seed, index, repeat))
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(num_patches)
    return ranks


def occlusion_mask(num_patches_h: int, num_patches_w: int, ratio: float, seed: int, index: int,
                   repeat: int = 0) -> torch.Tensor:
    """Bool ``(num_patches_h, num_patches_w)``: True where image ``index`` has its patch dropped at ``ratio``."""
    n = num_patches_h * num_patches_w
    k = num_dropped(n, ratio)
    return (patch_ranks(n, seed, index, repeat) < k).view(num_patches_h, num_patches_w)


def batch_masks(ranks: torch.Tensor, grid: tuple[int, int], ratio: float) -> torch.Tensor:
    """Bool ``(B, h, w)`` drop masks at ``ratio`` from stacked :func:`patch_ranks` ``(B, h * w)``."""
    return (ranks < num_dropped(grid[0] * grid[1], ratio)).view(-1, *grid)


# -------------------------------------------------------------------------------------- patch grid
def token_stride(model: nn.Module) -> tuple[int, int] | None:
    """Pixel stride (h, w) of a model's patch tokens, or None for a model without ``patch_embed``."""
    embed = getattr(model, 'patch_embed', None)
    if embed is None:
        return None
    stride = getattr(embed, 'token_stride', None)
    img_size, grid_size = getattr(embed, 'img_size', None), getattr(embed, 'grid_size', None)
    if stride is None and img_size is not None and grid_size is not None \
            and all(i % g == 0 for i, g in zip(img_size, grid_size)):
        stride = tuple(i // g for i, g in zip(img_size, grid_size))
    proj = getattr(embed, 'proj', None)
    if stride is None and isinstance(proj, nn.Conv2d):
        stride = proj.stride
    if stride is None:
        stride = getattr(embed, 'patch_size', None)
    if stride is None:
        raise ValueError(f'{type(model).__name__}.patch_embed has no token_stride / grid_size / proj.stride / '
                         'patch_size; pass --patch-size')
    stride = (stride, stride) if isinstance(stride, int) else tuple(stride)
    return int(stride[0]), int(stride[1])


def patch_grid(model: nn.Module, input_hw: Sequence[int], patch_size: int | None = None,
               mode: str = 'zero') -> tuple[tuple[int, int], tuple[int, int]]:
    """``((grid_h, grid_w), (patch_h, patch_w))`` of the occlusion grid for an ``input_hw`` input."""
    stride = token_stride(model)
    if mode == 'drop' and patch_size is not None and stride is not None and (patch_size, patch_size) != stride:
        raise ValueError(f'--patch-size {patch_size}: --mode drop removes tokens, so the grid is the model\'s '
                         f'token stride {stride}; leave --patch-size out or use --mode zero')
    patch = (patch_size, patch_size) if patch_size is not None else stride or (CNN_PATCH, CNN_PATCH)
    h, w = int(input_hw[0]), int(input_hw[1])
    if h % patch[0] or w % patch[1]:
        raise ValueError(f'input size {h}x{w} is not divisible by the patch size {patch[0]}x{patch[1]}; '
                         'pass --img-size (a multiple of it) or --patch-size')
    return (h // patch[0], w // patch[1]), patch


# ------------------------------------------------------------------------------------- zero mode
def fill_values(fill: str, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Per-channel value ``(C,)`` of a dropped pixel in normalised input space (see the module doc)."""
    if fill == 'zero':
        return torch.zeros(len(mean))
    if fill == 'black':
        return -torch.tensor(mean, dtype=torch.float32) / torch.tensor(std, dtype=torch.float32)
    raise ValueError(f'--fill: expected one of {FILLS}, got {fill!r}')


def zero_patches(images: torch.Tensor, masks: torch.Tensor, patch: tuple[int, int],
                 fill: torch.Tensor | None = None) -> torch.Tensor:
    """``images`` (B, C, H, W) with the pixels of dropped patches (``masks`` (B, h, w), True) set to ``fill``."""
    b, c, height, width = images.shape
    if masks.shape != (b, height // patch[0], width // patch[1]) or height % patch[0] or width % patch[1]:
        raise ValueError(f'masks {tuple(masks.shape)} do not tile images {tuple(images.shape)} with '
                         f'{patch[0]}x{patch[1]} patches')
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
    return order[:, :flat.shape[1] - int(counts[0])]


def _check_drop_model(model: nn.Module) -> None:
    if not isinstance(model, VisionTransformer):
        raise ValueError(f'--mode drop: {type(model).__name__} is not a timm VisionTransformer (ViT / DeiT / LV-ViT '
                         'and subclasses), so its tokens cannot be removed; use --mode zero')


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
    _check_drop_model(model)
    hook = _TokenDropHook(model.num_prefix_tokens)
    handle = model.patch_drop.register_forward_hook(hook)
    try:
        yield hook
    finally:
        handle.remove()


def occluded_logits(model: nn.Module, images: torch.Tensor, masks: torch.Tensor, patch: tuple[int, int], *,
                    mode: str = 'zero', fill: torch.Tensor | None = None,
                    hook: _TokenDropHook | None = None) -> torch.Tensor:
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
            raise ValueError(f'--mode drop: {type(model).__name__}.forward ran patch_drop {hook.calls - calls} '
                             'times (expected once); use --mode zero')
    return logits


# -------------------------------------------------------------------------------------- evaluation
class _Indexed(Dataset):
    """(image, target, index) of a dataset, index = the position the masks are seeded with."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        image, target = self.dataset[index]
        return image, target, index


def _dataset(data_dir: str, split: str, transform) -> Dataset:
    root = Path(data_dir) / split if split else Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f'--data-dir {data_dir} / --split {split!r}: {root} is not a directory '
                                '(expected the ImageFolder layout DIR/SPLIT/<class>/<image>)')
    dataset = create_dataset('', root=data_dir, split=split, search_split=bool(split), transform=transform)
    if len(dataset) == 0:
        raise FileNotFoundError(f'--data-dir {data_dir} / --split {split!r}: no images under {root}')
    return dataset


def _data_config(model: nn.Module, img_size: int | None, crop_pct: float | None) -> dict:
    """timm's eval data config; a fixed-size ViT (e.g. ``img_size=112``) gets its own size, not the cfg's 224."""
    args: dict[str, Any] = {'crop_pct': crop_pct}
    embed = getattr(model, 'patch_embed', None)
    if img_size is not None:
        args['input_size'] = (3, img_size, img_size)
    elif embed is not None and getattr(embed, 'img_size', None) is not None \
            and not getattr(model, 'dynamic_img_size', False):
        args['input_size'] = (3, *embed.img_size)
    return resolve_data_config(args, model=model)


def _topk_correct(logits: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    if int(target.max()) >= logits.shape[-1]:
        raise ValueError(f'the data has class index {int(target.max())} but the model has {logits.shape[-1]} '
                         'classes; check --num-classes / --data-dir')
    k = min(5, logits.shape[-1])
    top = logits.topk(k, dim=-1).indices
    hits = top == target[:, None]
    return int(hits[:, 0].sum()), int(hits.any(dim=1).sum())


def _autocast(device: torch.device, amp: bool):
    if not amp:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.float16 if device.type == 'cuda' else torch.bfloat16)


def _check_ratios(ratios: Sequence[float]) -> list[float]:
    if not ratios:
        raise ValueError('--ratios: give at least one ratio')
    for ratio in ratios:
        num_dropped(1, ratio)  # range check
    return sorted(set(float(r) for r in ratios))


def evaluate(model: nn.Module, loader: DataLoader, *, grid: tuple[int, int], patch: tuple[int, int],
             ratios: Sequence[float] = DEFAULT_RATIOS, mode: str = 'zero', fill: torch.Tensor | None = None,
             seed: int = 0, repeats: int = 1, device: torch.device | str = 'cpu', amp: bool = False,
             progress: bool = False) -> list[dict]:
    """One row per ratio (``CSV_FIELDS``): top-1 / top-5 accuracy in % over ``loader``'s (image, target, index)."""
    if mode not in MODES:
        raise ValueError(f'--mode: expected one of {MODES}, got {mode!r}')
    if repeats < 1:
        raise ValueError(f'--repeats must be >= 1, got {repeats}')
    ratios = _check_ratios(ratios)
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
    return _rows(correct, seen, ratios, n)


def _rows(correct: np.ndarray, seen: int, ratios: Sequence[float], num_patches: int) -> list[dict]:
    acc = 100.0 * correct / max(seen, 1)  # (repeats, ratios, 2)
    rows = []
    for j, ratio in enumerate(ratios):
        rows.append({'ratio': ratio, 'dropped_patches': num_dropped(num_patches, ratio), 'num_patches': num_patches,
                     'top1': float(acc[:, j, 0].mean()), 'top5': float(acc[:, j, 1].mean()),
                     'top1_std': float(acc[:, j, 0].std()), 'top5_std': float(acc[:, j, 1].std()),
                     'images': seen})
    return rows


# ----------------------------------------------------------------------------------------- output
def format_table(rows: Sequence[dict], repeats: int = 1) -> str:
    """Markdown table of the rows (``± std`` over repeats when there are several)."""
    def acc(row: dict, key: str) -> str:
        return f'{row[key]:.2f}' + (f' ± {row[key + "_std"]:.2f}' if repeats > 1 else '')
    lines = ['| drop ratio | dropped patches | top-1 (%) | top-5 (%) |', '|---:|---:|---:|---:|']
    for row in rows:
        lines.append(f'| {row["ratio"]:.0%} | {row["dropped_patches"]}/{row["num_patches"]} | '
                     f'{acc(row, "top1")} | {acc(row, "top5")} |')
    return '\n'.join(lines)


def _plot(rows: Sequence[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    x = [100 * row['ratio'] for row in rows]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for key, style in (('top1', 'o-'), ('top5', 's--')):
        y, err = [row[key] for row in rows], [row[key + '_std'] for row in rows]
        ax.errorbar(x, y, yerr=err if any(err) else None, fmt=style, capsize=3, label=key.replace('top', 'top-'))
    ax.set_xlabel('drop ratio (% of patches)')
    ax.set_ylabel('accuracy (%)')
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(rows: Sequence[dict], out: str | Path, *, header: str, repeats: int = 1,
                  title: str | None = None) -> dict[str, Path]:
    """``occlusion.csv`` (one row per ratio), ``occlusion.md`` (header + table) and ``occlusion.png`` in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {'csv': out / 'occlusion.csv', 'md': out / 'occlusion.md', 'png': out / 'occlusion.png'}
    with open(paths['csv'], 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    paths['md'].write_text(f'# Occlusion robustness\n\n{header}\n\n{format_table(rows, repeats)}\n')
    _plot(rows, paths['png'], title or header.splitlines()[0])
    return paths


# -------------------------------------------------------------------------------------------- CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='tokenaug-occlusion', description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_model_args(p, split='val')
    p.add_argument('--ratios', type=float, nargs='+', default=list(DEFAULT_RATIOS), metavar='R',
                   help='fractions of patches to drop, each in [0, 1) (default 0 0.1 ... 0.9)')
    p.add_argument('--mode', default='zero', choices=MODES,
                   help='zero: blank the pixels (any model); drop: remove the tokens (timm ViTs)')
    p.add_argument('--fill', default='zero', choices=FILLS,
                   help='zero mode: 0 in normalised space (= mean colour, default) or black (raw pixel 0)')
    p.add_argument('--patch-size', type=int, default=None, help='occlusion patch in px (default: the model\'s '
                   f'token stride; {CNN_PATCH} for models without patch_embed)')
    p.add_argument('--img-size', type=int, default=None, help='eval input size (default: the model\'s)')
    p.add_argument('--crop-pct', type=float, default=None, help='eval centre-crop fraction (default: the model\'s)')
    p.add_argument('--seed', type=int, default=0, help='mask seed (the same for every checkpoint)')
    p.add_argument('--repeats', type=int, default=1, help='independent mask draws to average')
    p.add_argument('-b', '--batch-size', type=int, default=64)
    p.add_argument('-j', '--workers', type=int, default=2, help='DataLoader workers')
    p.add_argument('--device', default=None, help='cpu | cuda | cuda:N (default: cuda when available)')
    p.add_argument('--amp', action='store_true', help='autocast (float16 on CUDA, bfloat16 on CPU)')
    p.add_argument('--out', default='occlusion', help='output directory (default ./occlusion)')
    p.add_argument('--no-progress', action='store_true', help='no progress bar')
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        args.ratios = _check_ratios(args.ratios)
    except ValueError as e:
        parser.error(str(e))
    checks = {'seed': args.seed >= 0, 'repeats': args.repeats >= 1, 'batch_size': args.batch_size >= 1,
              'workers': args.workers >= 0, 'patch_size': args.patch_size is None or args.patch_size >= 1,
              'img_size': args.img_size is None or args.img_size >= 1}
    for name, ok in checks.items():
        if not ok:
            parser.error(f'--{name.replace("_", "-")}: got {getattr(args, name)}, expected '
                         f'{">= 0" if name in ("seed", "workers") else ">= 1"}')
    return args


def _device(name: str | None) -> torch.device:
    name = name or ('cuda' if torch.cuda.is_available() else 'cpu')
    if name.startswith('cuda') and not torch.cuda.is_available():
        raise ValueError(f'--device {name}: CUDA is not available')
    return torch.device(name)


def run(args: argparse.Namespace) -> list[dict]:
    """The whole CLI run: model, data, sweep, files; returns the rows."""
    device = _device(args.device)
    model = create_annotator(args.model, checkpoint=args.checkpoint, num_classes=args.num_classes,
                             model_kwargs=parse_model_kwargs(args.model_kwargs), use_ema=args.use_ema)
    if args.mode == 'drop':
        _check_drop_model(model)
    model.to(device)
    config = _data_config(model, args.img_size, args.crop_pct)
    grid, patch = patch_grid(model, config['input_size'][-2:], args.patch_size, args.mode)
    transform = create_transform(**config, is_training=False)
    dataset = _Indexed(_dataset(args.data_dir, args.split, transform))
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
                        pin_memory=device.type == 'cuda')
    fill = fill_values(args.fill, config['mean'], config['std'])
    rows = evaluate(model, loader, grid=grid, patch=patch, ratios=args.ratios, mode=args.mode, fill=fill,
                    seed=args.seed, repeats=args.repeats, device=device, amp=args.amp,
                    progress=not args.no_progress)
    weights = f'{args.checkpoint}{" (EMA)" if args.use_ema else ""}' if args.checkpoint else 'random weights'
    header = (f'{args.model} ({weights}), mode {args.mode}'
              + (f' (fill {args.fill})' if args.mode == 'zero' else '') + '\n\n'
              f'data {args.data_dir} / {args.split or "."}: {len(dataset)} images at '
              f'{config["input_size"][1]}x{config["input_size"][2]}, {grid[0]}x{grid[1]} patches of '
              f'{patch[0]}x{patch[1]} px; seed {args.seed}, {args.repeats} repeat(s)')
    title = f'{args.model} ({Path(args.checkpoint).name if args.checkpoint else "random weights"}), mode {args.mode}'
    paths = write_results(rows, args.out, header=header, repeats=args.repeats, title=title)
    print(f'{header}\n\n{format_table(rows, args.repeats)}\n\nwrote {", ".join(str(p) for p in paths.values())}')
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f'tokenaug-occlusion: error: {e}', file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main())
