"""Scenario "speculative": one stream's decode rate with a draft model ÷ without.

Batched engines (`batched_engine`, the runner's default) driven in this process (no gateway),
each serving one request at a time (the lone path, where the draft is used), on two models:

- the demo model, with no draft; itself as its draft (`--draft-model orchard-demo`: every
  proposal agrees, but a draft step costs as much as the model's); `orchard-demo-draft`
  (another random model with the same tokenizer, one layer: proposals rarely agree);
- `orchard-demo-deep` (the demo model's logits exactly from 8 times its layers), with no
  draft; the demo model as its draft (every proposal agrees, a step costs about a sixth);
  `orchard-demo-draft`.

Each draft twice: drafting every request (`ModelOptions.draft_always`) and as the runner does
by default, drafting while that measures faster than decoding alone (runner.engine.speculative:
the first request drafts, the second does not, then the faster way but for one probe in
eight). Each round runs one greedy `tokens`-token request on each engine of a model, in turn
(end of sequence biased away, so that all run exactly `tokens`); a figure is the median over
`runs` rounds of the decode rate (`GenerationStats.generation_tps`: tokens after the first /
the time from it to the last), and each draft's figure is divided by the no-draft one of the
same rounds; "overall" divides the rate over all of a draft's requests (every request's time
counted, a probe's too) by no draft's. The acceptance rate is the draft's accepted ÷ drafted
tokens over the rounds. Each round starts one engine further on, so that each engine's request
follows each other engine's equally often.

`--num-draft-tokens` is `K` below (`python -m bench.speculative K` to try another).
"""

from __future__ import annotations

import sys
import time

from bench.harness import env_note, median, table
from protocol.frames import Generate, LogitBias, Message, SamplingParams
from runner.demo_model import (
    DEMO_DEEP_MODEL_ID,
    DEMO_DRAFT_MODEL_ID,
    DEMO_MODEL_ID,
    resolve_model,
)
from runner.engine.base import EngineEvent, Failure, Output
from runner.engine.batched import batched_engine
from runner.engine.mlx_engine import MlxEngine
from runner.model_options import ModelOptions

K = 3


def _request(i: int, tokens: int, eos: int, model: str) -> Generate:
    return Generate(
        f"spec-{i}",
        model,
        (Message("user", "Tell me about the orchard in spring."),),
        max_tokens=tokens,
        sampling=SamplingParams(temperature=0.0, logit_bias=(LogitBias(eos, -100.0),)),
    )


def _run(engine: MlxEngine, events: dict[str, list[EngineEvent]], request: Generate) -> Output:
    events[request.request_id] = []
    engine.submit(request)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        got = events[request.request_id]
        if got and (isinstance(got[-1], Failure) or got[-1].finish_reason is not None):
            last = got[-1]
            if isinstance(last, Failure):
                raise RuntimeError(last.message)
            return last
        time.sleep(0.002)
    raise RuntimeError(f"{request.request_id} did not finish")


def main(runs: int = 5, tokens: int = 256, num_draft_tokens: int = K) -> None:
    import mlx_lm

    tokenizer = mlx_lm.load(resolve_model(DEMO_MODEL_ID))[1]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    poor = f"{DEMO_DRAFT_MODEL_ID} (rarely agrees)"
    for target, agreeing in (
        (DEMO_MODEL_ID, "itself (always agrees)"),
        (DEMO_DEEP_MODEL_ID, f"{DEMO_MODEL_ID} (always agrees, 1/8 the layers)"),
    ):
        drafts = {
            "no draft": (None, False),
            f"{agreeing}, every request": (DEMO_MODEL_ID, True),
            f"{agreeing}, as measured (the default)": (DEMO_MODEL_ID, False),
            f"{poor}, every request": (DEMO_DRAFT_MODEL_ID, True),
            f"{poor}, as measured (the default)": (DEMO_DRAFT_MODEL_ID, False),
        }
        rows = _measure(target, drafts, runs, tokens, num_draft_tokens, eos)
        print(
            table(
                f"speculative decoding on {target}, 1 stream, {tokens} tokens, "
                f"K={num_draft_tokens}, median of {runs} ({env_note()})",
                ["draft", "decode tok/s", "÷ no draft", "÷ no draft, overall", "accepted"],
                rows,
            )
        )


def _overall(rates: list[float]) -> float:
    """The decode rate over requests of equal length that ran at `rates`."""
    return len(rates) / sum(1 / rate for rate in rates)


def _measure(  # noqa: PLR0917  # the scenario's settings, passed through
    target: str,
    drafts: dict[str, tuple[str | None, bool]],
    runs: int,
    tokens: int,
    num_draft_tokens: int,
    eos: int,
) -> list[list[object]]:
    """Each draft's median decode rate, its median ratio to no draft's in the same rounds,
    and its acceptance."""
    engines: dict[str, MlxEngine] = {}
    events: dict[str, list[EngineEvent]] = {}

    def sink(event: EngineEvent) -> None:
        events[event.request_id].append(event)

    for label, (draft, always) in drafts.items():
        options = ModelOptions(
            draft_model=draft, num_draft_tokens=num_draft_tokens, draft_always=always
        )
        engine = batched_engine(target, options=options)
        engine.start(sink)
        engines[label] = engine
    rates: dict[str, list[float]] = {label: [] for label in drafts}
    order = list(engines.items())
    try:
        for run in range(runs):
            # Each round starts one engine further on: an engine's request follows each of the
            # others' equally often (one that drafted leaves MLX's buffer cache cleared).
            turn = order[run % len(order) :] + order[: run % len(order)]
            for i, (label, engine) in enumerate(turn):
                last = _run(engine, events, _request(run * len(engines) + i, tokens, eos, target))
                assert last.usage.completion_tokens == tokens, last.usage
                assert last.stats is not None
                rates[label].append(last.stats.generation_tps)
        counts = {label: engine.speculation() for label, engine in engines.items()}
    finally:
        for engine in engines.values():
            engine.close()
    base = rates["no draft"]
    rows: list[list[object]] = []
    for label in drafts:
        ratios = [r / b for r, b in zip(rates[label], base, strict=True)]
        spec = counts[label]
        acceptance = f"{spec[0].accepted / spec[0].drafted:.1%}" if spec else "-"
        # Every request's time counted (a probe's too): the rate over all of them.
        overall = _overall(rates[label]) / _overall(base)
        rows.append([label, median(rates[label]), median(ratios), overall, acceptance])
    return rows


if __name__ == "__main__":
    main(num_draft_tokens=int(sys.argv[1]) if len(sys.argv) > 1 else K)
