"""What the tests of the built-in model share."""

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
"""The files of a built-in model's directory."""
