"""OpenAI Chat Completions: its route, its stored completions, its OpenAPI description."""
