"""WebSocket close codes Orchard uses, each named once (application range 4000-4999).

4008 and 4009 are retired (they were defined but never sent); do not reuse them."""

from __future__ import annotations

import enum


class CloseCode(enum.IntEnum):
    """Close codes for runner and client sockets. Standard codes are listed for clarity."""

    NORMAL = 1000
    """A drained runner leaving; a browser socket closed by its client."""
    GOING_AWAY = 1001
    """The gateway is stopping (after its drain): runners reconnect to the next one."""
    MESSAGE_TOO_BIG = 1009
    """Sent by the WebSocket server itself for a message over its size limit."""
    INTERNAL_ERROR = 1011
    """A bug in the gateway ended a browser socket (it is logged)."""
    TRY_AGAIN_LATER = 1013
    """Too many browser sockets are open."""

    PROTOCOL_ERROR = 4000
    """Generic protocol violation."""
    MALFORMED_FRAME = 4001
    """A frame that does not decode: bad JSON, unknown type, wrong field types."""
    ILLEGAL_STATE = 4002
    """A frame not allowed in the connection's current state."""
    UNSUPPORTED_VERSION = 4003
    """The runner speaks a protocol version the gateway does not."""
    UNAUTHORIZED = 4004
    """Missing or wrong credentials; the peer should not retry with the same ones."""
    HANDSHAKE_TIMEOUT = 4005
    """The peer did not complete the hello/welcome handshake in time."""
    HEARTBEAT_TIMEOUT = 4006
    """Nothing heard from the peer for longer than the liveness timeout."""
    FRAME_TOO_LARGE = 4007
    """A frame over the configured size limit."""
    CLIENT_TOO_SLOW = 4010
    """A client read so slowly that its unsent output passed the limit."""
    ORIGIN_NOT_ALLOWED = 4011
    """A browser socket from an origin the gateway does not allow."""
    RUNNER_ERROR = 4012
    """The runner sent an error about its whole connection (an error frame with no request
    id): the gateway closes the link; the runner's requests fail over or fail."""
