"""Refusals of a run's settings, collected so that independent ones are reported
together (one run to learn every setting to change, not one run per setting).

A check raises ``ValueError`` naming the setting and the fix in the trainer's words (its
keyword arguments, ``train_loop_config['...']``, ``datasets['...']``); a :class:`Refusal`
may carry the same message in a recipe's words too (its key path and the YAML to write),
which ``ray-disagg plan|train`` print instead (:mod:`ray_disagg.recipes.words` translates
the others).

Example:
    >>> refusals = Refusals()
    >>> with refusals.check():
    ...     raise ValueError("train_loop_config['eval_every']=50: beyond max_steps=10.")
    >>> with refusals.check():
    ...     raise Refusal("drop datasets['validation'].", recipe="set data.validation: null.")
    >>> try:
    ...     refusals.raise_any()
    ... except RunRefused as e:
    ...     print(e)
    2 settings to change:
      - train_loop_config['eval_every']=50: beyond max_steps=10.
      - drop datasets['validation'].
"""

from __future__ import annotations

import contextlib

__all__ = ["Refusal", "Refusals", "RunRefused", "refusals_of"]


class Refusal(ValueError):
    """A setting the run cannot take, in the trainer's words (``str(e)``) and, where the
    Python spelling does not translate, in a recipe's (:attr:`recipe`)."""

    def __init__(self, message: str, *, recipe: str | None = None):
        super().__init__(message)
        self.recipe = recipe
        """The message in a recipe's words: key paths (``data.validation``) and YAML."""


class RunRefused(ValueError):
    """Several independent refusals of one run (:attr:`errors`), reported together."""

    def __init__(self, errors: list[ValueError]):
        self.errors = list(errors)
        lines = "\n".join(f"  - {e}" for e in self.errors)
        super().__init__(f"{len(self.errors)} settings to change:\n{lines}")


def refusals_of(error: ValueError) -> list[ValueError]:
    """The refusals an error stands for: a :class:`RunRefused`'s, else itself."""
    return list(error.errors) if isinstance(error, RunRefused) else [error]


class Refusals:
    """Collects the ``ValueError``s of independent checks (:meth:`check`) to raise them
    together (:meth:`raise_any`). A check that failed leaves what it would have computed
    unset: give it a default before the ``with`` block."""

    def __init__(self):
        self.errors: list[ValueError] = []

    @contextlib.contextmanager
    def check(self):
        try:
            yield
        except ValueError as e:
            self.errors.extend(refusals_of(e))

    def raise_any(self) -> None:
        """Raise the one refusal as it is, several as a :class:`RunRefused`."""
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise RunRefused(self.errors)
