"""Integrations that load themselves when the library they bridge is imported.

``torchao.quantization.quantize_(model, quads.QuadsPolicy(...))`` needs ``QuadsPolicy``
registered with torchao, which :mod:`quads.integrations.torchao` does when it is imported. Importing
torchao costs about 1.3 s (and warns about its CUDA extensions on CPU machines), so ``import
quads`` imports neither torchao nor the integration; :func:`install` (run by ``import quads``)

* imports the integration at once if torchao's ``quant_api`` is already imported, else
* puts a finder on ``sys.meta_path`` that lets ``torchao.quantization.quant_api`` load as usual
  and imports the integration right after it has executed (then removes itself).

This module names the integration; it does not import it (the package root stays below the
integrations layer). A failure to import it (an unsupported torchao version) is a warning, never
an import error of torchao.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings

__all__ = ["AFTER_IMPORT", "install"]

# library module -> the quads integration imported right after it
AFTER_IMPORT = {"torchao.quantization.quant_api": "quads.integrations.torchao",
                "transformers.quantizers.auto": "quads.integrations.transformers"}


def _load_integration(name: str) -> None:
    integration = AFTER_IMPORT[name]
    try:
        importlib.import_module(integration)
    except Exception as err:  # noqa: BLE001 - the library must still import; say why quads is absent
        warnings.warn(f"quads could not load {integration} after {name} ({err!r}); "
                      f"import {integration} to see the error", stacklevel=2)


class _LoaderThenIntegration(importlib.abc.Loader):
    """The real loader of a library module, then its integration (other attributes delegated)."""

    def __init__(self, loader, name: str):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _load_integration(self._name)

    def __getattr__(self, name):  # get_source, get_code, ... (tracebacks, inspect)
        return getattr(self._loader, name)


class _IntegrationAfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str):
        self.name = name

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]  # once
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _LoaderThenIntegration(spec.loader, name)
                return spec
        return None


def install() -> None:
    """Load each integration now if its library is loaded, else when it is (idempotent)."""
    for name in AFTER_IMPORT:
        if name in sys.modules:
            _load_integration(name)
        elif not any(isinstance(f, _IntegrationAfterImport) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, _IntegrationAfterImport(name))
