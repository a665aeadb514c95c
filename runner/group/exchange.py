"""The per-step message rank 0 shares with the other ranks, on `mlx.distributed` collectives.

As in mlx_lm.server (`_share_object`): rank 0 contributes the bytes and every other rank
zeros to an `all_sum`, so all ranks end up with rank 0's bytes. Unlike it, the length goes in
the same collective as the bytes, in fixed-size chunks (`Exchange.share`): a step with nothing
new, or with a few requests, costs one collective of `CHUNK` bytes.

A step message holds the requests submitted since the last step (their `Generate` frames, in
the protocol's own encoding), the cancelled request ids and whether the group is closing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
import orjson
from mlx_lm.generate import generation_stream

from protocol.codec import decode_gateway_frame, encode
from protocol.frames import Generate


@attrs.frozen
class StepMessage:
    """What every rank must know before a step: what rank 0's engine thread drained."""

    submits: tuple[Generate, ...] = ()
    cancels: tuple[str, ...] = ()
    close: bool = False

    @property
    def empty(self) -> bool:
        return not (self.submits or self.cancels or self.close)

    def encode(self) -> bytes:
        """One JSON header line, then one line per submitted frame (JSON has no raw newline)."""
        header = orjson.dumps({"cancels": list(self.cancels), "close": self.close})
        return b"\n".join([header, *(encode(g) for g in self.submits)])

    @classmethod
    def decode(cls, data: bytes) -> StepMessage:
        header, *frames = data.split(b"\n")
        head = orjson.loads(header)
        submits = []
        for line in frames:
            frame = decode_gateway_frame(line)
            if not isinstance(frame, Generate):
                raise ValueError(f"a step message carries Generate frames, not {frame!r}")
            submits.append(frame)
        return cls(tuple(submits), tuple(head["cancels"]), bool(head["close"]))


CHUNK = 4096
"""Bytes per collective of a step message (the first 4 are its length)."""


class Exchange:
    """Rank 0's bytes to every rank of `group`, and every rank's bytes to all (`gather`)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank: int = group.rank()
        self.size: int = group.size()
        self.collectives = 0
        """Collectives run so far (for the benchmark's per-step cost)."""

    def _all_sum(self, array: mx.array) -> mx.array:
        self.collectives += 1
        # On mlx-lm's generation stream, where the model's own collectives run: a forward pass
        # may still be in flight, and collectives must pair up in one order on every rank
        # (on two streams they would interleave differently on each).
        total = mx.distributed.all_sum(array, group=self.group, stream=generation_stream)
        mx.eval(total)
        return total

    def share(self, data: bytes | None = None) -> bytes:
        """Rank 0 passes `data` and gets it back; the others pass nothing and get it.

        The bytes travel as a 4-byte length and the data, in chunks of `CHUNK` bytes: one
        collective for most steps, always of the same size. (On the ring backend a small
        collective followed by a larger one stalled for 10-16 ms: sharing the length alone
        first, as mlx_lm.server does, made each step with news that much longer.)
        """
        if self.rank == 0:
            payload = data or b""
            blob = len(payload).to_bytes(4, "little") + payload
            for start in range(0, len(blob), CHUNK):
                chunk = np.zeros(CHUNK, dtype=np.uint8)
                part = blob[start : start + CHUNK]
                chunk[: len(part)] = np.frombuffer(part, dtype=np.uint8)
                self._all_sum(mx.array(chunk))
            return payload
        first = self._chunk()
        size = int.from_bytes(first[:4], "little")
        parts = [first[4:]]
        for _ in range(-(-(4 + size) // CHUNK) - 1):
            parts.append(self._chunk())
        return b"".join(parts)[:size]

    def _chunk(self) -> bytes:
        return np.asarray(self._all_sum(mx.zeros(CHUNK, dtype=mx.uint8))).tobytes()

    def share_step(self, message: StepMessage | None = None) -> StepMessage:
        """`share` for a step: rank 0 passes its message; an empty one costs one collective."""
        data = None if message is None or message.empty else message.encode()
        shared = self.share(data)
        return StepMessage.decode(shared) if shared else StepMessage()

    def gather(self, data: bytes) -> list[bytes]:
        """Every rank passes its bytes; all get every rank's, in rank order."""
        sizes = mx.zeros(self.size, dtype=mx.int32)
        sizes[self.rank] = len(data)
        lengths = [int(n) for n in np.asarray(self._all_sum(sizes))]
        table = mx.zeros((self.size, max(lengths, default=0) or 1), dtype=mx.uint8)
        if data:
            table[self.rank, : len(data)] = mx.array(np.frombuffer(data, dtype=np.uint8))
        rows = self._all_sum(table)
        table_bytes = np.asarray(rows)
        return [table_bytes[i, :n].tobytes() for i, n in enumerate(lengths)]


def same_everywhere(values: Sequence[bytes]) -> bool:
    """Whether every rank gathered the same bytes (a check on flags that must agree)."""
    return all(v == values[0] for v in values)
