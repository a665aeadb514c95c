"""Speculative decoding (`--draft-model`) on both mlx engines, on the real demo model: the
output is the model's own (greedy identical to no draft, logprobs the model's), with logit
bias, stop strings, cancel, the prefix cache and a lone request handed over to the batch; the
drafted and accepted counts; a constrained request decodes without the draft."""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest

from protocol.frames import LogitBias, ResponseFormat, SamplingParams, Speculation
from runner.demo_model import DEMO_DEEP_MODEL_ID, DEMO_DRAFT_MODEL_ID, DEMO_MODEL_ID
from runner.engine.mlx_engine import MlxEngine
from runner.engine.speculative import (
    MIN_TOKENS,
    PROBE_EVERY,
    PROBE_TOKENS,
    Draft,
    vocabulary_mismatch,
)
from runner.model_options import DEFAULT_NUM_DRAFT_TOKENS, ModelOptions
from tests.runner.collect import Collector, engine_starter, final, outputs, run, text_of
from tests.runner.engines import GREEDY, MLX_ENGINES, MakeMlxEngine, Reference, ask
from tests.support import UNIT

StartEngine = Callable[..., tuple[MlxEngine, Collector]]
SELF = ModelOptions(draft_model=DEMO_MODEL_ID, num_draft_tokens=3, draft_always=True)
"""The built-in model as its own draft: every proposal is kept."""
POOR = ModelOptions(draft_model=DEMO_DRAFT_MODEL_ID, num_draft_tokens=4, draft_always=True)
"""Another random model with the same tokenizer: proposals are rarely kept."""
SAMPLES = 300


@pytest.fixture(scope="module", params=list(MLX_ENGINES))
def make_engine(request: pytest.FixtureRequest) -> MakeMlxEngine:
    return MLX_ENGINES[request.param]


@pytest.fixture
def start(make_engine: MakeMlxEngine, demo_model_path: Path) -> Iterator[StartEngine]:
    with engine_starter(lambda **options: make_engine(DEMO_MODEL_ID, **options)) as start:
        yield start


def spec(engine: MlxEngine) -> Speculation:
    (only,) = engine.speculation()
    return only


@pytest.mark.parametrize("options", [SELF, POOR], ids=["self", "poor"])
def test_greedy_output_is_the_models_own(
    start: StartEngine, reference: Reference, options: ModelOptions
) -> None:
    engine, collector = start(options=options)
    assert spec(engine) == Speculation(DEMO_MODEL_ID, options.draft_model or "", 0, 0)
    for i, prompt in enumerate(["Tell me about apples.", "Write a poem about the sea."]):
        request = ask(f"r{i}", prompt, max_tokens=40, sampling=GREEDY)
        events = run(engine, collector, request)
        tokens, texts = reference.greedy(request)
        assert text_of(events) == "".join(texts)
        usage = final(events).usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            len(reference.prompt(request)),
            len(tokens),
        )
    counts = spec(engine)
    assert counts.drafted > 0
    if options is SELF:
        # Every proposal is the model's own choice; only a round cut short by the end of a
        # request proposes more than is used.
        assert counts.accepted >= counts.drafted - 2 * options.num_draft_tokens
    else:
        assert counts.accepted < counts.drafted / 4


def test_logprobs_are_the_models(start: StartEngine) -> None:
    plain, plain_collector = start()
    drafted, drafted_collector = start(options=POOR)
    request = ask(
        "r1", "Tell me about pears.", max_tokens=12, sampling=GREEDY, logprobs=True, top_logprobs=3
    )
    want = [e for o in outputs(run(plain, plain_collector, request)) for e in o.logprobs]
    got = [e for o in outputs(run(drafted, drafted_collector, request)) for e in o.logprobs]
    assert [e.token for e in got] == [e.token for e in want]
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-3)
    assert [[t.token for t in e.top_logprobs] for e in got] == [
        [t.token for t in e.top_logprobs] for e in want
    ]


def test_logit_bias_and_stop_strings_hold(start: StartEngine, reference: Reference) -> None:
    engine, collector = start(options=POOR)
    token = reference.tokenizer.encode(" apple")[-1]
    biased = SamplingParams(temperature=0.0, logit_bias=(LogitBias(token, 100.0),))
    events = run(engine, collector, ask("b", max_tokens=9, sampling=biased))
    assert text_of(events) == reference.tokenizer.decode([token] * 9).lstrip()
    assert final(events).usage.completion_tokens == 9
    # A stop string inside the greedy answer ends it there, as without a draft.
    whole = ask("w", "Tell me about apples.", max_tokens=40, sampling=GREEDY)
    _, texts = reference.greedy(whole)
    answer = "".join(texts)
    stop = answer[12:16]
    request = ask("s", "Tell me about apples.", max_tokens=40, sampling=GREEDY, stop=(stop,))
    events = run(engine, collector, request)
    assert text_of(events) == answer[: answer.index(stop)]
    assert final(events).finish_reason == "stop"


def test_cancel_then_the_prefix_cache_serves_the_next_turn_exactly(
    start: StartEngine, reference: Reference
) -> None:
    engine, collector = start(options=SELF)
    long = ask("long", "Write a poem about the sea.", max_tokens=1500, sampling=GREEDY)
    engine.submit(long)
    collector.wait_for_outputs("long", 5)
    engine.cancel("long")
    assert final(collector.wait("long")).finish_reason == "cancelled"
    # The cancelled request's cache, rewound by the closed speculative step, serves a prompt
    # that starts the same: the answer is still exactly the model's.
    again = ask("again", "Write a poem about the sea.", max_tokens=30, sampling=GREEDY)
    events = run(engine, collector, again)
    _, texts = reference.greedy(again)
    assert text_of(events) == "".join(texts)
    assert final(events).usage.cached_tokens > 0


@pytest.mark.parametrize("options", [SELF, POOR], ids=["self", "poor"])
def test_a_lone_request_hands_over_to_the_batch_exactly(
    demo_model_path: Path, reference: Reference, options: ModelOptions
) -> None:
    # A closed speculative step holds the last token (a kept proposal: SELF) or not (the
    # model's own token ends the round: POOR); the batch must get the same tokens either way.
    with engine_starter(lambda **o: MLX_ENGINES["mlx-batched"](DEMO_MODEL_ID, **o)) as start:
        engine, collector = start(options=options)
        first = ask("first", "Tell me about apples.", max_tokens=120, sampling=GREEDY)
        second = ask("second", "Why is the sky blue?", max_tokens=20, sampling=GREEDY)
        engine.submit(first)
        collector.wait_for_outputs("first", 6)
        engine.submit(second)  # the lone one joins the batch mid-answer
        for request in (first, second):
            _, texts = reference.greedy(request)
            events = collector.wait(request.request_id)
            assert text_of(events) == "".join(texts), request.request_id
        assert engine.stats.solo_requests == 1


def test_a_constrained_request_decodes_without_the_draft(start: StartEngine) -> None:
    engine, collector = start(options=SELF)
    before = spec(engine)
    request = ask(
        "json", max_tokens=60, sampling=GREEDY, response_format=ResponseFormat("json_object")
    )
    events = run(engine, collector, request)
    json.loads(text_of(events))  # the grammar held
    assert spec(engine) == before


def test_seeded_sampling_repeats(start: StartEngine) -> None:
    engine, collector = start(options=POOR)
    sampled = SamplingParams(temperature=1.0, seed=7)
    texts = [
        text_of(run(engine, collector, ask(f"x{i}", max_tokens=20, sampling=sampled)))
        for i in range(2)
    ]
    assert texts[0] == texts[1]
    assert spec(engine).drafted > 0


def test_a_draft_with_another_vocabulary_is_named(reference: Reference) -> None:
    from mlx_lm.utils import load_tokenizer

    from runner.demo_model import resolve_model

    assert vocabulary_mismatch(reference.tokenizer, reference.tokenizer) is None
    other = load_tokenizer(Path(resolve_model("orchard-demo-harmony")))  # type: ignore[no-untyped-call]
    ours, theirs = reference.tokenizer.get_vocab(), other.get_vocab()
    assert len(ours) == len(theirs)  # the same size: the ids tell them apart
    differ = sorted(t for t in ours.keys() | theirs.keys() if ours.get(t) != theirs.get(t))
    assert vocabulary_mismatch(reference.tokenizer, other) == (
        f"{len(differ)} tokens have other ids (e.g. {differ[0]!r})"
    )


def test_the_counts_reach_the_heartbeat_shape(start: StartEngine) -> None:
    engine, collector = start(options=SELF)
    run(engine, collector, ask("r", max_tokens=10, sampling=GREEDY))
    deadline = time.monotonic() + 10 * UNIT
    while spec(engine).drafted == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    counts = spec(engine)
    assert counts.model == DEMO_MODEL_ID
    assert counts.draft_model == DEMO_MODEL_ID
    assert 0 < counts.accepted <= counts.drafted


def test_the_draft_is_chosen_while_it_measures_faster() -> None:
    draft = Draft("d", None, 3)
    assert draft.choose() == "probe"  # nothing measured: both ways, in one request
    draft.observe(True, 100, 1.0)  # 100 tok/s with it
    assert draft.choose() == "probe"  # still no rate without it
    draft.observe(False, 200, 1.0)  # 200 without: the draft loses
    ways = [draft.choose() for _ in range(2 * PROBE_EVERY)]
    assert ways.count("probe") == 2  # one probe every PROBE_EVERY requests
    assert ways.count("plain") == 2 * PROBE_EVERY - 2
    assert draft.chosen % PROBE_EVERY == 2
    assert ways.index("probe") == PROBE_EVERY - 1 - 2  # when the count reaches a multiple
    for _ in range(3):
        draft.observe(True, 400, 1.0)  # the draft measures faster now (a running mean)
    assert draft.rates[True] == pytest.approx(400 - 300 * 0.7**3)
    ways = [draft.choose() for _ in range(2 * PROBE_EVERY)]
    assert ways.count("plain") == 2  # now the probe of the other way is a plain request
    assert ways.count("draft") == 2 * PROBE_EVERY - 2
    draft.observe(False, MIN_TOKENS - 1, 0.001)  # too short to count
    assert draft.rates[False] == 200
    whole = Draft("d", None, 3)  # a decoder that cannot stop drafting midway
    assert whole.choose(can_stop=False) == "draft"  # the draft measured first, whole
    whole.observe(True, 100, 1.0)
    assert whole.choose(can_stop=False) == "plain"  # then the other way
    always = Draft("d", None, 3, always=True)
    always.observe(True, 100, 1.0)
    always.observe(False, 900, 1.0)
    assert {always.choose() for _ in range(2 * PROBE_EVERY)} == {"draft"}


def test_a_draft_that_does_not_pay_is_left_aside(start: StartEngine, reference: Reference) -> None:
    engine, collector = start(options=ModelOptions(draft_model=DEMO_DRAFT_MODEL_ID))
    drafted = []
    for i in range(PROBE_EVERY + 1):
        request = ask(f"r{i}", "Tell me about apples.", max_tokens=80, sampling=GREEDY)
        events = run(engine, collector, request)
        assert text_of(events) == "".join(reference.greedy(request)[1])
        drafted.append(spec(engine).drafted)
    grew = [b - a for a, b in zip([0, *drafted], drafted, strict=False)]
    if engine.strategy.__class__.__name__ == "Batched":
        # The first request drafts its first PROBE_TOKENS tokens only, then goes on without
        # the draft; the next ones go without it but for one probe in PROBE_EVERY.
        most = PROBE_TOKENS * DEFAULT_NUM_DRAFT_TOKENS  # a probe's rounds, one token each
        assert 0 < grew[0] <= most
        assert [g > 0 for g in grew] == [True] + [False] * (PROBE_EVERY - 2) + [True, False]
        assert 0 < grew[PROBE_EVERY - 1] <= most
    else:  # --engine mlx cannot stop drafting midway: whole requests, the draft's first
        assert grew[0] > PROBE_TOKENS
        assert [g > 0 for g in grew] == [True] + [False] * (PROBE_EVERY - 2) + [True, False]


def test_a_probe_with_penalties_goes_on_exactly_without_the_draft(start: StartEngine) -> None:
    """A probe stops drafting after PROBE_TOKENS tokens; its penalties still count every
    token generated before (runner.engine.speculative.with_context)."""
    plain, plain_collector = start()
    probing, probing_collector = start(options=ModelOptions(draft_model=DEMO_DRAFT_MODEL_ID))
    penalised = SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5)
    request = ask("p", "Tell me about apples.", max_tokens=PROBE_TOKENS + 40, sampling=penalised)
    want = run(plain, plain_collector, request)
    got = run(probing, probing_collector, request)
    assert text_of(got) == text_of(want)
    assert final(got).usage == final(want).usage
    assert spec(probing).drafted > 0


def test_sampled_output_follows_the_models_distribution(start: StartEngine) -> None:
    """Sampled, the tokens are drawn from the model's distribution whatever the draft
    proposes: the first two tokens' frequencies with a draft that rarely agrees match those
    without a draft (a total variation distance of sampling noise; a step that kept the
    draft's proposals would put nearly all of it on other tokens)."""
    # top_k 3: at most 9 pairs, so that 300 samples estimate their frequencies within a few
    # percent (two runs without a draft differ by about 0.09); the random draft's proposals
    # are almost never among the model's 3 best.
    sampled = SamplingParams(temperature=1.0, top_k=3)
    frequencies = []
    for options in (ModelOptions(), POOR):
        engine, collector = start(options=options)
        seen: collections.Counter[tuple[int, ...]] = collections.Counter()
        for i in range(SAMPLES):
            run(engine, collector, ask(f"s{i}", "Hello", max_tokens=2, sampling=sampled))
            request_id, tokens = engine.stats.recent_tokens[-1]
            assert request_id == f"s{i}"
            seen[tokens] += 1
        frequencies.append(seen)
    plain, drafted = frequencies
    assert len(plain) > 3  # the distribution is spread enough for the check to mean something
    distance = sum(abs(plain[k] - drafted[k]) for k in plain.keys() | drafted.keys())
    assert distance / (2 * SAMPLES) < 0.2


def test_penalties_count_the_generated_tokens_as_without_a_draft(start: StartEngine) -> None:
    plain, plain_collector = start()
    drafted, drafted_collector = start(options=POOR)
    penalised = SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5)
    request = ask("p", "Tell me about apples.", max_tokens=60, sampling=penalised)
    unpenalised = ask("u", "Tell me about apples.", max_tokens=60, sampling=GREEDY)
    want = text_of(run(plain, plain_collector, request))
    assert want != text_of(run(plain, plain_collector, unpenalised))  # the penalties bite
    assert text_of(run(drafted, drafted_collector, request)) == want


def test_the_demo_model_drafts_for_its_deep_copy_and_always_agrees(
    demo_model_path: Path, reference: Reference
) -> None:
    """`orchard-demo-deep` computes the demo model's logits (its extra layers add nothing), so
    its greedy answer is the demo model's, and the demo model as its draft is always kept."""
    options = ModelOptions(draft_model=DEMO_MODEL_ID, num_draft_tokens=3, draft_always=True)
    with engine_starter(lambda **o: MLX_ENGINES["mlx-batched"](DEMO_DEEP_MODEL_ID, **o)) as start:
        engine, collector = start(options=options)
        request = ask("deep", "Tell me about apples.", max_tokens=40, sampling=GREEDY)
        events = run(engine, collector, attrs.evolve(request, model=DEMO_DEEP_MODEL_ID))
        assert text_of(events) == "".join(reference.greedy(request)[1])
        (counts,) = engine.speculation()
        assert counts.model == DEMO_DEEP_MODEL_ID
        assert 0 < counts.drafted - 2 * options.num_draft_tokens <= counts.accepted


def test_the_drafts_cache_is_kept_for_the_next_turn(reference: Reference) -> None:
    """A finished request's draft cache is kept: the next turn of its conversation prefills
    the draft with its new tokens only, and the reused cache gives the draft's logits a fresh
    one would."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from runner.engine.prefix_cache import PrefixCache

    draft = Draft("d", reference.model, 3, kept=PrefixCache(None))
    first = reference.prompt(ask("a", "Tell me about apples."))
    turn = [*first, *reference.tokenizer.encode(" And pears? Tell me more about them.")]
    cache = draft.cache_for(first)
    assert draft.prefilled == len(first)
    draft.keep(first, cache)
    again = draft.cache_for(turn[:-1])
    assert draft.prefilled == len(first) + len(turn) - 1 - len(first)
    assert again[0].offset == len(turn) - 1
    fresh = make_prompt_cache(reference.model)
    reference.model(mx.array([turn[:-1]]), cache=fresh)
    reused = reference.model(mx.array([turn[-1:]]), cache=again)
    want = reference.model(mx.array([turn[-1:]]), cache=fresh)
    assert mx.allclose(reused, want, atol=1e-4).item()
