"""The machine annotator of Token Labeling (the Token Labeling paper, Sec. 3.2, 4.1): any timm classifier applied
at every location of its pre-pool features, giving a dense score map per image (``tokenaug-maps generate``,
:mod:`timm_plugin.tools.maps_cli`, writes them into a :mod:`shared_core.map_store` store).

How a map is made
-----------------
* The dataset is ``timm.data.create_dataset('', root=DIR, split=SPLIT)`` (ImageFolder layout
  ``DIR/SPLIT/<class>/<image>``); rows follow the dataset order and are keyed by
  ``dataset.filename(i)`` (the path relative to ``DIR/SPLIT``).
* Each image is resized, whole, to ``--input-size`` (squash: no crop, aspect not kept), converted to a
  tensor and normalised with the annotator's ``pretrained_cfg`` mean/std (``resolve_data_config``).
  So map cell (i, j) covers x in [j/w, (j+1)/w], y in [i/h, (i+1)/h] of the original image.
* The classifier is applied at every location of the annotator's pre-pool features
  (:func:`dense_logits`): 4-D features (CNNs: NCHW; Swin & co: NHWC, from ``model.output_fmt``) become
  a batch of 1 x 1 maps fed to ``model.forward_head`` (global pooling of a 1 x 1 map is the identity, so
  norm / pre-logits / conv layers of the head are kept); 3-D token features (ViT-like, ``(B, prefix + N,
  C)``) lose their ``model.num_prefix_tokens`` prefix tokens and each patch token goes through
  ``model.fc_norm`` then ``model.head`` (the mean of ``head`` and ``head_dist`` for distilled DeiT). A model
  with an ``aux_head`` (LV-ViT, :mod:`timm_plugin.lvvit`) is annotated by ``aux_head`` applied to each
  patch token as ``forward_features`` returns it (after the final norm, without ``fc_norm``), which is how
  LV-ViT's token-label head is used in training. Attention pooling (``attn_pool``, ``AttentionPool*``)
  mixes locations, so such models are refused.
* Softmax over classes (fp32), top-k per location (sorted descending), stored as fp16 probabilities and
  integer class indices. The grid is the annotator's native feature grid at the input size (ResNet-50 at
  576 px: 18 x 18) and is recorded in the store's meta.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
from typing import Any, Sequence

import timm
import torch
import torch.nn as nn
from timm.data import resolve_data_config
from timm.data.transforms import str_to_interp_mode
from torchvision import transforms as T

from .checkpoints import read_state_dict

__all__ = [
    'head_kind',
    'feature_layout',
    'logits_from_features',
    'dense_logits',
    'annotate',
    'create_annotator',
    'eval_transform',
    'sha256_file',
]


# ------------------------------------------------------------------------------ dense classification
def _check_no_attention_pool(model: nn.Module) -> None:
    pool = getattr(model, 'attn_pool', None)
    names = [n for n, m in model.named_modules() if type(m).__name__.startswith('AttentionPool')]
    if pool is not None or names:
        raise ValueError(
            f'{type(model).__name__} pools with attention ({names[0] if names else "attn_pool"}), '
            'which mixes all locations, so it has no per-location classifier; use a model with '
            'average / token pooling as annotator'
        )


def _token_grid(model: nn.Module, num_tokens: int, image_hw: tuple[int, int]) -> tuple[int, int]:
    """(h, w) of the patch tokens of a 3-D (B, N, C) feature map for an image of ``image_hw``."""
    embed = getattr(model, 'patch_embed', None)
    embed = getattr(model, 'stem', None) if embed is None else embed
    if embed is not None and getattr(model, 'dynamic_img_size', False) and hasattr(embed, 'dynamic_feat_size'):
        grid = tuple(embed.dynamic_feat_size(image_hw))
    elif embed is not None and getattr(embed, 'grid_size', None) is not None:
        grid = tuple(embed.grid_size)
    else:  # the (h, w) with h * w == N and the image's aspect ratio
        h = max(1, round((num_tokens * image_hw[0] / image_hw[1]) ** 0.5))
        grid = (h, num_tokens // h)
    if grid[0] * grid[1] != num_tokens:
        raise ValueError(
            f'{type(model).__name__}: {num_tokens} patch tokens do not form the grid {grid} expected '
            f'for a {image_hw[0]}x{image_hw[1]} input'
        )
    return int(grid[0]), int(grid[1])


def head_kind(model: nn.Module, feature_ndim: int) -> str:
    """Which per-location classifier :func:`dense_logits` uses (recorded in the store's meta)."""
    if feature_ndim == 4:
        return 'forward_head'
    if getattr(model, 'aux_head', None) is not None:
        return 'aux_head'
    if getattr(model, 'head_dist', None) is not None:
        return 'fc_norm+mean(head,head_dist)'
    return 'fc_norm+head'


def _token_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    kind = head_kind(model, 3)
    if kind == 'aux_head':
        return model.aux_head(tokens)
    head = getattr(model, 'head', None)
    if not isinstance(head, nn.Module):
        raise ValueError(f'{type(model).__name__} returns token features but has no `head` module to apply per token')
    fc_norm = getattr(model, 'fc_norm', None)
    x = tokens if fc_norm is None else fc_norm(tokens)
    if kind == 'fc_norm+head':
        return head(x)
    return (head(x) + model.head_dist(x)) / 2


def feature_layout(model: nn.Module, feats: torch.Tensor) -> str:
    """'NCHW', 'NHWC' (4-D, per ``model.output_fmt``) or 'NLC' (3-D tokens) for ``forward_features`` output."""
    if feats.ndim == 4:
        return 'NHWC' if getattr(model, 'output_fmt', 'NCHW') == 'NHWC' else 'NCHW'
    if feats.ndim == 3:
        return 'NLC'
    raise ValueError(
        f'{type(model).__name__}.forward_features gave shape {tuple(feats.shape)}; expected '
        '(B, C, h, w), (B, h, w, C) or (B, tokens, C)'
    )


def logits_from_features(model: nn.Module, feats: torch.Tensor, image_hw: tuple[int, int]) -> torch.Tensor:
    """Per-location logits ``(B, h, w, num_classes)`` from ``model.forward_features`` output."""
    _check_no_attention_pool(model)
    if isinstance(feats, (tuple, list)):
        raise ValueError(
            f'{type(model).__name__}.forward_features returns a {type(feats).__name__}; expected one feature tensor'
        )
    layout = feature_layout(model, feats)
    if layout == 'NHWC':
        b, h, w, c = feats.shape
        logits = model.forward_head(feats.reshape(b * h * w, 1, 1, c))
    elif layout == 'NCHW':
        b, c, h, w = feats.shape
        logits = model.forward_head(feats.permute(0, 2, 3, 1).reshape(b * h * w, c, 1, 1))
    else:
        b = feats.shape[0]
        tokens = feats[:, getattr(model, 'num_prefix_tokens', 0) :]
        h, w = _token_grid(model, tokens.shape[1], tuple(image_hw))
        logits = _token_logits(model, tokens).flatten(0, 1)
    if logits.ndim != 2 or logits.shape[0] != b * h * w:
        raise ValueError(
            f'{type(model).__name__}: per-location head gave shape {tuple(logits.shape)}, expected '
            f'({b * h * w}, num_classes)'
        )
    return logits.reshape(b, h, w, logits.shape[-1])


def dense_logits(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """Per-location class logits ``(B, h, w, num_classes)`` of a timm classifier (see the module doc)."""
    return logits_from_features(model, model.forward_features(images), tuple(images.shape[-2:]))


def annotate(model: nn.Module, images: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax probabilities and classes per location: ``(B, k, h, w)`` float16 and int64, descending."""
    probs = dense_logits(model, images).float().softmax(dim=-1)
    if k > probs.shape[-1]:
        raise ValueError(f"--topk {k} exceeds the annotator's {probs.shape[-1]} classes")
    values, indices = probs.topk(k, dim=-1, sorted=True)
    return values.permute(0, 3, 1, 2).half(), indices.permute(0, 3, 1, 2)


# --------------------------------------------------------------------------------- annotator, data
def _classifier_size(model_name: str, state_dict: dict[str, torch.Tensor], checkpoint: str) -> int:
    names = timm.models.get_pretrained_cfg_value(model_name, 'classifier') if timm.is_model(model_name) else None
    names = [names] if isinstance(names, str) else list(names or [])
    for name in names + ['head', 'fc', 'classifier', 'head.fc']:
        weight = state_dict.get(f'{name}.weight')
        if weight is not None and weight.ndim >= 2:
            return int(weight.shape[0])
    raise ValueError(f'cannot tell the number of classes of checkpoint {checkpoint}; pass --num-classes')


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(1 << 20), b''):
            digest.update(chunk)
    return digest.hexdigest()


def _register_plugin_models(model_name: str) -> None:
    """Make tokenaug's own timm models (LV-ViT) known to timm when a name is not registered yet."""
    if not timm.is_model(model_name) and importlib.util.find_spec('timm_plugin.lvvit') is not None:
        importlib.import_module('timm_plugin.lvvit')


def create_annotator(
    model_name: str,
    *,
    checkpoint: str | None = None,
    num_classes: int | None = None,
    model_kwargs: dict[str, Any] | None = None,
    use_ema: bool = False,
) -> nn.Module:
    """A timm model in eval mode; weights from a local checkpoint (``state_dict`` / ``state_dict_ema`` / raw,
    loaded with ``weights_only=True``, strictly: the aux head or ScoreNets of a token-labeling or TokenMixup run are
    attached first, :func:`~timm_plugin.recipe.attach_modules_in`) or random when ``checkpoint`` is None."""
    _register_plugin_models(model_name)
    kwargs = dict(model_kwargs or {})
    if 'num_classes' in kwargs and num_classes is not None:
        raise ValueError('give the number of classes once: --num-classes or --model-kwargs num_classes=..., not both')
    state_dict = None
    if checkpoint is not None:
        if not os.path.isfile(checkpoint):
            raise FileNotFoundError(f'--checkpoint {checkpoint}: no such file')
        state_dict = read_state_dict(checkpoint, '--checkpoint', use_ema=use_ema)  # a bad file: named
        if num_classes is None and 'num_classes' not in kwargs:
            num_classes = _classifier_size(model_name, state_dict, checkpoint)
    if num_classes is not None:
        kwargs['num_classes'] = num_classes
    model = timm.create_model(model_name, pretrained=False, **kwargs)
    if state_dict is not None:
        from .recipe import attach_modules_in

        attach_modules_in(model, state_dict)  # a token-labeling or TokenMixup run's file: its modules idle here
        try:
            model.load_state_dict(state_dict, strict=True)
        except RuntimeError as e:
            raise ValueError(f'--checkpoint {checkpoint} does not fit {model_name} {kwargs}: {e}') from e
    return model.eval()


def eval_transform(model: nn.Module, input_size: Sequence[int]) -> tuple[T.Compose, dict]:
    """Whole-image squash resize to ``input_size`` + the model's normalisation; also returns that config."""
    cfg = resolve_data_config({}, model=model)
    config = {
        'mean': [float(m) for m in cfg['mean']],
        'std': [float(s) for s in cfg['std']],
        'interpolation': cfg['interpolation'],
    }
    transform = T.Compose(
        [
            T.Resize(tuple(int(s) for s in input_size), interpolation=str_to_interp_mode(cfg['interpolation'])),
            T.ToTensor(),
            T.Normalize(config['mean'], config['std']),
        ]
    )
    return transform, config
