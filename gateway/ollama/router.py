"""Ollama's API as one router (gateway.api), in Ollama's error shape."""

from __future__ import annotations

from gateway.api import Api, mount
from gateway.auth import BEARER_HINT
from gateway.ollama.routes import ROUTES
from protocol.ollama.errors import error_body

OLLAMA = Api("ollama", error_body, BEARER_HINT, "/api")

MOUNTED = mount(OLLAMA, ROUTES)
