"""tokenaug's framework-free core: the mix description and samplers, token masks, label maps and their targets,
the label-path rules of TL-Align, token labeling, TokenMix and TokenMixup, and the checks they share."""

#: the version of the tokenaug distribution (one source: pyproject reads it; timm_plugin and mm_plugin re-export it)
__version__ = '0.1.0'
