"""Routes of the responses dialect (being written)."""

from __future__ import annotations

from typing import Any

ROUTES: list[Any] = []
"""This dialect's route handlers, registered by gateway.app."""
