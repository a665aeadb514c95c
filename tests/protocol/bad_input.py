"""Bad-input tables that more than one protocol test module runs, each case written once:
the same input refused the same way wherever a parser reads it."""

from __future__ import annotations

from typing import Any

BAD_JSON: list[tuple[bytes, str]] = [
    (
        b"{not json",
        "Invalid JSON: unexpected character, expected a string key: line 1 column 2 (char 1)",
    ),
    (b"", "Invalid JSON: Input is a zero-length, empty document: line 1 column 1 (char 0)"),
]
"""A browser socket's message that is not JSON, and the message of its invalid_json error."""

METADATA_REFUSALS: list[tuple[Any, str, str]] = [
    ([], "metadata", "invalid_type"),
    ({"k": 1}, "metadata.k", "invalid_type"),
    ({"k": "v" * 513}, "metadata.k", "string_above_max_length"),
    ({"k" * 65: "v"}, "metadata." + "k" * 65, "string_above_max_length"),
    ({str(i): "v" for i in range(17)}, "metadata", "object_above_max_properties"),
]
"""A stored completion's `metadata` refused (a chat request's or an update's): the value,
the param and the code."""
