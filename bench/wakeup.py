"""What one wake-up costs on this machine: a bare uvloop echo server's CPU per message.

`python -m bench.wakeup [RATE ...]` (default 600 and 3000 messages/s): a client process sends
a 200-byte message, waits for the echo, sleeps 1/RATE, for 3 s; the server's CPU time per
message is what a process pays to wake, read once and write once, with ~5 µs of Python.
Every per-token figure in docs/benchmarks.md sits on top of this floor.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import uvloop

MESSAGE = b"x" * 200
SECONDS = 3.0


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(4096):
        writer.write(data)


async def _client(port: int, rate: float, count: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(count):
        writer.write(MESSAGE)
        await reader.read(4096)
        await asyncio.sleep(1 / rate)
    writer.close()


async def measure(rate: float) -> float:
    """Server CPU µs per echoed message at `rate` messages/s."""
    count = int(rate * SECONDS)
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pid = os.fork()
    if pid == 0:  # the client: a process of its own, like a real peer
        server.close()
        uvloop.run(_client(port, rate, count))
        os._exit(0)
    started = time.process_time()
    await asyncio.get_running_loop().run_in_executor(None, os.waitpid, pid, 0)
    used = time.process_time() - started
    server.close()
    return used / count * 1e6


def main() -> None:
    rates = [float(arg) for arg in sys.argv[1:]] or [600.0, 3000.0]
    for rate in rates:
        print(f"{rate:g} messages/s: {uvloop.run(measure(rate)):.1f} µs of server CPU each")


if __name__ == "__main__":
    main()
