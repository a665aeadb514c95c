"""Runner tokens, client API keys, origins, and exposure rules, over real sockets."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from typing import Any, ClassVar

import httpx
import openai
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from gateway.auth import bearer, is_loopback, origin_allowed, secret_in
from gateway.config import GatewayConfig
from protocol.closecodes import CloseCode
from tests.support import (
    REPO,
    UNIT,
    FakeRunner,
    Gateway,
    recv_until_closed,
    start_runner,
    wait_until,
)

TOKEN = "runner-secret-token-5f2a"
KEY = "client-key-9c1d"


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gw = Gateway(
        "--runner-token",
        TOKEN,
        "--api-key",
        KEY,
        "--allow-origin",
        "http://allowed.example",
        "--log-level",
        "debug",
    )
    yield gw
    gw.stop()


AUTH = {"Authorization": f"Bearer {KEY}"}
FILE_KEYS = ("from-file-1", "from-file-2")
ENV_KEYS = ("env-a", "env-b")


@pytest.fixture(scope="module")
def tokenless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """No runner token (loopback runners only); client API keys from a file and from
    ORCHARD_API_KEYS."""
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text(f"{FILE_KEYS[0]}\n\n{FILE_KEYS[1]}\n")
    gw = Gateway("--api-key-file", str(key_file), env={"ORCHARD_API_KEYS": ", ".join(ENV_KEYS)})
    yield gw
    gw.stop()


# --- pure helpers ---------------------------------------------------------------------------


def test_helpers() -> None:
    assert secret_in("a", ["b", "a"])
    assert not secret_in("a", [])
    assert not secret_in(None, ["a"])
    assert not secret_in(7, ["7"])
    assert bearer({"authorization": "Bearer xyz"}) == "xyz"
    assert bearer({"authorization": "bearer  xyz "}) == "xyz"
    assert bearer({"authorization": "Basic xyz"}) is None
    assert bearer({"authorization": "Bearer "}) is None
    assert bearer({}) is None
    assert is_loopback("127.0.0.1")
    assert is_loopback("127.8.9.1")
    assert is_loopback("::1")
    assert is_loopback("localhost")
    assert not is_loopback("192.168.1.20")
    assert not is_loopback(None)
    assert not is_loopback("not-an-ip")
    config = GatewayConfig(allowed_origins=frozenset({"https://ok.example"}))
    assert origin_allowed(None, "h:1", config)
    assert origin_allowed("http://h:1", "h:1", config)
    assert origin_allowed("https://ok.example", "h:1", config)
    assert not origin_allowed("https://evil.example", "h:1", config)
    assert origin_allowed("https://x", "h:1", GatewayConfig(allowed_origins=frozenset({"*"})))


# --- runners --------------------------------------------------------------------------------


async def _close_code(gateway: Gateway, headers: dict[str, str]) -> tuple[int, str]:
    async with connect(
        f"ws://127.0.0.1:{gateway.port}/v1/runner/ws", additional_headers=headers
    ) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(recv_until_closed(ws), 5 * UNIT)
    assert closed.value.rcvd is not None
    return closed.value.rcvd.code, closed.value.rcvd.reason


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}],
    ids=["none", "wrong", "no-scheme"],
)
async def test_runner_without_the_token_is_refused(
    gateway: Gateway, headers: dict[str, str]
) -> None:
    code, reason = await _close_code(gateway, headers)
    assert code == CloseCode.UNAUTHORIZED
    assert reason == "missing or wrong runner token"
    async with httpx.AsyncClient() as http:
        listed = (await http.get(f"{gateway.base}/v1/runners", headers=AUTH)).json()["data"]
    assert listed == []


async def test_runner_with_the_token_registers(gateway: Gateway) -> None:
    fake = await FakeRunner.connect(
        gateway, name="trusted", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    try:
        async with httpx.AsyncClient() as http:
            data = (await http.get(f"{gateway.base}/v1/runners", headers=AUTH)).json()
        assert [r["name"] for r in data["data"]] == ["trusted"]
        assert TOKEN not in orjson.dumps(data).decode()
    finally:
        await fake.close()


def test_runner_process_with_a_wrong_token_exits_with_a_clear_message(gateway: Gateway) -> None:
    proc = start_runner(gateway, "--engine", "scripted", "--model", "m", "--token", "nope")
    wait_until(lambda: not proc.alive(), 15, "the refused runner to exit")
    out = proc.stop()
    assert proc.proc.returncode == 2
    assert "refused this runner: missing or wrong runner token" in out
    assert "nope" not in out  # the token it used is not echoed


def test_tokens_never_in_logs(gateway: Gateway) -> None:
    runner = start_runner(
        gateway,
        "--engine",
        "scripted",
        "--model",
        "m",
        "--log-level",
        "debug",
        env={"ORCHARD_RUNNER_TOKEN": TOKEN},
    )
    try:
        wait_until(
            lambda: any(
                r["name"] == "test-runner"
                for r in httpx.get(f"{gateway.base}/v1/runners", headers=AUTH).json()["data"]
            ),
            20,
            "the runner",
        )
        done = httpx.post(
            f"{gateway.base}/v1/chat/completions",
            headers=AUTH,
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert done.status_code == 200
    finally:
        runner_log = runner.stop()
    assert "registered with" in runner_log  # debug logging was on
    assert TOKEN not in runner_log
    assert KEY not in runner_log


def test_loopback_only_without_a_token(tokenless: Gateway) -> None:
    config = GatewayConfig()
    from gateway.pool.link import runner_refusal

    class Sock:
        headers: ClassVar[dict[str, str]] = {}

    assert runner_refusal(Sock(), "192.168.1.7", config) is not None  # type: ignore[arg-type]
    assert runner_refusal(Sock(), "127.0.0.1", config) is None  # type: ignore[arg-type]
    insecure = GatewayConfig(insecure=True)
    assert runner_refusal(Sock(), "192.168.1.7", insecure) is None  # type: ignore[arg-type]
    runner = start_runner(tokenless, "--engine", "scripted", "--model", "m")
    headers = {"Authorization": f"Bearer {ENV_KEYS[0]}"}
    try:
        wait_until(
            lambda: (
                len(httpx.get(f"{tokenless.base}/v1/runners", headers=headers).json()["data"]) == 1
            ),
            20,
            "the loopback runner to register",
        )
    finally:
        runner.stop()


def test_lan_address_without_token_needs_insecure() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "orchard", "gateway", "--host", "0.0.0.0", "--port", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30 * UNIT,
        check=False,
    )
    assert out.returncode == 2
    assert "--runner-token" in out.stderr
    assert "--insecure" in out.stderr


def test_insecure_prints_a_loud_warning() -> None:
    gw = Gateway("--insecure", "--log-level", "info")
    log = gw.stop()
    assert "!!! --insecure: ANY machine" in log


# --- clients --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/models", "/v1/runners"])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}], ids=["none", "wrong"])
def test_api_key_required_on_v1(gateway: Gateway, path: str, headers: dict[str, str]) -> None:
    resp = httpx.get(f"{gateway.base}{path}", headers=headers)
    assert resp.status_code == 401
    assert resp.json() == {
        "error": {
            "message": "Missing or incorrect API key. Send it as 'Authorization: Bearer <key>'.",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    assert httpx.get(f"{gateway.base}{path}", headers=AUTH).status_code == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages/nowhere", {"type": "error", "error": {"type": "not_found_error"}}),
        ("/api/nowhere", {"error": "Not Found"}),
        ("/v1/nowhere", {"error": {"type": "not_found_error", "param": None, "code": None}}),
    ],
    ids=["anthropic", "ollama", "openai"],
)
def test_errors_come_in_the_shape_of_the_api_asked(
    gateway: Gateway, path: str, body: dict[str, Any]
) -> None:
    resp = httpx.get(f"{gateway.base}{path}", headers=AUTH)
    assert resp.status_code == 404
    got = resp.json()
    if "type" in body:  # Anthropic's: the message is Litestar's
        assert got == {
            "type": "error",
            "error": {"type": "not_found_error", "message": "Not Found"},
        }
    elif isinstance(body["error"], str):
        assert got == body
    else:
        assert got == {"error": {**body["error"], "message": "Not Found"}}


def test_anthropics_key_header_is_an_api_key(gateway: Gateway) -> None:
    assert httpx.get(f"{gateway.base}/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(f"{gateway.base}/v1/models", headers={"x-api-key": "no"}).status_code == 401


def test_health_stays_open(gateway: Gateway) -> None:
    assert httpx.get(f"{gateway.base}/health").status_code == 200


def test_sdk_api_key_just_works(gateway: Gateway) -> None:
    with openai.OpenAI(base_url=f"{gateway.base}/v1", api_key=KEY, max_retries=0) as client:
        assert client.models.list().data == []
    with (
        openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="bad", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.models.list()


def test_foreign_origin_refused_on_http(gateway: Gateway) -> None:
    resp = httpx.get(f"{gateway.base}/v1/models", headers={**AUTH, "Origin": "http://evil.example"})
    assert resp.status_code == 403
    assert resp.json()["error"]["code"] == "origin_not_allowed"
    own = httpx.get(f"{gateway.base}/v1/models", headers={**AUTH, "Origin": gateway.base})
    assert own.status_code == 200
    allowed = httpx.get(
        f"{gateway.base}/v1/models", headers={**AUTH, "Origin": "http://allowed.example"}
    )
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "http://allowed.example"


async def test_foreign_origin_refused_on_websocket(gateway: Gateway) -> None:
    async with connect(
        f"ws://127.0.0.1:{gateway.port}/v1/ws",
        origin="http://evil.example",  # type: ignore[arg-type]
    ) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(recv_until_closed(ws), 5 * UNIT)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == CloseCode.ORIGIN_NOT_ALLOWED


@pytest.fixture
def ws_url(gateway: Gateway) -> str:
    return f"ws://127.0.0.1:{gateway.port}/v1/ws"


async def test_websocket_auth_by_first_message(ws_url: str) -> None:
    async with connect(ws_url) as ws:
        await ws.send(orjson.dumps({"type": "auth", "api_key": KEY}), text=True)
        assert orjson.loads(await ws.recv()) == {"type": "auth.ok"}
        await ws.send(b'{"type": "ping"}', text=True)
        assert orjson.loads(await ws.recv()) == {"type": "pong"}


async def test_websocket_auth_by_header(ws_url: str) -> None:
    async with connect(ws_url, additional_headers=AUTH) as ws:
        await ws.send(b'{"type": "ping"}', text=True)
        assert orjson.loads(await ws.recv()) == {"type": "pong"}


@pytest.mark.parametrize(
    ("first", "reason"),
    [
        ({"type": "auth", "api_key": "wrong"}, "invalid API key"),
        ({"type": "auth", "api_key": 12}, "invalid API key"),
        ({"type": "ping"}, "authenticate first"),
    ],
)
async def test_websocket_without_a_valid_key_is_closed(
    ws_url: str, first: dict[str, object], reason: str
) -> None:
    async with connect(ws_url) as ws:
        await ws.send(orjson.dumps(first), text=True)
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(recv_until_closed(ws), 5 * UNIT)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == CloseCode.UNAUTHORIZED
    assert closed.value.rcvd.reason == reason


def test_api_keys_from_env_and_file(tokenless: Gateway) -> None:
    for key in (*FILE_KEYS, *ENV_KEYS):
        resp = httpx.get(f"{tokenless.base}/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == 200, key
    assert httpx.get(f"{tokenless.base}/v1/models").status_code == 401
