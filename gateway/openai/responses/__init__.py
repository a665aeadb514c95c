"""OpenAI Responses API: its routes and OpenAPI description."""
