"""Anthropic's Messages API (`POST /v1/messages`) on Orchard's one internal request type."""
