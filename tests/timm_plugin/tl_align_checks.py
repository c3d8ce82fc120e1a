"""A TL-Align check the tracer tests share: the compact training call against the dense reference entry."""


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
