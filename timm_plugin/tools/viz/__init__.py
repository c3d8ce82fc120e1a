"""The ``tokenaug-viz`` commands, one module each (:mod:`timm_plugin.tools.viz_cli` dispatches)."""
