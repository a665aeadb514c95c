"""Bounded in-memory stores of finished answers (stored chat completions, Responses)."""
