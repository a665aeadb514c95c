"""Reading the gateway's own OpenAPI document in tests: an operation, and validators of its
documented request and response bodies (jsonschema-rs, Draft 2020-12, formats checked)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jsonschema_rs

from gateway.app import create_app
from tests.gateway.gateways import FAKE_RUNNERS
from tests.support import Gateway, secs

Check = Callable[[Any], bool]


def gateway_spec() -> dict[str, Any]:
    """The OpenAPI document of a gateway with the default settings."""
    schema: dict[str, Any] = create_app().openapi_schema.to_schema()
    return schema


def op(spec: dict[str, Any], path: str, method: str = "post") -> dict[str, Any]:
    operation: dict[str, Any] = spec["paths"][path][method]
    return operation


def validator(schema: dict[str, Any]) -> Check:
    return jsonschema_rs.Draft202012Validator(schema, validate_formats=True).is_valid


def response_check(spec: dict[str, Any], path: str, status: int, method: str = "post") -> Check:
    """The validator of `status`'s documented JSON body (the test fails if it is not there)."""
    content = op(spec, path, method)["responses"][str(status)]["content"]
    return validator(content["application/json"]["schema"])


def limited_gateway(api_key: str) -> Gateway:
    """A gateway whose error answers are easy to reach: an API key, a 64 KiB body limit and
    a queue of one that gives up after half a second."""
    return Gateway(
        "--api-key",
        api_key,
        "--max-body-bytes",
        "65536",
        "--queue-size",
        "1",
        "--queue-timeout",
        secs(0.5),
        *FAKE_RUNNERS,
    )
