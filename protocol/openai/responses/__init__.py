"""OpenAI Responses API: the request, its input items, the response object and events."""
