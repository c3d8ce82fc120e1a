"""TL-Align on timm's Eva (EVA-02, RoPE ViTs) and Beit against a generic brute force.

The brute force knows nothing of the families: it records every ``F.scaled_dot_product_attention`` call of a
plain forward (``q`` and ``k`` after RoPE, the bias or mask, the scale), materialises ``softmax(q kᵀ · scale +
mask)`` in float64 and applies ``Y ← (Y + mean_h A_h Y) / 2`` per call with an explicit loop over heads, starting
from dense one-hot labels of both sources. It reproduces today's ViT/DeiT tracer, so it is the yardstick the new
tracers are held to.
"""

import pytest
import timm
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from shared_core.mixing import one_hot
from timm_plugin import create_mixer
from timm_plugin.tl_align import BeitTracer, EvaTracer, TLAlign, TransMix, timm_tracer
from timm_plugin.token_grid import token_stride

C = 5


class RecordAttention(TorchFunctionMode):
    """Every scaled_dot_product_attention call: (q, k, mask, scale), keys repeated for grouped queries."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k = args[0], args[1]
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            scale = kwargs.get('scale') or q.shape[-1] ** -0.5
            self.calls.append((q.detach(), k.detach(), kwargs.get('attn_mask'), scale))
        return func(*args, **kwargs)


def brute_force(model, x, Y):
    """The label state after every attention call of ``model(x)``, from ``Y`` ``(B, T, K)``."""
    with RecordAttention() as rec, torch.no_grad():
        model(x)
    Y = Y.double()
    for q, k, mask, scale in rec.calls:
        logits = (q.double() @ k.double().transpose(-1, -2)) * scale
        if mask is not None:
            logits = logits.masked_fill(~mask, float('-inf')) if mask.dtype == torch.bool else logits + mask.double()
        A = logits.softmax(-1)
        H = A.shape[1]
        Y = (Y + sum(A[:, h] @ Y for h in range(H)) / H) / 2
    return Y, len(rec.calls)


def dense_start(mix, y, P):
    """Dense labels: the patch tokens mix the two one-hot labels by their token share, the prefix tokens carry
    the area label."""
    s = mix.token_share_flat()[..., None]
    own, partner = one_hot(y, C), one_hot(y[mix.partner], C)
    tokens = (1 - s) * own[:, None] + s * partner[:, None]
    area = mix.lam[:, None] * own + (1 - mix.lam)[:, None] * partner
    return torch.cat([area[:, None].expand(-1, P, -1), tokens], 1)


def batch(model, img, seed=0, B=4):
    g = torch.Generator().manual_seed(seed)
    ps = token_stride(model)[0]
    mixer = create_mixer(
        'cutmix', mixup_alpha=0.0, cutmix_alpha=1.0, num_classes=C, patch_size=ps, mode='elem', generator=g,
        carry_mix=True, label_smoothing=0.0,
    )  # fmt: skip
    x, y = torch.randn(B, 3, img, img, generator=g), torch.randint(0, C, (B,), generator=g)
    return mixer(x, y), y


def sharpen(model, std=0.3):
    """Random init gives near-uniform attention; larger weights make it peaked, so a wrong rule shows."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.normal_(0, std)
    return model.eval()


def pooled(model, Y):
    P = model.num_prefix_tokens
    return Y[:, 0] if model.global_pool == 'token' else Y[:, P:].mean(1)


MODELS = {
    'eva02 (rope, swiglu, avg)': ('eva02_tiny_patch14_224', dict(img_size=56)),
    'eva02 token pool': ('eva02_tiny_patch14_224', dict(img_size=56, global_pool='token')),
    'eva no class token': ('eva02_tiny_patch14_224', dict(img_size=56, class_token=False)),
    'eva post-norm': ('eva02_tiny_patch14_224', dict(img_size=56, use_post_norm=True)),
    'rope vit (mixed rope)': ('vit_small_patch16_rope_mixed_224', dict(img_size=64)),
    'rope vit, registers': ('vit_small_patch16_rope_224', dict(img_size=64, num_reg_tokens=2)),
    'rope vit, gqa': (
        'vit_small_patch16_rope_224',
        dict(img_size=64, attn_type='rope', num_kv_heads=2, qkv_fused=False),
    ),
    'beit (relative bias, avg)': ('beit_base_patch16_224', dict(img_size=64, embed_dim=64, num_heads=4)),
    'beit token pool': ('beit_base_patch16_224', dict(img_size=64, embed_dim=64, num_heads=4, global_pool='token')),
    "vit (today's tracer)": ('vit_tiny_patch16_224', dict(img_size=64)),
    'naflexvit (registers, avg)': ('naflexvit_base_patch16_gap', dict(img_size=64, embed_dim=64, num_heads=4)),
    'naflexvit, class token': (
        'naflexvit_base_patch16_gap',
        dict(img_size=64, embed_dim=64, num_heads=4, class_token=True, reg_tokens=0, global_pool='token'),
    ),
    'vit relpos (mlp bias, avg)': ('vit_relpos_small_patch16_224', dict(img_size=64)),
    'vit relpos, class token': ('vit_relpos_medium_patch16_cls_224', dict(img_size=64)),
    'vit relpos, shared bias': ('vit_srelpos_small_patch16_224', dict(img_size=64)),
    'vit relpos, res-post-norm': ('vit_relpos_small_patch16_rpn_224', dict(img_size=64)),
}


@pytest.mark.parametrize('name', list(MODELS))
def test_the_tracer_is_the_brute_force(name):
    arch, kw = MODELS[name]
    torch.manual_seed(0)
    model = sharpen(timm.create_model(arch, depth=3, num_classes=C, **kw))
    (xm, target), y = batch(model, kw['img_size'])
    Y, calls = brute_force(model, xm, dense_start(target.mix, y, model.num_prefix_tokens))
    assert calls == 3  # one attention call per block
    expected = pooled(model, Y)
    out, aligned = TLAlign(model)(xm, target)
    # measured max |d| 6e-8 (the tracer in fp32 on compact labels, the brute force in float64 on dense ones)
    assert (aligned.double() - expected).abs().max() < 1e-6
    assert torch.equal(out, model(xm))  # the token path is the model's own


def test_the_families_get_their_tracers_and_the_right_refusals():
    eva = timm.create_model('eva02_tiny_patch14_224', img_size=56, depth=1, num_classes=C)
    beit = timm.create_model('beit_base_patch16_224', img_size=32, depth=1, embed_dim=32, num_heads=2, num_classes=C)
    assert isinstance(timm_tracer(eva), EvaTracer) and isinstance(timm_tracer(beit), BeitTracer)
    eva.blocks[0].attn.fused_attn = False
    with pytest.raises(ValueError, match='without scaled_dot_product_attention'):
        TLAlign(eva)
    avgmax = timm.create_model('eva02_tiny_patch14_224', img_size=56, depth=1, num_classes=C, global_pool='avgmax')
    with pytest.raises(ValueError, match="global_pool='avgmax' has no TL-Align rule"):
        TLAlign(avgmax)


@pytest.mark.parametrize('arch, kw', [MODELS['beit token pool'], MODELS['eva02 token pool']])
def test_transmix_reads_the_class_attention_with_its_bias(arch, kw):
    """TransMix's share: the class token's head-mean attention over the patch tokens (BEiT: with the relative
    position bias the token path adds), renormalised, times each patch's partner share."""
    torch.manual_seed(1)
    model = sharpen(timm.create_model(arch, depth=2, num_classes=C, **kw))
    (xm, target), y = batch(model, kw['img_size'], seed=2)
    with RecordAttention() as rec, torch.no_grad():
        model(xm)
    q, k, mask, scale = rec.calls[-1]
    logits = (q.double() @ k.double().transpose(-1, -2)) * scale
    if mask is not None:
        logits = logits + mask.double()
    A = logits.softmax(-1)[:, :, 0, model.num_prefix_tokens :].mean(1)
    share = (A * target.mix.token_share_flat().double()).sum(1) / A.sum(1)
    _, aligned = TransMix(model)(xm, target)
    own, partner = one_hot(y, C).double(), one_hot(y[target.mix.partner], C).double()
    expected = (1 - share)[:, None] * own + share[:, None] * partner
    assert (aligned.double() - expected).abs().max() < 1e-6


@pytest.mark.parametrize(
    'arch, block',
    [
        ('xcit_nano_12_p16_224', 'XCA'),
        ('efficientvit_b0', 'LiteMLA'),
        ('focalnet_tiny_srf', 'FocalModulation'),
        ('levit_128s', 'AttentionSubsample'),
        ('coat_lite_tiny', 'FactorAttnConvRelPosEnc'),
        ('fastvit_t8', 'RepMixer'),
    ],
)
def test_families_without_a_rule_are_refused_naming_the_block_and_why(arch, block):
    model = timm.create_model(arch, num_classes=C)
    with pytest.raises(ValueError, match=f"TL-Align has no rule for {type(model).__name__}'s {block}.*: "):
        TLAlign(model)


def _zoo_refusals() -> list:
    """``(model, reason)`` of every family the zoo page lists as refused, the reason as the page prints it."""
    from ..helpers import REPO

    rows = []
    for line in (REPO / 'docs' / 'methods' / 'tl_align_zoo.md').read_text().splitlines():
        cells = [c.strip() for c in line.replace('\\|', '\0').split('|')]
        if len(cells) == 8 and cells[3] == 'refused':  # | family | model | status | exactness | TransMix | why |
            rows.append((cells[2].strip('`'), cells[6].replace('\0', '|')))
    return rows


@pytest.mark.slow
def test_tokenaug_train_refuses_every_refused_family_in_the_zoo_pages_words(tiny_world, tmp_path, capsys):
    """``tokenaug-train --mixup-type tl_align`` on each family the zoo page refuses: the tracer's refusal, in the
    page's words, before anything else (the label grid's lookup once came first and said "no patch embedding or
    first stage" for five of them); TransMix the same."""
    from tokenaug import commands

    from ..helpers import REPO
    from ..helpers.processes import call_main

    refused = _zoo_refusals()
    page = (REPO / 'docs' / 'methods' / 'tl_align_zoo.md').read_text()
    assert f', {len(refused)} refused with a reason,' in page and len(refused) >= 10, refused  # the page's count
    for model, reason in refused:
        for method in ('tl_align', 'transmix'):
            argv = ['--data-dir', tiny_world / 'imagenet', '--model', model, '--num-classes', 10, '--mixup-type']
            argv += [method, '--cutmix', '1.0', '--epochs', '1', '-b', '8', '--workers', '0', '--output', tmp_path]
            code, _, err = call_main(commands.train, argv, capsys)
            assert code == 2 and err.strip().splitlines()[-1] == f'tokenaug-train: error: model: {reason}', err


def test_the_zoo_page_is_what_timm_gives_now(run_env):
    """docs/methods/tl_align_zoo.md is scripts/tl_align_zoo.py's output for the installed timm (it cannot drift)."""
    from ..helpers.processes import check_generated_page

    check_generated_page('tl_align_zoo.py', run_env)


@pytest.mark.slow
@pytest.mark.parametrize(
    'model, kwargs',
    [
        ('eva02_tiny_patch14_224', ['img_size=112', 'depth=2']),
        ('vit_small_patch16_rope_224', ['img_size=112', 'depth=2']),
        ('caformer_s18', []),
        ('hiera_tiny_224', ['img_size=(128,128)']),  # 8x8 mask units: a grid divisible by 8
        ('twins_svt_small', ['img_size=128', 'depths=[1,1,1,1]', 'wss=[4,4,4,4]']),  # stages 32 to 4 tokens
        ('swinv2_tiny_window8_256', ['img_size=128', 'depths=[1,1,1,1]']),  # 8x8 windows on 32 to 8 tokens
        ('swinv2_cr_tiny_224', ['img_size=[128,128]', 'depths=[1,1,1,1]', 'window_size=8']),
        ('seresnet18', []),  # SE gates: channel mixing (the stride-4 grid)
        ('samvit_base_patch16_224', ['img_size=112', 'depth=2', 'window_size=7', 'global_attn_indexes=[1]']),
        ('vit_relpos_small_patch16_224', ['img_size=112', 'depth=2']),
        ('lvvit_s', ['img_size=112', 'depth=2']),
        ('convit_tiny', ['img_size=112', 'depth=3', 'local_up_to_layer=2']),
        ('davit_tiny', ['depths=[1,1,1,1]', 'window_size=4']),  # 128 px: grids of 32, 16, 8 and 4 tokens
        ('efficientnet_b0', []),  # the graph route: the mixer on its first stride-4 map
        ('maxvit_rmlp_pico_rw_256', ['img_size=128']),  # the graph route: window and grid attention, 4x4 windows
        ('tiny_vit_5m_224', ['window_sizes=[4,4,4,4]']),  # read at the input size: windows, then one window
        ('mobilevit_xxs', []),  # rows of patches: a drop path over rows, and over blocks without a shortcut
        ('efficientvit_m0', ['img_size=128', 'window_size=[4,2,2]']),  # a conv on each window's queries
        ('efficientformerv2_s0', ['img_size=128']),  # talking heads
        ('gcvit_xxtiny', ['img_size=128']),  # a global query shared by the windows
        ('naflexvit_base_patch16_gap', ['img_size=128', 'depth=2', 'embed_dim=64', 'num_heads=4']),
    ],
)
def test_tokenaug_train_tl_align_across_the_zoo(tiny_world, tmp_path, model, kwargs):
    """``tokenaug-train --mixup-type tl_align`` trains the newly traced families on the world (the mixer on each
    model's first grid: the patches, or the stem's 4-pixel grid)."""
    from timm_plugin.train import run

    from ..helpers import REPO

    at_128 = ('hiera', 'twins', 'swinv2', 'davit', 'maxvit', 'tiny_vit', 'mobilevit', 'efficient', 'gcvit', 'naflex')
    size = ['--img-size', '128'] if model.startswith(at_128) else []
    drop = [] if model.startswith('efficientvit') else ['--drop-path', '0.1']  # (EfficientViT-MSRA takes none)
    metrics = run(
        ['-c', str(REPO / 'configs' / 'timm' / 'world_vit-tiny.yaml'), '--data-dir', str(tiny_world / 'imagenet')]
        + ['--model', model, '--model-kwargs', *kwargs, *size, *drop]
        + ['--epochs', '1', '-b', '8', '--workers', '0', '--mixup-type', 'tl_align']
        + ['--output', str(tmp_path), '--experiment', 'run']
    )
    assert set(metrics) == {'loss', 'top1', 'top5'} and 0 <= metrics['top1'] <= 100


def test_naflexvit_takes_image_batches_and_names_a_masked_one():
    """NaFlexViT on an image batch is a ViT (the brute force above); a batch with a patch validity mask (its NaFlex
    mode) masks keys out of the attention, which the ViT rule does not read: the forward says so."""
    from timm_plugin.tl_align import NaFlexViTTracer

    model = timm.create_model(
        'naflexvit_base_patch16_gap', img_size=64, depth=2, embed_dim=64, num_heads=4, num_classes=C
    )
    tracer = timm_tracer(model)
    assert type(tracer) is NaFlexViTTracer
    patches = torch.randn(2, 16, 16 * 16 * 3)
    rows, cols = torch.meshgrid(torch.arange(4), torch.arange(4), indexing='ij')
    coord = torch.stack([rows.flatten(), cols.flatten()], -1).expand(2, -1, -1)
    valid = torch.ones(2, 16, dtype=torch.bool)
    valid[1, -3:] = False  # (the second image has 13 patches)
    batch = {'patches': patches, 'patch_coord': coord, 'patch_valid': valid}
    with pytest.raises(ValueError, match='a NaFlex batch with an attention mask'):
        tracer.capture(lambda: model(batch))
