"""Code copied from other projects, kept as its source has it (their licences apply), apart from ours:

- :mod:`tokenaug._vendor.timm_train_parser`: the argument definitions of timm's ``train.py``
  (huggingface/pytorch-image-models, Apache-2.0), from commit aa4b5850 (timm 1.0.29.dev0), with the flags
  timm 1.0.31's own tests drive; :mod:`tokenaug.train_args` builds ``tokenaug-train``'s parser on it.
"""
