"""TL-Align's label attention as Triton kernels, two of them.

- :func:`label_attention`: inside one fused attention forward, a flash-attention kernel at the token path's own
  head dim that also accumulates, per query row, ``Σ_h P_h · Y`` (the labels ``Y`` detached, fp32), and a
  ``torch.library`` custom op around it (``tokenaug::label_attention``, with a fake implementation, so
  ``torch.compile`` keeps one graph) whose backward is the plain attention's.
- :func:`label_only_attention` (``fused='labels'``): the labels alone, beside the token path's own attention call,
  which it leaves to the model (PyTorch picks cuDNN, flash or efficient as it would without TL-Align): a
  forward-only kernel with its own online max over (sample × head, query tile) programs, no ``P · V``, nothing
  kept for autograd; the heads summed by atomic adds (``tokenaug::label_only_attention``).

Why the labels cost one multiply-add per probability: the kernel computes each block of probabilities ``P = exp(S
- m)`` once, in fp32, for ``P · V``; the same unrounded ``P`` times the block's label rows is added into a
second accumulator that the online softmax rescales with the same running max as the output's, and both are
divided by the same row sum at the end. No wider head dim (the ``[v | labels]`` columns of the SDPA path pad 64
to 72 and kernels then run 128-wide tiles), no concatenation, no materialised attention. The labels carry no
gradient, so the backward is the plain attention's, fed the forward's output and log-sum-exp: PyTorch's own flash
attention backward (CUDA, fp16/bf16; the CPU's fused backward on the CPU), else the attention recomputed in fp32
and its backward written out.

Where it runs: :func:`shared_core.label_attention.use_label_kernel` (CUDA with Triton importable, or forced by
``TOKENAUG_FUSED_LABEL_ATTN=triton``; on the CPU the kernel runs only under Triton's interpreter,
``TRITON_INTERPRET=1``, which is how the tests check it on machines without a GPU).
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ['label_attention', 'label_only_attention', 'self_check', 'interpreting']

_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2


def interpreting() -> bool:
    """Whether Triton's interpreter runs kernels (``TRITON_INTERPRET=1``): kernels then take CPU tensors."""
    return os.environ.get('TRITON_INTERPRET', '0') not in ('', '0', 'false')


@functools.lru_cache(maxsize=None)
def _kernel():
    """The Triton kernel, compiled on first use (Triton imported only then)."""
    import triton
    import triton.language as tl

    @triton.jit
    def label_attention_fwd(
        Q, K, V, Y, OUT, LSE, HEADS,
        sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
        syb, syt, sob, soh, sot, slb, slh, shb, sht,
        H, T, qk_scale,
        D: tl.constexpr, KY: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        # one program: BLOCK_M query rows of one sample, every head (the labels summed over heads in place)
        pid_m = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_k = tl.arange(0, BLOCK_K)
        row_ok = offs_m < T
        d_ok = offs_d < D
        k_ok = offs_k < KY
        heads = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for h in range(H):
            q = tl.load(
                Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            m_i = tl.full([BLOCK_M], float('-inf'), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            acc_y = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
            for start_n in range(0, T, BLOCK_N):
                offs_n = start_n + tl.arange(0, BLOCK_N)
                col_ok = offs_n < T
                kt = tl.load(
                    K + b * skb + h * skh + offs_n[None, :] * skt + offs_d[:, None],
                    mask=col_ok[None, :] & d_ok[:, None],
                    other=0.0,
                )
                if DOT_F32:  # the interpreter: its 16-bit dots are wrong; the same products, exact in fp32
                    s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision='ieee') * qk_scale
                else:
                    s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # log2 units
                s = tl.where(col_ok[None, :], s, float('-inf'))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.math.exp2(s - m_new[:, None])  # fp32, unrounded: the labels' probabilities
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(
                    V + b * svb + h * svh + offs_n[:, None] * svt + offs_d[None, :],
                    mask=col_ok[:, None] & d_ok[None, :],
                    other=0.0,
                )
                if DOT_F32:
                    pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision='ieee')
                else:
                    pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                acc = acc * alpha[:, None] + pv
                y = tl.load(
                    Y + b * syb + offs_n[:, None] * syt + offs_k[None, :],
                    mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                if BLOCK_K == 1:  # the compact state: one multiply-add per probability
                    acc_y = acc_y * alpha[:, None] + tl.sum(p * tl.reshape(y, [1, BLOCK_N]), 1)[:, None]
                else:
                    acc_y = acc_y * alpha[:, None] + tl.dot(p, y, input_precision='ieee')
                m_i = m_new
            inv = 1.0 / l_i
            tl.store(
                OUT + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :],
                (acc * inv[:, None]).to(OUT.dtype.element_ty),
                mask=row_ok[:, None] & d_ok[None, :],
            )
            tl.store(LSE + b * slb + h * slh + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=row_ok)
            heads += acc_y * inv[:, None]
        tl.store(
            HEADS + b * shb + offs_m[:, None] * sht + offs_k[None, :],
            heads,
            mask=row_ok[:, None] & k_ok[None, :],
        )

    return label_attention_fwd


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _blocks(T: int, D: int, device: torch.device) -> Tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): small tiles under the interpreter (numpy per tile), flash's
    tiles on a GPU (head dims up to 64: 128 x 64; wider: 64 x 64)."""
    if device.type != 'cuda':
        return 32, 32, 4, 1
    if D <= 64:
        return 128, 64, 4, 3
    return 64, 64, 4, 2


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, labels: torch.Tensor) -> None:
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f'q, k, v: expected equal (B, H, T, d) shapes, got {tuple(q.shape)}, {tuple(k.shape)}, '
                         f'{tuple(v.shape)}')  # fmt: skip
    B, _, T, _ = q.shape
    if labels.dim() != 3 or labels.shape[:2] != (B, T) or labels.dtype != torch.float32:
        raise ValueError(f'labels: expected (B, T, K) = ({B}, {T}, K) fp32, got {tuple(labels.shape)} {labels.dtype}')
    if q.device.type == 'cpu' and not interpreting():
        raise RuntimeError(
            "the Triton label-attention kernel runs on CUDA tensors, or on CPU tensors under Triton's interpreter "
            '(TRITON_INTERPRET=1, set before Triton is imported)'
        )


def _forward(q, k, v, labels, scale: float):
    """The kernel's launch: ``(out (B, H, T, d) laid out as (B, T, H, d), lse (B, H, T) fp32, heads (B, T, K)
    fp32 = Σ_h P_h · labels)``."""
    _check(q, k, v, labels)
    B, H, T, D = q.shape
    KY = labels.shape[-1]
    # the last dims contiguous (a stacked qkv's views are); the output in flash's layout, so that the caller's
    # transpose(1, 2).reshape(B, T, H * d) is a view
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    labels = labels if labels.stride(-1) == 1 else labels.contiguous()
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    heads = torch.empty(B, T, KY, dtype=torch.float32, device=q.device)
    BM, BN, warps, stages = _blocks(T, D, q.device)
    BK = 1 if KY == 1 else max(16, _next_pow2(KY))
    precision = 'ieee' if q.dtype == torch.float32 else 'tf32'
    grid = (-(-T // BM), B)  # ceil(T / BM) query tiles per sample
    _kernel()[grid](
        q, k, v, labels, out, lse, heads,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), labels.stride(0), labels.stride(1),
        out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), heads.stride(0), heads.stride(1),
        H, T, scale * _LOG2E,
        D=D, KY=KY, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=max(16, _next_pow2(D)), BLOCK_K=BK, PRECISION=precision,
        DOT_F32=q.device.type != 'cuda',
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out, lse, heads


# ----------------------------------------------------------------------------------------------
# The custom ops: the forward (kernel) and the plain attention's backward, one graph under torch.compile
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op('tokenaug::label_attention', mutates_args=())
def _label_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, labels: torch.Tensor, scale: float
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, labels, scale)


@_label_attention_op.register_fake
def _(q, k, v, labels, scale):
    B, H, T, D = q.shape
    out = q.new_empty(B, T, H, D).transpose(1, 2)
    return out, q.new_empty(B, H, T, dtype=torch.float32), q.new_empty(B, T, labels.shape[-1], dtype=torch.float32)


def _flash_backward_applies(q: torch.Tensor) -> bool:
    D = q.shape[-1]
    return q.device.type == 'cuda' and q.dtype in (torch.float16, torch.bfloat16) and D % 8 == 0 and D <= 256


@torch.library.custom_op('tokenaug::label_attention_backward', mutates_args=())
def _label_attention_backward_op(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    aten = torch.ops.aten
    if _flash_backward_applies(q):  # flash attention's backward with the forward's output and log-sum-exp
        T = q.shape[2]
        nothing = torch.empty((), dtype=torch.long, device=q.device)
        try:
            return tuple(
                aten._scaled_dot_product_flash_attention_backward(
                    grad, q, k, v, out, lse, None, None, T, T, 0.0, False, nothing, nothing, scale=scale
                )
            )
        except RuntimeError as e:  # not on this build or device: the recomputed backward, after one warning
            _flash_backward_failed(e)
            return _recomputed_backward(grad, q, k, v, scale)
    if q.device.type == 'cpu':  # the CPU's fused backward (what SDPA's CPU backward runs)
        return tuple(
            aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, False, scale=scale)
        )
    return _recomputed_backward(grad, q, k, v, scale)  # fp32 or an odd head dim on CUDA


_FLASH_BACKWARD_WARNED = False


def _flash_backward_failed(error: Exception) -> None:
    global _FLASH_BACKWARD_WARNED
    if not _FLASH_BACKWARD_WARNED:
        _FLASH_BACKWARD_WARNED = True
        warnings.warn(
            f"PyTorch's flash attention backward refused the label kernel's output ({type(error).__name__}: "
            f'{str(error).splitlines()[0] if str(error) else ""}); the backward recomputes the attention instead',
            RuntimeWarning,
            stacklevel=2,
        )


def _recomputed_backward(grad, q, k, v, scale: float):
    """The attention's backward written out (a custom op runs below autograd, so no autograd here): ``P`` recomputed
    in fp32, ``dV = Pᵀ dO``, ``dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O))``, ``dQ = dS K · scale``, ``dK = dSᵀ Q · scale``;
    the gradients in the inputs' dtypes."""
    qf, kf, vf, g = q.float(), k.float(), v.float(), grad.float()
    p = torch.softmax((qf @ kf.transpose(-1, -2)) * scale, dim=-1)
    dv = p.transpose(-1, -2) @ g
    dp = g @ vf.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ qf) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@_label_attention_backward_op.register_fake
def _(grad, q, k, v, out, lse, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, _, scale = inputs
    out, lse, _ = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale = scale
    ctx.mark_non_differentiable(output[1], output[2])


def _backward(ctx, grad_out, _grad_lse, _grad_heads):
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None, None
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
    dq, dk, dv = _label_attention_backward_op(grad_out, q, k, v, out, lse, ctx.scale)
    return dq, dk, dv, None, None


torch.library.register_autograd('tokenaug::label_attention', _backward, setup_context=_setup_context)


def label_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, labels: torch.Tensor, scale: float
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, lse, heads)`` for ``q, k, v`` ``(B, H, T, d)`` and detached ``labels`` ``(B, T, K)`` fp32:
    ``out`` = ``scaled_dot_product_attention(q, k, v, scale=scale)`` (with its gradients), ``lse`` ``(B, H, T)``
    fp32 the rows' log-sum-exp of ``q kᵀ · scale``, ``heads`` ``(B, T, K)`` fp32 = ``Σ_h softmax(q kᵀ · scale)_h
    · labels`` (no gradient). One Triton kernel (:mod:`shared_core.label_kernel`)."""
    if labels.requires_grad:
        labels = labels.detach()
    return _label_attention_op(q, k, v, labels, float(scale))


# ----------------------------------------------------------------------------------------------
# The label-only kernel: Eq. 9 beside the token path's own attention call, forward only
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _label_only_kernel():
    """The label-only Triton kernel, compiled on first use."""
    import triton
    import triton.language as tl

    @triton.jit
    def label_only_fwd(
        Q, K, Y, BIAS, HEADS,
        sqb, sqh, sqt, skb, skh, skt, syb, syt, sbb, sbh, sbm, sbn, shb, sht,
        H, TQ, TK, qk_scale,
        D: tl.constexpr, KY: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        # one program: BLOCK_M query rows of one (sample, head); its share of Σ_h added into HEADS atomically
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // H, bh % H
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_k = tl.arange(0, BLOCK_K)
        row_ok = offs_m < TQ
        d_ok = offs_d < D
        k_ok = offs_k < KY
        q = tl.load(
            Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_M], float('-inf'), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc_y = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for start_n in range(0, TK, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            col_ok = offs_n < TK
            kt = tl.load(
                K + b * skb + h * skh + offs_n[None, :] * skt + offs_d[:, None],
                mask=col_ok[None, :] & d_ok[:, None],
                other=0.0,
            )
            if DOT_F32:  # the interpreter: its 16-bit dots are wrong; the same products, exact in fp32
                s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision='ieee') * qk_scale
            else:
                s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # log2 units
            if HAS_BIAS:  # an additive bias (log2 units), broadcast by its strides
                bias = tl.load(
                    BIAS + b * sbb + h * sbh + offs_m[:, None] * sbm + offs_n[None, :] * sbn,
                    mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0,
                )
                s += bias * 1.4426950408889634
            s = tl.where(col_ok[None, :], s, float('-inf'))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float('-inf'), 0.0, m_new)  # a row masked so far: no NaN
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            y = tl.load(
                Y + b * syb + offs_n[:, None] * syt + offs_k[None, :],
                mask=col_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            if BLOCK_K == 1:  # the compact state: one multiply-add per probability
                acc_y = acc_y * alpha[:, None] + tl.sum(p * tl.reshape(y, [1, BLOCK_N]), 1)[:, None]
            else:
                acc_y = acc_y * alpha[:, None] + tl.dot(p, y, input_precision='ieee')
            m_i = m_new
        tl.atomic_add(
            HEADS + b * shb + offs_m[:, None] * sht + offs_k[None, :],
            acc_y / l_i[:, None],
            mask=row_ok[:, None] & k_ok[None, :],
        )

    return label_only_fwd


def _label_only_forward(q, k, labels, bias, scale: float):
    """The label-only kernel's launch: ``Σ_h softmax(q_h k_hᵀ · scale + bias) · labels`` ``(B, T_q, K)`` fp32."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f'q, k: expected (B, H, T_q, d) and (B, H, T_k, d), got {tuple(q.shape)}, {tuple(k.shape)}')
    B, H, TQ, D = q.shape
    TK = k.shape[2]
    if labels.dim() != 3 or labels.shape[:2] != (B, TK) or labels.dtype != torch.float32:
        raise ValueError(
            f'labels: expected (B, T_k, K) = ({B}, {TK}, K) fp32, got {tuple(labels.shape)} {labels.dtype}'
        )
    if q.device.type == 'cpu' and not interpreting():
        raise RuntimeError(
            "the Triton label-only kernel runs on CUDA tensors, or on CPU tensors under Triton's interpreter "
            '(TRITON_INTERPRET=1, set before Triton is imported)'
        )
    q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
    labels = labels if labels.stride(-1) == 1 else labels.contiguous()
    KY = labels.shape[-1]
    heads = torch.zeros(B, TQ, KY, dtype=torch.float32, device=q.device)
    if bias is None:
        bias_t, strides = heads, (0, 0, 0, 0)  # not read
    else:
        bias_t = bias.expand(B, H, TQ, TK)
        strides = bias_t.stride()
    BM, BN, warps, stages = _blocks(TQ, D, q.device)
    BK = 1 if KY == 1 else max(16, _next_pow2(KY))
    _label_only_kernel()[(B * H, -(-TQ // BM))](
        q, k, labels, bias_t, heads,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        labels.stride(0), labels.stride(1), *strides, heads.stride(0), heads.stride(1),
        H, TQ, TK, scale * _LOG2E,
        D=D, KY=KY, HAS_BIAS=bias is not None,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=max(16, _next_pow2(D)), BLOCK_K=BK,
        PRECISION='ieee' if q.dtype == torch.float32 else 'tf32', DOT_F32=q.device.type != 'cuda',
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return heads


@torch.library.custom_op('tokenaug::label_only_attention', mutates_args=())
def _label_only_op(
    q: torch.Tensor, k: torch.Tensor, labels: torch.Tensor, bias: Optional[torch.Tensor], scale: float
) -> torch.Tensor:
    return _label_only_forward(q, k, labels, bias, scale)


@_label_only_op.register_fake
def _(q, k, labels, bias, scale):
    return q.new_empty(q.shape[0], q.shape[2], labels.shape[-1], dtype=torch.float32)


def label_only_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    labels: torch.Tensor,
    scale: float,
    attn_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``Σ_h softmax(q_h k_hᵀ · scale + attn_mask) · labels`` ``(B, T_q, K)`` fp32 for ``q`` ``(B, H, T_q, d)``, ``k``
    ``(B, H, T_k, d)`` (any float dtype: the products in fp32) and ``labels`` ``(B, T_k, K)``; ``attn_mask`` an
    additive bias or a boolean mask broadcastable to ``(B, H, T_q, T_k)``. Forward only, nothing kept for
    autograd: the token path's attention is the model's own call. One Triton kernel over (sample × head, query
    tile), the heads summed by atomic adds into fp32 (their order is the GPU's: equal to a serial sum up to the
    rounding of ``H`` additions)."""
    q, k, labels = q.detach(), k.detach(), labels.detach().float()
    bias = None
    if attn_mask is not None:
        attn_mask = attn_mask.detach()
        if attn_mask.dtype == torch.bool:
            bias = torch.zeros(attn_mask.shape, dtype=torch.float32, device=q.device).masked_fill_(
                ~attn_mask, -math.inf
            )
        else:
            bias = attn_mask.float()
        while bias.dim() < 4:
            bias = bias.unsqueeze(0)
    return _label_only_op(q, k, labels, bias, float(scale))


# ----------------------------------------------------------------------------------------------
# The self-check: a kernel runs for training only once it agrees with SDPA and the rule on this device
# ----------------------------------------------------------------------------------------------

#: what each (kernel, device, dtype, head dim) self-check found: ``None`` (it agrees) or what differed
_CHECKS: dict = {}
#: the self-check's bounds, relative to the largest reference value: the output and gradients of a bf16/fp16
#: kernel (``P`` rounded to the input's dtype before ``P · V``, as flash kernels do) within a few of the dtype's ulps,
#: fp32 ones within 1e-4; the labels (fp32 from the unrounded probabilities) within 1e-4 in every dtype
_BOUNDS = {torch.float32: 1e-4, torch.bfloat16: 2**-5, torch.float16: 2**-8}


def self_check(kind: str, device, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """Whether the ``kind`` kernel (``'fused'``: :func:`label_attention`; ``'labels'``: :func:`label_only_attention`)
    agrees here, checked once per (device, dtype, head dim) on a small fixed problem (2 samples, 2 heads, 37 tokens,
    seeds fixed) as it will run: the output and its gradients against ``scaled_dot_product_attention`` in fp32, the
    labels against the rule in float64. ``None`` where it agrees; else what differed and by how much (or why it did
    not build or launch)."""
    key = (kind, torch.device(device), dtype, int(head_dim))
    if key not in _CHECKS:
        _CHECKS[key] = _run_check(*key)
    return _CHECKS[key]


@torch.compiler.disable
def _run_check(kind: str, device: torch.device, dtype: torch.dtype, D: int) -> Optional[str]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 37, D, generator=g) for _ in range(3))
    labels = torch.softmax(torch.randn(2, 37, 1, generator=g) * 2, -1)
    w = torch.randn(2, 2, 37, D, generator=g)
    scale = D**-0.5
    bound = _BOUNDS.get(dtype, 2**-5)
    with torch.enable_grad(), torch.autocast(device.type, enabled=False):
        try:
            q, k, v = (t.to(device, dtype) for t in (q, k, v))
            labels, w = labels.to(device), w.to(device)
            if kind == 'fused':
                qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                out, _, heads = label_attention(qg, kg, vg, labels, scale)
                grads = torch.autograd.grad((out.float() * w).sum(), (qg, kg, vg))
            else:
                heads = label_only_attention(q, k, labels, scale)
        except Exception as e:  # it does not build or launch here
            return f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}'
        logits = (q.double() @ k.double().transpose(-1, -2)) * scale
        rule = sum(logits.softmax(-1)[:, h] @ labels.double() for h in range(2))
        found = [('labels', (heads.double() - rule).abs().max().item(), 1e-4)]
        if kind == 'fused':
            qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
            ref = F.scaled_dot_product_attention(qr, kr, vr, scale=scale)
            ref_grads = torch.autograd.grad((ref * w).sum(), (qr, kr, vr))
            found.append(('output', (out.float() - ref).abs().max().item(), bound * ref.abs().max().item()))
            for name, a, b in zip(('dq', 'dk', 'dv'), grads, ref_grads):
                found.append((name, (a.float() - b).abs().max().item(), bound * b.abs().max().item()))
    bad = [f'{name} by {d:.3g} (allowed {allowed:.3g})' for name, d, allowed in found if not d <= allowed]
    return None if not bad else 'differs from SDPA and the rule: ' + ', '.join(bad)
