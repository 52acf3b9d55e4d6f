"""Register the ``df.mpshuffle`` accessor without making ``import mpshuffle`` heavy.

Importing ``dask.dataframe`` takes over a second, and ``import mpshuffle`` a
few milliseconds. So :func:`install` registers the accessor right away only
when ``dask.dataframe`` is already imported; otherwise it adds a finder to
:data:`sys.meta_path` that registers it right after ``dask.dataframe`` is
first imported (PEP 451 finder/loader protocol), and then removes itself.
"""

from __future__ import annotations

import sys

# Not ``typing.TYPE_CHECKING``: importing typing would double this module's
# import time; type checkers honour a module-level constant of this name.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

__all__ = ["install"]

_TARGET = "dask.dataframe"


def _register() -> None:
    from mpshuffle.dask.accessor import register_accessor

    register_accessor()


class _Loader:
    """Runs the real loader of ``dask.dataframe``, then registers the accessor.

    Duck-typed (not an ``importlib.abc.Loader``): importing ``importlib.abc``
    alone would cost ``import mpshuffle`` some 30 ms.
    """

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _register()

    def __getattr__(self, name: str) -> Any:
        # get_resource_reader, is_package, ... of the wrapped loader.
        return getattr(self._loader, name)


class _Finder:
    """Finds ``dask.dataframe`` with the other finders and wraps its loader, once."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != _TARGET:
            return None
        _uninstall()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def _uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]


def install() -> None:
    """Register the accessor now if ``dask.dataframe`` is imported, else on its import.

    Errors of the registration itself (another ``mpshuffle`` attribute, say)
    surface when ``dask.dataframe`` is imported.
    """
    if _TARGET in sys.modules:
        _register()
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
