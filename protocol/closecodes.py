"""WebSocket close codes Orchard uses, each named once (application range 4000-4999)."""

from __future__ import annotations

import enum


class CloseCode(enum.IntEnum):
    """Close codes for runner and client sockets. Standard codes are listed for clarity."""

    NORMAL = 1000
    GOING_AWAY = 1001
    MESSAGE_TOO_BIG = 1009
    INTERNAL_ERROR = 1011
    TRY_AGAIN_LATER = 1013

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
    DUPLICATE_NAME = 4008
    """A runner name already connected (reserved for pool policy)."""
    DRAINING = 4009
    """The gateway is shutting down; reconnect to the next one."""
    CLIENT_TOO_SLOW = 4010
    """A client read so slowly that its unsent output passed the limit."""
    ORIGIN_NOT_ALLOWED = 4011
    """A browser socket from an origin the gateway does not allow."""
