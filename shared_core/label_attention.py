"""TL-Align's label attention as the token path runs it: the choice (a wrapper's ``fused=``, else the process's:
:func:`fused_label_attn`, :func:`set_fused_label_attn`, ``$TOKENAUG_FUSED_LABEL_ATTN``), the one backend object of
each wrapper that resolves it to a path once per device and dtype (:class:`LabelBackend`, :class:`LabelPath`), and
the paths: the labels riding in the token path's own attention as extra value columns (:func:`shared_attention`,
:class:`LabelColumns`; on the CPU an autograd function over PyTorch's fused CPU attention whose backward is the
plain attention's), through the Triton kernel, or in a label-only call (fused or a transient softmax).

The rule these compute is Eq. 9 of the TL-Align paper (:func:`shared_core.tl_align.attention_labels` is the
label-only form); this module holds only how it runs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import statistics
import time
import warnings
from dataclasses import dataclass, replace
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

__all__ = [
    'FUSED_ENV',
    'use_fused_label_attn',
    'set_fused_label_attn',
    'fused_label_attn',
    'use_label_kernel',
    'check_choice',
    'SHARED_PATHS',
    'SEPARATE_PATHS',
    'separate_path',
    'sdpa_labels',
    'LabelPath',
    'LabelBackend',
    'compute_dtype',
    'shared_attention',
    'LabelColumns',
]


# ----------------------------------------------------------------------------------------------
# The one switch: the label attention as a fused SDPA call or a transient softmax
# ----------------------------------------------------------------------------------------------

#: environment override: ``TOKENAUG_FUSED_LABEL_ATTN=1`` (always fused: an SDPA call), ``0`` (never), ``triton``
#: (the shared path through the Triton kernel, :mod:`shared_core.label_kernel`, on any device: on the CPU under
#: ``TRITON_INTERPRET=1``), ``labels`` (the token attention left to the model, the labels from the label-only
#: kernel beside it), ``auto`` (the fastest of those that passed their self-check, timed once per shape: the
#: default on CUDA where Triton imports); unset: by device and path
FUSED_ENV = 'TOKENAUG_FUSED_LABEL_ATTN'
#: what a choice may be: ``True`` / ``False`` / ``'triton'`` / ``'labels'`` (``None``: the default)
Choice = Union[bool, str, None]
#: the choices spelled as words
_WORDS = ('triton', 'labels', 'auto')


def _env_choice() -> Choice:
    value = os.environ.get(FUSED_ENV, '').strip().lower()
    if value == '':
        return None
    if value in _WORDS:
        return value
    if value in ('0', 'false'):
        return False
    if value in ('1', 'true'):
        return True
    raise ValueError(f'${FUSED_ENV}: expected 1, 0, triton, labels or auto (or unset), got {os.environ[FUSED_ENV]!r}')


def check_choice(name: str, enable: Choice) -> Choice:
    """``enable`` if it is a choice (``True``, ``False``, ``'triton'``, ``'labels'`` or ``'auto'`` in any case, as
    ``$TOKENAUG_FUSED_LABEL_ATTN`` takes them, or ``None``), else a ValueError naming ``name``."""
    if enable is None or isinstance(enable, bool):
        return enable
    if isinstance(enable, str) and enable.strip().lower() in _WORDS:
        return enable.strip().lower()
    raise ValueError(f"{name}: expected True, False, 'triton', 'labels', 'auto' or None (the default), got {enable!r}")


_FUSED: Choice = _env_choice()
#: whether Triton is installed (CUDA wheels of torch ship it), known without importing it
_TRITON = importlib.util.find_spec('triton') is not None
#: the innermost :func:`fused_label_attn` scope's choice: a plain global (read inside a compiled forward, dynamo
#: guards on it; torch 2.11's dynamo breaks the graph at a ``ContextVar.get`` in every block)
_FUSED_SCOPE: Choice = None


def set_fused_label_attn(enable: Choice) -> None:
    """Process-wide choice (as timm's ``set_fused_attn``): ``True`` (an SDPA call), ``False`` (a transient
    softmax), ``'triton'`` (the Triton kernel for the shared path), ``'labels'`` (the label-only kernel beside the
    model's own attention), or ``None`` for the default."""
    global _FUSED
    _FUSED = check_choice('enable', enable)


@contextlib.contextmanager
def fused_label_attn(enable: Choice):
    """The choice inside a ``with`` block (what a wrapper's ``fused=`` argument sets); ``None`` leaves it."""
    global _FUSED_SCOPE
    enable = check_choice('enable', enable)
    outer = _FUSED_SCOPE
    if enable is not None:
        _FUSED_SCOPE = enable
    try:
        yield
    finally:
        _FUSED_SCOPE = outer


def use_fused_label_attn(device: torch.device, shared: bool = False) -> bool:
    """Whether the label attention runs as a fused ``scaled_dot_product_attention`` call: the innermost
    :func:`fused_label_attn` scope, else :func:`set_fused_label_attn` / ``$TOKENAUG_FUSED_LABEL_ATTN``, else by
    device and path. ``shared``: the labels ride as extra value columns in the token path's own call
    (:class:`LabelColumns`): fused on every device (on the CPU too, PyTorch's fused CPU kernel with a few more
    columns costs less than materialising the attention once, ``bench/RESULTS.md``). A separate label-only call
    (the recomputing path): fused on accelerators, a transient softmax on the CPU (the fused CPU kernel is slower
    for the 1-wide values of the compact state)."""
    choice = _choice()
    if choice is not None:
        return bool(choice)
    return shared or torch.device(device).type != 'cpu'


def _choice() -> Choice:
    return _FUSED_SCOPE if _FUSED_SCOPE is not None else _FUSED


#: how a label-only call computes Eq. 9 (the recomputing path, TransMix): the label-only Triton kernel
#: (``'labels'``), a fused SDPA call with the labels as values (``'sdpa'``), or a transient softmax (``'softmax'``)
SEPARATE_PATHS = ('labels', 'sdpa', 'softmax')


def separate_path(device: torch.device) -> str:
    """How a label-only call runs now (:data:`SEPARATE_PATHS`): the label-only kernel where the choice is
    ``'labels'`` (inside a wrapper's forward: its backend's path), else :func:`use_fused_label_attn`'s."""
    if _choice() == 'labels':
        return 'labels'
    return 'sdpa' if use_fused_label_attn(device) else 'softmax'


def use_label_kernel(device: torch.device) -> bool:
    """Whether the shared path runs through the Triton kernel (:mod:`shared_core.label_kernel`): forced by the
    choice ``'triton'`` (any device: CPU tensors need ``TRITON_INTERPRET=1``), else by default on CUDA where
    Triton imports (an explicit ``True`` keeps the SDPA call with label columns, ``False`` the materialised
    attention)."""
    choice = _choice()
    if choice is not None:
        return choice == 'triton'
    return _TRITON and _KERNEL_FAILED is None and torch.device(device).type == 'cuda'


#: why the Triton kernel failed on this machine (its first launch), or ``None``: the default then goes back to the
#: SDPA label columns for the rest of the process, after one warning (a forced ``'triton'`` raises instead)
_KERNEL_FAILED: Optional[str] = None


def _kernel_failed(error: Exception) -> None:
    global _KERNEL_FAILED
    if _KERNEL_FAILED is None:
        _KERNEL_FAILED = f'{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ""}'
        warnings.warn(
            f'the Triton label-attention kernel failed here ({_KERNEL_FAILED}); TL-Align goes on with the SDPA label '
            f'columns (set {FUSED_ENV}=triton to see the error, =1 to choose the SDPA path)',
            RuntimeWarning,
            stacklevel=3,
        )


# ----------------------------------------------------------------------------------------------
# The backend: one wrapper's label-attention path, chosen once per device, dtype and process choice
# ----------------------------------------------------------------------------------------------

#: how the shared attention of timm ViTs carries the labels: ``'kernel'`` (the Triton kernel), ``'columns'`` (label
#: columns in the token path's fused SDPA call), ``'materialised'`` (the attention materialised once for both),
#: ``'apart'`` (no shared attention: the model's own, the labels in label-only calls beside it)
SHARED_PATHS = ('kernel', 'columns', 'materialised', 'apart')


@dataclass(frozen=True)
class LabelPath:
    """The label attention's path for one (device, dtype): ``shared`` (:data:`SHARED_PATHS`) for the shared
    attention of timm ViTs, ``separate`` (:data:`SEPARATE_PATHS`) for a label-only call (the recomputing path,
    TransMix); ``forced`` names a forced ``'triton'`` (honoured or refused, never replaced), else ``None``."""

    shared: str
    separate: str
    forced: Optional[str] = None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the attention of a forward on ``x`` computes in: autocast's where it is on, else ``x``'s."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def sdpa_labels(
    q: torch.Tensor,
    k: torch.Tensor,
    labels: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Eq. 9's head mean from one fused ``scaled_dot_product_attention`` call with the labels ``(B, T_k, K)`` as
    values (the attention never materialised): ``(B, T_q, K)``, ``q``/``k`` and the result in fp32."""
    v = labels.float().unsqueeze(1)
    # pad the (1- or 2-wide) label values to 8 columns: fp32 memory-efficient kernels need aligned head dims, and a
    # misaligned call falls back to the materialising math kernel
    width = v.shape[-1]
    v = F.pad(v, (0, -width % 8)).expand(-1, q.shape[1], -1, -1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    return out[..., :width].mean(1)


#: the label paths that run a Triton kernel (self-checked before they are timed)
_KERNELS = ('kernel', 'labels')
_LOG = logging.getLogger('tokenaug.label_attention')


@torch.compiler.disable
def time_label_paths(candidates, device: torch.device, dtype: torch.dtype, shape, repeats: int = 5) -> dict:
    """``{path: seconds}``: the median time of one block's attention forward and backward with its labels at
    ``shape`` ``(B, H, T, d)`` on each path (``'columns'`` the SDPA label columns, ``'kernel'`` the fused kernel,
    ``'labels'`` plain SDPA plus the label-only kernel, ``'sdpa'`` plain SDPA plus the label-only SDPA call), after
    two warm-up calls, ``repeats`` times interleaved (CUDA events on a GPU); ``None`` for a path that raised. About
    ``7 · len(candidates)`` block attentions: milliseconds at DeiT-S batch 128, once per shape."""
    from .label_kernel import label_attention, label_only_attention

    B, H, T, d = shape
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, B, H, T, d, generator=g).to(device, dtype).requires_grad_()
    grad = torch.randn(B, H, T, d, generator=g).to(device, dtype)
    labels = torch.rand(B, T, 1, generator=g).to(device)
    scale = d**-0.5

    def columns():
        out, _ = LabelColumns(labels, H, d, dtype).attend(qkv, scale)
        out.backward(grad)

    def kernel():
        out, _, _ = label_attention(*qkv.unbind(0), labels, scale)
        out.backward(grad)

    def apart(label_call):
        def run():
            q, k, v = qkv.unbind(0)
            F.scaled_dot_product_attention(q, k, v, scale=scale).backward(grad)
            label_call(q.detach(), k.detach())

        return run

    runs = {
        'columns': columns,
        'kernel': kernel,
        'labels': apart(lambda q, k: label_only_attention(q, k, labels, scale)),
        'sdpa': apart(lambda q, k: sdpa_labels(q.float(), k.float(), labels, scale=scale)),
    }
    cuda = device.type == 'cuda'
    samples: dict = {c: [] for c in candidates}
    for i in range(2 + repeats):
        for c in candidates:
            if samples[c] is None:
                continue
            try:
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    runs[c]()
                    end.record()
                    end.synchronize()
                    elapsed = start.elapsed_time(end) / 1e3
                else:
                    t0 = time.perf_counter()
                    runs[c]()
                    elapsed = time.perf_counter() - t0
            except Exception:  # the path does not run here: it is not chosen
                samples[c] = None
                continue
            qkv.grad = None
            if i >= 2:
                samples[c].append(elapsed)
    return {c: (statistics.median(t) if t else None) for c, t in samples.items()}


class LabelBackend:
    """The label-attention backend of one wrapper (``TLAlign(fused=...)``, ``TransMix``, mm's classifiers): its
    choice (the wrapper's ``fused``, else the process's: the innermost :func:`fused_label_attn` scope,
    :func:`set_fused_label_attn`, ``$TOKENAUG_FUSED_LABEL_ATTN``) resolved to a :class:`LabelPath` once per device,
    dtype and process choice (:meth:`path`), at the first forward that meets them; the blocks read that path, never
    the choice. A kernel that fails to build or launch moves this backend (and the process's default) to the SDPA
    label columns after one warning (:meth:`kernel_failed`); a forced one raises instead."""

    def __init__(self, choice: Choice = None, name: str = 'fused', head_dims: Sequence[int] = ()):
        self.choice, self.name = check_choice(name, choice), name
        #: the head dims the model's attention runs at, which a kernel's self-check covers (none known: 64)
        self.head_dims = tuple(sorted(set(head_dims))) or (64,)
        self._paths: dict = {}
        self._auto_of: dict = {}

    def _source(self, choice: Choice) -> str:
        """How the choice was made, for a message: the wrapper's argument or the process's."""
        if self.choice is not None:
            return f'{self.name}={choice!r}'
        return f'{choice!r} (${FUSED_ENV} or set_fused_label_attn)'

    def _forced(self, choice: Choice) -> Optional[str]:
        return self._source(choice) if choice == 'triton' else None

    def path(self, device, dtype: torch.dtype, shape: Optional[Tuple[int, int, int, int]] = None, shared_ok=True):
        """The :class:`LabelPath` for tensors of ``dtype`` on ``device`` (a dict lookup after the first call).
        ``'auto'`` (the default on CUDA where Triton imports) times the paths once per ``shape`` ``(B, H, T, d)`` of
        the model's attention (:meth:`_auto`; ``shared_ok``: whether the shared attention of timm ViTs can run)."""
        choice = self.choice_now()
        base = (torch.device(device), dtype, choice)
        auto = self._auto_of.get(base)
        if auto is None:  # decided once: 'auto', or the default where a kernel may run
            auto = self._auto_of[base] = choice == 'auto' or (choice is None and use_label_kernel(base[0]))
        device = base[0]
        key = base + ((shape, bool(shared_ok)) if auto else ())
        path = self._paths.get(key)
        if path is None:
            if auto:
                path = self._auto(device, dtype, shape, shared_ok)
            else:
                if choice is None:  # the defaults where no kernel runs
                    shared, separate = 'columns', 'sdpa' if use_fused_label_attn(device) else 'softmax'
                elif choice == 'labels':
                    shared, separate = 'apart', 'labels'
                else:
                    shared = 'kernel' if choice == 'triton' else 'columns' if choice else 'materialised'
                    separate = 'sdpa' if choice else 'softmax'
                path = self._checked(LabelPath(shared, separate, self._forced(choice)), device, dtype, choice)
            self._paths[key] = path
        return path

    def _self_check_fails(self, kind: str, device: torch.device, dtype: torch.dtype) -> Optional[Tuple[str, str]]:
        """Where the ``kind`` kernel fails its self-check here at one of the model's head dims: what failed."""
        from .label_kernel import self_check

        for head_dim in self.head_dims:
            failed = self_check(kind, device, dtype, head_dim)
            if failed is not None:
                what = 'the Triton label kernel' if kind == 'fused' else 'the label-only Triton kernel'
                where = f'on {device} in {str(dtype).removeprefix("torch.")} at head dim {head_dim}'
                return f'{what} failed its self-check {where}', failed
        return None

    def _checked(self, path: LabelPath, device: torch.device, dtype: torch.dtype, choice: Choice) -> LabelPath:
        """``path`` once each kernel it runs has passed its self-check here (:func:`shared_core.label_kernel.
        self_check`, for every head dim of the model); a chosen kernel (``'triton'``, ``'labels'``) that fails it
        raises."""
        for kind, runs in (('fused', path.shared == 'kernel'), ('labels', path.separate == 'labels')):
            failed = self._self_check_fails(kind, device, dtype) if runs else None
            if failed is not None:
                raise RuntimeError(f'{self._source(choice)}: {failed[0]}: {failed[1]}')
        return path

    def _auto(self, device: torch.device, dtype: torch.dtype, shape, shared_ok: bool) -> LabelPath:
        """The fastest path that passed its self-check, timed on the model's attention shape (:func:
        `time_label_paths`: forward and backward of one block's attention with its labels, interleaved repeats,
        medians); logged once. Candidates: the SDPA label columns, the fused kernel and the label-only kernel where
        the shared attention runs, else the label-only SDPA call and the label-only kernel. A kernel that fails its
        self-check is left out after one warning naming what differed. Without a shape (TransMix's one call, mm's
        classifiers) nothing is timed: the SDPA label call."""
        paths = {
            'columns': LabelPath('columns', 'sdpa'),
            'kernel': LabelPath('kernel', 'sdpa'),
            'labels': LabelPath('apart', 'labels'),
            'sdpa': LabelPath('columns', 'sdpa'),
        }
        if shape is None:
            return paths['sdpa']
        candidates = ['columns', 'kernel', 'labels'] if shared_ok else ['sdpa', 'labels']
        tested = []
        for c in candidates:
            failed = self._self_check_fails({'kernel': 'fused'}.get(c, c), device, dtype) if c in _KERNELS else None
            if failed is None:
                tested.append(c)
            else:
                warnings.warn(
                    f'{failed[0]} ({failed[1]}); TL-Align leaves it out and times the other label paths',
                    RuntimeWarning,
                    stacklevel=4,
                )
        times = {c: t for c, t in time_label_paths(tested, device, dtype, shape).items() if t is not None}
        best = min(times, key=times.get) if times else candidates[0]
        spelled = ', '.join(f'{c} {1e3 * t:.3f} ms' for c, t in times.items())
        _LOG.info(
            'TL-Align label attention on %s in %s at (B, H, T, d) = %s: %s (%s)',
            device,
            str(dtype).removeprefix('torch.'),
            tuple(shape),
            best,
            spelled,
        )
        return paths[best]

    @property
    def resolved(self) -> dict:
        """The paths resolved so far: ``{(device, dtype, choice[, shape, shared_ok]): LabelPath}`` (what ``auto``
        picked, for a benchmark's table)."""
        return dict(self._paths)

    def choice_now(self) -> Choice:
        """The choice in force: the wrapper's, else the process's."""
        return self.choice if self.choice is not None else _choice()

    def refuse_unrun_kernel(self, why_not: Optional[str]) -> None:
        """A forced ``'triton'`` where the kernel would not run (``why_not``; ``None``: it runs): a ValueError
        naming the choice and why."""
        forced = self._forced(self.choice_now())
        if forced is not None and why_not is not None:
            raise ValueError(f'{forced}: the Triton label kernel does not run here: {why_not}')

    @contextlib.contextmanager
    def applied(self, path: LabelPath):
        """The label-only calls inside (:func:`shared_core.tl_align.attention_labels` without ``fused``) follow
        ``path.separate``."""
        with fused_label_attn({'labels': 'labels', 'sdpa': True, 'softmax': False}[path.separate]):
            yield

    def kernel_failed(self, path: LabelPath, error: Exception) -> None:
        """The kernel did not build or launch (:func:`_fail`); this backend then goes on with the SDPA label
        columns where it had chosen the kernel."""
        _fail(path, error)
        for key, p in list(self._paths.items()):
            if p == path:
                self._paths[key] = replace(p, shared='columns')


def _fail(path: Optional[LabelPath], error: Exception) -> None:
    """The kernel did not build or launch: a forced one (or one inside a compiled graph) raises the error;
    otherwise one warning, and the process's default goes on with the SDPA label columns."""
    if (path is not None and path.forced is not None) or torch.compiler.is_compiling():
        raise error
    _kernel_failed(error)


def shared_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    labels: torch.Tensor,
    scale: float,
    attn_mask: Optional[torch.Tensor] = None,
    fused: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The token path's attention and Eq. 9's label branch from one attention: ``(out, branch)`` with ``out``
    what ``scaled_dot_product_attention(q, k, v, attn_mask, scale=scale)`` gives the token path (with its
    gradients) and ``branch`` ``(B, T, K)`` fp32, without gradients: ``mean_h softmax(q kᵀ · scale + mask) ·
    labels`` (``labels`` ``(B, T, K)``, no gradients).

    ``fused`` (default :func:`use_fused_label_attn` with ``shared``: fused on every device): one fused call with
    the labels as extra value columns
    (:class:`LabelColumns`, for one call; a model's forward keeps one across its blocks). Unfused: the attention
    materialised once (its logits in fp32) for both paths. No attention dropout here (callers keep the
    recomputing path then).
    """
    if fused is None:
        fused = use_fused_label_attn(q.device, shared=True)
    if fused:
        columns = LabelColumns(labels, q.shape[1], q.shape[-1], v.dtype)
        out, heads = columns.attend(torch.stack([q, k, v]), scale, attn_mask)
        return out, heads.div_(q.shape[1])
    with torch.autocast(device_type=q.device.type, enabled=False):
        logits = (q.float() * scale) @ k.float().transpose(-2, -1)
        if attn_mask is not None:
            logits = (
                logits.masked_fill(~attn_mask, float('-inf'))
                if attn_mask.dtype == torch.bool
                else logits + attn_mask.float()
            )
        attn = logits.softmax(-1)
        with torch.no_grad():
            branch = attn.mean(1) @ labels.float()
    return attn.to(v.dtype) @ v, branch


_ATEN = torch.ops.aten
#: PyTorch's fused CPU attention and its backward (what ``scaled_dot_product_attention`` runs on the CPU)
_CPU_FLASH = all(
    hasattr(_ATEN, n)
    for n in ('_scaled_dot_product_flash_attention_for_cpu', '_scaled_dot_product_flash_attention_for_cpu_backward')
)


class _CPUSharedAttention(torch.autograd.Function):
    """The CPU's fused attention over ``[q | 0]``, ``[k | 0]``, ``[v | labels]`` whose backward is the plain
    attention's: the zero columns leave the logits, the softmax and its log-sum-exp as they are, and the label
    columns carry no gradient, so the backward runs PyTorch's own CPU attention backward on ``q, k, v`` at their
    head dim with the forward's log-sum-exp (the gradients are the plain ``scaled_dot_product_attention``'s,
    bit for bit on this machine) instead of at the wider one."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, ext: torch.Tensor, scale: float, width: int):
        q, k, v = torch.cat([qkv, ext], -1).unbind(0)
        out, lse = _ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
        d = qkv.shape[-1]  # one op takes the token columns, the label columns and the padding (maybe 0) apart
        tokens, labels, _ = out.split_with_sizes([d, width, out.shape[-1] - d - width], -1)
        ctx.mark_non_differentiable(labels)
        ctx.set_materialize_grads(False)  # no zeros for the label columns' (absent) gradient
        ctx.save_for_backward(*qkv.unbind(0), tokens, lse)
        ctx.scale = scale
        return tokens, labels

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _):
        q, k, v, out, lse = ctx.saved_tensors
        grads = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, False, scale=ctx.scale
        )
        return torch.stack(grads), None, None, None


def _cpu_shared_attention(qkv: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> bool:
    """Whether :class:`_CPUSharedAttention` applies: eager (a compiled graph gets the plain call, which inductor
    optimises itself), on the CPU, no mask, a dtype the CPU kernel takes."""
    return (
        _CPU_FLASH
        and attn_mask is None
        and qkv.device.type == 'cpu'
        and qkv.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and not torch.compiler.is_compiling()
    )


class LabelColumns:
    """TL-Align's label state as extra value columns of the token path's own fused attention, for one forward:
    a buffer ``(3, B, 1, T, W)`` holds zeros for ``q`` and ``k`` and the label columns for ``v``, so one
    concatenation with a block's stacked ``qkv`` ``(3, B, H, T, d)`` gives ``[q | 0]``, ``[k | 0]`` and ``[v |
    labels]`` (kernels want equal head dims; ``d + W`` a multiple of 8), and the state is updated in place after
    each block (Eq. 11).

    The columns hold ``Z = c · Y``, the state scaled by a power of two ``c`` per sample (exact in floating point):
    Eq. 11's ``Y ← (Y + Σ_h A_h Y / H) / 2`` is then one in-place ``Z ← Z + Σ_h A_h Z / H`` with ``c`` doubled (a
    sample whose branch stochastic depth dropped keeps ``Z`` and ``c``), and :attr:`state` is ``Z / c``.

    fp32: ``Z`` is the buffer's value columns themselves. A lower precision (``dtype``, the dtype ``qkv`` has
    under autocast): ``Z`` stays fp32 and travels as two columns per label, ``hi`` (rounded) and ``lo`` (its
    rounding error), whose sum keeps fp32-like precision; the heads are summed in fp32. The label columns carry
    no gradient (the buffer does not require one), so the gradients of ``qkv`` are the plain attention's.

    ``path`` (the wrapper's :class:`LabelPath`; default the columns) with ``shared='kernel'``: no columns; ``Z``
    ``(B, T, K)`` fp32 is read as it is by the Triton kernel of :mod:`shared_core.label_kernel`, which computes the
    attention at the plain head dim and ``Σ_h A_h Z`` beside it (a block given a mask: the attention materialised
    once, unless the kernel was forced). A kernel that fails to build or launch: ``backend`` (the wrapper's
    :class:`LabelBackend`) is told, and this forward goes on with the materialised attention.
    """

    def __init__(
        self,
        labels: torch.Tensor,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        path: Optional[LabelPath] = None,
        backend: Optional[LabelBackend] = None,
    ):
        labels = labels.float()
        if labels.requires_grad:
            labels = labels.detach()
        B, T, K = labels.shape
        kernel = path is not None and path.shared == 'kernel'
        self.num_heads, self.head_dim, self.kernel, self.path, self.backend = num_heads, head_dim, kernel, path, backend
        self.scale: Union[float, torch.Tensor] = 1.0  # c: a float while every sample doubles, else (B, 1, 1)
        if kernel:  # Z read by the Triton kernel as it is, fp32: no columns to write
            self.split, self.width = False, K
            self.z = labels.clone(memory_format=torch.contiguous_format)
            return
        self.split = dtype != torch.float32
        self.width = 2 * K if self.split else K
        self.buf = labels.new_zeros(3, B, 1, T, self.width + (-(head_dim + self.width) % 8), dtype=dtype)
        self.ext = self.buf.expand(3, B, num_heads, T, self.buf.shape[-1])
        cols = self.buf[2, :, 0]
        if self.split:
            self.z = labels.clone()
            self._hi, self._lo = cols[..., :K], cols[..., K : 2 * K]
            self._write()
        else:
            self.z = cols[..., :K]
            self.z.copy_(labels)

    @property
    def state(self) -> torch.Tensor:
        """The label state ``Y = Z / c`` ``(B, T, K)`` fp32."""
        return self.z / self.scale

    def _write(self) -> None:
        self._hi.copy_(self.z)
        # in fp32, rounded once as it is written; compiled: a copy (dynamo breaks the graph at an ``out=`` view,
        # and inductor fuses the two), eager: one op
        if torch.compiler.is_compiling():
            self._lo.copy_(self.z - self._hi)
        else:
            torch.sub(self.z, self._hi, out=self._lo)

    def attend(
        self, qkv: torch.Tensor, scale: float, attn_mask: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(out, heads)``: the token path's ``scaled_dot_product_attention(q, k, v, attn_mask, scale=scale)``
        ``(B, H, T, d)`` for ``q, k, v = qkv.unbind(0)``, and ``Σ_h softmax(q kᵀ · scale + mask) · Z`` ``(B, T, K)``
        fp32 without gradient (for :meth:`update`)."""
        d = self.head_dim
        if self.kernel:
            q, k, v = qkv.unbind(0)
            if attn_mask is None:  # one Triton kernel: the labels at one multiply-add per probability
                from .label_kernel import label_attention

                try:
                    out, _, heads = label_attention(q, k, v, self.z, scale)
                    return out, heads
                except ValueError:
                    raise
                except Exception as e:  # the kernel does not build or launch here: warn once, go on without it
                    if self.backend is not None:
                        self.backend.kernel_failed(self.path, e)
                    else:
                        _fail(self.path, e)
            elif self.path.forced is not None:  # a mask: a forced kernel is refused, never replaced
                raise ValueError(
                    f'{self.path.forced}: the Triton label kernel does not run here: the block is given an attention '
                    'mask, which the kernel does not take'
                )
            out, branch = shared_attention(q, k, v, self.z, scale, attn_mask, fused=False)
            return out, branch.mul_(self.num_heads)
        if _cpu_shared_attention(qkv, attn_mask):  # the backward at the head dim (the plain one)
            out, lab = _CPUSharedAttention.apply(qkv, self.ext, scale, self.width)
        else:
            q, k, v = torch.cat([qkv, self.ext], -1).unbind(0)
            wide = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
            # two slices, not one split: the token slice's backward is one op (a split's: two zeros and a cat)
            out, lab = wide[..., :d], wide[..., d : d + self.width]
        with torch.no_grad():
            if self.split:  # the heads and the hi + lo pair summed in fp32
                heads = lab.unflatten(-1, (2, self.width // 2)).sum((1, 3), dtype=torch.float32)
            else:
                heads = lab.sum(1)
        return out, heads

    def update(self, heads: torch.Tensor, keep: Optional[torch.Tensor] = None, residual: bool = True) -> None:
        """Eq. 11 with the head mean, ``Y ← Norm(Y + Σ_h A_h Y / H)`` (``residual=False``: ``Y ← Σ_h A_h Y / H``),
        for the samples whose branch ran (``keep`` (B,) bool; the others keep their labels exactly)."""
        H = self.num_heads
        with torch.no_grad():
            if not residual:  # Z ← Σ_h A_h Z / H, c unchanged
                new = heads.div_(H)
                self.z.copy_(torch.where(keep.view(-1, 1, 1), new, self.z) if keep is not None else new)
            elif keep is None:
                self.z.add_(heads, alpha=1.0 / H)
                self.scale = self.scale * 2.0
            else:
                kept = keep.view(-1, 1, 1).float()
                self.z.addcmul_(heads, kept, value=1.0 / H)
                self.scale = self.scale * (kept + 1.0)
            if self.split:
                self._write()
