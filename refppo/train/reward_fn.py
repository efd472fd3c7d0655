"""A reward written as a Python function: ``--reward package.module:function``.

The function is called once per response as ``score = function(prompt, response)`` and must
return one real number. What it receives, exactly:

=================== =========================================================================
``prompt``          ``tokenizer.decode(prompt_ids)`` of the prompt as the policy saw it (left
                    padding removed). The prompt is tokenized with ``task.add_special_tokens``
                    (default false: no BOS is added, so a Llama-style tokenizer's ``<s>`` is not
                    there); the decoded text may differ from the prompts-file line in spacing.
``response``        ``tokenizer.decode(response_ids)`` of the sampled tokens, up to and including
                    the first EOS (nothing after it is ever sampled).
special tokens      default (``task.reward_special_tokens = false``): decoded with
                    ``skip_special_tokens=True``, so the final EOS, any padding token the policy
                    sampled mid-response, a BOS and every other special token are removed from
                    both strings (as TRL's ``GRPOTrainer`` decodes completions for its reward
                    functions, ``trl/trainer/grpo_trainer.py``). ``true``: decoded with
                    ``skip_special_tokens=False``, every special token spelled out (``</s>``,
                    ``<pad>``, ``<s>``) — for a reward that wants to see them.
truncation          a response cut at ``rollout.max_new_tokens`` without EOS is passed as it is;
                    ``rollout.missing_eos_penalty`` is subtracted from the score afterwards.
=================== =========================================================================

Accepted results: any real number — ``int``, ``float``, ``fractions.Fraction``, numpy integer and
floating scalars (``np.float32(0.5)``), and numpy arrays / torch tensors with exactly one element
of a real dtype. Refused, each with one line naming the function and the prompt: ``bool``,
complex numbers, strings, ``None``, arrays with more or fewer than one element, NaN and ±inf.

Errors are told apart:

* the function cannot be called as ``f(prompt, response)`` (checked with
  ``inspect.signature(fn).bind`` when it is loaded, before any model is built);
* the function raised: the message names the exception, the prompt and the response (truncated),
  followed by the traceback of the user's own frames only (refppo's frames are cut off);
* the function returned something that is not a finite real number.

Module lookup behaves like ``python -m``: the current directory is put at the front of
``sys.path`` before the module is imported, so ``--reward myrewards:score`` finds
``./myrewards.py`` under the ``refppo`` console script as under ``python -m refppo``.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import os
import sys
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any, cast

import numpy as np
import torch

from refppo.errors import RefPPOError
from refppo.models.roles import RewardFn

TextRewardFn = Callable[[str, str], Any]
"""``fn(prompt: str, response: str) -> real number`` (see the module docstring)."""

SHOWN_CHARS = 80
"""Prompt / response characters quoted in an error message."""


class RewardFunctionError(RefPPOError):
    """A user reward function that cannot be loaded or called, raised, or returned a bad value."""


def _short(text: str, n: int = SHOWN_CHARS) -> str:
    return repr(text if len(text) <= n else text[:n] + "…")


def resolve_reward_function(spec: str) -> TextRewardFn:
    """Import ``package.module:function`` (the current directory first on ``sys.path``, as
    ``python -m``) and check that it can be called as ``f(prompt, response)``."""
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise RewardFunctionError(f"--reward {spec!r}: expected package.module:function")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise RewardFunctionError(
            f"--reward {spec!r}: cannot import module {mod_name!r}: {e} (searched the current "
            f"directory {cwd!r} and sys.path)"
        ) from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise RewardFunctionError(f"--reward {spec!r}: module {mod_name!r} has no callable {fn_name!r}")
    check_signature(fn, spec)
    return cast(TextRewardFn, fn)


def check_signature(fn: Callable[..., Any], name: str) -> None:
    """Raise :class:`RewardFunctionError` unless ``fn("prompt", "response")`` binds to ``fn``'s
    signature (functions without an introspectable signature, e.g. some builtins, pass)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to check: the call itself will tell
        return
    try:
        sig.bind("prompt", "response")
    except TypeError as e:
        raise RewardFunctionError(
            f"reward function {name}{sig} cannot be called as f(prompt: str, response: str): {e}"
        ) from None


def as_real(value: Any) -> float | None:
    """``value`` as a float if it is a real number (see the module docstring), else None.

    NaN and ±inf are returned as they are (the caller names them)."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            return None
        return float(value.detach().cpu().reshape(()).item())
    if isinstance(value, np.ndarray):
        if value.size != 1 or value.dtype.kind not in "iuf":
            return None
        return float(value.reshape(()).item())
    return None


def _describe(value: Any) -> str:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return f"{type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + '…'}"


def _user_traceback(e: BaseException, tb: TracebackType | None) -> str:
    """The traceback of ``e`` from ``tb`` on (the user's frames only), indented."""
    lines = traceback.TracebackException(type(e), e, tb).format()
    return "".join("  " + line for chunk in lines for line in chunk.splitlines(keepends=True))


def text_reward(
    fn: TextRewardFn, tokenizer: Any, *, keep_special_tokens: bool = False, name: str | None = None
) -> RewardFn:
    """Wrap a text reward ``fn(prompt, response)`` as an ids-level :data:`refppo.models.roles.RewardFn`.

    Both id lists are decoded with ``skip_special_tokens=not keep_special_tokens``. The signature
    is checked here (before any call); a call that raises, or a result that is not a finite real
    number, raises :class:`RewardFunctionError` naming the function and the prompt."""
    label = name or str(getattr(fn, "__qualname__", repr(fn)))
    check_signature(fn, label)
    skip = not keep_special_tokens

    def reward(prompt_ids: list[int], response_ids: list[int]) -> float:
        p = tokenizer.decode(prompt_ids, skip_special_tokens=skip)
        r = tokenizer.decode(response_ids, skip_special_tokens=skip)
        where = f"the prompt {_short(p)} (response {_short(r)})"
        try:
            value = fn(p, r)
        except Exception as e:  # the user's code: report it with its own frames, whatever it is
            user_tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
            raise RewardFunctionError(
                f"reward function {label} raised {type(e).__name__} on {where}: {e}\n"
                + _user_traceback(e, user_tb).rstrip("\n")
            ) from e
        x = as_real(value)
        if x is None:
            raise RewardFunctionError(
                f"reward function {label}: expected a number, got {_describe(value)} on {where}"
            )
        if not math.isfinite(x):
            raise RewardFunctionError(
                f"reward function {label} returned {x} on {where}; a reward must be a finite number"
            )
        return x

    return reward


def load_reward_function(spec: str, tokenizer: Any, *, keep_special_tokens: bool = False) -> RewardFn:
    """``package.module:function`` → an ids-level reward (:func:`resolve_reward_function`, then
    :func:`text_reward`)."""
    return text_reward(
        resolve_reward_function(spec), tokenizer, keep_special_tokens=keep_special_tokens, name=spec
    )


__all__ = [
    "RewardFunctionError",
    "TextRewardFn",
    "as_real",
    "check_signature",
    "load_reward_function",
    "resolve_reward_function",
    "text_reward",
]
