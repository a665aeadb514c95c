"""Readers for a request body and its JSON fields and makers of OpenAI-worded 400s, shared by
every dialect's request parser. A JSON null reads as None ("not given")."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, NoReturn, TypeVar, cast

import orjson

from protocol.core.errors import invalid_request

# --- the body ------------------------------------------------------------------------------


def read_json(body: bytes) -> Any:
    """A request body's JSON (any value: `read_object` checks that it is an object)."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise invalid_request(
            f"We could not parse the JSON body of your request ({exc}). "
            "The API expects a JSON object.",
            None,
            "invalid_json",
        ) from exc


def read_object(data: Any) -> dict[str, Any]:
    """A decoded body, which must be a JSON object."""
    if type(data) is not dict:
        raise invalid_request(
            f"Invalid type for the request body: expected an object, but got {_kind(data)} "
            "instead.",
            None,
            "invalid_type",
        )
    return data


# --- field readers: a JSON null reads as None (not given) -----------------------------------

_S = TypeVar("_S", bound=str)


def _param(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def read_required(obj: dict[str, Any], key: str, path: str) -> Any:
    if key not in obj:
        param = _param(path, key)
        raise invalid_request(
            f"Missing required parameter: '{param}'.", param, "missing_required_parameter"
        )
    return obj[key]


def read_required_str(obj: dict[str, Any], key: str, path: str = "") -> str:
    value = read_required(obj, key, path)
    if type(value) is not str:
        fail_type(_param(path, key), "a string", value)
    return value


def read_one_of(obj: dict[str, Any], key: str, path: str, allowed: Sequence[_S]) -> _S:
    """A required string field that must be one of `allowed` (a role, a `type`), which the
    error lists."""
    value = read_required_str(obj, key, path)
    if value not in allowed:
        fail_value(_param(path, key), value, allowed)
    return cast(_S, value)


def read_array(value: Any, param: str, maximum: int, expected: str = "an array") -> list[Any]:
    """An optional array of at most `maximum` items (`expected`: the type the error names);
    None (not given) reads as empty."""
    if value is None:
        return []
    if type(value) is not list:
        fail_type(param, expected, value)
    if len(value) > maximum:
        fail_array_too_long(param, maximum, len(value))
    return value


def check_keys(obj: dict[str, Any], path: str, allowed: Collection[str]) -> None:
    """Every key of the object at `path` is one of `allowed`; the first that is not is an
    unknown parameter."""
    for key in obj:
        if key not in allowed:
            fail_unknown(f"{path}.{key}")


def read_bool(obj: dict[str, Any], key: str, path: str = "") -> bool | None:
    value = obj.get(key)
    if value is not None and type(value) is not bool:
        fail_type(_param(path, key), "a boolean", value)
    return value


def read_str(obj: dict[str, Any], key: str, path: str = "") -> str | None:
    value = obj.get(key)
    if value is not None and type(value) is not str:
        fail_type(_param(path, key), "a string", value)
    return value


def read_int(
    obj: dict[str, Any], key: str, minimum: int, maximum: int, path: str = ""
) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if type(value) is not int:
        fail_type(_param(path, key), "an integer", value)
    check_range(_param(path, key), "integer", value, minimum, maximum)
    return value


def read_number(
    obj: dict[str, Any], key: str, minimum: float, maximum: float, path: str = ""
) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if type(value) not in (int, float):  # bool is not a number
        fail_type(_param(path, key), "a decimal", value)
    check_range(_param(path, key), "decimal", value, minimum, maximum)
    return float(value)


def check_range(param: str, kind: str, value: float, minimum: float, maximum: float) -> None:
    if value < minimum:
        raise invalid_request(
            f"Invalid '{param}': {kind} below minimum value. Expected a value >= {minimum}, "
            f"but got {show(value)} instead.",
            param,
            f"{kind}_below_min_value",
        )
    if value > maximum:
        raise invalid_request(
            f"Invalid '{param}': {kind} above maximum value. Expected a value <= {maximum}, "
            f"but got {show(value)} instead.",
            param,
            f"{kind}_above_max_value",
        )


# --- error makers ---------------------------------------------------------------------------


def fail_type(param: str, expected: str, value: Any) -> NoReturn:
    raise invalid_request(
        f"Invalid type for '{param}': expected {expected}, but got {_kind(value)} instead.",
        param,
        "invalid_type",
    )


def fail_value(param: str, value: Any, supported: Sequence[str]) -> NoReturn:
    quoted = [f"'{item}'" for item in supported]
    listed = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + ", and " + quoted[-1]
    raise invalid_request(
        f"Invalid value for '{param}': {show(value)}. Supported values are: {listed}.",
        param,
        "invalid_value",
    )


def fail_unknown(param: str) -> NoReturn:
    param = clip(param)
    raise invalid_request(f"Unknown parameter: '{param}'.", param, "unknown_parameter")


def fail_unsupported(param: str, reason: str) -> NoReturn:
    raise invalid_request(
        f"Unsupported parameter: '{param}' is not supported with this server: {reason}.",
        param,
        "unsupported_parameter",
    )


def fail_unsupported_value(param: str, value: Any, default: str) -> NoReturn:
    raise invalid_request(
        f"Unsupported value: '{param}' does not support {show(value)} with this server. "
        f"Only the default ({default}) value is supported.",
        param,
        "unsupported_value",
    )


def fail_unsupported_kind(param: str, value: str, reason: str) -> NoReturn:
    """A role or a `type` that OpenAI knows and this server does not take, and why."""
    raise invalid_request(
        f"Unsupported value: '{param}' does not support {show(value)} with this server: {reason}.",
        param,
        "unsupported_value",
    )


def fail_array_too_long(param: str, maximum: int, length: int) -> NoReturn:
    raise invalid_request(
        f"Invalid '{param}': array too long. Expected an array with maximum length {maximum}, "
        f"but got an array with length {length} instead.",
        param,
        "array_above_max_length",
    )


def fail_empty_array(param: str) -> NoReturn:
    raise invalid_request(
        f"Invalid '{param}': empty array. Expected an array with minimum length 1, but got "
        "an empty array instead.",
        param,
        "empty_array",
    )


def fail_too_many(param: str, maximum: int, count: int) -> NoReturn:
    raise invalid_request(
        f"Invalid '{param}': too many properties. Expected an object with at most {maximum} "
        f"properties, but got an object with {count} properties instead.",
        param,
        "object_above_max_properties",
    )


def fail_too_long(param: str, maximum: int, length: int) -> NoReturn:
    raise invalid_request(
        f"Invalid '{param}': string too long. Expected a string with maximum length {maximum}, "
        f"but got a string with length {length} instead.",
        param,
        "string_above_max_length",
    )


def _kind(value: Any) -> str:
    """How OpenAI names a JSON value's type in its messages."""
    if value is None:
        return "null"
    if type(value) is bool:
        return "a boolean"
    if type(value) is int:
        return "an integer"
    if type(value) is float:
        return "a decimal"
    if type(value) is str:
        return "a string"
    if type(value) is list:
        return "an array"
    return "an object"


def show(value: Any) -> str:
    """A value for an error message, clipped so a huge input is not echoed back whole."""
    if type(value) is str:
        return f"'{clip(value)}'"
    if type(value) is int:
        return clip(str(value))  # orjson writes no integer past 64 bits
    return clip(orjson.dumps(value).decode())


def clip(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
