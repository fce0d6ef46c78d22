"""HDET: groups of data-parallel replicas at different learning rates that vote and blend.

The rules (what a vote decides, pure) are in :mod:`lightning_hdet.hdet.rules`; the modules beside it carry the
decisions out (process groups, merges, the guard) and plug them into Lightning. The rules' modules lived here before
(``lightning_hdet.hdet.votes``, ``...options``, ...): those paths still import, as the same module objects, so
imports, YAML ``class_path`` values and pickles that name them keep working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Optional, Sequence

#: The rules' modules by their earlier name (``lightning_hdet.hdet.<name>`` -> ``lightning_hdet.hdet.rules.<name>``).
MOVED = ("votes", "selection", "trust_region", "safety_net", "collapse", "plateau", "blends", "signals", "options",
         "config", "controller", "defaults")

_OWN_SPECS: dict[str, importlib.machinery.ModuleSpec] = {}


class _EarlierPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``lightning_hdet.hdet.<name>`` of :data:`MOVED` as the module of ``hdet.rules`` itself (one object)."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
                  ) -> Optional[importlib.machinery.ModuleSpec]:
        prefix, _, name = fullname.rpartition(".")
        if prefix != __name__ or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(f"{__name__}.rules.{spec.name.rpartition('.')[2]}")
        _OWN_SPECS[spec.name] = module.__spec__  # the import system sets the earlier name's on it next
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module ran under its own name); its own spec goes back."""
        module.__spec__ = _OWN_SPECS.pop(module.__spec__.name)


if not any(isinstance(finder, _EarlierPaths) for finder in sys.meta_path):
    sys.meta_path.append(_EarlierPaths())
