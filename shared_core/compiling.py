"""The methods under ``torch.compile``.

The methods add forward hooks (and, for TL-Align's shared attention, an attention forward) to the model's
submodules for each call and remove them after it. By default dynamo does not guard on the hooks of the modules it
inlines (``torch._dynamo.config.skip_nnmodule_hook_guards``): a graph traced for one call is then reused for a call
whose hooks differ, which runs without the method's hooks (a plain step traced first, then MixToken's hook ignored:
the tokens silently unmixed). :func:`guard_module_hooks` turns those guards on; the wrappers call it when they are
built, so build the method before the first compiled call (``tokenaug-train`` and the tasks do). Each distinct set
of hooks then compiles once (e.g. MixToken drawn or not) and later steps reuse it.
"""

from __future__ import annotations

__all__ = ['guard_module_hooks']


def guard_module_hooks() -> None:
    """Make ``torch.compile`` guard on module hooks (a process-wide dynamo setting; see the module docstring)."""
    import torch._dynamo

    torch._dynamo.config.skip_nnmodule_hook_guards = False
