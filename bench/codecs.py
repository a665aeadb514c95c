"""`python -m bench.codecs`: msgpack vs JSON for the runner → gateway frames, per frame and
per token.

Frames: one `Chunk` (one token, with usage: what a paced runner sends per token), and
`Batch`es of 16 and 256 such chunks (of different requests: what a busy runner sends per
wake-up). For each frame and codec:

- encode (the runner's cost): JSON is `protocol.codec.encode` (the converter's unstructure +
  `orjson.dumps`); msgpack is the same unstructure + `msgpack.packb`. `dumps`/`packb` alone
  are shown too, and `Packer.pack` on a kept `msgpack.Packer` (packb makes one per call).
- decode (the gateway's cost): JSON is `protocol.codec.decode_runner_frame`, fed a `str`
  (a runner sends text frames and the server's WebSocket layer hands the app text, already
  UTF-8 decoded; that decode is shown on its own as "utf-8"). msgpack is `msgpack.unpackb`
  followed by the very same checks and object building as `protocol.codec._decode`: the
  fast paths `_fast_chunk`/`_fast_batch` are called on the unpacked dict (they only look at
  dict keys and Python types, which msgpack yields just as orjson does), the converter
  otherwise. A binary frame arrives as bytes: no UTF-8 step.
- parse: `orjson.loads` vs `msgpack.unpackb` alone, so decode = parse + build is visible.
- bytes on the wire.

Timing: every operation runs in a calibrated loop (about `TARGET_S` per sample) of
`time.perf_counter_ns`; the operations are interleaved round-robin, `--runs` samples each, so
a noisy neighbour hits both codecs alike. Cells are medians; ± is half the min-max range of the
samples, in percent of the median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import orjson

from protocol import codec
from protocol.codec import converter, decode_runner_frame, encode
from protocol.errors import FrameError
from protocol.frames import Batch, Chunk, Frame, RunnerFrame, Usage

try:
    # msgpack ships no type stubs (and is not a dependency of the repo's .venv).
    import msgpack  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # pragma: no cover - depends on the environment
    msgpack = None

TARGET_S = 0.04
"""Seconds per timing sample (the loop count is calibrated to this)."""

WORDS = (" the", " model", " is", " a", ",", " and", " of", " token", "s", " to", "\n", " it")


def make_chunk(i: int) -> Chunk:
    """A mid-stream one-token chunk of request `i` (ids as the gateway makes them)."""
    return Chunk(
        request_id=f"chatcmpl-{i:032x}",
        seq=137 + i,
        text=WORDS[i % len(WORDS)],
        reasoning="",
        tokens=1,
        usage=Usage(prompt_tokens=412, completion_tokens=138 + i, cached_tokens=256),
    )


def msgpack_encode(frame: Frame) -> bytes:
    """The msgpack twin of `protocol.codec.encode`."""
    data: bytes = msgpack.packb(converter.unstructure(frame, Frame))
    return data


def msgpack_decode_runner_frame(data: bytes) -> RunnerFrame:
    """The msgpack twin of `protocol.codec.decode_runner_frame`: the same checks, fast paths
    and converter fallback, after `msgpack.unpackb` instead of `orjson.loads`."""
    try:
        obj = msgpack.unpackb(data)
    except (ValueError, TypeError) as exc:  # FormatError, StackError, ExtraData, ...
        raise FrameError(f"not valid msgpack: {exc}") from exc
    if not isinstance(obj, dict):
        raise FrameError(f"a frame must be a map, got {type(obj).__name__}")
    tag = obj.get("type")
    if not isinstance(tag, str):
        raise FrameError("a frame needs a string 'type' field")
    if tag not in codec._TAGS_BY_UNION[id(RunnerFrame)]:
        raise FrameError(f"unknown frame type {tag!r}")
    if tag == "chunk" and (chunk := codec.fast_chunk(obj)) is not None:
        return chunk
    if tag == "batch" and (batch := codec.fast_batch(obj)) is not None:
        return batch
    try:
        frame: RunnerFrame = converter.structure(obj, RunnerFrame)  # type: ignore[arg-type]
    except Exception as exc:
        raise FrameError(f"invalid {tag} frame: {exc}") from exc
    return frame


def _loop(fn: Callable[[], object], n: int) -> int:
    """Nanoseconds for `n` calls of `fn`."""
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return time.perf_counter_ns() - t0


def _calibrate(fn: Callable[[], object]) -> int:
    n = 1
    while True:
        ns = _loop(fn, n)
        if ns >= TARGET_S * 1e9 / 4:
            return max(1, int(n * TARGET_S * 1e9 / ns))
        n *= 4


def measure(ops: dict[str, Callable[[], object]], runs: int) -> dict[str, list[float]]:
    """µs per call of each op: `runs` samples each, the ops interleaved round-robin."""
    counts = {name: _calibrate(fn) for name, fn in ops.items()}
    samples: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(runs):
        for name, fn in ops.items():
            samples[name].append(_loop(fn, counts[name]) / counts[name] / 1000)
    return samples


def _cell(samples: list[float], per: int = 1) -> str:
    med = statistics.median(samples)
    spread = (max(samples) - min(samples)) / 2 / med * 100 if med else 0.0
    value = med / per
    return f"{value:.3f} ±{spread:.0f}%" if value < 10 else f"{value:.1f} ±{spread:.0f}%"


def bench_frame(frame: Chunk | Batch, runs: int) -> tuple[int, dict[str, list[float]], int, int]:
    """Samples of every operation for one frame; also its token count and both sizes."""
    tokens = sum(c.tokens for c in frame.frames) if isinstance(frame, Batch) else frame.tokens
    plain: Any = converter.unstructure(frame, Frame)
    js = encode(frame)
    js_text = js.decode()
    mp = msgpack_encode(frame)
    assert decode_runner_frame(js_text) == frame
    assert msgpack_decode_runner_frame(mp) == frame
    assert msgpack.unpackb(mp) == orjson.loads(js)
    # Both decoders took the fast path (the converter would also give `frame`, slower).
    if isinstance(frame, Chunk):
        assert codec.fast_chunk(orjson.loads(js)) == frame
    else:
        assert codec.fast_batch(orjson.loads(js)) == frame
    parsed = orjson.loads(js)
    packer = msgpack.Packer()  # packb builds one per call; a runner could keep one
    build: Callable[[], object] = (
        (lambda: codec.fast_chunk(parsed))
        if isinstance(frame, Chunk)
        else (lambda: codec.fast_batch(parsed))
    )
    ops: dict[str, Callable[[], object]] = {
        "unstructure": lambda: converter.unstructure(frame, Frame),
        "json encode": lambda: encode(frame),
        "mp encode": lambda: msgpack_encode(frame),
        "json dumps": lambda: orjson.dumps(plain),
        "mp packb": lambda: msgpack.packb(plain),
        "mp pack reused": lambda: packer.pack(plain),
        "json decode": lambda: decode_runner_frame(js_text),
        "json decode bytes": lambda: decode_runner_frame(js),
        "mp decode": lambda: msgpack_decode_runner_frame(mp),
        "json parse": lambda: orjson.loads(js_text),
        "mp parse": lambda: msgpack.unpackb(mp),
        "utf-8": js.decode,
        "build": build,
    }
    return tokens, measure(ops, runs), len(js), len(mp)


def main(runs: int = 7) -> int:
    if msgpack is None:
        print(
            "msgpack is not installed: python3 -m venv /tmp/evalvenv && "
            "/tmp/evalvenv/bin/pip install -e . msgpack && /tmp/evalvenv/bin/python -m bench.codecs"
        )
        return 0
    cases: list[tuple[str, Chunk | Batch]] = [
        ("Chunk (1 token)", make_chunk(0)),
        ("Batch of 16", Batch(tuple(make_chunk(i) for i in range(16)))),
        ("Batch of 256", Batch(tuple(make_chunk(i) for i in range(256)))),
    ]
    print(
        f"msgpack {'.'.join(map(str, msgpack.version))}, orjson {orjson.__version__}, "
        f"Python {sys.version.split()[0]}; {runs} samples of ~{TARGET_S * 1000:.0f} ms per cell, "
        "median ±half-range\n"
    )
    print(
        "| frame | codec | bytes | bytes/token | encode µs/frame | encode µs/token "
        "| decode µs/frame | decode µs/token | parse µs/token | build µs/token |"
    )
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    details = []
    for label, frame in cases:
        tokens, s, js_len, mp_len = bench_frame(frame, runs)
        build_json = [d - p for d, p in zip(s["json decode"], s["json parse"], strict=True)]
        build_mp = [d - p for d, p in zip(s["mp decode"], s["mp parse"], strict=True)]
        for name, size, enc, dec, parse, bld in (
            ("JSON", js_len, "json encode", "json decode", "json parse", build_json),
            ("msgpack", mp_len, "mp encode", "mp decode", "mp parse", build_mp),
        ):
            print(
                f"| {label} | {name} | {size} | {size / tokens:.1f} "
                f"| {_cell(s[enc])} | {_cell(s[enc], tokens)} "
                f"| {_cell(s[dec])} | {_cell(s[dec], tokens)} "
                f"| {_cell(s[parse], tokens)} | {_cell(bld, tokens)} |"
            )
        ratio_dec = statistics.median(
            m / j for m, j in zip(s["mp decode"], s["json decode"], strict=True)
        )
        ratio_enc = statistics.median(
            m / j for m, j in zip(s["mp encode"], s["json encode"], strict=True)
        )
        details.append(
            f"| {label} | {_cell(s['unstructure'], tokens)} | {_cell(s['json dumps'], tokens)} "
            f"| {_cell(s['mp packb'], tokens)} | {_cell(s['mp pack reused'], tokens)} "
            f"| {_cell(s['json decode bytes'], tokens)} "
            f"| {_cell(s['utf-8'], tokens)} | {_cell(s['build'], tokens)} "
            f"| {ratio_enc:.2f} | {ratio_dec:.2f} |"
        )
    print(
        "\nParts, µs per token (unstructure and build are shared by both codecs; "
        "ratios are msgpack/JSON, median of the paired samples):\n"
    )
    print(
        "| frame | unstructure | orjson.dumps | msgpack.packb | Packer.pack (reused) "
        "| JSON decode from bytes "
        "| utf-8 decode (WS text frame) | fast-path build alone | encode ratio | decode ratio |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    print("\n".join(details))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.codecs", description=__doc__)
    parser.add_argument("--runs", type=int, default=7, help="samples per cell (median)")
    sys.exit(main(runs=parser.parse_args().runs))
