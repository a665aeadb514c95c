"""How one request's completion is framed on the browser socket.

`BrowserFraming` is the `protocol.core.stream.Framing` of the browser socket: a
`CompletionStream` built with it renders exactly the messages of docs/websocket-api.md,

    chunk   {"type":"chunk","request_id":…,"chunk":<chat.completion.chunk>}
    done    {"type":"done","request_id":…,"finish_reason":…,"usage":{…}}
    error   {"type":"error","request_id":…,"error":{message, type, param, code}}

a request ending with one `done` or one `error`, never both. The bytes are the same as
`protocol.browser.messages.encode` of `ChunkMessage`, `Done` and `ErrorMessage` (the tests
check it), but built from prefixes made once per request: the chunk prefix and suffix are on
the per-token path. The chunks, the usage and the error object are the chat's, in OpenAI's
shape (protocol.openai): the socket carries the Chat Completions API.
"""

from __future__ import annotations

import orjson

from protocol.core.errors import ApiError
from protocol.frames import FinishReason, Usage
from protocol.openai.errors import error_body
from protocol.openai.objects import usage_dict

_ZERO_USAGE = Usage(0, 0)


class BrowserFraming:
    """The framing of request `request_id`'s messages (one instance per request)."""

    __slots__ = ("_done_head", "_error_head", "chunk_prefix", "chunk_suffix", "request_id")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        rid = orjson.dumps(request_id)
        self.chunk_prefix: bytes = b'{"type":"chunk","request_id":' + rid + b',"chunk":'
        """Bytes before each chunk object."""
        self.chunk_suffix: bytes = b"}"
        """Bytes after each chunk object."""
        self._done_head = b'{"type":"done","request_id":' + rid + b',"finish_reason":'
        self._error_head = b'{"type":"error","request_id":' + rid + b',"error":'

    def error(self, err: ApiError) -> bytes:
        """The `error` message that ends the request."""
        return self._error_head + orjson.dumps(error_body(err)["error"]) + b"}"

    def end(self, finish_reason: FinishReason | None, usage: Usage | None) -> bytes:
        """The `done` message after the request's last chunk; nothing after an error (the
        `error` was its last message)."""
        if finish_reason is None:
            return b""
        # A finish always comes with the request's usage; zero rather than fail if not.
        usage_obj = usage_dict(usage if usage is not None else _ZERO_USAGE)
        return (
            self._done_head
            + orjson.dumps(finish_reason)
            + b',"usage":'
            + orjson.dumps(usage_obj)
            + b"}"
        )
