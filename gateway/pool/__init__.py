"""The runner pool: placing requests, runner links, where prefixes are cached."""
