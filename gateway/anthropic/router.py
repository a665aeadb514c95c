"""Anthropic's Messages API as one router (gateway.api), in Anthropic's error shape; its
clients send their key in `x-api-key`."""

from __future__ import annotations

from gateway.anthropic.routes import ROUTES
from gateway.api import Api, mount
from protocol.anthropic.errors import error_body

ANTHROPIC = Api("anthropic", error_body, "x-api-key: <key>", "/v1/messages")

MOUNTED = mount(ANTHROPIC, ROUTES)
