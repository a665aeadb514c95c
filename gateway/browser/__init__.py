"""The browser WebSocket API (/v1/ws)."""
