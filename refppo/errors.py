"""Errors raised on bad input. Every message names the tensor, what was expected and what was given."""

from __future__ import annotations


class RefPPOError(ValueError):
    """Base class of every input error refppo raises on purpose."""


class ShapeError(RefPPOError):
    """A tensor has the wrong number of dimensions or the wrong size along one."""


class DtypeError(RefPPOError):
    """A tensor has a dtype the step cannot use (e.g. integer log-probs)."""


class MaskError(RefPPOError):
    """A response mask holds values other than 0/1, or a row has no valid token."""


class SingletonGroupError(MaskError):
    """A group estimator under ``singleton='error'`` met prompts with one response each.

    ``groups`` holds those prompts' ``group_index`` values (at most 8), so a caller can name them
    without reading the message (:func:`refppo.pipeline.rollout.critic_free_advantages` catches it by type).
    """

    def __init__(self, groups: list[int], message: str) -> None:
        super().__init__(message)
        self.groups = groups

    def __reduce__(self) -> tuple[type[SingletonGroupError], tuple[list[int], str]]:
        """Picklable across a process boundary (the default would call ``__init__`` with one argument)."""
        return (type(self), (self.groups, str(self)))


class ConventionError(RefPPOError):
    """An unknown convention name; the message lists the valid ones."""


class HyperparameterError(RefPPOError):
    """A hyperparameter is outside its valid range (e.g. gamma > 1, a negative clip range)."""


class DumpError(RefPPOError):
    """A dump (or its hyperparameters) that the oracle cannot use; the message is one line."""
