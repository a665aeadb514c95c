"""The OpenAI dialects (Chat Completions, legacy completions, Responses): request parsing,
response objects, SSE framing, the error shape. No I/O; the completion stream and the error
type they use are every dialect's (`protocol.core`)."""

from protocol.openai.chat.request import ChatRequest, parse_chat_request
from protocol.openai.chat.response import ChunkWriter, chat_completion_body, completion
from protocol.openai.errors import error_body
from protocol.openai.objects import usage_dict
from protocol.openai.sse import SSE

__all__ = [
    "SSE",
    "ChatRequest",
    "ChunkWriter",
    "chat_completion_body",
    "completion",
    "error_body",
    "parse_chat_request",
    "usage_dict",
]
