"""A format Orchard has no streaming parser for: each section is read whole at its end by the
family's own mlx-lm parser (`parse_tool_call(text, tools)`), and sent as one name delta and one
arguments delta per call."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from protocol.frames import ToolCallDelta
from runner.tool_formats.base import CallFormat, SectionParser, Tools

ParseToolCall = Callable[[str, Any], Any]
"""mlx-lm's `parse_tool_call(text, tools)`: {"name", "arguments"}, or a list of them."""


class WholeSectionParser(SectionParser):
    def __init__(self, tools: Tools, parse: ParseToolCall) -> None:
        super().__init__(tools)
        self._parse = parse
        self._text = ""

    def feed(self, text: str) -> list[ToolCallDelta]:
        self._text += text
        return []

    def end(self) -> list[ToolCallDelta]:
        try:
            parsed = self._parse(self._text, list(self.tools))
        except Exception:  # a parser of any family may raise anything on text it cannot read
            return []
        calls = parsed if isinstance(parsed, list) else [parsed]
        if not calls or not all(
            isinstance(item, dict) and isinstance(item.get("name"), str) for item in calls
        ):
            return []
        deltas: list[ToolCallDelta] = []
        for index, item in enumerate(calls):
            arguments = item.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            deltas += [ToolCallDelta(index, "", name=item["name"]), ToolCallDelta(index, arguments)]
        self.calls = len(calls)
        return deltas


def whole_format(name: str, start: str, end: str, parse: ParseToolCall) -> CallFormat:
    """The format of mlx-lm's parser `name`, read whole."""
    return CallFormat(
        parser=name,
        start=start,
        end=end or "",
        new_parser=lambda tools: WholeSectionParser(tools, parse),
        streamed=False,
    )
