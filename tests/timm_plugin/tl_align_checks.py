"""What the TL-Align tracer tests share: the compact training call against the dense reference entry, and the
explicit-loop pieces of their references (a window attention's label mixing, a conv's ``mean |K|`` stencil and its
label mixing)."""


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


def window_mix(Y, A, ws: int, shift: int = 0):
    """Eq. 9 by loops on a ``(B, H, W, K)`` label map tiled by ``ws x ws`` windows, cyclically shifted by ``shift``
    (Swin's shifted windows; 0: unshifted): each token's label the head-mean attention ``A`` ``(B · windows, ws²,
    ws²)`` (windows in row-major order per sample, on the shifted map) applied to the labels of its window's
    tokens, by index arithmetic."""
    import torch

    B, H, W, _ = Y.shape
    nwh, nww = H // ws, W // ws
    new = torch.zeros_like(Y)
    for b in range(B):
        for i in range(H):
            for j in range(W):
                si, sj = (i - shift) % H, (j - shift) % W
                win = b * nwh * nww + (si // ws) * nww + sj // ws
                n = (si % ws) * ws + sj % ws
                for m in range(ws * ws):
                    mi, mj = (si // ws) * ws + m // ws, (sj // ws) * ws + m % ws
                    new[b, i, j] += A[win, n, m] * Y[b, (mi + shift) % H, (mj + shift) % W]
    return new


def grid_mix(Y, A, G: int):
    """Eq. 9 by loops on a ``(B, H, W, K)`` label map split by MaxViT's grid partition (``G x G`` tokens per window,
    strided across the map): token ``(a, b)`` of window ``(p, q)`` is the cell ``(a · H/G + p, b · W/G + q)``;
    ``A`` ``(B · windows, G², G²)`` the head-mean attention, windows in row-major order per sample."""
    import torch

    B, H, W, _ = Y.shape
    gh, gw = H // G, W // G
    new = torch.zeros_like(Y)
    for b in range(B):
        for p in range(gh):
            for q in range(gw):
                win = b * gh * gw + p * gw + q
                cells = [(a * gh + p, c * gw + q) for a in range(G) for c in range(G)]
                for n, (i, j) in enumerate(cells):
                    for m, (r, c) in enumerate(cells):
                        new[b, i, j] += A[win, n, m] * Y[b, r, c]
    return new


def stencil_loops(Y, S, pads, stride=1, dilation=1):
    """``(B, H, W, K)`` labels mixed by the stencil ``S`` (float64, by loops): each output cell the ``S``-weighted
    mean of the in-grid cells under its taps (the conv's padding is no token); ``pads`` ``(left, right, top,
    bottom)``."""
    import torch

    B, H, W, K = Y.shape
    kh, kw = S.shape
    left, right, top, bottom = pads
    Ho = (H + top + bottom - dilation * (kh - 1) - 1) // stride + 1
    Wo = (W + left + right - dilation * (kw - 1) - 1) // stride + 1
    out = torch.zeros(B, Ho, Wo, K, dtype=torch.float64)
    for i in range(Ho):
        for j in range(Wo):
            num, den = torch.zeros(B, K, dtype=torch.float64), 0.0
            for u in range(kh):
                for v in range(kw):
                    r, c = i * stride + u * dilation - top, j * stride + v * dilation - left
                    if 0 <= r < H and 0 <= c < W:
                        num += float(S[u, v]) * Y[:, r, c].double()
                        den += float(S[u, v])
            out[:, i, j] = num / den
    return out


def mean_abs_stencil(weight):
    """A conv's ``(O, I, k, k)`` kernel as Table 9's stencil by loops: the mean over output and input channels of
    ``|K_{o,i}|``, in float64."""
    K = weight.detach().double()
    return sum(K[o, i].abs() for o in range(K.shape[0]) for i in range(K.shape[1])) / (K.shape[0] * K.shape[1])


def check_against_reference(tracer, model, records, handles, reference, B=4, side=64, dropped=True):
    """A training forward of ``model`` on ``B`` random ``side``-px images (stochastic depth drawn at seed 2) with the
    ``records`` its ``handles`` hook, and the tracer's labels of random token labels against
    ``reference(model, Y (B, H, W, K), records)`` to 1e-6 (and away from the plain mean); ``dropped``: some drop
    path (a ``DropPath`` key of ``records``) dropped a sample or row. Returns the max |difference|."""
    import timm
    import torch

    from .test_tl_align import C, random_token_labels

    g = torch.Generator().manual_seed(1)
    s = tracer.stride
    x, Y = torch.randn(B, 3, side, side, generator=g), random_token_labels(B, (side // s) ** 2, g)
    torch.manual_seed(2)
    out, caps = tracer.capture(lambda: model(x))
    for h in handles:
        h.remove()
    if dropped:
        assert any(not k.all() for m, k in records.items() if isinstance(m, timm.layers.DropPath))
    label = tracer.label_path(caps, out, Y)
    with torch.no_grad():
        want = reference(model, Y.reshape(B, side // s, side // s, C), records)
    diff = (label - want).abs().max()
    assert diff < 1e-6
    assert (label - Y.mean(1)).abs().max() > 1e-3
    return float(diff)
