"""Stored state across a real restart of the gateway process, with the official `openai` SDK:
a gateway on a `--store` file and a runner on the built-in model; a stored chat completion and
a stored response chain (previous_response_id) are made, the gateway process is stopped and a
new one started on the same port and file (the runner reconnects by itself), and what the
first stored is retrieved, listed and continued. With `--store memory` the same retrieve is
a 404 after the restart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.e2e.faults.harness import GatewayAt
from tests.support import UNIT, Gateway, Process, free_port, start_runner

MODEL = "orchard-demo"

pytestmark = pytest.mark.timeout(int(240 * UNIT))


def client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base}/v1", api_key="unused", max_retries=0)


class Restartable:
    """A gateway on a fixed port (its runner's `--gateway`), stopped and started again."""

    def __init__(self, *options: str) -> None:
        self.port = free_port()
        self.gateway: Gateway = GatewayAt(self.port, *options)
        self.runner: Process = start_runner(self.gateway, "--model", MODEL)
        self.gateway.wait_for_runners(1)

    def restart(self, *options: str) -> None:
        self.gateway.stop()
        assert self.gateway.process.proc.returncode == 0  # drained, then exited
        self.gateway = GatewayAt(self.port, *options)
        self.gateway.wait_for_runners(1)  # the runner came back by itself

    def stop(self) -> None:
        self.runner.stop()
        self.gateway.stop()


@pytest.fixture
def restartable() -> Iterator[list[Restartable]]:
    started: list[Restartable] = []
    yield started
    for one in started:
        one.stop()


def without_ids(items: Any) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.to_dict().items() if k != "id"} for item in items]


def test_stored_completions_and_responses_survive_a_restart(
    tmp_path: Path, restartable: list[Restartable]
) -> None:
    store = tmp_path / "state" / "store.sqlite3"
    stack = Restartable("--store", str(store))
    restartable.append(stack)
    with client(stack.gateway) as sdk:
        done = sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Name a pear."}],
            max_tokens=8,
            temperature=0,
            store=True,
            metadata={"topic": "pears"},
        )
        chat_before = sdk.chat.completions.retrieve(done.id)
        messages_before = sdk.chat.completions.messages.list(done.id)
        first = sdk.responses.create(
            model=MODEL, input="Tell me about pear trees.", max_output_tokens=16, temperature=0
        )
        second = sdk.responses.create(
            model=MODEL,
            previous_response_id=first.id,
            input="And apple trees?",
            max_output_tokens=16,
            temperature=0,
        )
        response_before = sdk.responses.retrieve(second.id)
        items_before = sdk.responses.input_items.list(second.id, order="asc")
    assert [item.type for item in items_before.data] == ["message", "message", "message"]
    assert store.exists()

    stack.restart("--store", str(store))
    with client(stack.gateway) as sdk:
        assert sdk.chat.completions.retrieve(done.id) == chat_before
        assert sdk.chat.completions.messages.list(done.id).data == messages_before.data
        listed = sdk.chat.completions.list(metadata={"topic": "pears"})
        assert [c.id for c in listed.data] == [done.id]
        assert sdk.responses.retrieve(second.id) == response_before
        assert sdk.responses.retrieve(second.id).previous_response_id == first.id
        assert sdk.responses.input_items.list(second.id, order="asc").data == items_before.data
        # The chain goes on from what the first gateway stored.
        third = sdk.responses.create(
            model=MODEL,
            previous_response_id=second.id,
            input="Which grows faster?",
            max_output_tokens=16,
            temperature=0,
        )
        assert third.status in ("completed", "incomplete")
        assert third.previous_response_id == second.id
        items = sdk.responses.input_items.list(third.id, order="asc").data
        assert without_ids(items[:3]) == without_ids(items_before.data)
        assert [item.type for item in items] == ["message"] * 5
        assert without_ids(items[3:4])[0]["role"] == "assistant"  # the second's answer
        # Deleted after a restart, it stays deleted after the next.
        sdk.chat.completions.delete(done.id)
    stack.restart("--store", str(store))
    with client(stack.gateway) as sdk:
        with pytest.raises(openai.NotFoundError):
            sdk.chat.completions.retrieve(done.id)
        assert sdk.responses.retrieve(third.id).id == third.id


def test_with_store_memory_a_restart_forgets(restartable: list[Restartable]) -> None:
    stack = Restartable("--store", "memory")
    restartable.append(stack)
    with client(stack.gateway) as sdk:
        done = sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Name an apple."}],
            max_tokens=4,
            temperature=0,
            store=True,
        )
        kept = sdk.responses.create(model=MODEL, input="Hi.", max_output_tokens=16)
        assert sdk.chat.completions.retrieve(done.id).id == done.id  # stored, in memory
        assert sdk.responses.retrieve(kept.id).id == kept.id
    stack.restart("--store", "memory")
    with client(stack.gateway) as sdk:
        with pytest.raises(openai.NotFoundError):
            sdk.chat.completions.retrieve(done.id)
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(kept.id)
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.responses.create(model=MODEL, previous_response_id=kept.id, input="More.")
        assert caught.value.param == "previous_response_id"
