"""Scenario "speculative": one stream's decode rate with a draft model ÷ without.

Three batched engines (`batched_engine`, the runner's default) on the demo model, driven in
this process (no gateway), each serving one request at a time (the lone path, where the draft
is used): no draft; the demo model as its own draft (`--draft-model orchard-demo`: every
proposal agrees); `orchard-demo-draft` (another random model with the same tokenizer, one layer:
proposals rarely agree). Each draft twice: drafting every request (`ModelOptions.draft_always`)
and as the runner does by default, drafting while that measures faster than decoding alone
(runner.engine.speculative: the first request drafts, the second does not, then the faster
way but for one probe in eight). Each round runs one greedy `tokens`-token request on each, in turn
(end of sequence biased away, so that all run exactly `tokens`); a figure is the median over
`runs` rounds of the decode rate (`GenerationStats.generation_tps`: tokens after the first /
the time from it to the last), and each draft's figure is divided by the no-draft one of the
same rounds. The acceptance rate is the draft's accepted ÷ drafted tokens over the rounds.

`--num-draft-tokens` is `K` below (`python -m bench.speculative K` to try another).
"""

from __future__ import annotations

import sys
import time

from bench.harness import env_note, median, table
from protocol.frames import Generate, LogitBias, Message, SamplingParams
from runner.demo_model import DEMO_DRAFT_MODEL_ID, DEMO_MODEL_ID, resolve_model
from runner.engine.base import EngineEvent, Failure, Output
from runner.engine.batched import batched_engine
from runner.engine.mlx_engine import MlxEngine
from runner.model_options import ModelOptions

K = 3


def _request(i: int, tokens: int, eos: int) -> Generate:
    return Generate(
        f"spec-{i}",
        DEMO_MODEL_ID,
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

    resolve_model(DEMO_DRAFT_MODEL_ID)
    tokenizer = mlx_lm.load(resolve_model(DEMO_MODEL_ID))[1]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    drafts = {
        "no draft": (None, False),
        "itself (always agrees), every request": (DEMO_MODEL_ID, True),
        "itself, as measured (the default)": (DEMO_MODEL_ID, False),
        f"{DEMO_DRAFT_MODEL_ID} (rarely agrees), every request": (DEMO_DRAFT_MODEL_ID, True),
        f"{DEMO_DRAFT_MODEL_ID}, as measured (the default)": (DEMO_DRAFT_MODEL_ID, False),
    }
    engines: dict[str, MlxEngine] = {}
    events: dict[str, list[EngineEvent]] = {}

    def sink(event: EngineEvent) -> None:
        events[event.request_id].append(event)

    for label, (draft, always) in drafts.items():
        options = ModelOptions(
            draft_model=draft, num_draft_tokens=num_draft_tokens, draft_always=always
        )
        engine = batched_engine(DEMO_MODEL_ID, options=options)
        engine.start(sink)
        engines[label] = engine
    rates: dict[str, list[float]] = {label: [] for label in drafts}
    n = 0
    try:
        for _ in range(runs):
            for label, engine in engines.items():
                n += 1
                last = _run(engine, events, _request(n, tokens, eos))
                assert last.usage.completion_tokens == tokens, last.usage
                assert last.stats is not None
                rates[label].append(last.stats.generation_tps)
        counts = {label: engine.speculation() for label, engine in engines.items()}
    finally:
        for engine in engines.values():
            engine.close()
    base = rates["no draft"]
    rows = []
    for label in drafts:
        ratios = [r / b for r, b in zip(rates[label], base, strict=True)]
        spec = counts[label]
        acceptance = f"{spec[0].accepted / spec[0].drafted:.1%}" if spec else "-"
        rows.append([label, median(rates[label]), median(ratios), acceptance])
    print(
        table(
            f"speculative decoding, 1 stream, {tokens} tokens, K={num_draft_tokens}, "
            f"median of {runs} ({env_note()})",
            ["draft", "decode tok/s", "÷ no draft", "accepted"],
            rows,
        )
    )


if __name__ == "__main__":
    main(num_draft_tokens=int(sys.argv[1]) if len(sys.argv) > 1 else K)
