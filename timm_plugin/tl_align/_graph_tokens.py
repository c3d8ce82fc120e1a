"""The graph route's tokens: feature tensors whose positions a reshape moved off a map's layout (windows, rows of
tokens, heads), the attention they go through (Eq. 9), and the record of its probabilities the token path leaves.

At compile time a token tensor is known by its **code**: an int64 tensor of the feature's shape (on the fake batch
of two) whose entry says which label cell and which channel that feature entry holds, ``(position + 1) * CODE +
channel``, ``position = b * cells + cell`` (0: no token, a padding). A layout op (view, permute, window partition,
chunk, roll, ...) is applied to the code as the token path applies it to the features, so no rule per reshape is
needed: wherever the features go, the code says whose label they carry. An attention then reads its query and key
positions off the codes of its operands, and its label op gathers the labels of the keys, applies the recorded
probabilities (mean over heads, Eq. 9) and scatters them back to the query cells of the grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from shared_core.capture import sdpa_record
from shared_core.tl_align import abs_row_norm

__all__ = ['CODE', 'Tok', 'Scores', 'Probs', 'SiteMode', 'Attend', 'SOFTMAX']

#: channel ids per position in a code
CODE = 1 << 24

#: the softmax calls the token path's record counts (the graph's ``x.softmax``, ``torch.softmax``, ``F.softmax``)
SOFTMAX = (torch.Tensor.softmax, torch.softmax, F.softmax)


@dataclass(eq=False)
class Tok:
    """A labelled feature off a map's layout: ``slot`` the label map it reads, ``code`` which cell and channel each
    entry holds (module docstring), ``keep`` the drop path whose dropped samples it does not count for."""

    slot: int
    code: torch.Tensor
    keep: Optional[int] = None

    @cached_property
    def pos(self) -> torch.Tensor:
        return self.code // CODE

    @property
    def chan(self) -> torch.Tensor:
        return self.code % CODE


@dataclass(eq=False)
class Scores:
    """Attention logits ``q kᵀ`` (before the softmax): the query positions ``(*L, N)`` of ``qslot``'s grid and the
    key positions ``(*L, M)`` of ``kslot``'s."""

    q: torch.Tensor
    k: torch.Tensor
    qslot: int
    kslot: int


@dataclass(eq=False)
class Probs(Scores):
    """Attention probabilities (a softmax of :class:`Scores` over the keys); ``site`` the softmax node."""

    site: Any = None
    #: the probabilities transposed (keys, then queries: SHViT's ``v @ attnᵀ`` with channels-first values)
    transposed: bool = False
    #: a 1x1 conv that mixes the heads of the probabilities before they weigh the values (talking heads)
    mix: Any = None


def map_code(shape, dims: Tuple[int, int], cells: int, grid: Tuple[int, int]) -> torch.Tensor:
    """The code of a map of ``shape`` whose ``dims`` hold the rows and columns of ``grid`` (``cells`` of its batch
    entries apart): its position from the batch index and the cell, a channel id from every other dim."""
    nd = len(shape)
    h, w = dims

    def along(d):
        view = [1] * nd
        view[d] = shape[d]
        return torch.arange(shape[d], device='cpu').view(view)

    pos = 1 + along(0) * cells + along(h) * grid[1] + along(w)
    rest = [d for d in range(1, nd) if d not in dims]
    chan = torch.zeros((), dtype=torch.long, device='cpu')
    for d in rest:
        chan = chan * shape[d] + along(d)
    return (pos * CODE + chan).expand(shape).contiguous()


def constant_along(t: torch.Tensor, dims) -> bool:
    """Whether ``t`` is the same along each of ``dims``."""
    return all(bool((t == t.narrow(d, 0, 1)).all()) for d in dims)


def renumber(code: torch.Tensor) -> torch.Tensor:
    """``code`` with its channel ids renumbered to stay below :data:`CODE` (their distinctness kept)."""
    chan = code % CODE
    if int(chan.max()) < CODE:
        return code
    _, inverse = torch.unique(chan, return_inverse=True)
    return (code // CODE) * CODE + inverse


def rechannel(code: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """The code after an op that mixes the channels of ``dim`` into ``size`` new ones (a linear layer)."""
    first = code.narrow(dim, 0, 1)
    view = [1] * code.ndim
    view[dim] = size
    chan = first % CODE
    new = (first // CODE) * CODE + chan * size + torch.arange(size, device='cpu').view(view)
    if int(chan.max()) * size + size <= CODE:  # the new ids fit (read off the one slice ``first``)
        return new.contiguous()
    return renumber(new.contiguous())


def is_gather(fn, code: torch.Tensor, *rest, **kw) -> bool:
    """Whether ``fn(code, ...)`` only moves, copies or pads entries (it commutes with a relabelling of the values
    that keeps 0): a layout op the code can go through."""
    prime, a = (1 << 61) - 1, 1_000_003
    try:
        out = fn(code, *rest, **kw)
        relabelled = fn((code * a) % prime, *rest, **kw)
    except Exception:  # an op that does not run on integers is no layout op
        return False
    if not isinstance(out, torch.Tensor) or out.dtype != torch.long:
        return False
    return torch.equal((out * a) % prime, relabelled)


class SiteMode(TorchFunctionMode):
    """Records, while a watched module runs (the innermost one), each softmax it computes and each
    ``scaled_dot_product_attention`` call it makes, in order, into ``records[its index]``."""

    def __init__(self, records: List[list]):
        super().__init__()
        self.records = records
        self.stack: List[int] = []

    def watch(self, module, index: int, handles: list) -> None:
        handles.append(module.register_forward_pre_hook(lambda m, a, i=index: self._push(i)))
        handles.append(module.register_forward_hook(lambda m, a, o: self._pop()))

    def _push(self, index: int) -> None:
        if not self.stack:
            self.__enter__()
        self.stack.append(index)

    def _pop(self) -> None:
        if self.stack:
            self.stack.pop()
            if not self.stack:
                self.__exit__(None, None, None)

    def remove(self) -> None:
        """Leave the mode if a forward stopped inside a watched module (a hook handle's ``remove``)."""
        if self.stack:
            self.stack.clear()
            self.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.stack:
            if func in SOFTMAX:
                self.records[self.stack[-1]].append(out.detach())
            elif func is F.scaled_dot_product_attention:
                self.records[self.stack[-1]].append(sdpa_record(*args, **kwargs))
        return out


class Attend:
    """Eq. 9 on the labels: the keys' labels gathered from their map, the recorded attention probabilities applied,
    the mean over heads (and over every query entry of a cell) scattered to the query grid. ``site``: ``(watched
    module, call)`` of the record, set once the graph is read."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, qcells: int, kcells: int, qgrid, what: str, mix=None):
        L = q.shape[:-1]
        self.mix = mix  # talking heads: the weights are ``mix(P)``, read as CaiT's (Norm(|mean_h mix(P)|))
        self.g = L[0] // 2
        self.what = what
        kidx = (k[: self.g] - 1) % kcells
        for d in range(1, kidx.ndim - 1):  # heads: the keys are the same along them (broadcast)
            if constant_along(kidx, [d]):
                kidx = kidx.narrow(d, 0, 1)
        self.kidx = kidx.contiguous()
        qidx = ((q[: self.g] - 1) % qcells).reshape(-1)
        self.qidx = qidx
        self.count = torch.bincount(qidx, minlength=qcells).clamp_min(1).to(torch.float32)
        self.qgrid = tuple(qgrid)
        self.site: Optional[Tuple[int, int]] = None

    def probabilities(self, record) -> torch.Tensor:
        if isinstance(record, torch.Tensor):
            return record.float()
        q, k, mask, scale = record
        s = (q.float() @ k.float().transpose(-2, -1)) * scale
        if mask is not None:
            s = s.masked_fill(~mask, float('-inf')) if mask.dtype == torch.bool else s + mask.float()
        return s.softmax(-1)

    def __call__(self, Y: torch.Tensor, record) -> torch.Tensor:
        B, K = Y.shape[:2]
        P = self.probabilities(record)
        if self.mix is not None:  # (windows, heads, N, M): the signed mixed weights' head mean, |.| row-normalised
            with torch.no_grad():
                W = self.mix(P.to(self.mix.weight.dtype)).float()
            P = abs_row_norm(W.mean(1, keepdim=True)).expand_as(W)
        if P.shape[0] != B * self.g:
            raise ValueError(
                f'model: {self.what} recorded attention over {P.shape[0]} windows for {B} samples; the graph read '
                f'{self.g} per sample'
            )
        idx = self.kidx.to(Y.device)
        Yk = Y.flatten(2)[:, :, idx]  # (B, K, g, *heads, M)
        Yk = Yk.movedim(1, -1).reshape(B * self.g, *idx.shape[1:], K)
        out = (P @ Yk).reshape(B, -1, K)  # (B, g * heads * N, K)
        if out.shape[1] != self.qidx.numel():
            raise ValueError(f'model: {self.what} recorded attention of another shape than the graph read')
        rows = Y.new_zeros(B, self.count.numel(), K).index_add_(1, self.qidx.to(Y.device), out)
        rows = rows / self.count.to(Y.device)[:, None]
        return rows.transpose(1, 2).reshape(B, K, *self.qgrid)


def site_node(node: fx.Node) -> Optional[str]:
    """The module path a softmax or attention call of the graph is recorded under: the innermost module that runs it
    (``None``: the model itself)."""
    stack = node.meta.get('nn_module_stack') or {}
    paths = [v[0] for v in stack.values()]
    if node.op == 'call_module' and paths and paths[-1] == node.target:
        paths = paths[:-1]
    return paths[-1] if paths else None


def is_site(node: fx.Node, softmax_modules) -> bool:
    """Whether the token path's record counts this node's call (a softmax or ``scaled_dot_product_attention``)."""
    if node.op == 'call_method':
        return node.target == 'softmax'
    if node.op == 'call_function':
        return node.target in SOFTMAX or getattr(node.target, '__name__', '') == 'scaled_dot_product_attention'
    if node.op == 'call_module':
        return isinstance(node.graph.owning_module.get_submodule(node.target), softmax_modules)
    return False
