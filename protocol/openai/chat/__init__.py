"""OpenAI Chat Completions: the request, the answer objects, stored completions."""
