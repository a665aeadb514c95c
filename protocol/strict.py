"""The strict cattrs converter both WebSocket protocols decode with.

cattrs' defaults coerce: `int("7")`, `str(7)`, `bool("no")`, a string read as a list of its
characters. Over a wire that is a bug waiting, so every JSON scalar must already have the
declared type (a bool is not an int, an int is a float only where a float is declared), arrays
must be JSON arrays, and unknown keys are refused. The protocols add their own tagged unions.
"""

from __future__ import annotations

import math
from typing import Any, get_args, get_origin

import cattrs
from cattrs.errors import IterableValidationError, IterableValidationNote
from cattrs.preconf.orjson import make_converter


def _strict_int(value: Any, _: type) -> int:
    if type(value) is not int:
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    return value


def _strict_float(value: Any, _: type) -> float:
    if type(value) not in (int, float):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError("expected a finite number")
    return float(value)


def _strict_str(value: Any, _: type) -> str:
    if type(value) is not str:
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _strict_bool(value: Any, _: type) -> bool:
    if type(value) is not bool:
        raise TypeError(f"expected a boolean, got {type(value).__name__}")
    return value


def _is_homogeneous_tuple(cl: Any) -> bool:
    args = get_args(cl)
    return get_origin(cl) is tuple and len(args) == 2 and args[1] is Ellipsis


def _is_list(cl: Any) -> bool:
    return get_origin(cl) is list and len(get_args(cl)) == 1


def _array_hook_factory(conv: cattrs.Converter, cl: Any, container: type) -> Any:
    item_type = get_args(cl)[0]
    item_hook = conv.get_structure_hook(item_type)

    def structure_array(value: Any, _: type) -> Any:
        if type(value) is not list:
            raise TypeError(f"expected an array, got {type(value).__name__}")
        items, errors = [], []
        for i, item in enumerate(value):
            try:
                items.append(item_hook(item, item_type))
            except Exception as exc:
                # The index note makes transform_error say `messages[1].role`.
                exc.__notes__ = [
                    *getattr(exc, "__notes__", []),
                    IterableValidationNote(f"Structuring {cl} @ index {i}", i, item_type),
                ]
                errors.append(exc)
        if errors:
            raise IterableValidationError(f"While structuring {cl}", errors, cl)
        return items if container is list else container(items)

    return structure_array


def make_strict_converter() -> cattrs.Converter:
    """A fresh orjson-flavoured converter with the strict hooks registered: `tuple[X, ...]`
    and `list[X]` fields read from JSON arrays only."""
    conv = make_converter(forbid_extra_keys=True)
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook_factory(
        _is_homogeneous_tuple, lambda cl: _array_hook_factory(conv, cl, tuple)
    )
    conv.register_structure_hook_factory(_is_list, lambda cl: _array_hook_factory(conv, cl, list))
    return conv
