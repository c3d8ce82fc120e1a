"""``custom_imports=dict(imports=['mm_plugin', 'mm_plugin.enable_safe_load'])``: the config-side call of
:func:`mm_plugin.mmengine_safe_load.allow_mmengine_checkpoints`, so MMEngine's own checkpoints (``--resume``,
``load_from``, the test scripts) load under torch's ``weights_only=True`` default. This module exists only to
make that call from a config, which can list imports but not calls; ``import mm_plugin`` itself changes nothing.
"""

from .mmengine_safe_load import allow_mmengine_checkpoints

allow_mmengine_checkpoints()
