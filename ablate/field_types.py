"""A config value must be of its field's declared kind, checked before the dataclass is built.

The composed config is untyped YAML: `redo=no` arrives as the string "no" (truthy), `threads=abc` as a
string that fails later with a comparison's TypeError, `results_dir=null` as None that fails as a path.
Each is refused here with the option's name and what it takes. Only the scalar kinds are checked
(bool, int, float, str, each maybe optional); nested sections and collections are checked by their
own builders. A str field takes a number (`book.section=7.3` is read as a float), but not null.
"""
from __future__ import annotations

import dataclasses
import numbers
import types
import typing
from typing import Any

WANTED = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}


def _scalar_kind(annotation: Any) -> tuple[type | None, bool]:
    """(bool | int | float | str | None, whether None is allowed) of a field's type."""
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        if len(args) != 1:
            return None, optional
        annotation = args[0]
    return (annotation if annotation in WANTED else None), optional


def _fits(kind: type, value: Any) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):            # True is an int to Python, not a number of threads
        return False
    if kind is int:
        return isinstance(value, numbers.Integral)
    if kind is float:
        return isinstance(value, numbers.Real)
    return isinstance(value, (str, numbers.Real))


def check_field_types(cls: type, values: dict[str, Any], prefix: str) -> None:
    """A ValueError naming `<prefix><field>` for the first value not of its field's kind: `redo must
    be true or false, got 'no'`, `threads must be a whole number (default 0), got 'abc'`."""
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):          # an annotation this module cannot resolve: its builder checks
        return
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        kind, optional = _scalar_kind(hints.get(f.name))
        value = values[f.name]
        if kind is None or (value is None and optional) or _fits(kind, value):
            continue
        default = "" if f.default is dataclasses.MISSING else f" (default {_yaml(f.default)})"
        raise ValueError(f"{prefix}{f.name} must be {WANTED[kind]}{' or null' if optional else ''}{default}, "
                         f"got {_yaml(value)}")


def _yaml(value: Any) -> str:
    """A value as it is written on the command line: null, true, 'text'."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)
