"""Ollama's API: its routes, model endpoints, OpenAPI description and router."""
