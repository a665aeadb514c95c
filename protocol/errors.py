"""The protocol package's errors, all under one base.

    ProtocolError                  anything a peer sent that the protocol forbids
    ├── FrameError                 bytes that do not decode to a known, well-typed frame
    ├── StateError                 a well-formed frame that is illegal in the current state
    └── AdvertisementError         an mDNS record that is not an Orchard gateway's

Each carries the WebSocket close code the receiving side should close with.
"""

from __future__ import annotations

from protocol.closecodes import CloseCode


class ProtocolError(Exception):
    """A peer broke the runner protocol; the connection should close with `close_code`."""

    close_code: CloseCode = CloseCode.PROTOCOL_ERROR

    def __init__(self, message: str, *, close_code: CloseCode | None = None) -> None:
        super().__init__(message)
        if close_code is not None:
            self.close_code = close_code

    @property
    def reason(self) -> str:
        """The close reason: the message, cut to fit a close frame (123 bytes)."""
        return _truncate_utf8(str(self), 123)


class FrameError(ProtocolError):
    """The data is not a valid frame: bad JSON, unknown type, missing or mistyped fields."""

    close_code = CloseCode.MALFORMED_FRAME


class StateError(ProtocolError):
    """A valid frame that is not allowed now (e.g. a chunk for an unknown request)."""

    close_code = CloseCode.ILLEGAL_STATE


class AdvertisementError(ProtocolError):
    """A service found on the LAN whose record is not an Orchard gateway's (no close code
    applies: there is no connection yet)."""


def _truncate_utf8(text: str, limit: int) -> str:
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[: limit - 3].decode(errors="ignore") + "..."
