"""Hypothesis strategies for the runner protocol: every frame type, valid and hostile JSON.

Valid frames use the full range the wire can carry: any Unicode text JSON can hold (no lone
surrogates), integers in orjson's range (i64 min to u64 max) and finite floats only (orjson
writes NaN and infinities as null).
"""

from __future__ import annotations

import copy
from typing import Any, get_args

import hypothesis.strategies as st
import orjson

from protocol.codec import converter
from protocol.frames import (
    DEFAULTABLE,
    Batch,
    CacheHeld,
    Cancel,
    Chunk,
    Download,
    Drain,
    Echo,
    Error,
    ErrorCode,
    FinishReason,
    Frame,
    GatewayFrame,
    Generate,
    GenerationStats,
    Hardware,
    Heartbeat,
    Hello,
    LogitBias,
    Message,
    ModelInfo,
    ModelState,
    ModelStatus,
    PromptToken,
    RunnerFrame,
    SamplingDefaults,
    SamplingParams,
    TopLogprob,
    Usage,
    Welcome,
)

INT_MIN = -(2**63)
INT_MAX = 2**64 - 1
"""orjson's integer range: it refuses to write anything outside and reads it back as a float."""

EDGE_INTS = (0, 1, -1, 2**31 - 1, -(2**31), 2**53, 2**53 + 1, 2**63 - 1, 2**63, INT_MIN, INT_MAX)
EDGE_FLOATS = (
    0.0,
    -0.0,
    0.1,
    1.0,
    -1.0,
    5e-324,
    2.2250738585072014e-308,
    1e16,
    1.7976931348623157e308,
)
EDGE_TEXT = (
    "",
    " ",
    '"',
    "\\",
    "\x00",
    "\x1f",
    "\u2028\u2029",
    "\ufeff",
    "é",
    "日本語",
    "🦙",
    "\U0010ffff",
)

ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(INT_MIN, INT_MAX))
floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(allow_nan=False, allow_infinity=False))
# codec="utf-8" leaves out lone surrogates, which JSON text cannot carry.
text = st.one_of(st.sampled_from(EDGE_TEXT), st.text(st.characters(codec="utf-8")))
optional_text = st.none() | text

finish_reasons: st.SearchStrategy[FinishReason] = st.sampled_from(get_args(FinishReason))
error_codes: st.SearchStrategy[ErrorCode] = st.sampled_from(get_args(ErrorCode))
roles: st.SearchStrategy[Any] = st.sampled_from(("system", "developer", "user", "assistant"))


def _tuples(elements: st.SearchStrategy[Any]) -> st.SearchStrategy[tuple[Any, ...]]:
    return st.lists(elements, max_size=4).map(tuple)


model_states: st.SearchStrategy[Any] = st.sampled_from(get_args(ModelState))
downloads = st.builds(Download, done_bytes=ints, total_bytes=ints)
sampling_defaults = st.builds(
    SamplingDefaults,
    temperature=st.none() | floats,
    top_p=st.none() | floats,
    top_k=st.none() | ints,
    min_p=st.none() | floats,
    max_tokens=st.none() | ints,
)
model_infos = st.builds(
    ModelInfo,
    id=text,
    context_length=st.none() | ints,
    engine=optional_text,
    state=model_states,
    size_bytes=st.none() | ints,
    download=st.none() | downloads,
    error=optional_text,
    defaults=st.none() | sampling_defaults,
    draft_model=optional_text,
    kv_bits=st.none() | ints,
    adapter=optional_text,
)
hardware = st.builds(
    Hardware,
    chip=text,
    cpu_count=ints,
    memory_bytes=ints,
    backend=text,
    platform=text,
    accelerator=st.none() | text,
    gpu_cores=st.none() | ints,
    accelerator_memory_bytes=st.none() | ints,
    accelerator_limit_bytes=st.none() | ints,
)
hellos = st.builds(
    Hello,
    protocol_version=ints,
    runner_name=text,
    models=_tuples(model_infos),
    max_concurrent=ints,
    hardware=hardware,
    memory_budget_bytes=st.none() | ints,
    members=_tuples(hardware),
)
welcomes = st.builds(Welcome, runner_id=text, protocol_version=ints, heartbeat_interval=floats)
messages = st.builds(Message, role=roles, content=text, name=optional_text, reasoning=optional_text)
logit_biases = st.builds(LogitBias, token=ints, bias=floats)
sampling_params = st.builds(
    SamplingParams,
    temperature=floats,
    top_p=floats,
    top_k=ints,
    min_p=floats,
    seed=st.none() | ints,
    presence_penalty=floats,
    frequency_penalty=floats,
    logit_bias=_tuples(logit_biases),
    unset=st.lists(st.sampled_from(DEFAULTABLE), unique=True).map(tuple),
)
generates = st.builds(
    Generate,
    request_id=text,
    model=text,
    messages=_tuples(messages),
    max_tokens=st.none() | ints,
    stop=_tuples(text),
    sampling=sampling_params,
    prompt=optional_text,
    prompt_tokens=st.none() | _tuples(ints),
    echo=st.booleans(),
    prompt_logprobs=st.booleans(),
    prefix=_tuples(text),
)
cancels = st.builds(Cancel, request_id=text)
usages = st.builds(
    Usage, prompt_tokens=ints, completion_tokens=ints, cached_tokens=ints, reasoning_tokens=ints
)
generation_stats = st.builds(
    GenerationStats,
    prompt_tps=floats,
    generation_tps=floats,
    peak_memory_bytes=ints,
    time_to_first_token=floats,
    cached_disk_tokens=ints,
)
_bytes = _tuples(st.integers(0, 255))
top_logprobs = st.builds(TopLogprob, token=text, logprob=floats, bytes=_bytes)
prompt_tokens = st.builds(
    PromptToken,
    token=text,
    bytes=_bytes,
    logprob=st.none() | floats,
    top_logprobs=_tuples(top_logprobs),
)
echoes = st.builds(Echo, text=text, tokens=_tuples(prompt_tokens))
chunks = st.builds(
    Chunk,
    request_id=text,
    seq=ints,
    text=text,
    reasoning=text,
    tokens=ints,
    usage=usages,
    finish_reason=st.none() | finish_reasons,
    stats=st.none() | generation_stats,
    matched_stop=st.none() | text,
)
echo_chunks = st.builds(
    Chunk,
    request_id=text,
    seq=ints,
    text=text,
    reasoning=text,
    tokens=ints,
    usage=usages,
    echo=echoes,
)
"""A choice's first chunk of a request with echo (off the decoder's fast path)."""
errors = st.builds(Error, request_id=optional_text, code=error_codes, message=text)
heartbeats = st.builds(
    Heartbeat,
    sent_at=floats,
    kv_bytes=st.none() | ints,
    kv_limit_bytes=st.none() | ints,
    kv_prefix_bytes=st.none() | ints,
    kv_disk_bytes=st.none() | ints,
    kv_disk_limit_bytes=st.none() | ints,
)
drains = st.builds(Drain, reason=text)
batches = st.builds(Batch, frames=_tuples(chunks))
model_statuses = st.builds(ModelStatus, model=model_infos)
cache_helds = st.builds(
    CacheHeld, model=text, added=_tuples(text), removed=_tuples(text), reset=st.booleans()
)

FRAME_STRATEGIES: dict[type, st.SearchStrategy[Any]] = {
    Hello: hellos,
    Welcome: welcomes,
    Generate: generates,
    Cancel: cancels,
    Chunk: chunks | echo_chunks,
    Error: errors,
    Heartbeat: heartbeats,
    Drain: drains,
    Batch: batches,
    ModelStatus: model_statuses,
    CacheHeld: cache_helds,
}
"""One strategy per frame class, to parametrize tests over every frame type."""

runner_frames: st.SearchStrategy[RunnerFrame] = st.one_of(
    hellos, chunks, errors, heartbeats, drains, batches, model_statuses, cache_helds
)
gateway_frames: st.SearchStrategy[GatewayFrame] = st.one_of(
    welcomes, generates, cancels, heartbeats
)
frames: st.SearchStrategy[Frame] = st.one_of(*FRAME_STRATEGIES.values())

# Hostile input.

json_scalars = st.one_of(
    st.none(), st.booleans(), ints, floats, text, st.sampled_from(("hello", "chunk", "foo"))
)
json_values: st.SearchStrategy[Any] = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(text, children, max_size=4),
    max_leaves=20,
)
"""Any value orjson can write."""


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (keys and indexes) to a value inside a JSON value."""
    found = [prefix]
    if isinstance(obj, dict):
        for key, value in obj.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(obj, list):
        for index, value in enumerate(obj):
            found += _paths(value, (*prefix, index))
    return found


@st.composite
def mutations(draw: st.DrawFn, base: Any, keys: st.SearchStrategy[str] = text) -> Any:
    """`base` (a JSON object) with one value replaced, one key dropped or one key (one of
    `keys`) added, at any depth: mostly invalid deep inside, where arbitrary JSON rarely
    reaches."""
    obj = copy.deepcopy(base)
    # The root itself is left to json_values.
    path = draw(st.sampled_from(_paths(obj)[1:]))
    parent = obj
    for step in path[:-1]:
        parent = parent[step]
    action = draw(st.sampled_from(("replace", "drop", "add")))
    if action == "replace" or (action == "drop" and isinstance(parent, list)):
        parent[path[-1]] = draw(json_values)
    elif action == "drop":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[draw(keys)] = draw(json_values)
    else:
        parent.append(draw(json_values))
    return obj


@st.composite
def mutated_frame_objects(draw: st.DrawFn) -> Any:
    """A valid frame's JSON object with one value replaced, one key dropped or one key added."""
    return draw(mutations(converter.unstructure(draw(frames), Frame)))


@st.composite
def hostile_bytes(draw: st.DrawFn) -> bytes:
    """Arbitrary bytes, or an encoded valid frame truncated or with bytes overwritten."""
    choice = draw(st.sampled_from(("random", "truncated", "corrupted", "mutated")))
    if choice == "random":
        return draw(st.binary(max_size=200))
    if choice == "mutated":
        return orjson.dumps(draw(mutated_frame_objects()))
    data = bytearray(orjson.dumps(converter.unstructure(draw(frames), Frame)))
    if choice == "truncated":
        return bytes(data[: draw(st.integers(0, max(len(data) - 1, 0)))])
    for _ in range(draw(st.integers(1, 4))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)
