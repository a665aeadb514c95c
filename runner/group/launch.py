"""Start a runner group: `--hostfile HOSTS` or `--local-group N`, supervised.

`orchard runner --hostfile HOSTS ...` and `orchard runner --local-group N ...` do not serve
themselves: they start the same `orchard runner` command (plus the hidden `--group-member`)
once per member and supervise the group:

- `--hostfile`: through MLX's launcher (`mlx.launch`, over ssh; `launched_members`), its
  output copied to ours; `--local-group`: N processes here with the environment
  `mlx.launch --backend ring` would give them (`local_members`);
- SIGTERM or SIGINT here is passed on as SIGTERM to the members on this machine (the ssh
  sessions of remote ones), so a local rank 0 drains and then closes the group; whatever
  is left `grace` seconds later (drain timeout + 2 x liveness timeout) is killed;
- when a member fails, the others on this machine are told at once (`LEAVE_SIGNAL`) and
  leave with a message; remote ones leave by themselves (`watchdog`) within the liveness
  timeout; one that cannot (a stopped process) is killed `failure_grace` seconds later
  (2 x liveness timeout: the others have left by then). Nothing is left behind; the exit
  status is 0 only if every member exited 0.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

import attrs
import psutil

from runner.group import GroupError
from runner.group.watchdog import LEAVE_SIGNAL

log = logging.getLogger("runner.group")

GROUP_OPTIONS = frozenset({"hostfile", "local_group"})
"""The options that start a group, which members must not see again."""
SECRET_OPTIONS = frozenset({"token"})
"""Passed to members in their environment, never on a command line."""
TOKEN_ENV = "ORCHARD_RUNNER_TOKEN"  # noqa: S105 -- a variable's name, not a secret
MEMBER_FLAG = "--group-member"
_FAILED = ("exited with code", "was killed")
"""What the launcher prints when a member did not exit 0."""


def member_argv(params: Iterable[Any], values: dict[str, Any]) -> list[str]:
    """The `orchard runner` options a member gets: every option given (or defaulted from the
    environment) as on the command line, minus the group's own and the secrets.

    `params` are the command's click options (duck-typed: `name`, `opts`, `secondary_opts`,
    `is_flag`, `multiple`), `values` what click parsed.
    """
    argv: list[str] = []
    for param in params:
        name = param.name
        if name in GROUP_OPTIONS or name in SECRET_OPTIONS or name not in values:
            continue
        value = values[name]
        if value is None or not getattr(param, "opts", None):
            continue
        flag = param.opts[0]
        if getattr(param, "is_flag", False):
            if value:
                argv.append(flag)
            elif param.secondary_opts:
                argv.append(param.secondary_opts[0])
            continue
        for item in value if getattr(param, "multiple", False) else (value,):
            argv += [flag, str(item)]
    return argv


def read_hostfile(path: Path) -> tuple[list[dict[str, Any]], str]:
    """The hosts and backend of an `mlx.launch` hostfile; `GroupError` if it cannot start a
    group (fewer than 2 hosts, a ring host without IPs)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise GroupError(f"cannot read the hostfile {path}: {exc}") from exc
    hosts = data.get("hosts") if isinstance(data, dict) else data
    backend = (data.get("backend") if isinstance(data, dict) else None) or "ring"
    if not isinstance(hosts, list) or not all(isinstance(h, dict) and "ssh" in h for h in hosts):
        raise GroupError(f"{path}: expected a list of hosts like {{'ssh': ..., 'ips': [...]}}")
    if len(hosts) < 2:
        raise GroupError(f"{path}: a group needs at least 2 hosts, it lists {len(hosts)}")
    if backend not in ("ring", "jaccl", "jaccl-ring"):
        raise GroupError(f"{path}: backend {backend!r}: a group runs on ring, jaccl or jaccl-ring")
    if backend == "ring" and not all(h.get("ips") for h in hosts):
        raise GroupError(f"{path}: the ring backend needs each host's IP addresses ('ips')")
    return hosts, backend


RING_PORTS = range(20000, 32000)
"""Where a local group's ring listens: below Linux's and macOS's ephemeral ranges (32768 and
49152 up), so no outgoing connection or port-0 listener of this machine can be holding a
port between the probe and the members' bind."""


def free_ports(count: int) -> int:
    """The first of `count` consecutive free TCP ports on loopback (for the ring)."""
    chooser = random.Random()
    for _ in range(50):
        first = chooser.randrange(RING_PORTS.start, RING_PORTS.stop - count)
        held: list[socket.socket] = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
        return first
    raise GroupError(f"found no {count} consecutive free ports on 127.0.0.1")


def launcher() -> list[str]:
    """MLX's launcher, as installed beside this interpreter."""
    script = Path(sys.executable).parent / "mlx.launch"
    if script.exists():
        return [str(script)]
    return [
        sys.executable,
        "-c",
        "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())",
    ]


@attrs.frozen
class Child:
    """A process the supervisor starts: its argv and what it adds to the environment."""

    argv: tuple[str, ...]
    env: dict[str, str] = attrs.field(factory=dict)


def local_members(member: Sequence[str], count: int, ring_file: Path) -> list[Child]:
    """`count` members on this machine, on the ring backend over loopback.

    They get the environment `mlx.launch --backend ring` gives its processes (`MLX_RANK`, and
    `MLX_HOSTFILE` naming each rank's address), but are started here rather than by
    `mlx.launch`: its I/O loop (mlx 0.32) polls the members' stdin without pause and keeps a
    CPU core busy, a third of a 2-core machine's, for nothing.
    """
    if count < 2:
        raise GroupError(f"--local-group needs at least 2 processes, not {count}")
    first = free_ports(count)
    ring_file.write_text(json.dumps([[f"127.0.0.1:{first + rank}"] for rank in range(count)]))
    return [
        Child(tuple(member), {"MLX_RANK": str(rank), "MLX_HOSTFILE": str(ring_file)})
        for rank in range(count)
    ]


def launched_members(member: Sequence[str], hostfile: Path, token: str | None) -> Child:
    """`mlx.launch` running `member` on each host of `hostfile` (over ssh)."""
    _, backend = read_hostfile(hostfile)
    # The launcher writes --env into each host's ssh command line: visible to `ps` there.
    env = ["--env", f"{TOKEN_ENV}={token}"] if token else []
    return Child(
        (*launcher(), "--hostfile", str(hostfile), "--backend", backend, *env, "--", *member)
    )


def run_group(
    member_args: Sequence[str],
    *,
    hostfile: Path | None,
    local_group: int | None,
    token: str | None,
    grace: float,
    failure_grace: float | None = None,
) -> int:
    """Start a group of `orchard runner` members with `member_args` and supervise it until
    it ends; the exit status (`GroupError` for a bad hostfile or size)."""
    if (hostfile is None) == (local_group is None):
        raise GroupError("give either --hostfile or --local-group, not both")
    member = member_command(member_args)
    if hostfile is not None:
        return Supervisor(
            [launched_members(member, hostfile, token)],
            grace=grace,
            failure_grace=failure_grace,
            launcher=True,
        ).run()
    assert local_group is not None
    with tempfile.TemporaryDirectory(prefix="orchard-group-") as scratch:
        children = local_members(member, local_group, Path(scratch) / "ring.json")
        if token:  # through the environment, never a command line
            children = [attrs.evolve(c, env={**c.env, TOKEN_ENV: token}) for c in children]
        return Supervisor(children, grace=grace, failure_grace=failure_grace, launcher=False).run()


def member_command(argv: Sequence[str]) -> list[str]:
    """How the launcher starts one member: this interpreter, `-m orchard runner`."""
    return [sys.executable, "-m", "orchard", "runner", *argv, MEMBER_FLAG]


class Supervisor:
    """Runs a group's processes (its members, or the launcher that starts them) and leaves no
    process behind (module docstring)."""

    def __init__(
        self,
        children: Sequence[Child],
        *,
        grace: float,
        launcher: bool,
        failure_grace: float | None = None,
    ) -> None:
        self.children = list(children)
        self.grace = grace
        """How long the group may take to end after SIGTERM (rank 0 drains first)."""
        self.failure_grace = grace if failure_grace is None else failure_grace
        """How long the others may take to leave after a member failed."""
        self.launcher = launcher
        """The one child is `mlx.launch`: member failures are read from its output."""
        self.failed = False
        """A member exited with another status than 0."""
        self._failed_at: float | None = None
        self._stop_at: float | None = None
        self._procs: list[subprocess.Popen[bytes]] = []

    def run(self) -> int:
        """Run the group until it ends; the exit status for this process."""
        copies: list[threading.Thread] = []
        pipe = subprocess.PIPE if self.launcher else None
        for child in self.children:
            log.info("starting %s", shlex.join(child.argv))
            proc = subprocess.Popen(  # noqa: S603 -- our own interpreter and command
                child.argv,
                stdin=subprocess.DEVNULL,
                stdout=pipe,
                stderr=pipe,
                env={**os.environ, **child.env},
                start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor only
            )
            self._procs.append(proc)
            for source, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                if source is not None:
                    copies.append(
                        threading.Thread(target=self._copy, args=(source, sink), daemon=True)
                    )
        for copy in copies:
            copy.start()
        signals = (signal.SIGTERM, signal.SIGINT)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in signals}
        try:
            while True:
                statuses = [proc.poll() for proc in self._procs]  # every one: no short cut
                if None not in statuses:
                    break
                if any(status not in (None, 0) for status in statuses):
                    self._failure()
                time.sleep(0.1)
                now = time.monotonic()
                for since, grace in (
                    (self._failed_at, self.failure_grace),
                    (self._stop_at, self.grace),
                ):
                    if since is not None and now - since > grace:
                        log.warning(
                            "the group did not end %.0f s after it should: killing it", grace
                        )
                        self._kill_all()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._kill_all()  # anything the launcher lost track of
        for copy in copies:
            copy.join(1)
        if any(proc.returncode for proc in self._procs):
            self.failed = True
        return 1 if self.failed else 0

    def _failure(self) -> None:
        self.failed = True
        if self._failed_at is None:
            self._failed_at = time.monotonic()
            self._tell_members()

    def _tell_members(self) -> None:
        """A member failed: tell the others here at once (SIGUSR1: they leave with a message,
        `member.leave_when_told`) rather than let their watchdogs find out a timeout later.
        Through the launcher, remote members are reached by their watchdogs alone."""
        if self.launcher:
            for process in self._descendants(recursive=False):
                with contextlib.suppress(psutil.Error):
                    process.send_signal(LEAVE_SIGNAL)
            return
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(LEAVE_SIGNAL)

    def _copy(self, source: IO[bytes], sink: IO[str]) -> None:
        for line in iter(source.readline, b""):
            text = line.decode(errors="replace")
            if any(marker in text for marker in _FAILED):
                self._failure()
            sink.write(text)
            sink.flush()

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._stop_at is not None:  # a second signal: now
            self._kill_all()
            return
        self._stop_at = time.monotonic()
        # Members drain (rank 0) or ignore it (the others, which rank 0 closes); through the
        # launcher, its children: the local members, the ssh sessions of remote ones.
        targets = self._descendants(recursive=False) if self.launcher else self._procs
        for target in targets:
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                target.send_signal(signal.SIGTERM)

    def _descendants(self, *, recursive: bool) -> list[psutil.Process]:
        found: list[psutil.Process] = []
        for proc in self._procs:
            with contextlib.suppress(psutil.Error):
                found += psutil.Process(proc.pid).children(recursive=recursive)
        return found

    def _kill_all(self) -> None:
        """SIGKILL every process of the group still running (each child's session)."""
        descendants = self._descendants(recursive=True)
        for proc in self._procs:
            # Also after the child itself ended: what it started may linger in its group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for process in descendants:
            with contextlib.suppress(psutil.Error):
                process.kill()
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
