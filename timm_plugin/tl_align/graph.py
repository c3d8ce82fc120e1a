"""TL-Align's graph route: Table 9's rules read off a conv net's fx graph, op by op, instead of a block type per
family.

:class:`GraphTracer` traces the model once with ``torch.fx`` (timm's own leaf modules and functions, as its
feature extraction does; a block that branches on its input's size is read at the compiled input size,
:class:`_SizedTracer`) and propagates the shapes of one fake batch through the graph. It then reads every op of
the forward by the TL-Align paper's Table 9 and keeps the ops that move labels as a small label program; anything
it has no rule for is refused, naming the node. The rules:

- **spatial mixing by a convolution** (``Conv2d``, functional ``conv2d`` with its weights, timm's weight-standardised
  and TF-"same" convs): the fixed stencil ``S = mean |K|`` over the output and input channels of the kernel the conv
  applies (a depthwise conv: over its channels; weight standardisation included), rows normalised over the in-grid
  positions (:func:`~shared_core.tl_align.conv_stencil_labels`), at the conv's stride, padding and dilation, as
  today's ResNet and ConvNeXt tracers do. A conv whose kernel equals its stride (a patchify or 2x2 downsampling
  conv) only aggregates: the mean of its window, as ConvNeXt's downsampling;
- **spatial aggregation** (max and average pooling, adaptive pooling, strided convs): the mean label of each window
  (in-grid positions only); global average pooling reads the mean label, which is the readout;
- **channel mixing and point-wise ops** (1x1 convs, linear layers over channels, norms, activations, dropout, channel
  slicing, splits, reshapes that keep the spatial dims): the labels unchanged. So is a **channel gate**: a map
  multiplied by a per-sample vector (SE, ECA, ESE: Table 9's data-dependent channel mixing);
- **residual connections** (a sum of maps with different labels): Eq. 11, the mean of the summands' labels; a
  summand from a drop path that dropped a sample does not count for it;
- **concatenation** along channels: the mean of the parts' labels (Table 9: Norm of their sum);
- **resampling** (nearest or bilinear upsampling): the same resampling of the labels (its weights are fixed,
  non-negative and sum to 1 per output).

The label state starts on the first feature map at stride >= 4 that every path from the image goes through (the
grid a ResNet's first stage runs on; a patchify stem's grid); the stem before it is not traced, as for the ResNet
tracer. Refused with the node named: a product of two maps with different labels (spatial gates, gated convs:
neither Eq. 9 nor a fixed mixer), a vector added to a map (a global context), reshapes that move the spatial dims
(attention, token MLPs), a head that pools by max, and any op or module without a rule.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import DropPath, _fx
from timm.layers.conv2d_same import Conv2dSame
from timm.layers.norm_act import BatchNormAct2d, FrozenBatchNormAct2d, SyncBatchNormAct
from timm.layers.padding import pad_same_arg
from timm.layers.pool2d_same import AvgPool2dSame, MaxPool2dSame
from timm.layers.std_conv import ScaledStdConv2dSame, StdConv2dSame
from timm.models.vgg import ConvMlp
from torch.fx.passes.shape_prop import ShapeProp

from shared_core.capture import Captures
from shared_core.tl_align import conv_pool_labels, conv_stencil_labels, kernel_stencil, residual_labels
from shared_core.tracer import Tracer

from ._graph_tokens import (
    CODE,
    Attend,
    Probs,
    Scores,
    SiteMode,
    Tok,
    is_gather,
    is_site,
    map_code,
    rechannel,
    renumber,
    site_node,
)
from ._graph_tokens import constant_along as _constant_along

__all__ = ['GraphTracer', 'GraphRouteError', 'START_STRIDE']

#: the label state starts on the first feature map at this stride or more (the grid a ResNet's first stage runs on)
START_STRIDE = 4


# ---------------------------------------------------------------------------------------------- abstract values


class _Pre:
    """A tensor computed from the image before the label grid starts."""

    def __repr__(self):
        return 'PRE'


PRE = _Pre()


@dataclass(frozen=True)
class Map:
    """A feature map with labels: ``slot`` indexes the label program's maps, ``dims`` are the tensor dims that hold
    its rows and columns (``ndim`` dims in all), ``keep`` the drop path (its capture index) whose dropped samples
    this branch does not count for."""

    slot: int
    dims: Tuple[int, int]
    ndim: int
    keep: Optional[int] = None


@dataclass(frozen=True)
class Vec:
    """A per-sample tensor without positions (a pooled map): ``slot`` is the map whose mean label it carries,
    ``None`` where it carries none (a max pool, a mix of pools)."""

    slot: Optional[int]


def _leaves(value) -> list:
    out: list = []
    fx.node.map_aggregate(value, out.append)
    return out


# ---------------------------------------------------------------------------------------------- the label ops

#: point-wise functions and methods (per position: labels unchanged), by name
POINTWISE = frozenset(
    'relu relu_ relu6 leaky_relu leaky_relu_ elu elu_ selu celu gelu silu silu_ mish hardswish hardswish_ '
    'hardsigmoid hardsigmoid_ hardtanh hardtanh_ sigmoid sigmoid_ tanh tanh_ softplus exp log abs neg sqrt rsqrt '
    'square clamp clamp_ clamp_min clamp_max pow reciprocal erf float half bfloat16 to type type_as contiguous clone '
    'dropout dropout2d alpha_dropout batch_norm group_norm instance_norm swish hard_sigmoid hard_swish hard_mish '
    'gelu_tanh quick_gelu'.split()
)
_ADD = {operator.add, operator.iadd, torch.add, 'add', 'add_', '__add__', '__iadd__', '__radd__'}
_MUL = {operator.mul, operator.imul, torch.mul, 'mul', 'mul_', '__mul__', '__imul__', '__rmul__'}
_DIV = {operator.truediv, operator.itruediv, torch.div, 'div', 'div_', '__truediv__'}
_SUB = {operator.sub, operator.isub, torch.sub, 'sub', 'sub_', '__sub__', '__rsub__'}
#: point-wise ops of several tensors: a rule where all the maps they read carry the same labels
_SAME_LABELS = frozenset('addcmul addcdiv where lerp maximum minimum'.split())
_LAYOUT = frozenset('view reshape flatten unflatten squeeze unsqueeze expand'.split())
_REDUCE = frozenset('mean sum amax amin max min std var logsumexp norm'.split())
#: point-wise modules (per position, per channel or over a sample's channels)
_POINTWISE_MODULES = (
    nn.BatchNorm2d,
    nn.SyncBatchNorm,
    nn.GroupNorm,
    nn.InstanceNorm2d,
    nn.LocalResponseNorm,
    nn.Identity,
    nn.Dropout,
    nn.Dropout2d,
    nn.AlphaDropout,
    BatchNormAct2d,
    SyncBatchNormAct,
    FrozenBatchNormAct2d,
)
_ACTIVATION_MODULES = ('torch.nn.modules.activation', 'timm.layers.activations', 'timm.layers.activations_me')
_NOT_POINTWISE = (nn.MultiheadAttention, nn.Softmax, nn.Softmin, nn.LogSoftmax, nn.Softmax2d, nn.GLU)
_MATMUL = frozenset('matmul bmm __matmul__'.split())
#: ops that take a map's positions off its layout (its entries are followed as tokens)
_TOKEN_OPS = _MATMUL | {'scaled_dot_product_attention', 'roll', 'stack', 'repeat_interleave'}
#: layout ops, replayed on the code of tokens
_REPLAYED = frozenset(
    'view reshape flatten unflatten squeeze unsqueeze expand expand_as view_as reshape_as permute transpose swapaxes '
    'movedim contiguous getitem chunk split tensor_split unbind roll narrow flip repeat repeat_interleave pad '
    'Flatten Unflatten '
    'cat concat concatenate stack'.split()
)
#: timm's functions that fx keeps whole (window partitions and reverses among them)
_NOTRACE = frozenset(_fx.get_notrace_functions())


def _same_positions(toks, codes) -> bool:
    """Whether the tokens' codes, broadcast to one shape (``codes``), name the same positions in every entry (a
    code compared only where it is another tensor: a point-wise op of one tensor's tokens is the common case)."""
    first = toks[0].code
    for t, c in zip(toks[1:], codes[1:]):
        if t.code is not first and not torch.equal(c, codes[0]) and not torch.equal(c // CODE, codes[0] // CODE):
            return False
    return True


class _OffTheGrid(Exception):
    """A layout op that moves a map's positions off its layout: its entries are followed as tokens."""


def _tuple(v, n: int) -> tuple:
    """A module's size argument as an ``n``-tuple."""
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


def _pair(v) -> Tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


@dataclass
class _Conv:
    """A convolution on the labels: ``weight()`` the kernel it applies; ``padding`` a pair, ``'same'`` (timm's TF
    padding, computed on the grid as the token path does) or explicit ``(left, right, top, bottom)``."""

    weight: Callable[[], torch.Tensor]
    kernel: Tuple[int, int]
    stride: Tuple[int, int]
    padding: Any
    dilation: Tuple[int, int]

    def __call__(self, Y: torch.Tensor) -> torch.Tensor:
        pads = self.padding
        if pads == 'same':
            pads = tuple(pad_same_arg(Y.shape[-2:], self.kernel, self.stride, self.dilation))
        if self.kernel == self.stride and self.dilation == (1, 1) and pads in ((0, 0), (0, 0, 0, 0)):
            return conv_pool_labels(Y, self.kernel, self.stride, 0)  # aggregation alone: each window's mean
        return conv_stencil_labels(Y, kernel_stencil(self.weight()), pads, self.stride, self.dilation)


@dataclass
class _Pool:
    """Pooling on the labels (max or average alike): the mean label of each window's in-grid positions."""

    kernel: Tuple[int, int]
    stride: Tuple[int, int]
    padding: Any
    ceil_mode: bool = False

    def __call__(self, Y: torch.Tensor) -> torch.Tensor:
        pads = self.padding
        if pads == 'same':
            pads = tuple(pad_same_arg(Y.shape[-2:], self.kernel, self.stride, (1, 1)))
        return conv_pool_labels(Y, self.kernel, self.stride, pads, self.ceil_mode)


@dataclass
class _Adaptive:
    size: Any

    def __call__(self, Y: torch.Tensor) -> torch.Tensor:
        return F.adaptive_avg_pool2d(Y, self.size)


@dataclass
class _Resample:
    kwargs: dict

    def __call__(self, Y: torch.Tensor) -> torch.Tensor:
        return F.interpolate(Y, **self.kwargs)


class _ConvMlpLabels:
    """timm's VGG head (``ConvMlp``, a leaf of timm's fx tracing): the adaptive pooling it applies to maps smaller
    than its kernel, its ``k x k`` conv, its 1x1 conv."""

    def __init__(self, m: ConvMlp):
        self.m, self.conv = m, _conv_of(m.fc1)

    def __call__(self, Y: torch.Tensor) -> torch.Tensor:
        k = self.m.input_kernel_size
        if Y.shape[-2] < k or Y.shape[-1] < k:
            Y = F.adaptive_avg_pool2d(Y, (max(k, Y.shape[-2]), max(k, Y.shape[-1])))
        return self.conv(Y)


def _conv_of(m: nn.Conv2d) -> _Conv:
    """The label op of a conv module (its kernel as applied: weight standardisation included)."""
    if m.padding_mode != 'zeros':
        raise GraphRouteError(f'{m} pads by {m.padding_mode!r}: the padded positions copy tokens, which has no rule')
    padding = m.padding
    if isinstance(m, (Conv2dSame, StdConv2dSame, ScaledStdConv2dSame)) and getattr(m, 'same_pad', True):
        padding = 'same'  # timm's TF "same", computed on the grid as its forward does
    elif isinstance(padding, str):  # torch's 'same' / 'valid' (stride 1)
        padding = (0, 0) if padding == 'valid' else _torch_same(m.kernel_size, m.dilation)
    weight = (lambda m=m: m.weight) if type(m) in (nn.Conv2d, Conv2dSame) else _effective_weight(m)
    return _Conv(weight, _pair(m.kernel_size), _pair(m.stride), padding, _pair(m.dilation))


def _torch_same(kernel, dilation):
    """torch's ``padding='same'`` as ``(left, right, top, bottom)`` (the extra pixel right and below)."""
    total = [d * (k - 1) for k, d in zip(_pair(kernel), _pair(dilation))]
    (th, tw) = total
    return (tw // 2, tw - tw // 2, th // 2, th - th // 2)


def _effective_weight(m: nn.Conv2d) -> Callable[[], torch.Tensor]:
    """The kernel a timm weight-standardised conv applies (its forward's standardisation of ``m.weight``)."""
    from timm.layers.std_conv import ScaledStdConv2d, StdConv2d

    if isinstance(m, (StdConv2d, StdConv2dSame)):
        return lambda: F.batch_norm(
            m.weight.reshape(1, m.out_channels, -1), None, None, training=True, momentum=0.0, eps=m.eps
        ).reshape_as(m.weight)
    if isinstance(m, (ScaledStdConv2d, ScaledStdConv2dSame)):
        return lambda: F.batch_norm(
            m.weight.reshape(1, m.out_channels, -1),
            None,
            None,
            weight=(m.gain * m.scale).view(-1),
            training=True,
            momentum=0.0,
            eps=m.eps,
        ).reshape_as(m.weight)
    raise GraphRouteError(f'{type(m).__module__}.{type(m).__name__} is a conv whose applied kernel has no rule')


# ---------------------------------------------------------------------------------------------- tracing


class _Tracer(fx.Tracer):
    """fx tracing as timm's feature extraction does it (its leaf modules and functions), drop paths as leaves."""

    def __init__(self, inline_models: bool = True):
        super().__init__(autowrap_functions=tuple(_fx.get_notrace_functions()))
        leaves = _fx.get_notrace_modules()
        if inline_models:  # a model's own blocks that timm keeps whole (for its feature extraction): read inside
            leaves = [m for m in leaves if not m.__module__.startswith('timm.models.')]
        self.leaves = tuple(leaves) + (DropPath, ConvMlp)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, self.leaves) or super().is_leaf_module(m, qualname)


class _SizedProxy(fx.Proxy):
    """A proxy that knows its value at the traced input (a fake tensor): sizes read from it are numbers, so that
    Python code branching on them (a window partition that pads only where the map does not tile) runs as at that
    input size."""

    def _value(self):
        return self.tracer.values.get(self.node)

    def size(self, dim=None):
        v = self._value()
        if not isinstance(v, torch.Tensor):
            return self.tracer.create_proxy('call_method', 'size', (self,) if dim is None else (self, dim), {})
        return v.size() if dim is None else v.size(dim)

    def dim(self):
        v = self._value()
        return v.dim() if isinstance(v, torch.Tensor) else self.tracer.create_proxy('call_method', 'dim', (self,), {})

    @property
    def shape(self):
        return self.size()

    @property
    def ndim(self):
        return self.dim()

    def __len__(self):
        return self.size(0)


class _SizedTracer(_Tracer):
    """fx tracing at one input size: every proxy carries its fake value (:class:`_SizedProxy`), so that a block fx
    cannot read symbolically (timm's window attentions that branch on the map's size) is read inside at that size.
    Its graph holds that input size only."""

    def trace_at(self, model: nn.Module, example: torch.Tensor) -> fx.Graph:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.values: Dict[fx.Node, Any] = {}
        self.example, self.running, self.forward = self.mode.from_tensor(example), False, None
        return self.trace(model)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _SizedProxy(node, self)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        return attr_val if self.running else super().getattr(attr, attr_val, parameter_proxy_cache)

    def call_module(self, m, forward, args, kwargs):
        if self.running:  # inside a leaf module's value: run it as it is
            return forward(*args, **kwargs)
        self.forward = forward
        return super().call_module(m, forward, args, kwargs)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if kind == 'placeholder':
            if not self.values:
                self.values[proxy.node] = self.example
            return proxy
        missing = object()

        def value(v):
            if isinstance(v, fx.Proxy):
                return self.values.get(v.node, missing)
            return v

        a = fx.node.map_aggregate(args, value)
        k = fx.node.map_aggregate(kwargs, value)
        if any(v is missing for v in _leaves((a, k))):
            return proxy
        self.running = True
        try:
            with self.mode:
                if kind == 'call_function':
                    out = target(*a, **k)
                elif kind == 'call_method':
                    out = getattr(a[0], target)(*a[1:], **k)
                elif kind == 'call_module':
                    out = self.forward(*a, **k)
                elif kind == 'get_attr':
                    out = operator.attrgetter(target)(self.root)
                else:
                    return proxy
            self.values[proxy.node] = out
        except Exception:  # a value it cannot compute: sizes read from it stay symbolic (and fail where branched on)
            pass
        finally:
            self.running = False
        return proxy


class _Shapes(ShapeProp):
    """fx's shape propagation, keeping the values of the nodes that compute sizes (``node.meta['value']``): the
    arguments a layout op is replayed with."""

    def run_node(self, n):
        result = super().run_node(n)
        if isinstance(result, (int, torch.Size)) or (
            isinstance(result, (tuple, list)) and all(isinstance(v, int) for v in result)
        ):
            n.meta['value'] = tuple(result) if isinstance(result, torch.Size) else result
        return result


def _trace(model: nn.Module, input_size) -> fx.GraphModule:
    """The model's graph as a training forward on a fake batch of two at ``input_size``, with each node's shape. It
    is traced in training mode (the forward TL-Align labels; an eval-time cache, as TinyViT's attention biases,
    would keep the trace's proxies); each module's mode and every buffer are set back as they were."""
    modes = [(m, m.training) for m in model.modules()]
    # a leaf's value at the traced size runs it (a batch norm counts a batch): the buffers are set back too
    buffers = [(b, b.clone()) for b in model.buffers()]
    for m, _ in modes:
        m.training = True
    try:
        return _trace_training(model, input_size)
    finally:
        for m, mode in modes:
            m.training = mode
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def _trace_training(model: nn.Module, input_size) -> fx.GraphModule:
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = next((p.device for p in model.parameters()), torch.device('cpu'))
    example = torch.empty(2, *input_size, device=device)
    # a model block fx cannot read inside symbolically: read at this input size, else kept whole (as timm's
    # feature extraction keeps it)
    for sized, inline in ((False, True), (True, True), (False, False)):
        tracer = _SizedTracer() if sized else _Tracer(inline_models=inline)
        try:
            graph = tracer.trace_at(model, example) if sized else tracer.trace(model)
            break
        except Exception as e:  # fx's own errors are of many types (TraceError, TypeError, ...)
            error = e
    else:
        why = f'{type(error).__name__}: {str(error).splitlines()[0][:200]}'
        raise GraphRouteError(f'torch.fx cannot trace it ({why})') from error
    gm = fx.GraphModule(tracer.root, graph)
    gm.meta['sized'] = sized
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        _Shapes(gm, fake_mode=mode).propagate(mode.from_tensor(example))
    except Exception as e:
        raise GraphRouteError(
            f'its graph does not run on a {tuple(input_size)} fake batch ({type(e).__name__}: {str(e)[:200]})'
        ) from e
    return gm


def _spatial(shape, H: int, W: int, least: int = START_STRIDE) -> Optional[Tuple[int, int]]:
    """The dims of a 4-d feature that hold its rows and columns at stride >= ``least`` (NCHW first, then NHWC), or
    ``None``."""
    for h in (2, 1):
        a, b = shape[h], shape[h + 1]
        if a * b > 1 and H / a >= least and W / b >= least and abs(H / a - W / b) < 1:
            return (h, h + 1)
    return None


def _shape(node) -> Optional[Tuple[int, ...]]:
    meta = node.meta.get('tensor_meta') if isinstance(node, fx.Node) else None
    return tuple(meta.shape) if meta is not None and hasattr(meta, 'shape') else None


def _where(node: fx.Node) -> str:
    stack = node.meta.get('nn_module_stack')
    path = next(reversed(stack.values()))[0] if stack else ''
    target = node.target if isinstance(node.target, str) else getattr(node.target, '__name__', str(node.target))
    return f'node {node.name} ({node.op} {target}{", in " + path if path and path != target else ""})'


class GraphRouteError(ValueError):
    """The graph route cannot take a model. ``decided``: an op Table 9 gives no reading by the route's rules (a
    product of maps, a global context, an image no label grid tiles, a max-pooled head): a refusal; else a part the
    route does not read (attention, tokens as rows, a module it has no rule for): a family tracer's work."""

    def __init__(self, message: str, decided: bool = False):
        super().__init__(message)
        self.decided = decided


# ---------------------------------------------------------------------------------------------- the compiler


class _Program:
    """The label program of one model: ``ops`` ``(fn, input slots, output slot)`` in graph order (``fn`` on label
    maps; a mean op takes ``(slot, keep)`` pairs), ``start`` the node the label state starts at and ``stride`` its
    pixels per cell, ``readout`` the slot whose mean label the classifier reads, ``drop_paths`` the drop-path
    modules in graph order."""

    def __init__(self, model: nn.Module, input_size, pooled_outside: bool = False):
        self.gm = gm = _trace(model, input_size)
        self.ops: List[tuple] = []
        self.slots = 1
        #: whether the program follows tokens: their codes, window partitions and replayed reshapes hold the input
        #: size it was compiled at (a program of maps alone holds at any size whose grid the stride tiles)
        self.sized = bool(gm.meta.get('sized'))  # a graph traced at this input size holds it in its branches
        self.drop_paths: List[nn.Module] = []
        #: per drop path, where its rows are not the samples (MobileViT's rows of patches: one per offset in a patch,
        #: per sample): ``(row, grid)``, each cell's row within its sample on the label grid ``grid``; else None
        self.keep_rows: List[Optional[Tuple[torch.Tensor, Tuple[int, int]]]] = []
        #: slots that hold positions and no labels: queries a conv mixed off the map (:meth:`_query_conv`)
        self.positions_only: set = set()
        self.start, start_dims, self.stride = self._start(gm, input_size)
        shape = _shape(self.start)
        self.grids: Dict[int, Tuple[int, int]] = {0: (shape[start_dims[0]], shape[start_dims[1]])}
        self.attends: List[Tuple[fx.Node, Attend]] = []
        env: Dict[fx.Node, Any] = {}
        nodes = list(gm.graph.nodes)
        last = {a: i for i, n in enumerate(nodes) for a in _leaves((n.args, n.kwargs)) if isinstance(a, fx.Node)}
        ends: Dict[int, list] = {}
        for a, i in last.items():
            ends.setdefault(i, []).append(a)
        out = None
        for i, node in enumerate(nodes):
            if node.op == 'placeholder':
                env[node] = PRE if not any(v is PRE for v in env.values()) else None
            elif node.op == 'get_attr':
                env[node] = None
            elif node.op == 'output':
                out = fx.node.map_aggregate(node.args[0], lambda n: env[n] if isinstance(n, fx.Node) else None)
            elif node is self.start:
                env[node] = Map(0, start_dims, len(shape))
            else:
                try:
                    env[node] = value = self._node(node, env)
                except GraphRouteError as e:
                    raise GraphRouteError(f'{_where(node)}: {e}', e.decided) from None
                if isinstance(value, Map) and value.slot not in self.grids:
                    at = _shape(node)
                    self.grids[value.slot] = (at[value.dims[0]], at[value.dims[1]])
            for a in ends.get(i, ()):  # the codes of token tensors no later node reads
                if any(isinstance(v, (Tok, Scores)) for v in _leaves(env.get(a))):
                    env[a] = None
        self._sites()
        if pooled_outside and isinstance(out, (tuple, list)) and len(out) == 1:
            out = out[0]
        if pooled_outside and isinstance(out, Map):  # the map a GlobalAveragePooling neck pools: its mean label
            out = Vec(out.slot)
        if not isinstance(out, Vec) or out.slot is None:
            what = 'a map' if isinstance(out, Map) else 'no pooled label' if isinstance(out, Vec) else repr(out)
            raise GraphRouteError(
                f'its output is {what}: the graph route reads the mean label of one global average pooling '
                '(a max or mixed head pooling has no label)',
                decided=isinstance(out, Vec),
            )
        self._read([out.slot])
        self.readout = out.slot

    def _sites(self) -> None:
        """The record each attention reads: the modules the token path's record watches (the innermost module of
        each attention the labels go through), and for each attention its module and call number there, counting
        every softmax and attention call the module makes (:class:`~._graph_tokens.SiteMode` records them all)."""
        self.watched: List[str] = []
        for node, _ in self.attends:
            path = site_node(node)
            if path is None:
                raise GraphRouteError(f'{_where(node)}: an attention outside any module: its call is not recorded')
            if path not in self.watched:
                self.watched.append(path)
        index = {p: i for i, p in enumerate(self.watched)}
        calls = [0] * len(self.watched)
        number = {}
        for node in self.gm.graph.nodes:
            if not is_site(node, (nn.Softmax,)):
                continue
            stack = [v[0] for v in (node.meta.get('nn_module_stack') or {}).values()]
            owner = next((index[p] for p in reversed(stack) if p in index), None)
            if owner is not None:
                number[node] = (owner, calls[owner])
                calls[owner] += 1
        self.calls = calls
        for node, op in self.attends:
            op.site = number[node]

    # ------------------------------------------------------------------ the start

    def _start(self, gm: fx.GraphModule, input_size):
        """``(node, its spatial dims, stride)``: the first node at stride >= :data:`START_STRIDE` that every path from
        the image goes through (or the single map before several on that grid)."""
        nodes = list(gm.graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        x = next(n for n in nodes if n.op == 'placeholder')
        live, last_use = {x}, {}
        for n in nodes:
            if any(a in live for a in _leaves((n.args, n.kwargs)) if isinstance(a, fx.Node)) and n.op != 'output':
                live.add(n)
        for n in nodes:
            for a in _leaves((n.args, n.kwargs)):
                if isinstance(a, fx.Node):
                    last_use[a] = max(last_use.get(a, 0), index[n])
        H, W = input_size[-2:]
        ends: Dict[int, list] = {}
        for m, i in last_use.items():
            ends.setdefault(i, []).append(m)
        open_: set = set()
        first = before = None  # the first map at stride >= 4; the last single map before it (stride 2)
        for i, n in enumerate(nodes):
            if n in live and last_use.get(n, -1) > i:
                open_.add(n)
            open_.difference_update(ends.get(i, ()))
            shape = _shape(n)
            fine = n is not x and n in live and shape is not None and len(shape) == 4
            dims = _spatial(shape, H, W) if fine else None
            if dims is None:
                coarse = _spatial(shape, H, W, 2) if fine and first is None and open_ == {n} else None
                before = (n, coarse) if coarse is not None else before
                continue
            h, w = shape[dims[0]], shape[dims[1]]
            first = first or (n, h, w)
            if open_ != {n}:
                continue
            if (h, w) != first[1:]:
                if before is None:
                    raise GraphRouteError(
                        f'its first maps at stride >= {START_STRIDE} ({first[1]}x{first[2]} cells, '
                        f'{_where(first[0])}) travel as several tensors (cells of two inputs), and no single map '
                        'comes before them: the route starts on one map'
                    )
                # several tensors on the first stride-4 grid (NASNet's two-input cells): start on the single map
                # before them, so that nothing after the stem goes untraced
                n, dims = before
                shape = _shape(n)
                h, w = shape[dims[0]], shape[dims[1]]
            if H % h or W % w or H // h != W // w:
                raise GraphRouteError(
                    f'its first single feature map at stride >= {H // h} ({_where(n)}) is {h}x{w} for a {H}x{W} '
                    'input: no token grid tiles the image (convs without padding shrink the map)',
                    decided=True,
                )
            return n, dims, H // h
        raise GraphRouteError(
            f'no single feature map at stride >= {START_STRIDE} that every path from the image reaches'
        )

    # ------------------------------------------------------------------ one node

    def _read(self, ins) -> None:
        """A label op reads its input slots: none may be a query's positions alone (:meth:`_query_conv`)."""
        if any((i[0] if isinstance(i, tuple) else i) in self.positions_only for i in ins):
            raise GraphRouteError(
                'a spatial mixing of tokens (a conv on tokens off the map) read other than as attention queries '
                'has no rule'
            )

    def _new(self, fn, ins, *, dims, ndim) -> Map:
        self._read(ins)
        slot = self.slots
        self.slots += 1
        self.ops.append((fn, ins, slot))
        return Map(slot, dims, ndim)

    def _node(self, node: fx.Node, env) -> Any:
        args = fx.node.map_aggregate(node.args, lambda n: env[n] if isinstance(n, fx.Node) else n)
        kwargs = fx.node.map_aggregate(node.kwargs, lambda n: env[n] if isinstance(n, fx.Node) else n)
        values = [v for v in _leaves((node.args, node.kwargs)) if isinstance(v, fx.Node)]
        kinds = [env[v] for v in values]
        flat = [k for v in kinds for k in (_leaves(v) if isinstance(v, (tuple, list)) else [v])]
        maps = [k for k in flat if isinstance(k, Map)]
        vecs = [k for k in flat if isinstance(k, Vec)]
        name = node.target if isinstance(node.target, str) else getattr(node.target, '__name__', '')
        if any(isinstance(k, (Tok, Scores)) for k in flat) or (maps and name in _TOKEN_OPS):
            if vecs and not any(k is PRE for k in flat):
                return self._token_gate(node, name, flat, [v for v, k in zip(values, kinds) if isinstance(k, Vec)])
            if any(k is PRE for k in flat) or vecs:
                raise GraphRouteError('joins tokens to a tensor off the label grid (a pooled vector, the stem)')
            return self._tokens(node, name, env)
        if any(k is PRE for k in flat):
            if maps or vecs:
                raise GraphRouteError(
                    'joins a tensor from before the label grid to one on it (a long skip from the stem)'
                )
            return PRE
        if not maps and not vecs:
            return None
        if not maps:  # any op on pooled vectors alone: the label of the one it reads, if one
            labelled = {v.slot for v in vecs}
            return Vec(labelled.pop() if len(labelled) == 1 else None)
        try:
            if node.op == 'call_module':
                return self._module(node, node.graph.owning_module.get_submodule(node.target), maps, vecs, env)
            return self._function(node, node.target, name, args, kwargs, maps, vecs)
        except _OffTheGrid:  # a layout op that moves a map's positions: its entries are followed as tokens
            return self._tokens(node, name, env)

    def _module(self, node, m: nn.Module, maps, vecs, env) -> Any:
        if len(maps) != 1 or vecs:
            raise GraphRouteError(f'a {type(m).__name__} of several inputs has no rule')
        x = maps[0]
        if x.keep is not None and not isinstance(m, (DropPath,) + _POINTWISE_MODULES):
            # a drop path's output that a module reads before any sum does (timm's ByobNet blocks without a
            # shortcut drop their whole output): the drop scales each sample (Table 9's channel mixing), so its
            # labels are as they are, for this module and every later reader of the value
            x = Map(x.slot, x.dims, x.ndim)
            for v in _leaves(node.args):
                if isinstance(v, fx.Node) and env[v] == maps[0]:
                    env[v] = x
        if isinstance(m, DropPath):
            if m in self.drop_paths:
                raise GraphRouteError('a drop path called twice (its kept samples are read at one call)')
            self.drop_paths.append(m)
            self.keep_rows.append(None)  # (a map's rows are the samples)
            return Map(x.slot, x.dims, x.ndim, keep=len(self.drop_paths) - 1)
        if isinstance(m, _POINTWISE_MODULES) or (
            type(m).__module__ in _ACTIVATION_MODULES and not isinstance(m, _NOT_POINTWISE)
        ):
            return x
        if isinstance(m, nn.Conv2d):
            if x.dims != (2, 3) or x.ndim != 4:
                raise GraphRouteError('a conv on a map not in (B, C, H, W) layout')
            return self._conv(_conv_of(m), x)
        if isinstance(m, ConvMlp):
            return self._new(_ConvMlpLabels(m), [x.slot], dims=x.dims, ndim=4)
        if isinstance(m, (nn.MaxPool2d, nn.AvgPool2d)):
            dilation = getattr(m, 'dilation', 1)
            if _pair(dilation) != (1, 1) or getattr(m, 'return_indices', False):
                raise GraphRouteError(f'{m}: dilated pooling or pooling indices have no rule')
            padding = 'same' if isinstance(m, (MaxPool2dSame, AvgPool2dSame)) else _pair(m.padding)
            op = _Pool(_pair(m.kernel_size), _pair(m.stride or m.kernel_size), padding, bool(m.ceil_mode))
            return self._new(op, [x.slot], dims=x.dims, ndim=4)
        if isinstance(m, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)):
            return self._adaptive(node, x, m.output_size, isinstance(m, nn.AdaptiveAvgPool2d))
        if isinstance(m, nn.Upsample):
            return self._resample(
                node, x, dict(size=m.size, scale_factor=m.scale_factor, mode=m.mode, align_corners=m.align_corners)
            )
        if isinstance(m, nn.Flatten):
            return self._layout(node, x)
        if isinstance(m, nn.Linear):
            return self._last_dim(x, 'a Linear')
        if isinstance(m, nn.LayerNorm):
            return self._dims_free(x, range(x.ndim - len(m.normalized_shape), x.ndim), 'a LayerNorm')
        raise GraphRouteError(f'{type(m).__module__}.{type(m).__name__} has no Table 9 rule in the graph route')

    def _last_dim(self, x: Map, what: str) -> Map:
        return self._dims_free(x, [x.ndim - 1], what)

    def _dims_free(self, x: Map, dims, what: str) -> Map:
        if set(d % x.ndim for d in dims) & set(x.dims):
            raise GraphRouteError(f'{what} across the spatial dims mixes tokens without a rule')
        return x

    def _adaptive(self, node, x: Map, size, average: bool):
        out = _shape(node)
        if out is not None and out[x.dims[0]] == 1 and out[x.dims[1]] == 1 and _pair_none(size) == (1, 1):
            return Vec(x.slot if average else None)
        if not average:
            raise GraphRouteError('an adaptive max pooling to a grid has no rule', decided=True)
        return self._new(_Adaptive(size), [x.slot], dims=x.dims, ndim=x.ndim)

    def _resample(self, node, x: Map, kw: dict):
        if kw.get('mode', 'nearest') not in ('nearest', 'nearest-exact', 'bilinear', 'area'):
            raise GraphRouteError(f'{kw.get("mode")} resampling has negative weights: no rule', decided=True)
        if kw.get('size') is not None:
            raise GraphRouteError('resampling to a size computed in the graph is not traced (a scale factor is)')
        kw = {k: v for k, v in kw.items() if v is not None}
        return self._new(_Resample(kw), [x.slot], dims=x.dims, ndim=x.ndim)

    def _layout(self, node, x: Map) -> Any:
        """A reshape, flatten or squeeze of a map: the same labels where its spatial dims survive as they are."""
        src, out = _shape(node.args[0]), _shape(node)
        if src is None or out is None:
            raise GraphRouteError('a reshape of unknown shape')
        h, w = x.dims
        if out[0] == src[0]:
            before, after = math.prod(src[:h]), math.prod(src[w + 1 :])
            for i in range(1, len(out) - 1):
                if out[i : i + 2] == src[h : w + 1] and math.prod(out[:i]) == before:
                    if math.prod(out[i + 2 :]) == after:
                        return Map(x.slot, (i, i + 1), len(out), x.keep)
            if src[h] == 1 and src[w] == 1:  # a 1x1 map flattened: its one label is its mean
                return Vec(x.slot)
        raise _OffTheGrid()

    def _function(self, node, target, name, args, kwargs, maps, vecs) -> Any:
        first = args[0] if args else None
        if target is getattr or name == 'size' or name == 'dim':
            return None  # shapes
        if target in _ADD or name in _ADD:
            if vecs:
                raise GraphRouteError(
                    'a pooled vector added to a map (a global context) has no Table 9 reading', decided=True
                )
            return self._mean(maps)
        if target in _MUL or name in _MUL or target in _DIV or name in _DIV:
            slots = {m.slot for m in maps}
            if len(slots) > 1:
                raise GraphRouteError(
                    'a product of two maps with different labels (a spatial gate, a gated conv): a data-dependent '
                    'elementwise product, neither an attention (Eq. 9) nor a fixed mixer (Table 9)',
                    decided=True,
                )
            if len(maps) == 1:
                return maps[0]
            return Map(maps[0].slot, maps[0].dims, maps[0].ndim)
        if name in _SAME_LABELS:
            if vecs or len({m.slot for m in maps}) > 1:
                raise GraphRouteError(f'{name} of maps with different labels or of a map and a vector has no rule')
            return Map(maps[0].slot, maps[0].dims, maps[0].ndim)
        if target in _SUB or name in _SUB:
            if vecs or len({m.slot for m in maps}) > 1:
                raise GraphRouteError('a difference of maps with different labels has no rule', decided=True)
            return maps[0]
        if name == 'getitem' and isinstance(first, (tuple, list)):
            return first[args[1]]
        if name in ('expand_as', 'expand', 'view_as', 'reshape_as', 'type_as', 'to') and isinstance(first, Vec):
            return first  # a pooled vector broadcast to a map's shape: still a vector (a gate)
        if name in ('cat', 'concat', 'concatenate'):
            parts = args[0]
            dim = args[1] if len(args) > 1 else kwargs.get('dim', 0)
            if vecs or any(not isinstance(p, Map) for p in parts):
                raise GraphRouteError('a concatenation of a map with a tensor off the label grid has no rule')
            x = parts[0]
            if len({(p.dims, p.ndim) for p in parts}) > 1:
                raise GraphRouteError('a concatenation of maps in different layouts')
            if dim % x.ndim in (0, *x.dims):
                raise GraphRouteError('a concatenation along the batch or a spatial dim has no rule')
            return self._mean(parts)
        if len(maps) != 1 or vecs or not isinstance(first, Map):
            raise GraphRouteError(f'{name} of several maps or vectors has no rule')
        x = first
        if x.keep is not None and name not in POINTWISE:
            raise GraphRouteError('a drop path output goes into an op that moves labels')
        if name in POINTWISE:
            return x
        if name == 'getitem':
            return self._getitem(node, x)
        if name in ('chunk', 'split', 'tensor_split', 'unbind'):
            dim = args[2] if len(args) > 2 else kwargs.get('dim', 0)
            if dim % x.ndim in (0, *x.dims) or name == 'unbind':
                raise _OffTheGrid()
            n = len(node.meta['tensor_meta']) if isinstance(node.meta.get('tensor_meta'), (tuple, list)) else 0
            return tuple(x for _ in range(n))
        if name in ('permute', 'transpose', 'swapaxes', 'movedim'):
            return self._permute(node, x, args, name)
        if name in _LAYOUT:
            return self._layout(node, x)
        if name in _REDUCE:
            at = 2 if name == 'norm' else 1  # (x.norm(p, dim))
            dims = args[at] if len(args) > at else kwargs.get('dim')
            if dims is None:
                raise GraphRouteError(f'{name} over every dim has no rule')
            dims = {d % x.ndim for d in ((dims,) if isinstance(dims, int) else dims)}
            if not dims & set(x.dims):
                if name in ('max', 'min') and isinstance(node.meta.get('tensor_meta'), (tuple, list)):
                    return (x, None)
                return x
            if set(x.dims) <= dims and 0 not in dims:
                return Vec(x.slot if name in ('mean', 'sum') else None)
            raise GraphRouteError(f'{name} over {sorted(dims)} reduces part of the spatial dims')
        if name in ('adaptive_avg_pool2d', 'adaptive_max_pool2d'):
            size = args[1] if len(args) > 1 else kwargs.get('output_size')
            return self._adaptive(node, x, size, name == 'adaptive_avg_pool2d')
        if name in ('avg_pool2d', 'max_pool2d'):
            return self._functional_pool(node, x, name, args, kwargs)
        if name in ('interpolate', 'upsample'):
            kw = dict(zip(('size', 'scale_factor', 'mode', 'align_corners'), args[1:]))
            kw.update({k: v for k, v in kwargs.items() if k in ('size', 'scale_factor', 'mode', 'align_corners')})
            return self._resample(node, x, kw)
        if name == 'pad':
            pad = args[1] if len(args) > 1 else kwargs['pad']
            mode = args[2] if len(args) > 2 else kwargs.get('mode', 'constant')
            given = node.args[1] if len(node.args) > 1 else node.kwargs['pad']  # (sizes the graph computes)
            amounts = [p.meta.get('value') if isinstance(p, fx.Node) else p for p in given]
            if all(a == 0 for a in amounts):  # a padding by nothing (to a window size the grid already tiles)
                return x
            if mode not in ('reflect', 'replicate', 'circular') or len(pad) != 4 or x.dims != (x.ndim - 2, x.ndim - 1):
                raise GraphRouteError(f'a {mode} padding of the grid adds cells that are no tokens: not traced')
            return self._new(_Pad(tuple(pad), mode), [x.slot], dims=x.dims, ndim=x.ndim)
        if name == 'conv2d':
            return self._functional_conv(node, x, args, kwargs)
        if name == 'linear':
            return self._last_dim(x, 'a linear layer')
        if name == 'layer_norm':
            shape = args[1] if len(args) > 1 else kwargs['normalized_shape']
            return self._dims_free(x, range(x.ndim - len(shape), x.ndim), 'a layer norm')
        if name in ('softmax', 'log_softmax', 'normalize'):
            dim = args[1] if len(args) > 1 else kwargs.get('dim', 1 if name == 'normalize' else None)
            if dim is None:
                raise GraphRouteError(f'{name} without a dim')
            return self._dims_free(x, [dim], name)
        if target in _NOTRACE:
            raise _OffTheGrid()
        raise GraphRouteError(f'{name} has no Table 9 rule in the graph route')

    def _mean(self, maps: List[Map]) -> Map:
        """A sum (Eq. 11) or a concatenation along channels (Norm of the sum): the mean of the parts' labels."""
        x = maps[0]
        if len({(m.dims, m.ndim) for m in maps}) > 1:
            raise GraphRouteError('a sum of maps in different layouts')
        if len({m.slot for m in maps}) == 1:
            return Map(x.slot, x.dims, x.ndim)
        return self._new(_MeanOp(), [(m.slot, m.keep) for m in maps], dims=x.dims, ndim=x.ndim)

    def _getitem(self, node, x: Map) -> Map:
        src, out = _shape(node.args[0]), _shape(node)
        h, w = x.dims
        if src is not None and out is not None and len(out) == len(src) and out[0] == src[0]:
            if out[h] == src[h] and out[w] == src[w]:
                return x
        raise _OffTheGrid()

    def _permute(self, node, x: Map, args, name) -> Map:
        nd = x.ndim
        if name == 'permute':
            perm = list(args[1:]) if not isinstance(args[1], (tuple, list)) else list(args[1])
        else:
            a, b = args[1] % nd, args[2] % nd
            perm = list(range(nd))
            if name == 'movedim':
                perm.pop(a)
                perm.insert(b, a)
            else:
                perm[a], perm[b] = perm[b], perm[a]
        perm = [p % nd for p in perm]
        h, w = perm.index(x.dims[0]), perm.index(x.dims[1])
        if perm[0] != 0 or h > w:
            raise _OffTheGrid()
        return Map(x.slot, (h, w), nd, x.keep)

    def _functional_conv(self, node, x: Map, args, kwargs) -> Map:
        """``F.conv2d`` with a kernel the graph computes from the model's parameters and buffers alone (a fixed
        blur filter, a standardised weight): the kernel is evaluated from them at each label pass."""
        names = ('weight', 'bias', 'stride', 'padding', 'dilation', 'groups')
        kw = dict(zip(names, args[1:]))
        kw.update(kwargs)
        weight = node.args[1] if len(node.args) > 1 else node.kwargs['weight']
        if x.dims != (2, 3) or x.ndim != 4:
            raise GraphRouteError('a conv on a map not in (B, C, H, W) layout')
        padding = kw.get('padding', 0)
        if isinstance(padding, str):
            raise GraphRouteError(f'F.conv2d with padding={padding!r} is not traced')
        shape = _shape(weight)
        stride, dilation = _pair(kw.get('stride', 1)), _pair(kw.get('dilation', 1))
        return self._conv(_Conv(_constant(self.gm, weight), tuple(shape[-2:]), stride, _pair(padding), dilation), x)

    def _conv(self, op: '_Conv', x: Map) -> Map:
        """A conv's label op, where it moves labels (a stride-1 1x1 conv is channel mixing: the same labels)."""
        if op.kernel == (1, 1) and op.stride == (1, 1):
            return x
        return self._new(op, [x.slot], dims=x.dims, ndim=4)

    def _functional_pool(self, node, x: Map, name, args, kwargs) -> Map:
        names = (
            ('kernel_size', 'stride', 'padding', 'ceil_mode')
            if name == 'avg_pool2d'
            else ('kernel_size', 'stride', 'padding', 'dilation', 'ceil_mode')
        )
        kw = dict(zip(names, args[1:]))
        kw.update(kwargs)
        if _pair(kw.get('dilation', 1)) != (1, 1) or kw.get('return_indices'):
            raise GraphRouteError('dilated pooling or pooling indices have no rule')
        k = _pair(kw['kernel_size'])
        stride = kw.get('stride') or k
        op = _Pool(k, _pair(stride if stride != [] else k), _pair(kw.get('padding', 0)), bool(kw.get('ceil_mode')))
        return self._new(op, [x.slot], dims=x.dims, ndim=x.ndim)

    # ------------------------------------------------------------------ tokens

    def _slot(self, fn, ins, grid) -> int:
        self._read(ins)
        slot = self.slots
        self.slots += 1
        self.ops.append((fn, ins, slot))
        self.grids[slot] = tuple(grid)
        return slot

    def _cells(self, slot: int) -> int:
        h, w = self.grids[slot]
        return h * w

    def _tok_of(self, node, v):
        """A labelled value as tokens (a map's code from its layout); any other value as it is."""
        if isinstance(v, Map):
            self.sized = True  # the code holds this input size's layout
            return Tok(v.slot, map_code(_shape(node), v.dims, self._cells(v.slot), self.grids[v.slot]), v.keep)
        return v

    def _settle(self, t):
        """Tokens back on a map where their code is a map's layout (the batch first, then the rows and columns of
        their grid next to each other, every other dim a channel dim); else the tokens."""
        if not isinstance(t, Tok):
            return t
        shape, (gh, gw) = t.code.shape, self.grids[t.slot]
        if len(shape) < 3 or shape[0] != 2:
            return t
        for h in range(1, len(shape) - 1):
            if shape[h] == gh and shape[h + 1] == gw:
                code = map_code(shape, (h, h + 1), gh * gw, (gh, gw))
                if torch.equal(t.pos, code // CODE):
                    return Map(t.slot, (h, h + 1), len(shape), t.keep)
        return t

    def _tokens(self, node, name, env) -> Any:
        """One op on tokens (or on a map whose positions it moves): layout ops follow the code, Eq. 9 at an
        attention, Eq. 11 at a sum, the labels unchanged where the op is per token."""
        target = node.target

        def labelled(n):
            return self._tok_of(n, env[n]) if isinstance(n, fx.Node) else n

        args = fx.node.map_aggregate(node.args, labelled)
        kwargs = fx.node.map_aggregate(node.kwargs, labelled)
        flat = _leaves((args, kwargs))
        toks = [v for v in flat if isinstance(v, Tok)]
        scores = [v for v in flat if isinstance(v, Scores)]
        out = _shape(node)
        if node.op == 'call_module':
            m = node.graph.owning_module.get_submodule(target)
            return self._token_module(node, m, args, toks, scores, out, env)
        first = args[0] if args else None
        if target is getattr or name in ('size', 'dim'):
            return None
        if name == 'getitem' and isinstance(first, (tuple, list)):
            return first[args[1]]
        if scores:
            return self._scores(node, name, args, kwargs, toks, scores, out)
        if name in _MATMUL:
            return self._matmul(node, args, out)
        if name == 'scaled_dot_product_attention':
            return self._sdpa(node, args, kwargs, out)
        if any(t.keep is not None for t in toks) and not (
            name in POINTWISE or target in _ADD or name in _ADD or name in _REPLAYED
        ):
            raise GraphRouteError('a drop path output goes into an op that moves labels')
        if target in _ADD or name in _ADD:
            return self._token_sum(toks, out)
        if target in _SUB or name in _SUB or target in _MUL or name in _MUL or target in _DIV or name in _DIV:
            if len({t.slot for t in toks}) > 1:
                raise GraphRouteError(
                    'a product or difference of tokens with different labels: neither an attention (Eq. 9) nor a '
                    'fixed mixer (Table 9)',
                    decided=True,
                )
            return self._same(toks, out)
        if name in POINTWISE or name in _SAME_LABELS:
            return self._same(toks, out)
        if name in _REDUCE and len(toks) == 1:
            return self._token_reduce(node, name, args, kwargs, toks[0])
        if name == 'linear':
            return self._per_token(toks, [-1], out, 'a linear layer')
        if name == 'layer_norm':
            shape = args[1] if len(args) > 1 else kwargs['normalized_shape']
            return self._per_token(toks, range(-len(shape), 0), out, 'a layer norm')
        if name in ('softmax', 'log_softmax', 'normalize'):
            dim = args[1] if len(args) > 1 else kwargs.get('dim', 1 if name == 'normalize' else None)
            if name == 'normalize' and len(toks) == 1 and dim is not None and dim % toks[0].code.ndim != 0:
                # x / ||x|| over a dim of one sample: each entry scaled by a scalar of its sample and channel (a
                # data-dependent channel scale, Table 9's channel mixing), over positions too (SwiftFormer)
                return self._same(toks, out)
            return self._per_token(toks, [dim], out, name)
        if name in ('cat', 'concat', 'concatenate', 'stack'):
            return self._token_cat(node, name, args, kwargs, env)
        if name in _REPLAYED or target in _NOTRACE:
            return self._replay(node, name, env, check=name not in _REPLAYED)
        raise GraphRouteError(f'{name} on tokens has no Table 9 rule in the graph route')

    def _token_gate(self, node, name, flat, vec_nodes) -> Tok:
        """Tokens times a pooled vector of their sample (SwiftFormer's global query times each key): a data-dependent
        scale of each channel, Table 9's channel mixing, as an SE gate on a map: the tokens' labels."""
        toks = [k for k in flat if isinstance(k, Tok)]
        if not (node.target in _MUL or name in _MUL) or len(toks) != 1 or len(flat) != 2:
            raise GraphRouteError('joins tokens to a tensor off the label grid (a pooled vector, the stem)')
        (t,) = toks
        vec = _shape(vec_nodes[0]) if len(vec_nodes) == 1 else None
        code, out = t.code, _shape(node)
        moving = [d for d in range(code.ndim) if not _constant_along(t.pos, [d])]
        off = code.ndim - len(vec) if vec is not None else -1
        if vec is None or off < 0 or tuple(out) != tuple(code.shape) or code.shape[0] != 2:
            raise GraphRouteError('tokens times a vector that changes their shape has no rule')
        if any(vec[d - off] != 1 for d in moving if d > 0 and d >= off) or (off == 0 and vec[0] != 2):
            raise GraphRouteError('tokens times a vector that varies along their positions has no rule')
        return self._settle(Tok(t.slot, t.code, t.keep))

    def _token_module(self, node, m, args, toks, scores, out, env) -> Any:
        if scores:
            (s,) = scores
            if isinstance(m, nn.Softmax) and not isinstance(s, Probs) and m.dim is not None:
                return self._softmax(node, s, m.dim)
            if isinstance(m, _POINTWISE_MODULES) or type(m).__module__ in _ACTIVATION_MODULES:
                return s
            if (
                isinstance(m, nn.Conv2d)
                and tuple(m.kernel_size) == (1, 1)
                and tuple(m.stride) == (1, 1)
                and m.groups == 1
                and s.q.ndim == 3
                and tuple(out) == tuple(s.q.shape) + (s.k.shape[-1],)
            ):  # talking heads: a 1x1 conv over the heads of ``(windows, heads, N, M)`` weights
                if not isinstance(s, Probs):  # of the logits: logits still, the recorded softmax holds the mixing
                    return s
                if s.mix is not None or s.transposed:
                    raise GraphRouteError('attention probabilities whose heads are mixed twice have no rule')
                return dataclasses.replace(s, mix=m)  # of the probabilities: CaiT's rule, Norm(|mean_h mix(P)|)
            raise GraphRouteError(f'a {type(m).__name__} on attention weights has no rule')
        if len(toks) != 1:
            raise GraphRouteError(f'a {type(m).__name__} of several inputs has no rule')
        (t,) = toks
        if isinstance(m, DropPath):
            if m in self.drop_paths:
                raise GraphRouteError('a drop path called twice (its kept samples are read at one call)')
            self.keep_rows.append(self._drop_rows(t))
            self.drop_paths.append(m)
            return Tok(t.slot, t.code, keep=len(self.drop_paths) - 1)
        if t.keep is not None and not isinstance(m, _POINTWISE_MODULES):
            raise GraphRouteError('a drop path output goes into an op that moves labels')
        if isinstance(m, _POINTWISE_MODULES) or (
            type(m).__module__ in _ACTIVATION_MODULES and not isinstance(m, _NOT_POINTWISE)
        ):
            return self._same(toks, out)
        if isinstance(m, nn.Linear):
            return self._per_token(toks, [-1], out, 'a Linear')
        if isinstance(m, nn.LayerNorm):
            return self._per_token(toks, range(-len(m.normalized_shape), 0), out, 'a LayerNorm')
        if isinstance(m, (nn.Flatten, nn.Unflatten)):
            return self._replay(node, type(m).__name__, env, check=False)
        if isinstance(m, nn.Conv2d) and t.code.ndim == 4:
            return self._token_conv(t, m, out)
        if isinstance(m, nn.BatchNorm1d) and t.code.ndim in (2, 3):  # (B, C[, L]): per channel
            return self._per_token(toks, [1], out, 'a BatchNorm1d')
        if isinstance(m, (nn.AvgPool1d, nn.MaxPool1d, nn.AvgPool2d, nn.MaxPool2d)):
            return self._token_pool(t, m, out)
        raise GraphRouteError(f'{type(m).__module__}.{type(m).__name__} on tokens has no rule in the graph route')

    def _drop_rows(self, t: Tok) -> Optional[Tuple[torch.Tensor, Tuple[int, int]]]:
        """Where a drop path's rows are not the samples but parts of each (MobileViT's rows of patches, one per offset
        in a patch), each cell's row within its sample, so that Eq. 11 counts a dropped row's cells out (None where
        the rows are the samples)."""
        rows, cells = t.code.shape[0], self._cells(t.slot)
        pos = t.pos.reshape(rows, -1)
        R = rows // 2
        row = torch.arange(rows).view(-1, 1).expand_as(pos)
        real = pos > 0
        if rows % 2 or not bool(((pos - 1) // cells == row // R)[real].all()):
            raise GraphRouteError('a drop path over rows that mix the samples has no rule')
        if R == 1:
            return None
        first = real & (row < R)
        of = torch.full((cells,), -1, dtype=torch.long)
        of[pos[first] - 1] = row[first]
        if bool((of < 0).any()) or not torch.equal(of[pos[first] - 1], row[first]):
            raise GraphRouteError('a drop path over rows that hold some cells twice or not at all has no rule')
        return of, self.grids[t.slot]

    def _token_conv(self, t: Tok, m: nn.Conv2d, out) -> Tok:
        """A conv on channels-first tokens off the map (in windows): a 1x1 conv mixes channels alone (the labels
        stay); a conv over positions that keeps them in place gives tokens whose positions are known and whose
        labels are not, which may only be read as attention queries: an attention's output rows are its queries'
        positions, and its labels come from the values (EfficientViT's depthwise conv on the queries)."""
        pad = (0, 0) if isinstance(m.padding, str) else _pair(m.padding)  # ('same', 'valid': none at 1x1)
        if tuple(m.kernel_size) == (1, 1) and tuple(m.stride) == (1, 1) and pad == (0, 0):
            return self._per_token([t], [1], out, 'a 1x1 conv')
        if tuple(out[2:]) != tuple(t.code.shape[2:]) or tuple(m.stride) != (1, 1):
            raise GraphRouteError(f'a {type(m).__name__} on tokens that moves their positions has no rule')
        slot = self.slots
        self.slots += 1
        self.grids[slot] = self.grids[t.slot]
        self.positions_only.add(slot)
        code = t.code if out[1] == t.code.shape[1] else rechannel(t.code, 1, out[1])
        return Tok(slot, code, t.keep)

    @staticmethod
    def _group_grid(index: torch.Tensor, grid) -> tuple:
        """``(index, grid, order)`` of pooled groups of cells (``index`` ``(G, k)``): where they are the aligned
        ``kh x kw`` windows that tile the ``grid`` (a pooling of the map in another layout), the pooled grid, its
        windows in row-major order (``order[g]``: group ``g``'s cell on it), so that it sums with a map pooled by
        the same windows; else one cell per group, ``(G, 1)``, in their order."""
        G, k = index.shape
        H, W = grid
        r, c = index // W, index % W
        r0, c0 = r.min(1).values, c.min(1).values
        kh, kw = int((r - r0[:, None]).max()) + 1, int((c - c0[:, None]).max()) + 1
        same = torch.arange(G, device='cpu')
        if kh * kw != k or H % kh or W % kw or G != (H // kh) * (W // kw) or bool((r0 % kh).any() | (c0 % kw).any()):
            return index, (G, 1), same
        dr, dc = torch.meshgrid(torch.arange(kh), torch.arange(kw), indexing='ij')
        window = ((r0[:, None] + dr.reshape(1, -1)) * W + c0[:, None] + dc.reshape(1, -1)).sort(1).values
        if not torch.equal(window, index.sort(1).values):
            return index, (G, 1), same
        order = (r0 // kh) * (W // kw) + c0 // kw
        placed = torch.empty_like(index)
        placed[order] = index
        return placed, (H // kh, W // kw), order

    def _token_pool(self, t: Tok, m: nn.Module, out) -> Tok:
        """A pooling of tokens in windows that tile them (max or average alike, as on a map): spatial aggregation,
        each output token the mean label of the cells its window holds. The groups are read off the code; they form
        a new label map of one cell per group (:class:`_GroupMean`)."""
        nd = 1 if isinstance(m, (nn.AvgPool1d, nn.MaxPool1d)) else 2
        kernel, stride, padding = (_tuple(v, nd) for v in (m.kernel_size, m.stride or m.kernel_size, m.padding))
        dilation = _tuple(getattr(m, 'dilation', 1), nd)
        if kernel != stride or any(padding) or any(d != 1 for d in dilation) or getattr(m, 'ceil_mode', False):
            raise GraphRouteError(f'a {type(m).__name__} on tokens whose windows overlap or pad has no rule')
        code = t.code
        u = code
        for d, k in zip(range(code.ndim - nd, code.ndim), kernel):
            if u.shape[d] % k:
                raise GraphRouteError(f'a {type(m).__name__} on tokens whose windows do not tile them has no rule')
            u = u.unfold(d, k, k)  # the window's entries in a trailing dim
        u = u.reshape(*u.shape[: code.ndim], -1)
        pos, chan = u // CODE, u % CODE
        if not _constant_along(chan, [u.ndim - 1]):
            raise GraphRouteError(f'a {type(m).__name__} over the channels of tokens has no rule')
        if bool((pos == 0).any()):
            raise GraphRouteError(f'a {type(m).__name__} over padded cells (no tokens) has no rule')
        cells = self._cells(t.slot)
        groups, inverse = torch.unique(pos.reshape(-1, pos.shape[-1]), dim=0, return_inverse=True)
        n = groups.shape[0] // 2  # the fake batch's two samples (sorted: the first sample's groups first)
        sample = (groups - 1) // cells
        if groups.shape[0] % 2 or not _constant_along(sample, [1]) or not torch.equal(groups[:n] + cells, groups[n:]):
            raise GraphRouteError(f'a {type(m).__name__} on tokens across samples has no rule')
        index, grid, order = self._group_grid((groups[:n] - 1) % cells, self.grids[t.slot])
        slot = self._slot(_GroupMean(index), [t.slot], grid)
        inverse = inverse.view(pos.shape[:-1])
        new = ((inverse // n) * n + order[inverse % n] + 1) * CODE + chan[..., 0]
        if tuple(new.shape) != tuple(out):
            raise GraphRouteError(f'a {type(m).__name__} on tokens that the code does not follow')
        return self._settle(Tok(slot, new.contiguous()))

    def _same(self, toks, out) -> Tok:
        """A point-wise op of tokens of one label map at the same positions: the same labels."""
        t = toks[0]
        try:
            codes = [u.code.expand(out) for u in toks]
        except RuntimeError:
            raise GraphRouteError('a point-wise op of tokens that changes their shape has no rule') from None
        if len({u.slot for u in toks}) > 1 or not _same_positions(toks, codes):
            raise GraphRouteError('a point-wise op of tokens at different positions has no rule')
        return self._settle(Tok(t.slot, codes[0].contiguous() if t.code.shape != out else t.code, t.keep))

    def _per_token(self, toks, dims, out, what) -> Tok:
        """An op over the channel dims ``dims`` alone (a linear layer, a norm): the same labels."""
        (t,) = toks
        dims = [d % t.code.ndim for d in dims if d is not None]
        if len(dims) == 0 or not _constant_along(t.pos, dims):
            raise GraphRouteError(f'{what} across token positions mixes tokens without a rule')
        code = t.code
        if tuple(code.shape) != tuple(out):
            if len(dims) != 1 or len(out) != code.ndim:
                raise GraphRouteError(f'{what} that changes the shape of tokens has no rule')
            code = rechannel(code, dims[0], out[dims[0]])
        return self._settle(Tok(t.slot, code, t.keep))

    def _token_sum(self, toks, out) -> Any:
        """A sum of tokens: the same labels where one map's; Eq. 11 (the mean of the summands' labels, a dropped
        branch not counting) where several maps' at the same positions."""
        if len({t.slot for t in toks}) == 1:
            return self._same(toks, out)
        codes = torch.broadcast_tensors(*(t.code for t in toks))
        if not _same_positions(toks, codes):
            raise GraphRouteError('a sum of tokens at different positions has no rule')
        if len({self.grids[t.slot] for t in toks}) > 1:
            raise GraphRouteError('a sum of tokens on different grids has no rule')
        slot = self._slot(_MeanOp(), [(t.slot, t.keep) for t in toks], self.grids[toks[0].slot])
        return self._settle(Tok(slot, codes[0].contiguous()))

    def _replay(self, node, name, env, check: bool) -> Any:
        """A layout op: the same op on the code (``check``: a function whose semantics are not known must move
        entries alone, :func:`~._graph_tokens.is_gather`)."""
        slots, keeps = set(), set()

        def concrete(n):
            if not isinstance(n, fx.Node):
                return n
            v = self._tok_of(n, env[n])
            if isinstance(v, Tok):
                if v.keep is not None and (check or keeps and keeps != {v.keep}):
                    raise GraphRouteError('a drop path output goes into an op that moves labels')
                slots.add(v.slot)
                keeps.add(v.keep)
                return v.code
            if 'value' in n.meta:
                return n.meta['value']
            raise GraphRouteError(f'{name} of tokens and a tensor off the label grid has no rule')

        args = fx.node.map_aggregate(node.args, concrete)
        kwargs = fx.node.map_aggregate(node.kwargs, concrete)
        if len(slots) != 1:
            raise GraphRouteError(f'{name} of tokens of several label maps has no rule')
        if name == 'pad' and (
            (args[2] if len(args) > 2 else kwargs.get('mode', 'constant')) != 'constant'
            or ((args[3] if len(args) > 3 else kwargs.get('value', 0)) not in (0, 0.0, None))
        ):
            raise GraphRouteError('a padding of tokens other than by zeros has no rule')
        if node.op == 'call_method':
            fn = getattr(torch.Tensor, node.target)
        elif node.op == 'call_module':
            fn = node.graph.owning_module.get_submodule(node.target)
        else:
            fn = node.target
        if check and not is_gather(fn, *args, **kwargs):
            raise GraphRouteError(f'{name} on tokens is no layout op (it computes new values): no rule')
        result = fn(*args, **kwargs)
        (slot,), (keep,) = slots, keeps  # a layout op moves a drop path's entries within their samples: kept along
        return fx.node.map_aggregate(
            result, lambda r: self._settle(Tok(slot, r.contiguous(), keep)) if isinstance(r, torch.Tensor) else r
        )

    def _token_cat(self, node, name, args, kwargs, env) -> Any:
        """A concatenation of tokens: of one map's, their layout; along a channel dim of several maps' tokens at
        the same positions, the mean of their labels (as a map's concatenation)."""
        parts = args[0]
        if any(not isinstance(p, Tok) for p in parts):
            raise GraphRouteError(f'{name} of tokens with a tensor off the label grid (a class token) has no rule')
        if len({p.slot for p in parts}) == 1:
            return self._replay(node, name, env, check=False)
        dim = args[1] if len(args) > 1 else kwargs.get('dim', 0)
        nd = parts[0].code.ndim
        if name == 'stack' or not all(_constant_along(p.pos, [dim % nd]) for p in parts):
            raise GraphRouteError(f'{name} of tokens of several label maps along their positions has no rule')
        first = [p.pos.narrow(dim % nd, 0, 1) for p in parts]
        if any(not torch.equal(f, first[0]) for f in first):
            raise GraphRouteError(f'{name} of tokens at different positions has no rule')
        slot = self._slot(_MeanOp(), [(p.slot, p.keep) for p in parts], self.grids[parts[0].slot])
        code = torch.cat([p.code for p in parts], dim)
        return self._settle(Tok(slot, renumber(code)))

    def _token_reduce(self, node, name, args, kwargs, t: Tok) -> Any:
        """A reduction of tokens: over channel dims, the same labels; over every position of the grid (a global
        pooling of token rows), the mean label (``mean`` / ``sum``; a max has none)."""
        nd = t.code.ndim
        dims = args[1] if len(args) > 1 else kwargs.get('dim')
        if dims is None:
            raise GraphRouteError(f'{name} over every dim has no rule')
        dims = sorted({d % nd for d in ((dims,) if isinstance(dims, int) else dims)})
        keepdim = bool(args[2] if len(args) > 2 else kwargs.get('keepdim', False))
        pos = t.pos
        if _constant_along(pos, dims):
            code = t.code
            for d in reversed(dims):
                code = code.narrow(d, 0, 1) if keepdim else code.select(d, 0)
            return self._settle(Tok(t.slot, code.contiguous(), t.keep))
        rest = [d for d in range(nd) if d not in dims]
        rows = pos.permute(*rest, *dims).reshape(*[pos.shape[d] for d in rest], -1)
        cells = self._cells(t.slot)
        if 0 in dims or (rows == 0).any():
            raise GraphRouteError(f'{name} over the batch or over padded tokens has no rule')
        flat = rows.reshape(-1, rows.shape[-1])
        b = (flat - 1) // cells
        counts = torch.zeros(flat.shape[0], cells, dtype=torch.long, device='cpu').scatter_add_(
            1, (flat - 1) % cells, torch.ones_like(flat)
        )
        if bool((b != b[:, :1]).any()) or bool((counts != counts[:, :1]).any()):
            raise GraphRouteError(f'{name} over part of the token positions has no rule')
        return Vec(t.slot if name in ('mean', 'sum') else None)

    def _matmul(self, node, args, out) -> Any:
        a, b = args[0], args[1]
        if isinstance(a, Tok) and isinstance(b, Tok):
            if a.keep is not None or b.keep is not None:
                raise GraphRouteError('a drop path output goes into an op that moves labels')
            if not (_constant_along(a.pos, [a.code.ndim - 1]) and _constant_along(b.pos, [b.code.ndim - 2])):
                raise GraphRouteError('a product of tokens over their positions (no attention logits) has no rule')
            lead = tuple(out[:-2])
            q = a.pos[..., 0].expand(*lead, out[-2])
            k = b.pos[..., 0, :].expand(*lead, out[-1])
            return Scores(q, k, a.slot, b.slot)
        if isinstance(a, Tok):
            return self._per_token([a], [-1], out, 'a matrix product over channels')
        raise GraphRouteError('a fixed matrix over tokens (a token MLP) has no rule in the graph route')

    def _softmax(self, node, s: Scores, dim) -> Probs:
        if dim is None or dim % (s.q.ndim + 1) != s.q.ndim:
            raise GraphRouteError('a softmax of attention logits over the queries has no rule')
        return Probs(s.q, s.k, s.qslot, s.kslot, site=node)

    def _scores(self, node, name, args, kwargs, toks, scores, out) -> Any:
        """Attention logits and probabilities: scaled, biased and masked logits stay logits; their softmax over
        the keys is the probabilities; the probabilities times the values' tokens are Eq. 9."""
        (s,) = scores
        probs = isinstance(s, Probs)
        plain = probs and not s.transposed
        if name in _MATMUL and plain and args[0] is s and isinstance(args[1], Tok) and not toks[1:]:
            v = args[1]
            if not _constant_along(v.pos, [v.code.ndim - 1]):
                raise GraphRouteError('attention weights times tokens over their channels has no rule')
            return self._attend(s.site, s.q, s.k, s.qslot, s.kslot, v, out, mix=s.mix)
        if name in _MATMUL and probs and s.transposed and args[1] is s and isinstance(args[0], Tok) and not toks[1:]:
            # values with channels first times the transposed probabilities: (v Pᵀ)ᵀ = P vᵀ, Eq. 9 on vᵀ
            v = args[0]
            if not _constant_along(v.pos, [v.code.ndim - 2]):
                raise GraphRouteError('tokens over their channels times attention weights has no rule')
            vt = Tok(v.slot, v.code.transpose(-1, -2), v.keep)
            flipped = (*out[:-2], out[-1], out[-2])
            return self._attend(s.site, s.q, s.k, s.qslot, s.kslot, vt, flipped, transposed=True, mix=s.mix)
        if probs and name == 'transpose' and not toks and len(args) == 3 and args[0] is s:
            if sorted(a % len(out) for a in args[1:3]) == [len(out) - 2, len(out) - 1]:  # the queries and keys swap
                return Probs(s.q, s.k, s.qslot, s.kslot, site=s.site, transposed=not s.transposed, mix=s.mix)
        if toks and not probs and (node.target in _ADD or name in _ADD) and all(t.keep is None for t in toks):
            # logits plus a term computed from the tokens (BoTNet's relative logits from the queries): a bias; the
            # recorded probabilities hold it, and the entries keep their query and key cells
            if tuple(out) != tuple(s.q.shape[:-1]) + (s.q.shape[-1], s.k.shape[-1]):
                raise GraphRouteError('attention logits broadcast to another shape have no rule')
            return s
        if toks:
            raise GraphRouteError('attention weights combined with tokens other than as values have no rule')
        if name in POINTWISE:
            return s
        if name in ('softmax',) and not probs:
            return self._softmax(node, s, args[1] if len(args) > 1 else kwargs.get('dim'))
        if not probs and (
            node.target in _ADD
            or name in _ADD
            or node.target in _MUL
            or name in _MUL
            or node.target in _DIV
            or name in _DIV
            or node.target in _SUB
            or name in _SUB
            or name in ('masked_fill', 'masked_fill_')
        ):
            if tuple(out) != tuple(s.q.shape[:-1]) + (s.q.shape[-1], s.k.shape[-1]):
                raise GraphRouteError('attention logits broadcast to another shape have no rule')
            return s  # a scale, a position bias, a mask
        raise GraphRouteError(f'{name} on attention {"probabilities" if probs else "logits"} has no rule')

    def _sdpa(self, node, args, kwargs, out) -> Any:
        names = ('query', 'key', 'value', 'attn_mask', 'dropout_p', 'is_causal', 'scale', 'enable_gqa')
        kw = dict(zip(names, args))
        kw.update(kwargs)
        q, k, v = kw['query'], kw['key'], kw['value']
        if kw.get('is_causal'):
            raise GraphRouteError('causal attention has no rule', decided=True)
        if not all(isinstance(t, Tok) for t in (q, k, v)) or isinstance(kw.get('attn_mask'), (Tok, Scores)):
            raise GraphRouteError('an attention of tokens with a tensor off the label grid has no rule')
        if not all(_constant_along(t.pos, [t.code.ndim - 1]) for t in (q, k, v)):
            raise GraphRouteError('an attention whose head dim holds token positions has no rule')
        lead = tuple(out[:-2])
        if k.code.shape[:-2] != q.code.shape[:-2]:
            raise GraphRouteError('an attention with grouped or broadcast keys has no rule in the graph route')
        return self._attend(node, q.pos[..., 0].expand(*lead, out[-2]), k.pos[..., 0], q.slot, k.slot, v, out)

    def _attend(self, site, q, k, qslot, kslot, v: Tok, out, transposed: bool = False, mix=None) -> Tok:
        """Eq. 9: a label op that applies the recorded probabilities to the keys' labels, per query cell the mean
        over heads (and over the windows that hold the cell, where several do)."""
        if v.slot != kslot:
            raise GraphRouteError('an attention whose keys and values carry different labels has no rule')
        if any(t.keep is not None for t in (v,)):
            raise GraphRouteError('a drop path output goes into an op that moves labels')
        vk = v.pos[..., 0]
        try:
            kk, vk = torch.broadcast_tensors(k, vk)
        except RuntimeError:
            raise GraphRouteError('an attention whose values are not its keys has no rule') from None
        if not torch.equal(kk, vk):
            raise GraphRouteError('an attention whose values sit at other positions than its keys has no rule')
        if qslot != kslot and q.shape == kk.shape and q.shape[0] > 2:
            per = q.reshape(2, q.shape[0] // 2, *q.shape[1:])
            if _constant_along(per, [1]):  # a query shared by every window of a sample (GCViT's global query):
                q, qslot = kk, kslot  # output row i of a window is its window's cell i, where the values' rows sit
        if bool((q == 0).any()) or bool((k == 0).any()):
            raise GraphRouteError('an attention over padded cells (no tokens) has no rule')
        qcells, kcells = self._cells(qslot), self._cells(kslot)
        for t, cells in ((q, qcells), (kk, kcells)):
            n = t.shape[0]
            view = [n] + [1] * (t.ndim - 1)
            if n % 2 or not torch.equal(
                (t - 1) // cells, (torch.arange(n, device='cpu') // (n // 2)).view(view).expand_as(t)
            ):
                raise GraphRouteError('an attention whose first dim is not the samples (then windows) has no rule')
        counts = torch.bincount(((q[: q.shape[0] // 2] - 1) % qcells).reshape(-1), minlength=qcells)
        if int(counts.min()) == 0 or int(counts.min()) != int(counts.max()):
            raise GraphRouteError('an attention whose queries cover part of the grid (or some cells twice) has no rule')
        op = Attend(q, kk.expand(*q.shape[:-1], kk.shape[-1]), qcells, kcells, self.grids[qslot], _where(site), mix)
        slot = self._slot(op, [kslot], self.grids[qslot])
        self.attends.append((site, op))
        code = (q[..., None] * CODE + v.chan[..., :1, :]).expand(out)
        return self._settle(Tok(slot, (code.transpose(-1, -2) if transposed else code).contiguous()))

    # ------------------------------------------------------------------ running it

    def run(
        self, Y0: torch.Tensor, keeps: Sequence[Optional[torch.Tensor]], records: Sequence[list] = (), observe=None
    ) -> torch.Tensor:
        """The ``(B, K, H, W)`` initial labels through the program; the readout map. ``records``: per watched module,
        the softmax and attention calls it made in the forward (:class:`~._graph_tokens.SiteMode`). ``observe(map)``:
        the last map on each grid before the first op that leaves it (a stage's end), then the readout map."""
        for path, want, got in zip(self.watched, self.calls, records):
            if len(got) != want:
                raise ValueError(
                    f'model: {path} made {len(got)} softmax or attention calls in this forward; the graph route read '
                    f'{want} (a module called twice, or a forward that differs from the traced one)'
                )
        maps: List[Optional[torch.Tensor]] = [None] * self.slots
        maps[0] = Y0
        keeps = [  # a drop path over rows of parts of each sample: its kept rows as a mask of each sample's cells
            k if k is None or at is None else k.view(len(Y0), -1)[:, at[0]].view(len(Y0), 1, *at[1])
            for k, at in zip(keeps, self.keep_rows)
        ]
        seen = set()
        for fn, ins, out in self.ops:
            if isinstance(fn, _MeanOp):
                maps[out] = fn([(maps[s], None if k is None else keeps[k]) for s, k in ins])
            elif isinstance(fn, Attend):
                maps[out] = fn(maps[ins[0]], records[fn.site[0]][fn.site[1]])
            else:
                maps[out] = fn(*(maps[s] for s in ins))
                grid = maps[ins[0]].shape[-2:]
                if observe is not None and maps[out].shape[-2:] != grid and grid not in seen:
                    seen.add(grid)
                    observe(maps[ins[0]])
        if observe is not None:
            observe(maps[self.readout])
        return maps[self.readout]


def _constant(gm: fx.GraphModule, node: fx.Node) -> Callable[[], torch.Tensor]:
    """A node computed from the model's parameters and buffers alone, as a function that computes it now (a graph
    of its ancestors, sharing the model's tensors)."""
    if not isinstance(node, fx.Node):
        raise GraphRouteError('a conv whose kernel is no tensor of the graph')
    needed, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        if n.op == 'placeholder':
            raise GraphRouteError('a conv whose kernel depends on the input (a dynamic kernel) has no Table 9 rule')
        needed.add(n)
        stack.extend(a for a in _leaves((n.args, n.kwargs)) if isinstance(a, fx.Node))
    graph, env = fx.Graph(), {}
    for n in gm.graph.nodes:
        if n in needed:
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(env[node])
    return fx.GraphModule(gm, graph)


@dataclass
class _Pad:
    """A reflect / replicate / circular padding: the padded cells copy tokens, so the labels are padded alike."""

    pad: Tuple[int, ...]
    mode: str

    def __call__(self, Y: torch.Tensor) -> torch.Tensor:
        return F.pad(Y, self.pad, mode=self.mode)


def _pair_none(size):
    if size is None:
        return None
    return _pair(size) if not isinstance(size, (tuple, list)) or None not in size else tuple(size)


@dataclass(eq=False)
class _GroupMean:
    """Tokens pooled in groups: a ``(B, K, G, 1)`` label map, group ``g`` the mean label of the cells
    ``index[g]`` of the source map (Table 9's aggregation, Norm of the sum)."""

    index: torch.Tensor  # (G, k) cells of the source map

    def __call__(self, Y: torch.Tensor) -> torch.Tensor:
        return Y.flatten(2)[:, :, self.index.to(Y.device)].mean(-1).unsqueeze(-1)


class _MeanOp:
    """Eq. 11 on a sum of maps, and a concatenation's Norm of the sum: the mean of the parts' labels, a part whose
    drop path dropped a sample not counting for it (two parts, one from a drop path: exactly
    :func:`~shared_core.tl_align.residual_labels`)."""

    def __call__(self, parts) -> torch.Tensor:
        kept = [p for p in parts if p[1] is not None]
        if len(parts) == 2 and len(kept) <= 1:
            (a, ka), (b, kb) = parts
            short, branch, keep = (b, a, ka) if ka is not None else (a, b, kb)
            return residual_labels(short, branch, keep)
        ones = parts[0][0].new_ones(len(parts[0][0]), 1, 1, 1)
        weights = [ones if k is None else (k if k.dim() == 4 else k.view(-1, 1, 1, 1)).to(ones.dtype) for _, k in parts]
        num, den = sum(w * Y for w, (Y, _) in zip(weights, parts)), sum(weights)
        plain = sum(Y for Y, _ in parts) / len(parts)  # a sample whose every part was dropped: the plain mean
        return torch.where(den > 0, num / den.clamp_min(1.0), plain)


# ---------------------------------------------------------------------------------------------- the tracer


class GraphTracer(Tracer):
    """TL-Align on any conv net built from Table 9's operations, read off its fx graph (the module docstring has the
    rules). Its label state is a ``(B, K, H, W)`` map on the first stride >= 4 grid (``stride``: the mixer's patch
    size); the classifier reads the mean label of the head's global average pooling. The whole graph is one label
    program: there are no blocks to pick (``layers``) or residuals to drop (``residual=False``).

    ``input_size`` ``(C, H, W)``: the fake batch the graph's shapes are read from (default the model's
    ``pretrained_cfg`` input size); a label program of maps alone holds at any input size whose grid the stride
    tiles, one that follows tokens (windows, partitions, reshapes) is compiled again, once, for each other input
    size a forward has. ``pooled_outside``: the model's head pooling is off and its final map is average-pooled
    outside it (mmpretrain's ``TIMMBackbone`` with a ``GlobalAveragePooling`` neck): the readout is that map's mean
    label."""

    layout = 'map'
    attends = False
    why_no_attention = 'the graph route reads no class-token attention in a last block (it reads a global pooling)'
    grid_module = 'the model'
    whole_graph = True

    def __init__(self, model: nn.Module, input_size: Optional[Sequence[int]] = None, pooled_outside: bool = False):
        cfg = getattr(model, 'pretrained_cfg', None) or {}
        size = tuple(input_size or cfg.get('input_size') or (3, 224, 224))
        size = (size[0], *(-(-int(v) // 32) * 32 for v in size[1:]))  # a size the usual strides tile (299 -> 320)
        try:
            self.program = _Program(model, size, pooled_outside)
        except GraphRouteError as e:
            how = 'refuses' if e.decided else 'does not read'
            raise GraphRouteError(
                f"model: TL-Align's graph route {how} {type(model).__name__}: {e}", e.decided
            ) from None
        super().__init__(model)
        self.stride = self.program.stride
        self._channels, self._pooled_outside = size[0], pooled_outside
        self._programs = {tuple(size[1:]): self.program}

    def program_at(self, grid: Tuple[int, int]) -> _Program:
        """The label program for a forward on ``grid`` label cells: the compiled one, or where it follows tokens
        and was compiled at another input size, the program compiled at this one (kept for the next forward)."""
        if not self.program.sized:
            return self.program
        size = (grid[0] * self.stride, grid[1] * self.stride)
        program = self._programs.get(size)
        if program is None:
            try:
                program = _Program(self.model, (self._channels, *size), self._pooled_outside)
            except GraphRouteError as e:
                raise ValueError(f"x: TL-Align's graph route reads no label program at {size[0]}x{size[1]}: {e}") from e
            if (
                program.stride != self.stride
                or [id(m) for m in program.drop_paths] != [id(m) for m in self.program.drop_paths]
                or program.watched != self.program.watched
            ):
                raise ValueError(
                    f'x: at {size[0]}x{size[1]} the graph starts on another grid or has other drop paths or '
                    'attention modules than at the size it was compiled at'
                )
            self._programs[size] = program
        return program

    def blocks(self) -> Sequence[nn.Module]:
        """The drop paths of the graph (each keeps its samples in one capture)."""
        return self.program.drop_paths

    def drop_path(self, blk: nn.Module):
        return blk

    def watch_model(self, captures: Captures, handles: list) -> None:
        s = self.stride

        def grid(m, args):
            H, W = args[0].shape[-2:]
            if H % s or W % s:
                raise ValueError(f'x: a {H}x{W} input is no whole number of {s}x{s} label cells')
            captures.grid = (H // s, W // s)

        handles.append(self.model.register_forward_pre_hook(grid))
        captures.attention = [[] for _ in self.program.watched]
        if self.program.watched:
            mode = SiteMode(captures.attention)
            for i, path in enumerate(self.program.watched):
                mode.watch(self.model.get_submodule(path), i, handles)
            handles.append(mode)

    def propagate(self, captures, labels, layers=None, residual=True, observe=None):
        if layers is not None or not residual:
            raise ValueError('layers / residual: the graph route runs the whole graph; it has no blocks to pick')
        states = []
        Y = self.program_at(captures.grid).run(
            self.to_layout(labels, captures), [c.keep for c in captures], captures.attention, observe and states.append
        )
        for i, state in enumerate(states):  # (after the run: the maps are final by then)
            observe(i, self.to_rows(state).clone(), tuple(state.shape[-2:]))
        return self.to_rows(Y)
