"""OpenAI's framing of a streamed completion over HTTP: server-sent events (`SSE`), the
`protocol.core.stream.Framing` of chat completions and legacy text completions. No I/O."""

from __future__ import annotations

import orjson

from protocol.core.errors import ApiError
from protocol.frames import FinishReason, Usage
from protocol.openai.errors import error_body


class SseFraming:
    """Server-sent events, as OpenAI streams: `data: <json>` events, `data: [DONE]` last (also
    after an error event, which the OpenAI SDK raises as `APIError`)."""

    chunk_prefix = b"data: "
    chunk_suffix = b"\n\n"

    def error(self, err: ApiError) -> bytes:
        return b"data: " + orjson.dumps(error_body(err)) + b"\n\n"

    def end(self, finish_reason: FinishReason | None, usage: Usage | None) -> bytes:
        return b"data: [DONE]\n\n"


SSE = SseFraming()
