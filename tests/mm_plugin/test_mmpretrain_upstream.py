"""MMPretrain 1.2.0's own tests of its batch augments and of ``ClsDataPreprocessor``, run on tokenaug's classes.

Ported from open-mmlab/mmpretrain at v1.2.0 (commit 17a886cb5825cd8c26df4e65f7112d404b99fe12; both files are
unchanged at the newest stored commit ee7f2e88):

- ``tests/test_models/test_utils/test_batch_augments.py``: ``Mixup`` -> :class:`mm_plugin.TAMixup`,
  ``CutMix`` -> :class:`mm_plugin.TACutMix`, inside mmpretrain's own ``RandomBatchAugment``. ``ResizeMix`` has
  no tokenaug counterpart: its two cases (the same template as Mixup's) run on our other augments,
  :class:`mm_plugin.TAMixToken` and :class:`mm_plugin.TATokenMix`.
- ``tests/test_models/test_utils/test_data_preprocessor.py``: ``TestClsDataPreprocessor`` ->
  :class:`mm_plugin.TokenAugDataPreprocessor` (a ``ClsDataPreprocessor``). Its ``SelfSup``/``TwoNorm``/``Video``
  preprocessors have no tokenaug counterpart and are not ported.

Upstream's structure and assertions are kept; each departure says why, where it is. Upstream's ``alpha='unknown'``
cases pass as they are: our argument errors are :class:`shared_core.checks.ArgumentError`, a ``ValueError`` that
is also the ``AssertionError`` mmpretrain's augments raise.

Copyright (c) OpenMMLab. All rights reserved. The original tests are licensed under the Apache License 2.0
(https://github.com/open-mmlab/mmpretrain/blob/main/LICENSE); this adaptation is part of tokenaug (Apache-2.0).
"""

from unittest import TestCase
from unittest.mock import patch

import numpy as np
import pytest
import torch
from mmengine.registry import DefaultScope
from mmpretrain.models import RandomBatchAugment
from mmpretrain.registry import BATCH_AUGMENTS, MODELS
from mmpretrain.structures import DataSample

from mm_plugin import TAMixup, TokenAugDataPreprocessor, mix_from_samples
from shared_core.checks import ArgumentError
from shared_core.mix import mix_images, mix_rows


@pytest.fixture(autouse=True)
def mmpretrain_scope():
    """Build from mmpretrain's registries whatever scope an earlier test left current, and restore that one."""
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        yield


# ---------------------------------------------------------------------------------------------------------------
# test_batch_augments.py
# ---------------------------------------------------------------------------------------------------------------
class TestRandomBatchAugment(TestCase):
    def test_initialize(self):
        # test single augmentation
        augments = dict(type='TAMixup', alpha=1.0)
        batch_augments = RandomBatchAugment(augments)
        self.assertIsInstance(batch_augments.augments, list)
        self.assertEqual(len(batch_augments.augments), 1)

        # test specify augments with object
        augments = TAMixup(alpha=1.0)
        batch_augments = RandomBatchAugment(augments)
        self.assertIsInstance(batch_augments.augments, list)
        self.assertEqual(len(batch_augments.augments), 1)

        # test multiple augmentation
        augments = [
            dict(type='TAMixup', alpha=1.0),
            dict(type='TACutMix', alpha=0.8),
        ]
        batch_augments = RandomBatchAugment(augments)
        # mixup, cutmix
        self.assertEqual(len(batch_augments.augments), 2)
        self.assertIsNone(batch_augments.probs)

        # test specify probs
        augments = [
            dict(type='TAMixup', alpha=1.0),
            dict(type='TACutMix', alpha=0.8),
        ]
        batch_augments = RandomBatchAugment(augments, probs=[0.5, 0.3])
        # mixup, cutmix and None
        self.assertEqual(len(batch_augments.augments), 3)
        self.assertAlmostEqual(batch_augments.probs[-1], 0.2)

        # test assertion
        with self.assertRaisesRegex(AssertionError, 'Got 2 vs 1'):
            RandomBatchAugment(augments, probs=0.5)

        with self.assertRaisesRegex(AssertionError, 'exceeds 1.'):
            RandomBatchAugment(augments, probs=[0.5, 0.6])

    def test_call(self):
        inputs = torch.rand(2, 3, 224, 224)
        scores = torch.rand(2, 10)

        augments = [
            dict(type='TAMixup', alpha=1.0),
            dict(type='TACutMix', alpha=0.8),
        ]
        batch_augments = RandomBatchAugment(augments, probs=[0.5, 0.3])

        # Upstream swaps augments[1] for a MagicMock and asserts it was called once with (inputs, scores). We keep
        # the real TACutMix (no mocks): that it ran, and on (inputs, scores), shows in the mix it kept (last_mix),
        # which must be the one that made the outputs, while TAMixup kept none. numpy's RNG is a real
        # RandomState(0), as upstream, whose first draw (0.549) picks index 1 under probs [0.5, 0.3, 0.2].
        mixup, cutmix = batch_augments.augments[:2]
        with patch('numpy.random', np.random.RandomState(0)):
            mixed_inputs, mixed_scores = batch_augments(inputs, scores)
        self.assertIsNone(mixup.last_mix)
        mix = cutmix.last_mix
        self.assertIsNotNone(mix)
        self.assertEqual(mix.kind, 'cutmix')
        torch.testing.assert_close(mixed_inputs, mix_images(inputs, mix))
        torch.testing.assert_close(mixed_scores, mix_rows(scores, mix.partner, 1.0 - mix.lam))

        augments = [
            dict(type='TAMixup', alpha=1.0),
            dict(type='TACutMix', alpha=0.8),
        ]
        batch_augments = RandomBatchAugment(augments, probs=[0.0, 0.0])
        mixed_inputs, mixed_samples = batch_augments(inputs, scores)
        self.assertIs(mixed_inputs, inputs)
        self.assertIs(mixed_samples, scores)


class TestTAMixup(TestCase):
    DEFAULT_ARGS = dict(type='TAMixup', alpha=1.0)

    def test_initialize(self):
        # as upstream: ArgumentError is an AssertionError (and a ValueError, as all our argument checks)
        with self.assertRaises(AssertionError):
            cfg = {**self.DEFAULT_ARGS, 'alpha': 'unknown'}
            BATCH_AUGMENTS.build(cfg)

    def test_call(self):
        inputs = torch.rand(2, 3, 224, 224)
        scores = torch.rand(2, 10)

        mixup = BATCH_AUGMENTS.build(self.DEFAULT_ARGS)
        mixed_inputs, mixed_scores = mixup(inputs, scores)
        self.assertEqual(mixed_inputs.shape, (2, 3, 224, 224))
        self.assertEqual(mixed_scores.shape, (2, 10))

        # test binary classification
        scores = torch.rand(2, 1)

        mixed_inputs, mixed_scores = mixup(inputs, scores)
        self.assertEqual(mixed_inputs.shape, (2, 3, 224, 224))
        self.assertEqual(mixed_scores.shape, (2, 1))


class TestTACutMix(TestCase):
    DEFAULT_ARGS = dict(type='TACutMix', alpha=1.0)

    def test_initialize(self):
        # as upstream: ArgumentError is an AssertionError (and a ValueError, as all our argument checks)
        with self.assertRaises(AssertionError):
            cfg = {**self.DEFAULT_ARGS, 'alpha': 'unknown'}
            BATCH_AUGMENTS.build(cfg)

    def test_call(self):
        inputs = torch.rand(2, 3, 224, 224)
        scores = torch.rand(2, 10)

        # test with cutmix_minmax
        cfg = {**self.DEFAULT_ARGS, 'cutmix_minmax': (0.1, 0.2)}
        cutmix = BATCH_AUGMENTS.build(cfg)
        mixed_inputs, mixed_scores = cutmix(inputs, scores)
        self.assertEqual(mixed_inputs.shape, (2, 3, 224, 224))
        self.assertEqual(mixed_scores.shape, (2, 10))

        # test without correct_lam
        cfg = {**self.DEFAULT_ARGS, 'correct_lam': False}
        cutmix = BATCH_AUGMENTS.build(cfg)
        mixed_inputs, mixed_scores = cutmix(inputs, scores)
        self.assertEqual(mixed_inputs.shape, (2, 3, 224, 224))
        self.assertEqual(mixed_scores.shape, (2, 10))

        # test default settings
        cutmix = BATCH_AUGMENTS.build(self.DEFAULT_ARGS)
        mixed_inputs, mixed_scores = cutmix(inputs, scores)
        self.assertEqual(mixed_inputs.shape, (2, 3, 224, 224))
        self.assertEqual(mixed_scores.shape, (2, 10))

        # test binary classification
        scores = torch.rand(2, 1)

        mixed_inputs, mixed_scores = cutmix(inputs, scores)
        self.assertEqual(mixed_inputs.shape, (2, 3, 224, 224))
        self.assertEqual(mixed_scores.shape, (2, 1))


class TestTAMixToken(TestCase):
    """Upstream's TestResizeMix cases (ResizeMix has no tokenaug counterpart) on our MixToken."""

    DEFAULT_ARGS = dict(type='TAMixToken', alpha=1.0)

    def test_initialize(self):
        # as upstream: ArgumentError is an AssertionError (and a ValueError, as all our argument checks)
        with self.assertRaises(AssertionError):
            cfg = {**self.DEFAULT_ARGS, 'alpha': 'unknown'}
            BATCH_AUGMENTS.build(cfg)

    def test_call(self):
        inputs = torch.rand(2, 3, 224, 224)
        scores = torch.rand(2, 10)

        mixup = BATCH_AUGMENTS.build(self.DEFAULT_ARGS)
        mixed_inputs, mixed_scores = mixup(inputs, scores)
        self.assertEqual(mixed_inputs.shape, (2, 3, 224, 224))
        self.assertEqual(mixed_scores.shape, (2, 10))

        # test binary classification
        scores = torch.rand(2, 1)

        mixed_inputs, mixed_scores = mixup(inputs, scores)
        self.assertEqual(mixed_inputs.shape, (2, 3, 224, 224))
        self.assertEqual(mixed_scores.shape, (2, 1))


class TestTATokenMix(TestTAMixToken):
    """Upstream's TestResizeMix cases (ResizeMix has no tokenaug counterpart) on our TokenMix."""

    DEFAULT_ARGS = dict(type='TATokenMix', alpha=1.0)


# ---------------------------------------------------------------------------------------------------------------
# test_data_preprocessor.py
# ---------------------------------------------------------------------------------------------------------------
class TestTokenAugDataPreprocessor(TestCase):
    def test_stack_batch(self):
        cfg = dict(type='TokenAugDataPreprocessor')
        processor: TokenAugDataPreprocessor = MODELS.build(cfg)

        data = {'inputs': [torch.randint(0, 256, (3, 224, 224))], 'data_samples': [DataSample().set_gt_label(1)]}
        processed_data = processor(data)
        inputs = processed_data['inputs']
        data_samples = processed_data['data_samples']
        self.assertEqual(inputs.shape, (1, 3, 224, 224))
        self.assertEqual(len(data_samples), 1)
        self.assertTrue((data_samples[0].gt_label == torch.tensor([1])).all())

    def test_padding(self):
        cfg = dict(type='TokenAugDataPreprocessor', pad_size_divisor=16)
        processor: TokenAugDataPreprocessor = MODELS.build(cfg)

        data = {'inputs': [torch.randint(0, 256, (3, 255, 255)), torch.randint(0, 256, (3, 224, 224))]}
        inputs = processor(data)['inputs']
        self.assertEqual(inputs.shape, (2, 3, 256, 256))

        data = {'inputs': torch.randint(0, 256, (2, 3, 255, 255))}
        inputs = processor(data)['inputs']
        self.assertEqual(inputs.shape, (2, 3, 256, 256))

    def test_to_rgb(self):
        cfg = dict(type='TokenAugDataPreprocessor', to_rgb=True)
        processor: TokenAugDataPreprocessor = MODELS.build(cfg)

        # torch.testing.assert_close for upstream's assert_allclose, deprecated since torch 1.12 (a FutureWarning in
        # every run); both compare float tensors with the same default tolerances
        data = {'inputs': [torch.randint(0, 256, (3, 224, 224))]}
        inputs = processor(data)['inputs']
        torch.testing.assert_close(data['inputs'][0].flip(0).float(), inputs[0])

        data = {'inputs': torch.randint(0, 256, (1, 3, 224, 224))}
        inputs = processor(data)['inputs']
        torch.testing.assert_close(data['inputs'].flip(1).float(), inputs)

    def test_normalization(self):
        cfg = dict(type='TokenAugDataPreprocessor', mean=[127.5, 127.5, 127.5], std=[127.5, 127.5, 127.5])
        processor: TokenAugDataPreprocessor = MODELS.build(cfg)

        data = {'inputs': [torch.randint(0, 256, (3, 224, 224))]}
        processed_data = processor(data)
        inputs = processed_data['inputs']
        self.assertTrue((inputs >= -1).all())
        self.assertTrue((inputs <= 1).all())
        self.assertIsNone(processed_data['data_samples'])

        data = {'inputs': torch.randint(0, 256, (1, 3, 224, 224))}
        inputs = processor(data)['inputs']
        self.assertTrue((inputs >= -1).all())
        self.assertTrue((inputs <= 1).all())

    def test_batch_augmentation(self):
        cfg = dict(
            type='TokenAugDataPreprocessor',
            num_classes=10,
            batch_augments=dict(augments=[dict(type='TAMixup', alpha=0.8), dict(type='TACutMix', alpha=1.0)]),
        )
        processor: TokenAugDataPreprocessor = MODELS.build(cfg)
        self.assertIsInstance(processor.batch_augments, RandomBatchAugment)
        image = torch.randint(0, 256, (3, 224, 224))
        data = {'inputs': [image], 'data_samples': [DataSample().set_gt_label(1)]}
        processed_data = processor(data, training=True)
        self.assertIn('inputs', processed_data)
        self.assertIn('data_samples', processed_data)
        # ours, token-aware: the samples carry the batch's mix. A batch of 1 (upstream's) mixes with itself, so the
        # images and the target stay as they are (mmpretrain's augments take any batch size; so do ours)
        mix = mix_from_samples(processed_data['data_samples'])
        self.assertIsNotNone(mix)
        self.assertIn(mix.kind, ('mixup', 'cutmix'))
        self.assertEqual(mix.batch_size, 1)
        self.assertEqual(mix.partner.tolist(), [0])
        unmixed = processor({'inputs': [image], 'data_samples': [DataSample().set_gt_label(1)]})['inputs']
        torch.testing.assert_close(processed_data['inputs'], unmixed)
        torch.testing.assert_close(processed_data['data_samples'][0].gt_score, torch.eye(10)[1])

        cfg['batch_augments'] = None
        processor: TokenAugDataPreprocessor = MODELS.build(cfg)
        self.assertIsNone(processor.batch_augments)
        data = {'inputs': [torch.randint(0, 256, (3, 224, 224))]}
        processed_data = processor(data, training=True)
        self.assertIn('inputs', processed_data)
        self.assertIsNone(processed_data['data_samples'])


def test_argument_errors_are_both_kinds():
    """Not upstream: the error upstream's ``alpha='unknown'`` cases catch as AssertionError is our ValueError,
    with our message, for every augment argument (mmpretrain asserts alpha, CutMix's minmax, the scores' shape)."""
    bad = [
        (dict(type='TAMixup', alpha='unknown'), r"alpha: expected a number, got 'unknown' \(str\)"),
        (dict(type='TACutMix', alpha=0.0), 'alpha: expected a number > 0, got 0.0'),
        (dict(type='TACutMix', alpha=1.0, cutmix_minmax=(0.1,)), r'cutmix_minmax must be \(min, max\)'),
        (dict(type='TAMixToken', alpha=1.0, mode='batches'), 'mode must be one of'),
        (dict(type='TATokenMix', alpha=1.0, mask='grid'), "mask must be 'block' or 'random'"),
    ]
    for cfg, match in bad:
        for kind in (ArgumentError, ValueError, AssertionError):
            with pytest.raises(kind, match=match):
                BATCH_AUGMENTS.build(cfg)
    mixup = BATCH_AUGMENTS.build(dict(type='TAMixup', alpha=1.0))
    with pytest.raises(AssertionError, match=r'batch_score: expected \(N=2, num_classes\) scores, got \(2,\)'):
        mixup(torch.rand(2, 3, 32, 32), torch.rand(2))
