"""The tracer contract: what one model family tells TL-Align, and the driver that runs every family.

A *tracer* holds the label rules of one model family in one framework (timm's in :mod:`timm_plugin.tl_align`,
mmpretrain's in :mod:`mm_plugin.tl_align`). It derives from :class:`Tracer`, and the split is this.

**The driver owns** (this class, never a family):

- the forward: :meth:`Tracer.capture` registers the hooks, runs the token path unchanged and removes them whatever
  happens; one :class:`~shared_core.capture.LabelCapture` per block, in the order ``layers`` indexes, in
  :class:`~shared_core.capture.Captures` (with the first token ``grid``);
- the attention record: a family that names a ``capture_mode`` (:class:`~shared_core.capture.SdpaCapture`,
  :class:`~shared_core.capture.SoftmaxCapture`) gets each block's attention call recorded into its capture;
- stochastic depth: the samples each block's token-mixing drop path kept (``'public'``: ignored);
- the token count check, no gradients and fp32 whatever autocast the token path ran under;
- the loop: per stage, :meth:`~Tracer.enter` (downsampling), then per block the ``layers`` filter and Eq. 11,
  ``Y ← Norm(shortcut + branch)`` (:func:`~shared_core.tl_align.residual_labels`) for the samples whose branch
  ran, a block outside ``layers`` passing its shortcut; then :meth:`~Tracer.leave`;
- observation: ``observe(index, labels, grid)`` after every block (``TLAlign.label_states``, tokenaug-viz);
- the readout kinds (:data:`READOUTS`): the class token, the mean of the patch tokens, the mean of all tokens,
  class and distillation tokens, or a learnt pooling's weights;
- TransMix's eligibility, read from the tracer's ``attends`` (:func:`check_transmix`).

**A family supplies:**

- ``__init__(model)``: its refusals, through the shared checks (:func:`check_block_parts`,
  :func:`check_fused_sdpa`, :func:`check_pool`, :func:`check_types`), then ``super().__init__(model)``;
- its blocks: :meth:`~Tracer.blocks` (one sequence), or :meth:`~Tracer.stages` (``(stage, blocks)`` pairs);
- its watch: ``capture_mode`` and :meth:`~Tracer.attention` (which module's attention call to record),
  :meth:`~Tracer.drop_path` (the drop path of the token-mixing branch), :meth:`~Tracer.watch` (any other per-block
  hook), :meth:`~Tracer.watch_model` (the first grid, a pooling), and the capture fields its rule ``needs``;
- its layout: ``layout = 'rows'`` (``(B, T, K)``, prefix tokens first), ``'map'`` (``(B, K, H, W)`` on
  ``captures.grid``, for the conv ops) or ``'grid'`` (``(B, H, W, K)``, for window attention), or its own
  :meth:`~Tracer.to_layout` (Hiera's unrolled order);
- its per-block rule: :meth:`~Tracer.branch`, the labels the block's token mixing gives (Eq. 9, Table 9), and
  where the shortcut is not the identity (pooling), :meth:`~Tracer.shortcut`; :meth:`~Tracer.after` for a
  mixing between blocks (Twins' position encoding);
- ``readout`` (one of :data:`READOUTS`), ``num_prefix_tokens``, ``attends`` (and ``why_no_attention`` where not),
  and, where a class token attends in the last block, :meth:`~Tracer.class_attention` for TransMix.

A tracer whose model another framework may pool outside it (a timm CNN as mmpretrain's ``TIMMBackbone`` with a
``GlobalAveragePooling`` neck) takes ``pooled_outside=True``: the head's own pooling is then not checked, and the
readout is the same mean. A tracer holds no state of a forward: everything a forward leaves is in its captures.
``docs/development.md`` ("Adding a family to TL-Align") has a worked example.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .capture import Captures, LabelCapture, check_captured, hook_drop_path
from .options import DROP_PATH_LABELS
from .tl_align import residual_labels

__all__ = [
    'READOUTS',
    'Tracer',
    'tracer_for',
    'check_transmix',
    'check_drop_path',
    'check_block_parts',
    'check_types',
    'check_fused_sdpa',
    'check_pool',
]

#: what the classifier reads, and so the label the target is: ``'cls'`` the class token; ``'mean'`` the mean of
#: the patch tokens (global average pooling); ``'mean_all'`` the mean of every token, prefix tokens included;
#: ``'cls_dist'`` DeiT distilled (the class token in distilled training, two outputs; else the mean of the class
#: and distillation tokens); ``'pool'`` a learnt pooling ``Σ_t w_t Y_t``, ``w = softmax(captures.pool)``
READOUTS = ('cls', 'mean', 'mean_all', 'cls_dist', 'pool')

#: ``observe(index, labels, grid)``: the ``(B, T, K)`` label rows after block ``index`` (prefix tokens first) and
#: the ``(H, W)`` grid of its patch tokens (``None`` where they are not on one)
Observer = Callable[[int, torch.Tensor, Optional[Tuple[int, int]]], None]


class Tracer:
    """The base of every tracer (see the module docstring for the contract)."""

    num_prefix_tokens: int = 0
    #: the last block mixes its tokens by a self-attention (TransMix reads it); where not, ``why_no_attention``
    attends: bool = True
    why_no_attention: str = ''
    readout: str = 'mean'
    #: ``'rows'`` ``(B, T, K)``; ``'map'`` ``(B, K, H, W)`` on the first grid ``captures.grid`` (for the conv ops);
    #: ``'grid'`` ``(B, H, W, K)`` on it (as window attention partitions its tokens)
    layout: str = 'rows'
    #: the torch function mode that records each block's attention call (``None``: the family's own hooks)
    capture_mode: Optional[type] = None
    #: the capture fields every block must have after a forward, and the likely cause where one lacks them
    needs: Tuple[str, ...] = ()
    why_missing: str = ''
    #: the module whose hook gives ``captures.grid`` (for the error where it did not run)
    grid_module: str = 'the patch embedding'
    #: the label path runs the model's whole graph as one program (timm's graph route for conv nets): it has no
    #: blocks to pick (``layers``) or residuals to drop (``residual=False``)
    whole_graph: bool = False

    def __init__(self, model: nn.Module):
        self.model = model

    # ------------------------------------------------------------------ what a family supplies

    def stages(self) -> Sequence[Tuple[Any, Sequence[nn.Module]]]:
        """``(stage, blocks)`` in order (default: one stage of :meth:`blocks`); ``stage`` is what :meth:`enter`
        and :meth:`leave` get."""
        return [(None, self.blocks())]

    def blocks(self) -> Sequence[nn.Module]:
        """The blocks ``layers`` indexes, in order."""
        return [blk for _, blocks in self.stages() for blk in blocks]

    def attention(self, blk: nn.Module) -> Optional[nn.Module]:
        """The module whose attention call ``capture_mode`` records (``None``: the block has none)."""
        return blk.attn

    def drop_path(self, blk: nn.Module) -> Optional[nn.Module]:
        """The drop path of the block's token-mixing branch (read at its first call), or ``None``."""
        return getattr(blk, 'drop_path1', None)

    def watch(self, blk: nn.Module, cap: LabelCapture, handles: list) -> None:
        """The family's own hooks on one block (appending their handles)."""

    def watch_model(self, captures: Captures, handles: list) -> None:
        """The family's hooks outside the blocks (the first grid, ``captures.grid``; a pooling, ``captures.pool``)."""

    def tokens(self, captures: Captures) -> int:
        """The tokens of the label state for this forward (prefix and patches); default from ``captures.grid``."""
        if captures.grid is None:
            raise ValueError(
                f'model: the label path found no token grid: {self.grid_module} did not run (a replaced forward?)'
            )
        grid = captures.grid
        return self.num_prefix_tokens + (grid if isinstance(grid, int) else grid[0] * grid[1])

    def to_layout(self, labels: torch.Tensor, captures: Captures):
        """The ``(B, T, K)`` initial labels in the family's layout."""
        if self.layout == 'map':
            H, W = captures.grid
            return labels.transpose(1, 2).reshape(labels.shape[0], labels.shape[2], H, W)
        if self.layout == 'grid':
            return labels.view(labels.shape[0], *captures.grid, labels.shape[-1])
        return labels

    def to_rows(self, Y) -> torch.Tensor:
        """The family's layout back to ``(B, T, K)`` rows."""
        if self.layout == 'map':
            return Y.flatten(2).transpose(1, 2)
        return Y.flatten(1, 2) if self.layout == 'grid' else Y

    def grid_of(self, Y, captures: Captures) -> Optional[Tuple[int, int]]:
        """The ``(H, W)`` grid of the patch tokens in ``Y`` (for an observer), ``None`` where they are on none."""
        if self.layout == 'map':
            return tuple(Y.shape[-2:])
        if self.layout == 'grid':
            return tuple(Y.shape[1:3])
        grid = captures.grid
        if isinstance(grid, tuple) and Y.shape[1] == self.num_prefix_tokens + grid[0] * grid[1]:
            return grid
        return None

    def enter(self, stage, Y):
        """What a stage does before its blocks (downsampling); default nothing."""
        return Y

    def leave(self, stage, Y):
        """What a stage does after its blocks (mmpretrain's patch merging); default nothing."""
        return Y

    def shortcut(self, blk: nn.Module, cap: LabelCapture, Y):
        """The labels of the block's shortcut (a pooled shortcut at a stage start); default the identity."""
        return Y

    def branch(self, blk: nn.Module, cap: LabelCapture, Y):
        """The labels the block's token-mixing branch gives (Eq. 9 or Table 9), in the layout of ``Y``."""
        raise NotImplementedError(f'{type(self).__name__}.branch')

    def after(self, stage, j: int, Y):
        """A mixing after block ``j`` of ``stage`` outside the blocks (Twins' position encoding); default none."""
        return Y

    def class_attention(self, captures: Captures) -> Optional[tuple]:
        """For TransMix's class-token rule: ``(q_cls (B, H, 1, d), k (B, H, T, d), scale[, mask])`` of the last
        block, or the class token's attention probabilities ``(B, H, 1, T)``; ``None`` where the classifier reads
        no class token (TransMix then reads the pooled label after the last block's attention alone)."""
        return None

    # ------------------------------------------------------------------ the driver

    @property
    def depth(self) -> int:
        """The number of blocks ``layers`` indexes."""
        return len(self.blocks())

    def _attention_geometry(self):
        """``(num_heads, head_dim)`` of each attention module of the model (its ``head_dim``, mmpretrain's
        ``head_dims``, else its ``q`` or ``qkv`` projection's width over ``num_heads``)."""
        for m in self.model.modules():
            heads = getattr(m, 'num_heads', None)
            dim = next((d for d in (getattr(m, 'head_dim', None), getattr(m, 'head_dims', None)) if _count(d)), None)
            qkv, q = getattr(m, 'qkv', None), getattr(m, 'q', None)
            if dim is None and _count(heads):
                if isinstance(q, nn.Linear):
                    dim = q.out_features // heads
                elif isinstance(qkv, nn.Linear):
                    dim = qkv.out_features // 3 // heads
            if _count(dim):
                yield (heads if _count(heads) else None), dim

    def head_dims(self) -> Tuple[int, ...]:
        """The head dims the model's attention modules run at: what a label kernel's self-check covers."""
        return tuple(sorted({d for _, d in self._attention_geometry()}))

    def attention_shape(self) -> Optional[Tuple[int, int]]:
        """``(num_heads, head_dim)`` of the model's first attention, for timing the label paths at its shape
        (``None``: none found)."""
        return next(((h, d) for h, d in self._attention_geometry() if h is not None), None)

    def register(self, captures: Captures) -> list:
        """The hooks of one forward (one capture per block appended to ``captures``); returns their handles."""
        handles: list = []
        self.watch_model(captures, handles)
        mode = self.capture_mode() if self.capture_mode is not None else None
        for blk in self.blocks():
            cap = LabelCapture()
            captures.append(cap)
            module = self.attention(blk) if mode is not None else None
            if module is not None:
                mode.watch(module, cap, handles)
            self.watch(blk, cap, handles)
            hook_drop_path(self.drop_path(blk), cap, handles)
        if mode is not None:
            mode.start(handles)
        return handles

    def capture(self, forward: Callable[[], Any], watcher=None) -> Tuple[Any, Captures]:
        """Run ``forward()`` (the token path, unchanged) with the hooks of ``watcher`` (default this tracer; the
        shared attention pass of timm ViTs is another); returns its output and the captures."""
        captures = Captures()
        handles = (watcher or self).register(captures)
        try:
            output = forward()
        finally:
            for h in handles:
                h.remove()
        return output, captures

    def num_tokens(self, captures: Captures) -> int:
        """:meth:`tokens`, after checking that every block left what the rule ``needs``."""
        if self.needs:
            check_captured(captures, self.needs, self.why_missing)
        return self.tokens(captures)

    def propagate(
        self,
        captures: Captures,
        labels: torch.Tensor,
        layers: Optional[set] = None,
        residual: bool = True,
        observe: Optional[Observer] = None,
    ) -> torch.Tensor:
        """The ``(B, T, K)`` labels through every block: per stage :meth:`enter`, per block Eq. 11 on
        :meth:`shortcut` and :meth:`branch` for the samples whose branch ran (``layers``: only at these block
        indices, elsewhere the shortcut alone; ``residual=False``: the branch alone, Table 8), :meth:`after`,
        ``observe``; then :meth:`leave`. Returns ``(B, T', K)`` rows."""
        Y = self.to_layout(labels, captures)
        caps = iter(captures)
        idx = 0
        for stage, blocks in self.stages():
            Y = self.enter(stage, Y)
            for j, blk in enumerate(blocks):
                cap = next(caps)
                short = self.shortcut(blk, cap, Y)
                if layers is None or idx in layers:
                    Y = residual_labels(short, self.branch(blk, cap, Y), cap.keep, residual)  # Eq. 11
                else:
                    Y = short
                Y = self.after(stage, j, Y)
                if observe is not None:
                    observe(idx, self.to_rows(Y).clone(), self.grid_of(Y, captures))
                idx += 1
            Y = self.leave(stage, Y)
        return self.to_rows(Y)

    def read(self, labels: torch.Tensor, output: Any, captures: Captures) -> torch.Tensor:
        """``(B, K)``: the label of what the classifier reads (:data:`READOUTS`)."""
        kind = self.readout
        if kind == 'cls':
            return labels[:, 0]
        if kind == 'mean':
            return labels[:, self.num_prefix_tokens :].mean(1)
        if kind == 'mean_all':
            return labels.mean(1)
        if kind == 'cls_dist':
            return labels[:, 0] if isinstance(output, (tuple, list)) else (labels[:, 0] + labels[:, 1]) / 2
        if kind == 'pool':
            return (captures.pool.float().softmax(1) * labels).sum(1)
        raise ValueError(f'readout: expected one of {READOUTS}, got {kind!r}')

    def label_path(
        self,
        captures: Captures,
        output: Any,
        labels: torch.Tensor,
        layers: Optional[set] = None,
        residual: bool = True,
        drop_path: str = 'kept',
        observe: Optional[Observer] = None,
        state: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """After a captured forward: the initial ``labels`` ``(B, T, K)`` through every block (no gradients, fp32)
        and read out as ``(B, K)``. ``drop_path`` (:data:`~shared_core.options.DROP_PATH_LABELS`): ``'public'``
        ignores which samples stochastic depth dropped. ``state``: the labels after the blocks where the forward
        carried them itself (the shared attention of timm ViTs); only the readout then."""
        if check_drop_path(drop_path) == 'public':
            for c in captures:
                c.keep = None
        with torch.no_grad(), torch.autocast(device_type=labels.device.type, enabled=False):
            if state is None:
                tokens = self.num_tokens(captures)
                if tokens != labels.shape[1]:
                    raise ValueError(
                        f'labels: {labels.shape[1]} token labels for {tokens} tokens '
                        f'(prefix {self.num_prefix_tokens} + patches): the patch grid of x does not match'
                    )
                state = self.propagate(captures, labels.float(), layers, residual, observe)
            return self.read(state, output, captures)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# ---------------------------------------------------------------------------------------------- the shared checks


def tracer_for(model, supported: dict, name: str = 'model') -> Tracer:
    """The tracer of ``model`` from ``{model class: tracer class}`` (most specific first); an error
    listing the supported classes otherwise."""
    if hasattr(model, '_orig_mod'):  # torch.compile's OptimizedModule: its hooks would not see the graph
        raise ValueError(
            f"{name}: a torch.compile'd model; wrap the plain model first and compile the wrapper "
            '(torch.compile(TLAlign(model)))'
        )
    for cls, tracer in supported.items():
        if isinstance(model, cls):
            return tracer(model)
    names = ', '.join(f'{c.__module__}.{c.__name__}' for c in supported)
    raise ValueError(
        f'{name}: TL-Align has no tracer for {type(model).__module__}.{type(model).__name__}; supported: {names}'
    )


def check_transmix(tracer: Tracer, model, name: str = 'model') -> None:
    """TransMix reads the last block's self-attention: refuse, naming the family and what mixes its tokens there,
    a model whose tracer does not attend there (``tracer.attends``)."""
    if not tracer.attends:
        raise ValueError(
            f"{name}: TransMix reads the last block's self-attention, and {type(model).__name__} has none there: "
            f'{tracer.why_no_attention}; TL-Align traces it (TLAlign, --mixup-type tl_align)'
        )


def check_drop_path(drop_path: str, name: str = 'drop_path') -> str:
    if drop_path not in DROP_PATH_LABELS:
        raise ValueError(f'{name}: expected one of {DROP_PATH_LABELS}, got {drop_path!r}')
    return drop_path


def check_block_parts(blocks, parts: dict, first: int = 0, where: str = 'block') -> None:
    """Refuse blocks whose parts are not of the exact types the label rules assume (``parts``: dotted
    attribute -> allowed types; a part a model version lacks is skipped), naming the block (numbered from
    ``first``; ``where``: how to name it), the part and its type."""
    for i, blk in enumerate(blocks, first):
        for name, types in parts.items():
            obj = blk
            for attr in name.split('.'):
                obj = getattr(obj, attr, None)
            if obj is not None and type(obj) not in types:
                raise ValueError(
                    f"model: {where} {i}.{name} is a {type(obj).__module__}.{type(obj).__name__}; TL-Align's rules "
                    f'assume {", ".join(t.__name__ for t in types)} there (per-token: the labels pass it '
                    'unchanged); a part that mixes tokens needs its own label rule'
                )


def check_types(blocks, block_types: tuple, attn_types: tuple, family: str, attention=lambda b: b.attn) -> None:
    """Refuse a block that is not exactly one of ``block_types`` with an attention (``attention(blk)``) exactly one
    of ``attn_types``, naming the family, the block and what it is."""
    for i, blk in enumerate(blocks):
        attn = attention(blk)
        if type(blk) not in block_types or type(attn) not in attn_types:
            raise ValueError(
                f'model: TL-Align traces {family} blocks of type {"/".join(t.__name__ for t in block_types)} with '
                f'{"/".join(t.__name__ for t in attn_types)}; block {i} is a {type(blk).__name__} with '
                f'{type(attn).__name__}'
            )


def check_fused_sdpa(blocks, attention=lambda b: b.attn) -> None:
    """Refuse blocks whose attention (``attention(blk)``; ``None``: no attention) computes it without
    ``scaled_dot_product_attention`` (timm's ``fused_attn`` off): the tracer reads the attention at that call."""
    unfused = [i for i, b in enumerate(blocks) if not getattr(attention(b), 'fused_attn', True)]
    if unfused:
        raise ValueError(
            f'model: blocks {unfused} compute their attention without scaled_dot_product_attention '
            '(fused_attn off, e.g. TIMM_FUSED_ATTN=0); TL-Align reads the attention at that call'
        )


def check_pool(pool, allowed: tuple, family: str, what: str = 'global_pool=') -> None:
    """Refuse a classifier pooling TL-Align has no readout for (``what``: how the model names it), naming the family
    and the poolings it reads."""
    if pool not in allowed:
        use = ' or '.join(repr(p) for p in allowed)
        raise ValueError(f'model: {family} with {what}{pool!r} has no TL-Align rule; use {use}')
