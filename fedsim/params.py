"""Constraints on parameter values: the one declarative way to state a component's limits.

A component declares each parameter once, in its ``__init__`` signature, with its type, its default
and, where the value is limited, constraint objects in ``typing.Annotated``::

    def __init__(self, iterations: Annotated[int, Range(1)] = 300,
                 mode: Annotated[str, OneOf("a", "b")] = "a",
                 ratio: Annotated[float, Range(0, 1, open_low=True)] = 0.5): ...

:func:`fedsim.components.check_value` (called by ``Registry.check_params`` for every config entry)
checks the type and then every constraint, and the config schema (:data:`fedsim.config.SCHEMA`) uses
the same objects for its fixed keys, so every limit produces the same one-line error naming the key
(``attack.params.dlg.iterations must be >= 1, got 0``). Checks that relate several parameters, or a
parameter to the rest of the config, belong in the component's ``validate_config``.

This module imports nothing from fedsim (:class:`ConfigError` lives here and is re-exported by
:mod:`fedsim.components`).
"""
from __future__ import annotations

import math
import typing
from typing import Any, Callable, Sequence


class ConfigError(ValueError):
    """A config value is missing, unknown or out of range; the message names the key."""


class Constraint:
    """A limit on one parameter's value. ``check`` raises :class:`ConfigError` naming ``key``; it is
    called with values that already have the declared type (and never with None). ``why`` (a keyword of
    every constraint) says what a bad value would break; it ends the error line."""

    why: str = ""

    def check(self, key: str, value: Any) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def refuse(self, key: str, value: Any) -> ConfigError:
        """The one error line: ``KEY must be DESCRIPTION, got VALUE[ (WHY)]``."""
        return ConfigError(f"{key} must be {self.describe()}, got {value!r}{f' ({self.why})' if self.why else ''}")

    def describe(self) -> str:  # pragma: no cover - interface
        """What an allowed value is, as words after "must be"."""
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:  # equal constraints make equal annotations
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.describe()))


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else f"{x}"


class Range(Constraint):
    """A number in an interval: ``Range(1)`` is ``>= 1``, ``Range(0, open_low=True)`` ``> 0``,
    ``Range(0, 1)`` ``in [0, 1]``, ``Range(0, 1, open_high=True)`` ``in [0, 1)``, ``Range(high=5)`` ``<= 5``."""

    def __init__(self, low: float | None = None, high: float | None = None, *, open_low: bool = False,
                 open_high: bool = False, why: str = ""):
        self.low, self.high, self.open_low, self.open_high, self.why = low, high, open_low, open_high, why

    def contains(self, value: Any) -> bool:
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.open_high else value > self.high))

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return (f"in {'(' if self.open_low else '['}{_num(self.low)}, {_num(self.high)}"
                    f"{')' if self.open_high or self.high == math.inf else ']'}")
        if self.low is not None:
            return f"{'>' if self.open_low else '>='} {_num(self.low)}"
        if self.high is not None:
            return f"{'<' if self.open_high else '<='} {_num(self.high)}"
        return "a number"

    def check(self, key: str, value: Any) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not self.contains(value):
            raise self.refuse(key, value)

    def __repr__(self) -> str:
        return f"Range({self.describe()})"


class OneOf(Constraint):
    """One of a fixed set of values (``OneOf("sum", "mean")``; ``OneOf(None, "strong_wolfe")``)."""

    def __init__(self, *choices: Any, why: str = ""):
        self.choices, self.why = tuple(choices), why

    def describe(self) -> str:
        return f"one of {list(self.choices)}"

    def check(self, key: str, value: Any) -> None:
        if not any(c == value and isinstance(c, bool) == isinstance(value, bool) for c in self.choices):
            raise self.refuse(key, value)

    def __repr__(self) -> str:
        return f"OneOf{self.choices!r}"


class Satisfies(Constraint):
    """A value a predicate accepts, described in words (for structured values: lists of patterns,
    per-layer weights): ``Satisfies(is_patterns, "a list of parameter-name patterns (fnmatch)")``."""

    def __init__(self, predicate: Callable[[Any], bool], description: str, *, why: str = ""):
        self.predicate, self.description, self.why = predicate, description, why

    def describe(self) -> str:
        return self.description

    def check(self, key: str, value: Any) -> None:
        if not self.predicate(value):
            raise self.refuse(key, value)

    def __repr__(self) -> str:
        return f"Satisfies({self.description!r})"


class CountOrFraction(Constraint):
    """A count or a share, told apart by the type: an integer is a count (``>= low``; odd with ``odd``),
    a number with a decimal point a fraction in (0, 1] of ``of``. ``why`` says what a bad count breaks.
    (SecAgg+'s ``num_shares``: ``CountOrFraction(3, of="the round's clients", odd=True)``.)"""

    def __init__(self, low: int, *, of: str, odd: bool = False, why: str = ""):
        self.low, self.of, self.odd, self.why = low, of, odd, why

    def describe(self) -> str:
        return f"{'an odd' if self.odd else 'an'} integer >= {self.low} or a fraction in (0, 1] of {self.of}"

    def check(self, key: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        if isinstance(value, int):
            if value < self.low or (self.odd and value % 2 == 0):
                raise ConfigError(f"{key} must be {self.describe()}, got {value}{': ' + self.why if self.why else ''}")
        elif not 0 < value <= 1:
            raise ConfigError(f"{key} as a number with a decimal point is a fraction of {self.of} and must be in "
                              f"(0, 1], got {value} (write an integer for a count)")

    def __repr__(self) -> str:
        return f"CountOrFraction({self.describe()!r})"


def split(annotation: Any) -> tuple[Any, tuple[Constraint, ...]]:
    """``Annotated[T, c1, c2]`` -> ``(T, (c1, c2))`` (only the :class:`Constraint` metadata); anything
    else -> ``(annotation, ())``."""
    if typing.get_origin(annotation) is typing.Annotated:
        base, *meta = typing.get_args(annotation)
        return base, tuple(m for m in meta if isinstance(m, Constraint))
    return annotation, ()


def check_constraints(key: str, value: Any, constraints: Sequence[Constraint]) -> None:
    """Every constraint on a set value (None, where the type allows it, means unset: nothing to limit)."""
    if value is None:
        return
    for c in constraints:
        c.check(key, value)
