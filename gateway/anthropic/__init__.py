"""Anthropic's Messages API: its routes, OpenAPI description and router."""
