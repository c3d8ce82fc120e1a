"""A segmentation or detection user without mmpretrain: our mmseg / mmdet configs build, and tokenaug-convert
runs, in a process where every ``import mmpretrain`` fails."""

import subprocess
import sys
import textwrap

from ..conftest import REPO


def test_seg_det_configs_and_convert_need_no_mmpretrain(tmp_path, run_env):
    code = textwrap.dedent(
        f"""
        import os, sys
        sys.modules['mmpretrain'] = None  # any import of mmpretrain now raises ImportError
        import timm, torch
        from mmengine.config import Config
        import mm_plugin
        assert not mm_plugin.HAS_MMPRETRAIN and mm_plugin.HAS_MMSEG
        os.environ['TOKENAUG_WORLD'] = {str(tmp_path)!r}
        from mmseg.registry import MODELS as SEG
        from mmseg.utils import register_all_modules as seg_modules
        seg_modules()
        for name in ('upernet_vit-tiny_world.py', 'upernet_swin-mini_world.py', 'fcn_lvvit-tiny_world.py'):
            cfg = Config.fromfile(os.path.join({str(REPO)!r}, 'configs', 'mmseg', name))
            print(name, type(SEG.build(cfg.model)).__name__)
        from mmdet.registry import MODELS as DET
        from mmdet.utils import register_all_modules as det_modules
        det_modules()
        cfg = Config.fromfile(os.path.join({str(REPO)!r}, 'configs', 'mmdet', 'cascade-mask-rcnn_swin-mini_world.py'))
        print('det', type(DET.build(cfg.model)).__name__)
        from mm_plugin.convert_cli import main
        torch.manual_seed(0)
        torch.save({{'state_dict': timm.create_model('deit_tiny_patch16_224', img_size=32, patch_size=8).state_dict()}},
                   {str(tmp_path / 'cls.pth')!r})
        rc = main(['--src', {str(tmp_path / 'cls.pth')!r}, '--dst', {str(tmp_path / 'seg.pth')!r}, '--to', 'mmseg',
                   '--model', 'deit_tiny_patch16_224', '--model-kwargs', 'img_size=32', 'patch_size=8'])
        loaded = sorted(k for k, v in sys.modules.items() if k.startswith('mmpretrain') and v is not None)
        print('convert rc', rc, 'mmpretrain modules', loaded)
        """
    )
    res = subprocess.run([sys.executable, '-c', code], env=run_env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert 'upernet_vit-tiny_world.py PretrainedEncoderDecoder' in out
    assert 'fcn_lvvit-tiny_world.py PretrainedEncoderDecoder' in out
    assert 'det CascadeRCNN' in out and 'convert rc 0 mmpretrain modules []' in out, out
