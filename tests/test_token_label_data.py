"""Label maps follow the image through timm's loader: crops and flips of quadrant images, both the
fast-collate prefetcher path and the plain path, checked token by token against the pixels."""

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import create_dataset, create_loader
from timm.data.auto_augment import rand_augment_transform
from torchvision import transforms as T

from shared_core.map_store import LabelMapStore, MissingLabelMapError
from timm_plugin.token_label_data import (
    GEOMETRIC_RAND_OPS,
    TokenLabelCollate,
    TokenLabelDataset,
    TokenLabelTarget,
    split_train_transform,
)

from .helpers import COLOURS, quadrant_image  # quadrant_data: the fixture of conftest.py


def pixel_classes(x):
    """Class of each pixel of (B, 3, H, W) images in [0, 1]: nearest quadrant colour."""
    cols = torch.tensor(COLOURS, dtype=torch.float32) / 255.0
    d = ((x.permute(0, 2, 3, 1)[..., None, :] - cols) ** 2).sum(-1)
    return d.argmin(-1)


def loader(root, prefetcher, batch_size=6, **kw):
    ds = TokenLabelDataset(
        create_dataset('', root=str(root), split='train', is_training=True), LabelMapStore.open(root / 'maps')
    )
    return create_loader(
        ds,
        input_size=(3, 64, 64),
        batch_size=batch_size,
        is_training=True,
        use_prefetcher=prefetcher,
        device=torch.device('cpu'),
        mean=(0.0, 0.0, 0.0),
        std=(1.0, 1.0, 1.0),
        scale=(0.08, 1.0),
        hflip=0.5,
        color_jitter=0.0,
        interpolation='nearest',
        num_workers=0,
        collate_fn=TokenLabelCollate(4),
        **kw,
    )


@pytest.mark.parametrize('prefetcher', [True, False])
def test_token_targets_follow_crops_and_flips_through_timms_loader(quadrant_data, prefetcher):
    torch.manual_seed(0)
    checked = flipped = 0
    for _ in range(8):
        for x, target in loader(quadrant_data, prefetcher):
            assert isinstance(target, TokenLabelTarget)
            flipped += int(target.flips.sum())
            t = target.token_targets((4, 4)).dense()  # (B, 16, C)
            torch.testing.assert_close(t.sum(-1), torch.ones_like(t[..., 0]))
            pix = pixel_classes(x.float())  # (B, 64, 64)
            tok = pix.view(-1, 4, 16, 4, 16).permute(0, 1, 3, 2, 4).reshape(len(x), 16, 256)
            pure = (tok == tok[..., :1]).all(-1)  # tokens whose pixels are one quadrant
            assert pure.any()
            assert torch.equal(t.argmax(-1)[pure], tok[..., 0][pure])
            checked += int(pure.sum())
    assert checked > 300 and flipped > 0


def test_randaugment_keeps_only_colour_ops_and_other_geometry_is_refused():
    ra = rand_augment_transform('rand-m9-mstd0.5-inc1', dict(translate_const=20, img_mean=(124, 116, 104)))
    tf = T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip(0.3), ra, T.ToTensor()])
    crop, hflip, rest = split_train_transform(tf)
    assert hflip == 0.3 and isinstance(crop, T.RandomResizedCrop)
    names = {op.name for op in rest.transforms[0].ops}
    assert names and not names & set(GEOMETRIC_RAND_OPS) and 'Rotate' in {op.name for op in ra.ops}
    _, _, kept = split_train_transform(tf, keep_geometric_aa=True)
    assert kept.transforms[0] is ra
    with pytest.raises(ValueError, match='vertical'):
        split_train_transform(T.Compose([T.RandomResizedCrop(32), T.RandomVerticalFlip(0.5)]))
    with pytest.raises(ValueError, match='random resized crop'):
        split_train_transform(T.Compose([T.CenterCrop(32)]))


def test_a_missing_map_names_the_image(quadrant_data, tmp_path):
    import shutil

    root = tmp_path / 'data'
    shutil.copytree(quadrant_data / 'train', root / 'train')
    Image.fromarray(quadrant_image(64, 64, [[0, 1], [2, 3]])).save(root / 'train' / 'c0' / 'zz_new.png')
    ds = TokenLabelDataset(
        create_dataset('', root=str(root), split='train', is_training=True), LabelMapStore.open(quadrant_data / 'maps')
    )
    ds.transform = T.Compose([T.RandomResizedCrop(32), T.PILToTensor()])
    with pytest.raises(MissingLabelMapError, match='c0/zz_new.png'):
        for i in range(len(ds)):
            ds[i]


def test_randaugment_posterize_at_full_magnitude_works_with_this_pillow():
    """timm asks Posterize for 0 bits at magnitude 10 (inc1); Pillow refuses; timm_plugin.fix_posterize fixes it
    (an explicit call: tokenaug-train makes it, and importing timm_plugin does not)."""
    from timm.data import auto_augment
    from timm.data.auto_augment import AugmentOp

    import timm_plugin

    assert auto_augment.NAME_TO_OP['PosterizeIncreasing'] is auto_augment.posterize  # import patches nothing
    timm_plugin.fix_posterize()
    img = Image.fromarray(np.full((8, 8, 3), 200, np.uint8))
    op = AugmentOp('PosterizeIncreasing', prob=1.0, magnitude=10, hparams={})
    assert np.asarray(op(img)).max() == 0
    op = AugmentOp('PosterizeIncreasing', prob=1.0, magnitude=5, hparams={})
    assert np.asarray(op(img)).max() == 192  # 200 keeping 2 bits (4 - 2)


@pytest.mark.parametrize('policy', ['rand-m9-mstd0.5-tweights', 'rand-m9-t3aw'])
def test_weighted_randaugment_policies_keep_matching_weights(policy):
    ra = rand_augment_transform(policy, dict(translate_const=20, img_mean=(124, 116, 104)))
    _, _, rest = split_train_transform(T.Compose([T.RandomResizedCrop(32), ra]))
    kept = rest.transforms[0]
    assert len(kept.choice_weights) == len(kept.ops) < len(ra.ops)
    assert abs(sum(kept.choice_weights) - 1) < 1e-9
    kept(Image.fromarray(np.full((32, 32, 3), 100, np.uint8)))
