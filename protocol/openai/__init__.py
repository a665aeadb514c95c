"""The OpenAI Chat Completions dialect: request parsing, the completion stream, response
objects, errors. No I/O."""

from protocol.openai.errors import OpenAIError
from protocol.openai.request import ChatRequest, parse_chat_request
from protocol.openai.response import ChunkWriter, completion, usage_dict
from protocol.openai.stream import SSE, CompletionBuilder, CompletionStream, Framing

__all__ = [
    "SSE",
    "ChatRequest",
    "ChunkWriter",
    "CompletionBuilder",
    "CompletionStream",
    "Framing",
    "OpenAIError",
    "completion",
    "parse_chat_request",
    "usage_dict",
]
