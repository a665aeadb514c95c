"""OpenAI legacy text completions: the request and the `text_completion` objects."""
