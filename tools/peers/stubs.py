"""Import stand-ins for the peers' interpreters (nothing from refppo is imported here).

The peers' package ``__init__`` files pull in Ray, vLLM, DeepSpeed and more, which their loss and
advantage code never calls (``/work/shared/peers/README.md``):

- :func:`install_stubs`: a ``sys.meta_path`` finder that serves an inert module for each name of
  :data:`STUBBED` (and ``extra``, and each of ``if_absent`` the venv does not have) and its
  submodules, with the three behaviours the peers need: ``ray.is_initialized() -> False``,
  ``ray.remote`` and ``numba.njit`` are identity decorators.
- :func:`mount`: register a package as a bare module whose ``__path__`` is the installed folder, so
  its submodules load from their own files without running the package's ``__init__``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

STUBBED: tuple[str, ...] = (
    "ray", "vllm", "sglang", "flash_attn", "deepspeed", "peft", "accelerate", "wandb", "tensorboard",
    "datasets", "torchdata", "hydra", "fastapi", "uvicorn", "aiohttp", "httpx", "requests", "tenacity",
    "einops", "flask", "PIL", "numba", "polars", "s3fs", "uvloop", "func_timeout", "debugpy",
    "hf_transfer", "skyrl_gym",
)  # fmt: skip
"""Served inert wherever a peer is imported (never called by the code that runs)."""


def _identity_decorator(*args: Any, **kwargs: Any) -> Any:
    """``@deco`` and ``@deco(...)`` both return the decorated object unchanged."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda f: f


class _StubMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub


class _Stub(metaclass=_StubMeta):
    """Anything: callable, subclassable, attribute access returns another stub."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Stub()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub()

    def __iter__(self) -> Any:
        return iter(())

    def __class_getitem__(cls, item: Any) -> Any:  # ``Stub[...]`` in annotations (torchtune's BaseNode)
        return cls

    def __bool__(self) -> bool:
        return False


_SPECIAL: dict[str, Any] = {
    "ray.is_initialized": lambda *a, **k: False,
    "ray.remote": _identity_decorator,
    "numba.njit": _identity_decorator,
    "numba.jit": _identity_decorator,
}


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _SPECIAL.get(f"{self.__name__}.{name}", _Stub)


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves a :class:`_StubModule` for each of ``names`` and their submodules."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if any(fullname == n or fullname.startswith(n + ".") for n in self.names):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        mod = _StubModule(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install_stubs(extra: Sequence[str] = (), if_absent: Sequence[str] = ()) -> None:
    """Serve inert modules for :data:`STUBBED`, ``extra`` and the ``if_absent`` names this
    interpreter cannot import, before anything imports them."""
    absent = [n for n in if_absent if importlib.util.find_spec(n) is None]
    names = (*STUBBED, *extra, *absent)
    for n in list(sys.modules):
        if any(n == s or n.startswith(s + ".") for s in names):
            del sys.modules[n]
    sys.meta_path.insert(0, StubFinder(names))


def site_packages() -> str:
    return next(p for p in sys.path if p.endswith("site-packages"))


def mount(name: str, site: str | None = None) -> None:
    """Register package ``name`` without running its ``__init__`` (its folder is its ``__path__``)."""
    mod = types.ModuleType(name)
    mod.__path__ = [os.path.join(site or site_packages(), *name.split("."))]
    sys.modules[name] = mod
