"""The browser WebSocket API (`/v1/ws`), sans-I/O: its messages (`messages`), the errors it
answers about them (`errors`), the framing of a completion's messages (`framing`) and the
gateway's state machine for one socket (`session`). docs/websocket-api.md is the spec."""
