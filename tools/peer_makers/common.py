"""Shared by the dump makers (run in the peers' interpreters; nothing from refppo is imported).

- :func:`install_stubs`: a ``sys.meta_path`` finder that serves an inert module for each stubbed
  name and its submodules (ray, vllm, deepspeed, ...; shared/peers/README.md), with the three
  behaviours the peers need: ``ray.is_initialized() -> False``, ``ray.remote`` and ``numba.njit``
  are identity decorators.
- :func:`mount`: register a package as a bare module whose ``__path__`` is the installed folder, so
  its submodules load from their own files without running the package's ``__init__``.
- :func:`inputs`: a random right-padded batch with junk on the padding.
- :func:`save`: one dump (``NAME.pt``), its sidecar (``NAME.pt.json``: hyperparameters) and the
  ``--set`` keys that reproduce it (``NAME.set.json``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HP: dict[str, float] = {
    "gamma": 0.99,
    "lam": 0.95,
    "kl_coef": 0.05,
    "cliprange": 0.2,
    "cliprange_value": 0.5,
    "vf_coef": 0.0,
    "ent_coef": 0.0,
}
"""Hyperparameters shared by every maker's sidecar (a maker may add its own keys)."""

STUBBED: tuple[str, ...] = (
    "ray",
    "vllm",
    "sglang",
    "flash_attn",
    "deepspeed",
    "peft",
    "accelerate",
    "wandb",
    "tensorboard",
    "datasets",
    "torchdata",
    "hydra",
    "fastapi",
    "uvicorn",
    "aiohttp",
    "httpx",
    "requests",
    "tenacity",
    "einops",
    "flask",
    "PIL",
    "numba",
    "polars",
    "s3fs",
    "uvloop",
    "func_timeout",
    "debugpy",
    "hf_transfer",
    "skyrl_gym",
)


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

    def __bool__(self) -> bool:
        return False


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        special: dict[str, Any] = {
            "ray.is_initialized": lambda *a, **k: False,
            "ray.remote": _identity_decorator,
            "numba.njit": _identity_decorator,
            "numba.jit": _identity_decorator,
        }
        key = f"{self.__name__}.{name}"
        if key in special:
            return special[key]
        return _Stub


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
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


def install_stubs(extra: Sequence[str] = ()) -> None:
    """Serve inert modules for :data:`STUBBED` (+ ``extra``) before anything imports them."""
    names = (*STUBBED, *extra)
    for n in list(sys.modules):
        if any(n == s or n.startswith(s + ".") for s in names):
            del sys.modules[n]
    sys.meta_path.insert(0, _StubFinder(names))


def site_packages() -> str:
    return next(p for p in sys.path if p.endswith("site-packages"))


def mount(name: str, site: str | None = None) -> None:
    """Register package ``name`` without running its ``__init__`` (its folder is its ``__path__``)."""
    mod = types.ModuleType(name)
    mod.__path__ = [os.path.join(site or site_packages(), *name.split("."))]
    sys.modules[name] = mod


def inputs(seed: int, B: int = 8, T: int = 16, dtype: Any = None, full_row: bool = True) -> dict[str, Any]:
    """Random right-padded inputs, junk (7.5) on padding. ``full_row``: row 0 has no padding."""
    import torch

    dt = dtype or torch.float64
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[1] = 1
    if full_row:
        lengths[0] = T
    else:
        lengths = torch.clamp(lengths, max=T - 1)
    mask = (torch.arange(T).expand(B, T) < lengths.unsqueeze(1)).to(dt)
    old = -torch.rand(B, T, generator=g, dtype=dt) * 3.0 - 0.1
    junk = torch.full((B, T), 7.5, dtype=dt)

    def pad(x: Any) -> Any:
        return torch.where(mask.bool(), x, junk)

    return {
        "response_mask": mask,
        "old_logprobs": pad(old),
        "ref_logprobs": pad(old + 0.4 * torch.randn(B, T, generator=g, dtype=dt)),
        "logprobs": pad(old + 0.6 * torch.randn(B, T, generator=g, dtype=dt)),
        "old_values": pad(torch.randn(B, T, generator=g, dtype=dt)),
        "values": pad(torch.randn(B, T, generator=g, dtype=dt)),
        "entropy": pad(torch.rand(B, T, generator=g, dtype=dt) * 2.0),
        "scores": 4.0 * torch.randn(B, generator=g, dtype=dt),
    }


def save(
    out: Path,
    name: str,
    dump: dict[str, Any],
    hp: dict[str, Any],
    conv: dict[str, Any],
    control: dict[str, Any] | None = None,
) -> str:
    """Write ``name``'s dump, sidecar (``hp``) and the ``--set`` keys (``conv``); returns ``name``.

    ``control``: ``--set`` keys that flip the option this case exercises; the validator checks that
    the dump then does NOT match (the option is load-bearing, the match is not vacuous).
    """
    import torch

    torch.save({k: v.detach().contiguous() for k, v in dump.items()}, out / f"{name}.pt")
    (out / f"{name}.pt.json").write_text(json.dumps(hp))
    (out / f"{name}.set.json").write_text(json.dumps(conv))
    if control:
        (out / f"{name}.control.json").write_text(json.dumps(control))
    return name


def run_peers(out: Path, makers: dict[str, Callable[[Path], list[str]]]) -> int:
    """Run each maker; record what it made (or why it could not run) in ``out/status-*.json``."""
    import traceback

    status: dict[str, Any] = {}
    for peer, fn in makers.items():
        try:
            status[peer] = {"made": fn(out)}
        except Exception as exc:  # report why a peer cannot be imported/run, then go on
            tb = traceback.format_exc().strip().splitlines()[-4:]
            status[peer] = {"skipped": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}", "tb": tb}
    tag = "-".join(makers)
    (out / f"status-{tag}.json").write_text(json.dumps(status, indent=2))
    return 0
