"""The authors' checkpoints load here (docs/checkpoints.md): for each family, a port of the public
model definition with random weights, saved in the format its training script writes, is read by our checkpoint
reader and loaded strictly into our timm model, and the logits agree in float64; the families that transfer are
converted onto mmseg. The ports follow the public code read at these commits (their quirks are the point):

- DeiT (TL-Align 4da0621, TokenMix 0e17d5d, TransMix 0e4d31e): timm 0.3-0.5's ``VisionTransformer`` (DeiT's
  ``models.py``, TokenMix's ``deit.py``, TransMix's ``vision_transformer.py`` with ``return_attn``); the files as
  DeiT's ``main.py`` (``model``, ``args``: a Namespace, ...) and timm 0.5.4's ``CheckpointSaver`` write them.
- LV-ViT (zihangJiang/TokenLabeling 9dbfd59, ``tlt/models/lvvit.py``, ``layers.py``): ``PatchEmbed4_2``, no qkv bias,
  ``nn.LayerNorm`` (eps 1e-5), ``x + f(x) / skip_lam``, eval logits ``head(cls) + 0.5 max_tokens(aux_head)``.
- TokenMixup's ViT-B/16 (mlvlab/TokenMixup 5a97bfe, ``experiments/vit/models/modeling.py``, from
  jeonsworld/ViT-pytorch): separate query / key / value, ``transformer.*`` names, the HTM ScoreNet on the class
  token; saved as a bare state dict. Its CCT (``tests/timm_plugin/test_cct.py``): here the VTM block's
  ``Attention_Vertical``.
"""

import argparse

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

import timm_plugin  # noqa: F401  (registers lvvit_*, cct_*)
from shared_core.checkpoint_io import load_checkpoint_file
from timm_plugin.annotator import create_annotator

IMG = 64


def peaked(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random weights large enough that the logits differ clearly between samples (a wrong layout shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                torch.randn(p.shape, generator=g) * (0.02 if p.dim() > 1 else 0.1)
                + (1.0 if 'norm' in name and name.endswith('weight') else 0.0)
            )
        for name, b in model.named_buffers():
            if name.endswith('running_var'):
                b.copy_(torch.rand(b.shape, generator=g) + 0.5)
            elif name.endswith('running_mean'):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model


# ---------------------------------------------------------------------------------------------------------------
# DeiT: timm 0.3-0.5's VisionTransformer, as TL-Align, TokenMix and TransMix build it
# ---------------------------------------------------------------------------------------------------------------


class OldAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.scale = num_heads, (dim // num_heads) ** -0.5
        self.qkv, self.proj = nn.Linear(dim, dim * 3, bias=True), nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C)), attn


class OldMlp(nn.Module):
    def __init__(self, dim, hidden, act=nn.GELU):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), act(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class OldBlock(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, eps=1e-6):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim, eps=eps), OldAttention(dim, num_heads)
        self.norm2, self.mlp = nn.LayerNorm(dim, eps=eps), OldMlp(dim, int(dim * mlp_ratio))

    def forward(self, x):
        y, attn = self.attn(self.norm1(x))
        x = x + y
        return x + self.mlp(self.norm2(x)), attn


class OldPatchEmbed(nn.Module):
    def __init__(self, dim, patch=16, in_chans=3):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch, stride=patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class PublicDeiT(nn.Module):
    """``VisionTransformer(patch_size=16, embed_dim, depth, num_heads, mlp_ratio=4, qkv_bias=True,
    norm_layer=partial(nn.LayerNorm, eps=1e-6))``; ``return_attn``: TransMix's last block also returns the class
    token's attention to the patches, averaged over heads (``(x, attn)`` in train and eval)."""

    def __init__(self, dim=48, depth=2, heads=3, classes=10, return_attn=False):
        super().__init__()
        self.patch_embed = OldPatchEmbed(dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, (IMG // 16) ** 2 + 1, dim))
        self.blocks = nn.Sequential(*[OldBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pre_logits = nn.Identity()
        self.head = nn.Linear(dim, classes)
        self.return_attn = return_attn

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        for blk in self.blocks:
            x, attn = blk(x)
        out = self.head(self.pre_logits(self.norm(x)[:, 0]))
        return (out, attn[:, :, 0, 1:].mean(1)) if self.return_attn else out


def _args(**kw):
    return argparse.Namespace(input_size=IMG, nb_classes=10, lr=5e-4, device='cuda', **kw)


def deit_file(kind: str, public: nn.Module, path) -> None:
    """``public`` saved as the ``kind`` repository's training script saves it."""
    sd = public.state_dict()
    opt = torch.optim.AdamW(public.parameters(), lr=5e-4).state_dict()
    sched = dict(base_values=[5e-4], warmup_t=5, t_in_epochs=True, noise_range_t=None, last_epoch=3)
    scaler = dict(scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, _growth_tracker=12)
    if kind == 'tl_align':  # main_tla.py (DeiT's main.py): no EMA
        state = dict(
            model=sd,
            optimizer=opt,
            lr_scheduler=sched,
            epoch=3,
            scaler=scaler,
            args=_args(model='deit_small_patch16_224'),
        )
    elif kind == 'tokenmix':  # main.py: EMA on by default
        ema = {k: v + 0.01 for k, v in sd.items()}
        state = dict(
            model=sd,
            optimizer=opt,
            lr_scheduler=sched,
            epoch=3,
            state_dict_ema=ema,
            scaler=scaler,
            args=_args(model='deit_small'),
        )
    else:  # TransMix: timm 0.5.4's CheckpointSaver (train.py), model_ema True in its configs
        ema = {k: v + 0.01 for k, v in sd.items()}
        state = dict(
            epoch=3,
            arch='deit_small_patch16_224_return_attn',
            state_dict=sd,
            optimizer=opt,
            version=2,
            args=_args(model='deit_small_patch16_224_return_attn'),
            state_dict_ema=ema,
            metric=71.3,
        )
    torch.save(state, path)


@pytest.mark.parametrize('kind', ['tl_align', 'tokenmix', 'transmix'])
def test_deit_checkpoints_of_tl_align_tokenmix_and_transmix_load_with_equal_logits(kind, tmp_path):
    from mm_plugin.convert_cli import convert_checkpoint

    torch.manual_seed(0)
    public = peaked(PublicDeiT(return_attn=kind == 'transmix')).double().eval()
    path = tmp_path / f'{kind}.pth'
    deit_file(kind, public, path)
    kw = dict(img_size=IMG, depth=2, embed_dim=48, num_heads=3)
    assert load_checkpoint_file(path, '--checkpoint')['args'].nb_classes == 10  # the reader: Namespace allowed
    ours = create_annotator('deit_tiny_patch16_224', checkpoint=str(path), model_kwargs=kw).double()
    x = torch.randn(3, 3, IMG, IMG, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        ref = public(x)[0] if kind == 'transmix' else public(x)
        assert (ours(x) - ref).abs().max() < 1e-10 and ref.std() > 0.1
    if kind != 'tl_align':  # the EMA weights, where the file has them (timm's loader: --model-ema's use_ema)
        ema = create_annotator('deit_tiny_patch16_224', checkpoint=str(path), model_kwargs=kw, use_ema=True)
        assert torch.allclose(ema.state_dict()['head.bias'], public.state_dict()['head.bias'].float() + 0.01)
    report = convert_checkpoint(str(path), str(tmp_path / 'seg.pth'), 'mmseg', 'deit_tiny_patch16_224', model_kwargs=kw)
    assert report['converted'] > 0 and 'head.weight' in report['dropped']


# ---------------------------------------------------------------------------------------------------------------
# LV-ViT: zihangJiang/TokenLabeling tlt/models/lvvit.py
# ---------------------------------------------------------------------------------------------------------------


class PatchEmbed4_2(nn.Module):
    def __init__(self, embed_dim, patch_size=16, in_chans=3, stem=64):
        super().__init__()
        self.conv1 = nn.Conv2d(in_chans, stem, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(stem)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(stem, stem, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(stem)
        self.conv3 = nn.Conv2d(stem, stem, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(stem)
        self.proj = nn.Conv2d(stem, embed_dim, kernel_size=patch_size // 2, stride=patch_size // 2)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.relu(self.bn2(self.conv2(x)))
        x = self.relu(self.bn3(self.conv3(x)))
        return self.proj(x)


class LVAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.scale = num_heads, (dim // num_heads) ** -0.5
        self.qkv, self.proj = nn.Linear(dim, dim * 3, bias=False), nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, N, C))


class LVBlock(nn.Module):
    def __init__(self, dim, num_heads, skip_lam, mlp_ratio=3.0):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), LVAttention(dim, num_heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), OldMlp(dim, int(dim * mlp_ratio))
        self.skip_lam = skip_lam

    def forward(self, x):
        x = x + self.attn(self.norm1(x)) / self.skip_lam
        return x + self.mlp(self.norm2(x)) / self.skip_lam


class PublicLVViT(nn.Module):
    """``LV_ViT(patch_size=16, embed_dim, depth, num_heads, mlp_ratio=3., p_emb='4_2', skip_lam, return_dense=True,
    mix_token=True)`` in eval mode (no MixToken): ``x_cls + 0.5 * x_aux.max(1)[0]``."""

    def __init__(self, dim=48, depth=2, heads=3, skip_lam=2.0, classes=10):
        super().__init__()
        self.patch_embed = PatchEmbed4_2(dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, (IMG // 16) ** 2 + 1, dim))
        self.blocks = nn.ModuleList([LVBlock(dim, heads, skip_lam) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head, self.aux_head = nn.Linear(dim, classes), nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        return self.head(x[:, 0]) + 0.5 * self.aux_head(x[:, 1:]).max(1)[0]


@pytest.mark.parametrize('wrapped', [False, True])
def test_lvvit_releases_load_with_equal_logits_and_transfer(wrapped, tmp_path):
    """The release files (a bare state dict, or timm 0.4.5's CheckpointSaver dict with ``args``) through timm's
    pretrained route (``--pretrained-path``) and the annotator's reader; then onto our mmseg LV-ViT."""
    from mm_plugin.convert_cli import convert_checkpoint

    torch.manual_seed(0)
    public = peaked(PublicLVViT()).double().eval()
    path = tmp_path / 'lvvit.pth.tar'
    sd = public.state_dict()
    torch.save(
        dict(epoch=3, arch='lvvit_s', state_dict=sd, version=2, args=_args(model='lvvit_s')) if wrapped else sd, path
    )
    kw = dict(img_size=IMG, depth=2, embed_dim=48, num_heads=3, skip_lam=2.0, num_classes=10)
    # the overlay names the file's classes (timm re-initialises a classifier of another size; the releases: 1000)
    overlay = dict(file=str(path), num_classes=10)
    via_timm = timm.create_model('lvvit_s', pretrained=True, pretrained_cfg_overlay=overlay, **kw)
    kw.pop('num_classes')
    via_reader = create_annotator('lvvit_s', checkpoint=str(path), model_kwargs=kw)
    x = torch.randn(3, 3, IMG, IMG, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        ref = public(x)
        for model in (via_timm, via_reader):
            assert (model.double().eval()(x) - ref).abs().max() < 1e-10 and ref.std() > 0.1
    report = convert_checkpoint(str(path), str(tmp_path / 'seg.pth'), 'mmseg', 'lvvit_s', model_kwargs=kw)
    assert 'aux_head.weight' in report['dropped']


# ---------------------------------------------------------------------------------------------------------------
# TokenMixup: its ViT-B/16 (jeonsworld/ViT-pytorch names) and its CCT's VTM block
# ---------------------------------------------------------------------------------------------------------------


class JAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = (
            m(x).view(B, N, self.heads, self.head_dim).permute(0, 2, 1, 3) for m in (self.query, self.key, self.value)
        )
        probs = F.softmax(q @ k.transpose(-1, -2) / self.head_dim**0.5, dim=-1)
        return self.out((probs @ v).permute(0, 2, 1, 3).reshape(B, N, C))


class JMlp(nn.Module):
    def __init__(self, dim, mlp):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, mlp), nn.Linear(mlp, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class JBlock(nn.Module):
    def __init__(self, dim, heads, mlp, scorenet_classes=None):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.ffn, self.attn = JMlp(dim, mlp), JAttention(dim, heads)
        if scorenet_classes:
            self.scorenet = nn.Linear(dim, scorenet_classes)

    def forward(self, x):
        x = x + self.attn(self.attention_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Embeddings(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.patch_embeddings = nn.Conv2d(3, dim, kernel_size=16, stride=16)
        self.position_embeddings = nn.Parameter(torch.zeros(1, (IMG // 16) ** 2 + 1, dim))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))

    def forward(self, x):
        x = self.patch_embeddings(x).flatten(2).transpose(-1, -2)
        return torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.position_embeddings


class Encoder(nn.Module):
    def __init__(self, dim, heads, mlp, depth, htm_layer, classes):
        super().__init__()
        self.layer = nn.ModuleList([JBlock(dim, heads, mlp, classes if i == htm_layer else None) for i in range(depth)])
        self.encoder_norm = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x):
        for layer in self.layer:
            x = layer(x)
        return self.encoder_norm(x)


class Transformer(nn.Module):
    def __init__(self, dim, heads, mlp, depth, htm_layer, classes):
        super().__init__()
        self.embeddings, self.encoder = Embeddings(dim), Encoder(dim, heads, mlp, depth, htm_layer, classes)

    def forward(self, x):
        return self.encoder(self.embeddings(x))


class PublicTokenMixupViT(nn.Module):
    """``VisionTransformer(config, img_size, num_classes, horizontal_layer=L, ...)`` at eval (HTM and VTM act in
    training only): the class token's logits."""

    def __init__(self, dim=48, heads=3, depth=3, htm_layer=1, classes=10):
        super().__init__()
        self.transformer = Transformer(dim, heads, dim * 4, depth, htm_layer, classes)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(self.transformer(x)[:, 0])


def test_tokenmixup_vit_converts_to_timm_with_equal_logits_and_its_scorenet(tmp_path):
    """``tokenaug-convert --from tokenmixup --to timm``: query / key / value fused into timm's qkv, the ScoreNet of
    the HTM block as ``tokenmixup_scorenet.1.fc`` (the class token into a linear layer, the public ScoreNet)."""
    from mm_plugin.convert_cli import main
    from shared_core.state_dict_maps import tokenmixup_vit_to_timm
    from timm_plugin.tokenmixup import attach_scorenets

    torch.manual_seed(0)
    public = peaked(PublicTokenMixupViT()).double().eval()
    src, dst = tmp_path / 'VIT_HTM.bin', tmp_path / 'vit_htm.pth'
    torch.save(public.state_dict(), src)
    kw = ['img_size=64', 'depth=3', 'embed_dim=48', 'num_heads=3']
    argv = [
        '--src',
        str(src),
        '--dst',
        str(dst),
        '--to',
        'timm',
        '--from',
        'tokenmixup',
        '--model',
        'vit_base_patch16_224',
    ]
    assert main([*argv, '--model-kwargs', *kw]) == 0
    state = load_checkpoint_file(dst, '--initial-checkpoint')['state_dict']
    assert {k for k in state if k.startswith('tokenmixup_scorenet.')} == {
        'tokenmixup_scorenet.1.fc.weight',
        'tokenmixup_scorenet.1.fc.bias',
    }
    model = timm.create_model('vit_base_patch16_224', img_size=64, depth=3, embed_dim=48, num_heads=3, num_classes=10)
    nets = attach_scorenets(model, [1])
    model.load_state_dict(state, strict=True)
    model.double().eval()
    x = torch.randn(3, 3, IMG, IMG, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tokens = torch.randn(2, 17, 48, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        ref = public(x)
        assert (model(x) - ref).abs().max() < 1e-10 and ref.std() > 0.1
        block = public.transformer.encoder.layer[1]
        assert torch.allclose(nets['1'](tokens), block.scorenet(tokens[:, 0]), atol=1e-12)
    with pytest.raises(ValueError, match=r"1 TokenMixup ViT keys have no mapping: \['transformer.extra.weight'\]"):
        tokenmixup_vit_to_timm({**public.state_dict(), 'transformer.extra.weight': torch.zeros(1)})
    # tokenaug-train --initial-checkpoint with the HTM flag: the ScoreNet attached first, the file loads strictly
    from timm_plugin.recipe import build_training
    from tokenaug.train_args import parse_args

    args = ['--model', 'vit_base_patch16_224', '--num-classes', '10', '--model-kwargs', *kw]
    args += ['--initial-checkpoint', str(dst), '--tokenmixup-htm-layers', '1', '--data-dir', str(tmp_path)]
    trained = build_training(parse_args(args)).model
    assert torch.equal(trained.tokenmixup_scorenet['1'].fc.weight, state['tokenmixup_scorenet.1.fc.weight'].float())
    # --plain: the timm model's own weights, which timm's pretrained route loads strictly (evaluation)
    plain = tmp_path / 'vit_htm_plain.pth'
    assert main([*argv[:3], str(plain), *argv[4:], '--plain', '--model-kwargs', *kw]) == 0
    assert not any(k.startswith('tokenmixup_scorenet.') for k in load_checkpoint_file(plain, 'x')['state_dict'])
    overlay = dict(file=str(plain), num_classes=10)
    via_timm = timm.create_model(
        'vit_base_patch16_224', pretrained=True, img_size=64, depth=3, embed_dim=48, num_heads=3, num_classes=10,
        pretrained_cfg_overlay=overlay,
    )  # fmt: skip
    with torch.no_grad():
        assert (via_timm.double().eval()(x) - ref).abs().max() < 1e-10


def test_tokenmixup_cct_with_a_vtm_block_loads_with_equal_logits(tmp_path):
    """The released CCT checkpoints of VTM and HTM+VTM runs save the VTM block's ``Attention_Vertical`` as
    ``self_attn.query/key/value`` (no bias): ``timm_plugin.cct.checkpoint_filter_fn`` fuses them into qkv."""
    from ..timm_plugin.test_cct import public_checkpoint

    public = public_checkpoint(tmp_path / 'p.pth', 100)
    state = torch.load(tmp_path / 'p.pth', weights_only=True)
    qkv = state['state_dict'].pop('classifier.blocks.2.self_attn.qkv.weight')
    for name, part in zip(('query', 'key', 'value'), qkv.chunk(3, 0)):
        state['state_dict'][f'classifier.blocks.2.self_attn.{name}.weight'] = part.clone()
    torch.save(state, tmp_path / 'vtm.pth')
    model = timm.create_model(
        'cct_7_3x1_32', pretrained=True, pretrained_cfg_overlay=dict(file=str(tmp_path / 'vtm.pth'))
    )
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        assert (model.double().eval()(x) - public(x)).abs().max() < 1e-10
