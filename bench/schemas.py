"""JSON Schemas and documents for the constrained-decoding benchmarks (`bench.grammars`,
`bench.structured`): a realistic document, a large schema, and the coverage cases."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (a) the per-token document: an order with nested objects, arrays, enums and free strings.
ORDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^ord-[0-9]{6}$"},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string"},
                "vip": {"type": "boolean"},
            },
            "required": ["name", "email", "vip"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
            "minItems": 1,
        },
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "total": {"type": "number"},
    },
    "required": ["id", "status", "customer", "items", "note", "total"],
    "additionalProperties": False,
}
ORDER: dict[str, Any] = {
    "id": "ord-004217",
    "status": "shipped",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "vip": True},
    "items": [
        {"sku": "apple-crate-12", "quantity": 3, "price": 24.5},
        {"sku": "pear-basket", "quantity": 1, "price": 12.0},
        {"sku": "cider-press-rental", "quantity": 2, "price": 45.75},
    ],
    "note": "Leave the crates by the barn door; the dog is friendly.",
    "total": 209.0,
}


def large_schema() -> dict[str, Any]:
    """(b): 60 properties over 4 $defs, with anyOf, enums, patterns, formats and bounds."""
    countries = [f"C{i:02d}" for i in range(30)]
    defs: dict[str, Any] = {
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "postcode": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"},
                "country": {"enum": countries},
            },
            "required": ["street", "city", "postcode", "country"],
            "additionalProperties": False,
        },
        "person": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string", "format": "email"},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "address": {"$ref": "#/$defs/address"},
            },
            "required": ["name", "email", "age", "address"],
            "additionalProperties": False,
        },
        "item": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "quantity": {"type": "integer", "minimum": 1},
                "price": {"type": "number", "minimum": 0},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
            },
            "required": ["sku", "quantity", "price", "tags"],
            "additionalProperties": False,
        },
        "payment": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "kind": {"const": "card"},
                        "last4": {"type": "string", "pattern": "^[0-9]{4}$"},
                    },
                    "required": ["kind", "last4"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {"kind": {"const": "transfer"}, "iban": {"type": "string"}},
                    "required": ["kind", "iban"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {"kind": {"const": "cash"}},
                    "required": ["kind"],
                    "additionalProperties": False,
                },
            ]
        },
    }
    kinds: list[Callable[[int], dict[str, Any]]] = [
        lambda i: {"type": "string"},
        lambda i: {"type": "integer", "minimum": -i, "maximum": 1000 + i},
        lambda i: {"type": "number"},
        lambda i: {"type": "boolean"},
        lambda i: {"enum": [f"v{i}_{j}" for j in range(12)]},
        lambda i: {"$ref": "#/$defs/person"},
        lambda i: {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1},
        lambda i: {"anyOf": [{"type": "string"}, {"type": "null"}]},
        lambda i: {
            "type": "object",
            "properties": {
                "x": {"type": "number"},
                "y": {"type": "number"},
                "label": {"type": "string", "format": "date-time"},
            },
            "required": ["x", "y", "label"],
            "additionalProperties": False,
        },
        lambda i: {"$ref": "#/$defs/payment"},
    ]
    properties = {f"field_{i:02d}": kinds[i % len(kinds)](i) for i in range(60)}
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
        "$defs": defs,
    }


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def _deep(levels: int) -> dict[str, Any]:
    node: dict[str, Any] = {"value": levels, "children": []}
    for level in range(levels - 1):
        node = {"value": level, "children": [node]}
    return node


TREE = _obj({"value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#"}}})

# (c): feature, schema, documents that must pass, documents that must be refused.
COVERAGE: list[tuple[str, dict[str, Any], list[Any], list[Any]]] = [
    ("string", _obj({"a": {"type": "string"}}), [{"a": "x y"}], [{"a": 1}]),
    ("number", _obj({"a": {"type": "number"}}), [{"a": -1.5e3}, {"a": 2}], [{"a": "2"}]),
    ("integer", _obj({"a": {"type": "integer"}}), [{"a": -42}], [{"a": 1.5}]),
    ("boolean", _obj({"a": {"type": "boolean"}}), [{"a": False}], [{"a": 0}]),
    ("null", _obj({"a": {"type": "null"}}), [{"a": None}], [{"a": False}]),
    (
        "type list [string, null]",
        _obj({"a": {"type": ["string", "null"]}}),
        [{"a": None}, {"a": "s"}],
        [{"a": 3}],
    ),
    ("enum", _obj({"a": {"enum": ["red", "green", 3]}}), [{"a": "red"}, {"a": 3}], [{"a": "blue"}]),
    ("const", _obj({"a": {"const": "fixed"}}), [{"a": "fixed"}], [{"a": "other"}]),
    (
        "anyOf",
        _obj({"a": {"anyOf": [{"type": "integer"}, _obj({"b": {"type": "string"}})]}}),
        [{"a": 1}, {"a": {"b": "c"}}],
        [{"a": "c"}],
    ),
    (
        "$ref/$defs",
        {**_obj({"a": {"$ref": "#/$defs/pt"}}), "$defs": {"pt": _obj({"x": {"type": "number"}})}},
        [{"a": {"x": 1}}],
        [{"a": {"y": 1}}],
    ),
    (
        "recursive $ref",
        {
            **_obj({"root": {"$ref": "#/$defs/node"}}),
            "$defs": {
                "node": _obj(
                    {
                        "v": {"type": "integer"},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    }
                )
            },
        },
        [{"root": {"v": 1, "kids": [{"v": 2, "kids": []}]}}],
        [{"root": {"v": 1, "kids": [{"v": "2", "kids": []}]}}],
    ),
    (
        "required (an optional property)",
        _obj({"a": {"type": "integer"}, "b": {"type": "integer"}}, required=["a"]),
        [{"a": 1}, {"a": 1, "b": 2}],
        [{"b": 2}],
    ),
    (
        "additionalProperties false",
        _obj({"a": {"type": "integer"}}),
        [{"a": 1}],
        [{"a": 1, "z": 2}],
    ),
    (
        "nested objects and arrays",
        _obj({"a": {"type": "array", "items": _obj({"b": {"type": "array", "items": {}}})}}),
        [{"a": [{"b": [1, "x", None]}]}],
        [{"a": [{"c": []}]}],
    ),
    (
        "string pattern",
        _obj({"a": {"type": "string", "pattern": "^[a-z]{2}-[0-9]+$"}}),
        [{"a": "ab-12"}],
        [{"a": "ab12"}],
    ),
    (
        "format date-time",
        _obj({"a": {"type": "string", "format": "date-time"}}),
        [{"a": "2024-05-01T12:30:00Z"}],
        [{"a": "yesterday"}],
    ),
    (
        "format email",
        _obj({"a": {"type": "string", "format": "email"}}),
        [{"a": "ada@example.com"}],
        [{"a": "not an email"}],
    ),
    (
        "format uuid",
        _obj({"a": {"type": "string", "format": "uuid"}}),
        [{"a": "123e4567-e89b-12d3-a456-426614174000"}],
        [{"a": "123"}],
    ),
    (
        "minItems/maxItems",
        _obj({"a": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}}),
        [{"a": [1]}, {"a": [1, 2]}],
        [{"a": []}, {"a": [1, 2, 3]}],
    ),
    (
        "minimum/maximum",
        _obj({"a": {"type": "integer", "minimum": 3, "maximum": 12}}),
        [{"a": 3}, {"a": 12}],
        [{"a": 2}, {"a": 13}],
    ),
    (
        "exclusiveMinimum/Maximum",
        _obj({"a": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}),
        [{"a": 0.5}],
        [{"a": 0}, {"a": 1}],
    ),
    (
        "multipleOf",
        _obj({"a": {"type": "integer", "multipleOf": 5}}),
        [{"a": 15}],
        [{"a": 7}],
    ),
    (
        "minLength/maxLength",
        _obj({"a": {"type": "string", "minLength": 2, "maxLength": 3}}),
        [{"a": "ab"}],
        [{"a": "a"}, {"a": "abcd"}],
    ),
    (
        "root recursion (#), 6 deep",
        TREE,
        [_deep(6)],
        [{"value": 1, "children": [{"value": 2}]}],
    ),
    # Past the strict subset: what each library does with the rest of JSON Schema.
    (
        "oneOf",
        _obj({"a": {"oneOf": [{"type": "integer"}, {"type": "string"}]}}),
        [{"a": 1}],
        [{"a": None}],
    ),
    (
        "allOf",
        _obj({"a": {"allOf": [{"type": "integer"}, {"minimum": 2}]}}),
        [{"a": 3}],
        [{"a": 1}],
    ),
    ("not", _obj({"a": {"not": {"type": "string"}}}), [{"a": 1}], [{"a": "x"}]),
    (
        "if/then/else",
        _obj({"a": {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {}}}),
        [{"a": 1}],
        [{"a": -1}],
    ),
    (
        "additionalProperties: schema",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        [{"x": 1}],
        [{"x": "1"}],
    ),
    (
        "patternProperties",
        {"type": "object", "patternProperties": {"^n_": {"type": "integer"}}},
        [{"n_a": 1}],
        [{"n_a": "1"}],
    ),
    (
        "uniqueItems",
        _obj({"a": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}),
        [{"a": [1, 2]}],
        [{"a": [1, 1]}],
    ),
    (
        "prefixItems",
        _obj({"a": {"type": "array", "prefixItems": [{"type": "integer"}], "items": False}}),
        [{"a": [1]}],
        [{"a": ["x"]}],
    ),
    (
        "minProperties",
        {"type": "object", "minProperties": 1},
        [{"x": 1}],
        [{}],
    ),
    (
        "pattern with lookahead",
        _obj({"a": {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]+$"}}),
        [{"a": "a1"}],
        [{"a": "ab"}],
    ),
    (
        "unknown format",
        _obj({"a": {"type": "string", "format": "hostname-ish"}}),
        [{"a": "x"}],
        [],
    ),
    (
        "remote $ref",
        _obj({"a": {"$ref": "https://example.com/schema.json"}}),
        [{"a": 1}],
        [],
    ),
]
