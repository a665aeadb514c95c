"""The Ollama API (`/api/chat`, `/api/generate`, ...) on Orchard's one internal request type."""
