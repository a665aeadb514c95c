"""Pages of OpenAI's list objects (`{"object": "list", "data", "first_id", "last_id",
"has_more"}`): the query (`after`, `limit` 1 to 100, default 20, `order`), and the page it asks
for. A bad value, a parameter given twice, or an `after` that names nothing is a 400 naming
the parameter. Stored chat completions and their messages, and a response's input items, are
listed this way."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Literal, TypeVar

import attrs
import orjson

from protocol.core.errors import invalid_request
from protocol.core.fields import (
    check_range,
    clip,
    fail_value,
    show,
)

DEFAULT_LIMIT = 20


MAX_LIMIT = 100


Order = Literal["asc", "desc"]


_ORDERS: tuple[Order, ...] = ("asc", "desc")


T = TypeVar("T")


@attrs.frozen
class PageQuery:
    """Which page of a list: after which id, how many, in which order."""

    after: str | None = None
    limit: int = DEFAULT_LIMIT
    order: Order = "asc"


def single_values(params: Iterable[tuple[str, str]]) -> dict[str, str]:
    """A query's parameters, each given once (a 400 otherwise)."""
    fields: dict[str, str] = {}
    for key, value in params:
        if key in fields:
            raise invalid_request(
                f"Invalid query: {show(key)} is given more than once.",
                clip(key),
                "invalid_value",
            )
        fields[key] = value
    return fields


def page_query(fields: dict[str, str], default_order: Order = "asc") -> PageQuery:
    """The page asked for by a query's `after`, `limit` and `order` (`default_order` when
    not given)."""
    limit = DEFAULT_LIMIT
    text = fields.get("limit")
    if text is not None:
        # Digits only: int() would also take " 1", "+1" and "1_0".
        digits = text.removeprefix("-")
        if not (digits.isascii() and digits.isdigit()) or len(digits) > 20:
            raise invalid_request(
                f"Invalid type for 'limit': expected an integer, but got {show(text)} instead.",
                "limit",
                "invalid_type",
            )
        limit = int(text)
        check_range("limit", "integer", limit, 1, MAX_LIMIT)
    order = fields.get("order", default_order)
    if order not in _ORDERS:
        fail_value("order", order, _ORDERS)
    checked: Order = "asc" if order == "asc" else "desc"
    return PageQuery(after=fields.get("after"), limit=limit, order=checked)


def page(
    items: Sequence[T], query: PageQuery, id_of: Callable[[T], str], what: str
) -> tuple[list[T], bool]:
    """The page `query` asks for of `items` (given oldest first), in the page's order, and
    whether more follow it. An `after` that is none of the items' ids is a 400 (`what`
    names the items in its message)."""
    ordered = items if query.order == "asc" else items[::-1]
    start = 0
    if query.after is not None:
        for index, item in enumerate(ordered):
            if id_of(item) == query.after:
                start = index + 1
                break
        else:
            raise invalid_request(
                f"Invalid value for 'after': no {what} has the id {show(query.after)} "
                "(it may have been deleted, or have expired).",
                "after",
                "invalid_value",
            )
    end = start + query.limit
    return list(ordered[start:end]), end < len(ordered)


def list_body(data: Sequence[bytes], ids: Sequence[str], has_more: bool) -> bytes:
    """A list object (ChatCompletionList, ChatCompletionMessageList) of items already in
    JSON; `first_id` and `last_id` are null for an empty page."""
    first = ids[0] if ids else None
    last = ids[-1] if ids else None
    return b"".join(
        (
            b'{"object":"list","data":[',
            b",".join(data),
            b'],"first_id":',
            orjson.dumps(first),
            b',"last_id":',
            orjson.dumps(last),
            b',"has_more":',
            b"true" if has_more else b"false",
            b"}",
        )
    )
