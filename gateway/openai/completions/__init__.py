"""OpenAI legacy text completions: its route and OpenAPI description."""
