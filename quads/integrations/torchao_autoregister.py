"""``torchao.quantization.quantize_(model, quads.QuadsPolicy(...))`` right after ``import quads``.

torchao dispatches on configs registered with it; :func:`quads.integrations.torchao.register`
registers ``QuadsPolicy``. Without it torchao fails with its bare "Passing a generic Callable to
`quantize_` is no longer recommended" assertion. Importing torchao costs about 1.3 s (and prints
warnings about its CUDA extensions on CPU machines), so ``import quads`` does not import it;
:func:`install` (run by ``import quads``) instead

* registers at once if torchao's ``quant_api`` is already imported, else
* puts a finder on ``sys.meta_path`` that lets ``torchao.quantization.quant_api`` load as usual
  and registers right after it has executed (then removes itself).

The registration itself is :func:`quads.integrations.torchao.config.register` (no torchao import
at module level there); a failure to register (an unsupported torchao version) is a warning,
never an import error of torchao.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings

__all__ = ["install"]

_TARGET = "torchao.quantization.quant_api"


def _register() -> None:
    try:
        from quads.integrations.torchao.config import register

        register()
    except Exception as err:  # noqa: BLE001 - torchao must still import; say why quads is absent
        warnings.warn(f"quads could not register QuadsPolicy with torchao ({err!r}); "
                      "import quads.integrations.torchao to see the error", stacklevel=2)


class _LoaderThenRegister(importlib.abc.Loader):
    """The real loader of ``quant_api``, then :func:`_register` (other attributes delegated)."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _register()

    def __getattr__(self, name):  # get_source, get_code, ... (tracebacks, inspect)
        return getattr(self._loader, name)


class _RegisterAfterQuantApi(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]  # once
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _LoaderThenRegister(spec.loader)
                return spec
        return None


def install() -> None:
    """Register now if torchao is loaded, else when it is (idempotent)."""
    if _TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, _RegisterAfterQuantApi) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterQuantApi())
