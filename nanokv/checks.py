"""Checks of user-given values (SamplingParams, EngineConfig, token ids).

Each raises an error that names the field, the bad value and what is allowed:
TypeError for a value of the wrong type, ValueError for one out of range.
bool is an int in Python, but never counts as a number here.
"""
from __future__ import annotations

import math
from typing import NoReturn

SEED_RANGE = (-2**63, 2**64 - 1)   # what torch.Generator.manual_seed accepts


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(name: str, value, allowed: str, optional: bool, error: type[Exception]) -> NoReturn:
    raise error(f"{name} must be {'None or ' if optional else ''}{allowed}, got {value!r}")


def check_int(name: str, value, low: int, high: int | None = None, *, optional: bool = False) -> None:
    """value is an int in [low, high] (no upper end when high is None), or None if optional."""
    if optional and value is None:
        return
    allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    if not _is_int(value):
        _fail(name, value, allowed, optional, TypeError)
    if value < low or (high is not None and value > high):
        _fail(name, value, allowed, optional, ValueError)


def check_float(name: str, value, low: float, high: float = math.inf, *, low_open: bool = False,
                optional: bool = False) -> None:
    """value is a finite int or float in [low, high] ((low, high] if low_open), or None if optional."""
    if optional and value is None:
        return
    if high == math.inf:
        allowed = f"a finite number {'>' if low_open else '>='} {low}"
    else:
        allowed = f"a finite number in {'(' if low_open else '['}{low}, {high}]"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        _fail(name, value, allowed, optional, TypeError)
    too_low = value <= low if low_open else value < low
    if not math.isfinite(value) or too_low or value > high:
        _fail(name, value, allowed, optional, ValueError)


def check_bool(name: str, value, *, optional: bool = False) -> None:
    if not isinstance(value, bool) and not (optional and value is None):
        _fail(name, value, "True or False", optional, TypeError)


def check_choice(name: str, value, choices: tuple[str, ...], *, optional: bool = False) -> None:
    """value is one of the strings in choices, or None if optional."""
    if optional and value is None:
        return
    if not isinstance(value, str) or value not in choices:
        error = ValueError if isinstance(value, str) else TypeError
        raise error(f"unknown {name} {value!r}; use one of {', '.join(choices)}"
                    + (" or None" if optional else ""))


def check_type(name: str, value, types: tuple[type, ...], allowed: str, *, optional: bool = False) -> None:
    """value is an instance of one of types (described by `allowed`), or None if optional."""
    if not (optional and value is None) and not isinstance(value, types):
        _fail(name, value, allowed, optional, TypeError)


def check_token_ids(name: str, ids, vocab_size: int | None = None) -> None:
    """ids is a list or tuple of ints, each in [0, vocab_size) when that is given."""
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"{name} must be a list of token ids, got {ids!r}")
    for t in ids:
        if not _is_int(t):
            raise TypeError(f"{name}: token ids are integers, got {t!r} ({type(t).__name__})")
        if vocab_size is not None and not 0 <= t < vocab_size:
            raise ValueError(f"{name}: token id {t} is outside the vocabulary [0, {vocab_size})")
