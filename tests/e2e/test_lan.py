"""A LAN for real: network namespaces joined by veth pairs and a bridge, each with its own
address. A gateway listens in one; a runner in another finds it by mDNS alone (no URL) and
serves a chat completion to the `openai` SDK in a third. A runner without the token is
refused; a second gateway on the LAN makes a runner ask which, and `--gateway NAME` picks it.

Needs root and the `ip` command (iproute2); skipped where they are missing, such as a Mac.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import attrs
import httpx
import orjson
import pytest

from protocol.frames import PROTOCOL_VERSION
from runner.demo_model import DEMO_MODEL_ID
from tests.support import UNIT, Process, wait_until

TOKEN = "lan-runner-token"
PORT = 8000
SUBNET = "10.77.{}.{}"


def _why_not() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    if shutil.which("ip") is None:
        return "needs the ip command (iproute2)"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@attrs.define
class Lan:
    """Namespaces on one bridge; the test process reaches them through the bridge's own
    address."""

    tag: str
    net: int
    hosts: dict[str, str] = attrs.field(factory=dict)
    """Namespace name → its address."""

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    def add(self, role: str, host: int) -> str:
        """A namespace on the LAN at 10.77.<net>.<host>; returns its name."""
        ns, veth = f"{self.tag}-{role}", f"{self.tag}{role}"
        address = SUBNET.format(self.net, host)
        _ip("netns", "add", ns)
        self.hosts[ns] = address
        _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}b")
        _ip("link", "set", veth, "netns", ns)
        _ip("link", "set", f"{veth}b", "master", self.bridge)
        _ip("link", "set", f"{veth}b", "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", veth)
        _ip("-n", ns, "link", "set", veth, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return ns

    def url(self, ns: str, port: int = PORT) -> str:
        return f"https://{self.hosts[ns]}:{port}"


@pytest.fixture(scope="module")
def lan() -> Iterator[Lan]:
    net = os.getpid() % 200 + 20
    network = Lan(f"o{os.getpid() % 10000}", net)
    try:
        _ip("link", "add", network.bridge, "type", "bridge")
        _ip("addr", "add", f"{SUBNET.format(net, 254)}/24", "dev", network.bridge)
        _ip("link", "set", network.bridge, "up")
        for role, host in (("gw", 1), ("rn", 2), ("cl", 3), ("gw2", 4)):
            network.add(role, host)
    except subprocess.CalledProcessError as exc:
        _teardown(network)
        pytest.skip(f"cannot build network namespaces here: {exc.stderr.decode().strip()}")
    yield network
    _teardown(network)


def _teardown(network: Lan) -> None:
    for ns in network.hosts:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        veth = f"{ns.replace('-', '')}b"
        subprocess.run(["ip", "link", "del", veth], capture_output=True, check=False)
    subprocess.run(["ip", "link", "del", network.bridge], capture_output=True, check=False)


def _gateway(
    lan: Lan, ns: str, name: str, port: int = PORT, *, token: str = TOKEN, tls: Path | None = None
) -> Process:
    """A gateway on the LAN: TLS by default there, its certificates in its own directory
    unless `tls` names one."""
    tls = tls or _tls_dir(lan, ns)
    gateway = Process(
        ["gateway", "--host", "0.0.0.0", "--port", str(port), "--name", name],
        env={"ORCHARD_RUNNER_TOKEN": token, "ORCHARD_TLS_DIR": str(tls)},
        netns=ns,
    )
    health = f"{lan.url(ns, port)}/health"
    wait_until(lambda: _get(health) is not None, 30, f"gateway {name}")
    return gateway


def _tls_dir(lan: Lan, ns: str) -> Path:
    return Path(tempfile.gettempdir()) / f"{lan.tag}-tls" / ns


def _get(url: str) -> dict[str, object] | None:
    """Test plumbing (the clients under test verify the certificate; see the SDK below)."""
    try:
        response = httpx.get(url, timeout=2, verify=False)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


def _runners(lan: Lan, ns: str, port: int = PORT) -> list[str]:
    found = _get(f"{lan.url(ns, port)}/v1/runners")
    data = found["data"] if found else []
    assert isinstance(data, list)
    return [runner["name"] for runner in data]


SCRIPTED = ("--engine", "scripted", "--model", "lan-model")
"""The engine of the runners that serve no request: loading the built-in model (seconds of
MLX) is no part of what they show."""
BUILT_IN = ("--model", DEMO_MODEL_ID)


def _runner(
    lan: Lan, name: str, *extra: str, token: str | None = TOKEN, engine: tuple[str, ...] = SCRIPTED
) -> Process:
    """A runner in the runner's namespace (no --gateway unless `extra` has one)."""
    env = {"ORCHARD_RUNNER_TOKEN": token or ""}
    args = ["runner", "--name", name, *engine, "--max-concurrent", "2", *extra]
    return Process(args, env=env, netns=f"{lan.tag}-rn")


@pytest.fixture(scope="module")
def gateway(lan: Lan) -> Iterator[str]:
    ns = f"{lan.tag}-gw"
    process = _gateway(lan, ns, "lan-gw")
    yield ns
    process.stop()


def test_a_runner_finds_the_gateway_by_mdns_and_serves_a_client_elsewhere(
    lan: Lan, gateway: str, demo_model_path: object
) -> None:
    runner = _runner(lan, "found-by-mdns", engine=BUILT_IN)  # no --gateway: mDNS only
    try:
        wait_until(lambda: "found-by-mdns" in _runners(lan, gateway), 60, "the runner to join")
        # The openai SDK, in a third namespace, against the gateway's LAN address.
        script = textwrap.dedent(
            f"""
            import json, openai
            client = openai.OpenAI(
                base_url="{lan.url(gateway)}/v1",
                api_key="unused",
                http_client=openai.DefaultHttpxClient(
                    verify="{_tls_dir(lan, gateway) / "ca.pem"}"
                ),
            )
            answer = client.chat.completions.create(
                model="{DEMO_MODEL_ID}",
                messages=[{{"role": "user", "content": "Hello from the LAN"}}],
                max_tokens=5,
                temperature=0,
            )
            print(json.dumps(answer.model_dump()))
            """
        )
        done = subprocess.run(
            ["ip", "netns", "exec", f"{lan.tag}-cl", sys.executable, "-c", script],
            capture_output=True,
            timeout=60 * UNIT,
            check=False,
        )
        assert done.returncode == 0, done.stderr.decode()
        answer = orjson.loads(done.stdout)
        assert answer["object"] == "chat.completion"
        assert answer["model"] == DEMO_MODEL_ID
        (choice,) = answer["choices"]
        assert (choice["index"], choice["finish_reason"]) == (0, "length")
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"]
        assert answer["usage"]["completion_tokens"] == 5
    finally:
        log = runner.stop()
    assert "found gateway lan-gw" in log, log
    assert "the gateway proved the runner token; pinned its certificate" in log, log


def test_a_runner_without_the_token_is_refused(lan: Lan, gateway: str) -> None:
    runner = _runner(lan, "no-token", token=None)
    try:
        runner.proc.wait(60 * UNIT)
    finally:
        log = runner.stop()
    assert runner.proc.returncode == 2, log
    assert "the gateway refused this runner" in log, log
    # At its first try: a refusal is final, not a reason to look again and retry.
    assert log.count("missing or wrong runner token") == 1, log
    assert "no-token" not in _runners(lan, gateway)


def test_a_second_gateway_makes_the_runner_ask_which(lan: Lan, gateway: str) -> None:
    second_ns = f"{lan.tag}-gw2"
    second = _gateway(lan, second_ns, "lan-gw-2")
    try:
        asking = _runner(lan, "undecided")
        asking.proc.wait(60 * UNIT)
        log = asking.stop()
        assert asking.proc.returncode == 2, log
        assert "2 gateways answer on this network" in log, log
        for name, ns in (("lan-gw", gateway), ("lan-gw-2", second_ns)):
            line = f"{name}  {lan.url(ns)}  protocol {PROTOCOL_VERSION}, runner token required"
            assert line in log, log
        assert "Choose one with --gateway NAME" in log
        # Named, it joins that one.
        chosen = _runner(lan, "chosen", "--gateway", "lan-gw-2")
        try:
            wait_until(lambda: "chosen" in _runners(lan, second_ns), 60, "the named gateway")
            assert "chosen" not in _runners(lan, gateway)
        finally:
            chosen.stop()
    finally:
        second.stop()


def _verified(lan: Lan, url: str, ca: Path) -> str:
    """`GET url` from the client's namespace by a client trusting `ca`: its status, or why
    it failed."""
    script = f"import httpx; print(httpx.get({url!r}, verify={str(ca)!r}, timeout=10).json())"
    done = subprocess.run(
        ["ip", "netns", "exec", f"{lan.tag}-cl", sys.executable, "-c", script],
        capture_output=True,
        timeout=60 * UNIT,
        check=False,
    )
    return done.stdout.decode() if done.returncode == 0 else done.stderr.decode()


def test_a_runner_follows_its_gateway_to_a_new_address(lan: Lan) -> None:
    # The gateway named "moving" stops and comes back at another address (another network
    # namespace), with the same TLS directory: a client trusting its authority verifies it by
    # IP at both, and the runner looks it up again and joins it there, its pin unchanged.
    first_ns, second_ns = f"{lan.tag}-gw", f"{lan.tag}-gw2"
    port = PORT + 1  # beside the module's gateway, if it runs
    tls = _tls_dir(lan, "moving")
    first = _gateway(lan, first_ns, "moving", port, tls=tls)
    runner = _runner(lan, "follower", "--gateway", "moving")
    try:
        wait_until(lambda: "follower" in _runners(lan, first_ns, port), 60, "it to join")
        assert "'status': 'ok'" in _verified(
            lan, f"{lan.url(first_ns, port)}/health", tls / "ca.pem"
        )
        first.stop()
        second = _gateway(lan, second_ns, "moving", port, tls=tls)
        try:
            health = _verified(lan, f"{lan.url(second_ns, port)}/health", tls / "ca.pem")
            assert "'status': 'ok'" in health, health
            wait_until(lambda: "follower" in _runners(lan, second_ns, port), 60, "it to follow")
        finally:
            second.stop()
    finally:
        log = runner.stop()
        first.stop()
    assert f"the gateway is now at wss://{lan.hosts[second_ns]}:{port}" in log, log
    assert log.count("pinned its certificate authority") == 1, log
    assert "its certificate authority is still" in log, log


def test_a_runner_refuses_an_impostor_that_advertises_the_gateways_name(lan: Lan) -> None:
    # Someone on the LAN answers for "shared-name" without knowing the runner token: the
    # runner asks it to prove the token before sending it, and leaves.
    ns = f"{lan.tag}-gw2"
    impostor = _gateway(lan, ns, "shared-name", PORT + 2, token="not-the-token")
    try:
        fooled = _runner(lan, "fooled", "--gateway", "shared-name")
        fooled.proc.wait(60 * UNIT)
        log = fooled.stop()
    finally:
        seen = impostor.stop()
    assert fooled.proc.returncode == 2, log
    assert "found gateway shared-name" in log, log
    assert "did not prove that it knows the runner token" in log, log
    assert "missing or wrong runner token" not in seen, seen
