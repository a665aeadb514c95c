"""OpenAI's APIs as one router (gateway.api): Chat Completions with its stored completions,
legacy completions, Responses, and the model and runner lists; OpenAI's error shape."""

from __future__ import annotations

from gateway.api import Api, mount
from gateway.auth import BEARER_HINT
from gateway.observability.admin import list_models, list_runners
from gateway.openai.chat import stored
from gateway.openai.chat.routes import chat_completions
from gateway.openai.completions.routes import completions
from gateway.openai.responses import routes as responses
from protocol.openai.errors import error_body

OPENAI = Api("openai", error_body, BEARER_HINT, "/v1")

MOUNTED = mount(
    OPENAI,
    [
        chat_completions,
        *stored.ROUTES,
        completions,
        *responses.ROUTES,
        list_models,
        list_runners,
    ],
)
