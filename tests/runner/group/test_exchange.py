"""The step message the group's members exchange (runner.group.exchange)."""

from __future__ import annotations

import attrs

from protocol.frames import Generate, Message, SamplingParams
from runner.group.exchange import StepMessage

# --- the step message ---------------------------------------------------------------------


def test_step_message_round_trips_frames_cancels_and_close() -> None:
    generate = Generate(
        "r1",
        "m",
        (Message("user", "two\nlines and ünïcode"),),
        max_tokens=7,
        sampling=SamplingParams(temperature=0.5, seed=3),
    )
    message = StepMessage((generate, attrs.evolve(generate, request_id="r2")), ("r0",), True)
    assert StepMessage.decode(message.encode()) == message
    assert StepMessage.decode(StepMessage(cancels=("x",)).encode()) == StepMessage(cancels=("x",))
    assert StepMessage().empty
    assert not StepMessage(close=True).empty
