"""tokenaug's command line: the console commands (:mod:`tokenaug.commands`) and their argument parsers
(:mod:`tokenaug.train_args` for ``tokenaug-train``, :mod:`tokenaug.tool_args` for the tools). Importing this
package, building a parser or asking a command for ``--help`` loads neither torch, timm nor OpenMMLab; a command
that runs imports its work from :mod:`shared_core`, :mod:`timm_plugin` and :mod:`mm_plugin`.
"""

from shared_core import __version__  # noqa: F401  (the distribution's version)
