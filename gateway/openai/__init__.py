"""OpenAI's APIs: Chat Completions (with stored completions), legacy completions, Responses."""
