"""tokenaug's methods as timm training tasks (``timm.task.TrainingTask``): ``result = task(input, target)``
returns ``{'loss', 'output', ...}`` as timm's ``ClassificationTask`` does, so timm's own ``train.py`` enables a
method by changing its task line (docs: the timm guide, "With timm's own train.py").

- :class:`TLAlignTask`, :class:`TransMixTask`: the target of a token-aware mixer (a
  :class:`~timm_plugin.carrier.MixTarget`, ``create_mixer(mix_kind, method=...)``) is re-weighted by the
  attention (:meth:`shared_core.tracer.Tracer.label_path` / :func:`~shared_core.tl_align.transmix_share`)
  before the criterion; the logits are the model's own. A plain target (mixing off) is the
  ``ClassificationTask`` step.
- :class:`TokenLabelingTask`: MixToken on the patch embedding, the aux head's un-mixed token logits and
  token labeling's loss (Eq. 3-7); validation uses :func:`~shared_core.token_labeling.inference_logits`.
- :class:`TokenMixupTask`: HTM / VTM inside the model, the relabelled target plus the ScoreNet loss.

As in timm: the trainable module is the bare model (``prepare_distributed`` wraps it in DDP), the method's
hooks sit on the unwrapped model and the step runs through the (wrapped) module, so DDP synchronises as usual;
EMA (``setup_ema``) and checkpoints hold the bare model, keys unchanged. ``compile()`` (timm's) compiles the
trainable module; the step runs through it, and dynamo traces the method's hooks into the graph (equal to the
eager step: ``tests/timm_plugin/test_compile.py``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn
from timm.task import ClassificationTask
from timm.utils import unwrap_model
from timm.utils.model import get_state_dict

from .carrier import MixTarget
from .tl_align import TLAlign, TransMix
from .token_labeling import TokenLabeling, TokenLabelingLoss
from .tokenmixup import TokenMixup

__all__ = ['MethodTask', 'TLAlignTask', 'TransMixTask', 'TokenLabelingTask', 'TokenLabelingEval', 'TokenMixupTask']


class MethodTask(ClassificationTask):
    """A ``ClassificationTask`` whose step runs one of our method wrappers (``method_cls``) on the bare model,
    built before anything else so a bad model fails first, and held outside the task's modules (the trainable
    module stays the model: DDP, EMA and checkpoint keys as timm's)."""

    method_cls: type = nn.Module
    #: keys of ``forward``'s output (floats) that the training loop averages over the epoch and logs
    log_keys: Tuple[str, ...] = ()

    def __init__(
        self,
        model: nn.Module,
        criterion=None,
        criterion_kwargs: Optional[dict] = None,
        *,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
        verbose: bool = True,
        **method_kwargs,
    ):
        method = self.method_cls(unwrap_model(model), **method_kwargs)
        super().__init__(model, criterion, criterion_kwargs, device=device, dtype=dtype, verbose=verbose)
        self.__dict__['method'] = method  # holds the bare model: not a submodule of the task


class TLAlignTask(MethodTask):
    """TL-Align (the TL-Align paper) as a timm ``TrainingTask``: :meth:`timm_plugin.TLAlign.align` run through the
    trainable module.

    Args:
        model: a timm model with a TL-Align tracer (:data:`timm_plugin.tl_align.SUPPORTED_MODELS`).
        criterion, criterion_kwargs, device, dtype, verbose: as ``timm.task.ClassificationTask`` (the criterion
            takes the soft target, e.g. ``SoftTargetCrossEntropy`` or ``BinaryCrossEntropy``).
        layers, residual, fused, drop_path: as :class:`timm_plugin.TLAlign`.

    ``forward`` returns ``loss``, ``output`` (the model's logits) and ``target`` (the aligned target); with a
    plain target (mixing switched off) it is the ``ClassificationTask`` step.
    """

    method_cls = TLAlign

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> Dict[str, torch.Tensor]:
        if not isinstance(target, MixTarget):  # mixing off (prob 0, after --mixup-off-epoch): the plain step
            return super().forward(input, target)
        output, aligned = self.method.align(input, target, lambda: self.trainable_module(input))
        return {'loss': self.criterion(output, aligned), 'output': output, 'target': aligned}


class TransMixTask(TLAlignTask):
    """TransMix (the baseline TL-Align compares with) as a timm ``TrainingTask``: :class:`timm_plugin.TransMix`'s
    ``align`` (:meth:`timm_plugin.TLAlign.align`'s signature; the partner share from the last block's class-token
    attention, ``mode='paper'`` or ``'average'``)."""

    method_cls = TransMix


class TokenLabelingEval(nn.Module):
    """The prediction of a model with an aux head (:meth:`TokenLabeling.predict`,
    :func:`~shared_core.token_labeling.inference_logits`). Holds the model without registering it (its state
    dict is empty), so checkpoints keep the model's own keys; works for a ``ModelEmaV3`` too."""

    def __init__(self, model: nn.Module, method: TokenLabeling):
        super().__init__()
        self.__dict__['model'] = model  # not a submodule
        self.__dict__['method'] = method

    def train(self, mode: bool = True) -> 'TokenLabelingEval':
        super().train(mode)
        self.model.train(mode)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model = unwrap_model(self.model)
        return self.method.predict(x, getattr(model, 'module', model))  # ModelEmaV3 keeps its copy in .module


class TokenLabelingTask(MethodTask):
    """Token labeling + MixToken (the Token Labeling paper) as a timm ``TrainingTask``.

    The target is the :class:`~timm_plugin.token_label_data.TokenLabelTarget` of ``TokenLabelCollate`` (label
    indices carrying each image's map rows, crop and flip). The step is :meth:`TokenLabeling.outputs` run
    through the trainable module (MixToken's box, un-mixed aux logits), then
    :class:`~timm_plugin.token_labeling.TokenLabelingLoss`; validation uses :meth:`TokenLabeling.predict`.

    Args:
        model: a timm ViT with ``model.aux_head`` (LV-ViT, or :func:`~timm_plugin.token_labeling.attach_aux_head`)
            when ``dense_weight > 0``.
        criterion: a :class:`TokenLabelingLoss` (default: built from ``num_classes``, ``dense_weight``,
            ``cls_target``, ``cls_target_mix``, ``smoothing``, ``cls_target_pool``).
        mix_token, beta, prob, mode: MixToken (Beta(beta, beta) box, mixing probability, ``'batch'``/``'pair'``).
        head_rule: validation output, ``'cls+aux'`` or ``'cls'``.
        generator: RNG of MixToken's box.
        box_rounding: ``'timm'`` or ``'public'`` (the public code's ``cut // 2`` box).
    """

    method_cls = TokenLabeling

    def __init__(
        self,
        model: nn.Module,
        criterion: Optional[TokenLabelingLoss] = None,
        *,
        num_classes: Optional[int] = None,
        dense_weight: float = 0.5,
        cls_target: str = 'gt',
        cls_target_mix: float = 0.5,
        smoothing: float = 0.1,
        cls_target_pool: str = 'distributions',
        mix_token: bool = True,
        beta: float = 1.0,
        prob: float = 1.0,
        mode: str = 'batch',
        head_rule: str = 'cls+aux',
        generator: Optional[torch.Generator] = None,
        box_rounding: str = 'timm',
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
        verbose: bool = True,
    ):
        if criterion is None:
            criterion = TokenLabelingLoss(
                num_classes or unwrap_model(model).num_classes,
                dense_weight=dense_weight,
                cls_target=cls_target,
                cls_target_mix=cls_target_mix,
                smoothing=smoothing,
                cls_target_pool=cls_target_pool,
            )
        super().__init__(
            model,
            criterion,
            device=device,
            dtype=dtype,
            verbose=verbose,
            mix_token=mix_token,
            beta=beta,
            prob=prob,
            mode=mode,
            aux=bool(criterion.dense_weight),
            head_rule=head_rule,
            generator=generator,
            box_rounding=box_rounding,
        )

    @property
    def sampler(self):
        """MixToken's sampler (``sampler.mixup_enabled = False`` switches it off, as timm's mixers)."""
        return self.method.sampler

    def get_eval_model(self, module: Optional[nn.Module] = None, ema: bool = False) -> Optional[nn.Module]:
        inner = super().get_eval_model(module, ema)
        return None if inner is None else TokenLabelingEval(inner, self.method)

    def get_checkpoint_state(self, ema: bool = False, unwrap_fn=unwrap_model) -> Dict[str, Any]:
        state = super().get_checkpoint_state(ema, unwrap_fn)
        key = 'state_dict_ema' if ema else 'state_dict'
        if key in state:  # the model's own keys (the eval wrapper holds no state)
            state[key] = get_state_dict(self.get_trainable_module(ema=ema), unwrap_fn)
        return state

    def load_checkpoint_state(self, state_dict, task_state=None, ema: bool = False, strict: bool = True) -> None:
        unwrap_model(self.get_trainable_module(ema=ema)).load_state_dict(state_dict, strict=strict)

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> Dict[str, torch.Tensor]:
        out = self.method.outputs(input, self.trainable_module)
        return {'loss': self.criterion(out, target), 'output': out.cls}


class TokenMixupTask(MethodTask):
    """TokenMixup (the TokenMixup paper) as a timm ``TrainingTask``: :meth:`timm_plugin.TokenMixup.mix_forward` run
    through the trainable module; ``loss = criterion(logits, relabelled target) + target.aux_loss`` (the ScoreNet
    loss). The ScoreNets are ``model.tokenmixup_scorenet``, so the optimizer built from the trainable module, EMA
    and checkpoints hold them. Eval is the plain model.

    Args:
        model: a timm ViT/DeiT or tokenaug CCT.
        criterion: a soft-target loss (``SoftTargetCrossEntropy``): the target is soft after HTM's relabelling.
        **method_kwargs: :class:`timm_plugin.TokenMixup`'s (``htm_layers``, ``vtm_layers``, ``rho``, ``tau``, ...).

    ``forward`` returns ``loss``, ``output``, ``target`` (relabelled), ``scorenet_loss`` and ``htm_mixed`` (a
    float: the samples HTM mixed, summed over its blocks, per sample of the batch; with one block, the share of
    the batch it mixed: the paper's Fig. 4 curve), which ``tokenaug-train`` logs (:attr:`log_keys`).
    """

    method_cls = TokenMixup  # attaches the ScoreNets to the model before the optimizer is built
    log_keys = ('htm_mixed',)

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> Dict[str, torch.Tensor]:
        output, mixed = self.method.mix_forward(input, target, lambda: self.trainable_module(input))
        loss = self.criterion(output, mixed.as_subclass(torch.Tensor)) + mixed.aux_loss
        share = sum(s['mixed'] for s in mixed.stats.values()) / input.shape[0]
        return {'loss': loss, 'output': output, 'target': mixed, 'scorenet_loss': mixed.aux_loss, 'htm_mixed': share}
