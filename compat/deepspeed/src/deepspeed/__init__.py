"""`deepspeed`, as zerokit's compatibility layer: every `deepspeed.X` is `zerokit.compat.deepspeed.X`.

A meta-path finder, placed first so no other finder loads a second copy of a module under the
`deepspeed.` name, answers each `deepspeed.*` import with the zerokit module itself (the same
object in sys.modules under both names). This file then puts zerokit.compat.deepspeed in
sys.modules as `deepspeed`, so `import deepspeed` returns it too.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

ALIAS = "deepspeed"
TARGET = "zerokit.compat.deepspeed"


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(ALIAS + "."):
            return None
        real = TARGET + fullname[len(ALIAS):]
        try:
            found = importlib.util.find_spec(real)
        except ModuleNotFoundError:
            found = None
        if found is None:
            raise ModuleNotFoundError(f"No module named '{fullname}': zerokit's DeepSpeed "
                                      f"compatibility layer does not mirror it (no {real})", name=fullname)
        spec = importlib.machinery.ModuleSpec(fullname, self, origin=found.origin,
                                              is_package=found.submodule_search_locations is not None)
        spec.loader_state = real
        return spec

    def create_module(self, spec):
        return None  # a placeholder; exec_module swaps in the real module

    def exec_module(self, module):
        # importlib reads sys.modules[name] back after exec_module, so the import yields this one.
        sys.modules[module.__spec__.name] = importlib.import_module(module.__spec__.loader_state)


if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())
sys.modules[__name__] = importlib.import_module(TARGET)
