"""The OpenAI Chat Completions dialect: request parsing, response building, errors. No I/O."""

from protocol.openai.errors import OpenAIError
from protocol.openai.request import ChatRequest, parse_chat_request
from protocol.openai.response import ChunkWriter, completion, usage_dict

__all__ = [
    "ChatRequest",
    "ChunkWriter",
    "OpenAIError",
    "completion",
    "parse_chat_request",
    "usage_dict",
]
