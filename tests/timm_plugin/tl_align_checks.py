"""What the TL-Align tracer tests share: the compact training call against the dense reference entry, and the
explicit-loop pieces of their references (a window attention's label mixing, a conv's ``mean |K|`` stencil)."""


def check_compact_equals_dense(model, mixer, x, y, num_classes, smoothing=0.1, seed=5):
    """TL-Align's training call on a mixed batch (compact partner-share labels) against ``trace`` with the same
    labels written out densely per token: same logits (same stochastic-depth draws), same aligned target within
    1e-6, a distribution per row, no gradient. Returns the wrapper, the mixed images and the aligned target."""
    import torch

    from shared_core.mixing import one_hot
    from timm_plugin.tl_align import TLAlign

    xm, target = mixer(x, y)
    wrapped = TLAlign(model)
    torch.manual_seed(seed)
    out, aligned = wrapped(xm, target)
    mix = target.mix
    s = mix.token_share_flat()[..., None]
    dense = (1 - s) * one_hot(y, num_classes, smoothing)[:, None] + s * one_hot(y[mix.partner], num_classes, smoothing)[
        :, None
    ]
    torch.manual_seed(seed)
    out_dense, label = wrapped.trace(xm, dense)
    assert torch.equal(out, out_dense)
    assert torch.allclose(aligned, label, atol=1e-6)
    assert torch.allclose(aligned.sum(1), torch.ones(len(y)), atol=1e-6) and aligned.min() >= 0
    assert not aligned.requires_grad
    return wrapped, xm, aligned


def window_mix(Y, A, ws: int):
    """Eq. 9 by loops on a ``(B, H, W, K)`` label map tiled by ``ws x ws`` windows (unshifted): each token's label
    the head-mean attention ``A`` ``(B · windows, ws², ws²)`` (windows in row-major order per sample) applied to the
    labels of its window's tokens."""
    import torch

    B, H, W, _ = Y.shape
    nwh, nww = H // ws, W // ws
    new = torch.zeros_like(Y)
    for b in range(B):
        for i in range(H):
            for j in range(W):
                win, n = b * nwh * nww + (i // ws) * nww + j // ws, (i % ws) * ws + j % ws
                for m in range(ws * ws):
                    new[b, i, j] += A[win, n, m] * Y[b, (i // ws) * ws + m // ws, (j // ws) * ws + m % ws]
    return new


def mean_abs_stencil(weight):
    """A conv's ``(O, I, k, k)`` kernel as Table 9's stencil by loops: the mean over output and input channels of
    ``|K_{o,i}|``, in float64."""
    K = weight.detach().double()
    return sum(K[o, i].abs() for o in range(K.shape[0]) for i in range(K.shape[1])) / (K.shape[0] * K.shape[1])
