"""Frames exchanged between a runner and the gateway over one WebSocket.

Every frame is a frozen attrs class; on the wire it is a JSON object whose `type` field names
the class (see `protocol.codec`). A connection goes:

    runner  → gateway   Hello          (protocol version, name, models, capacity, hardware)
    gateway → runner    Welcome        (the runner id the gateway assigned)
    gateway → runner    Generate       (one request, with every generation parameter)
    runner  → gateway   Chunk ...      (text, token counts, usage so far; the last one has
                                        finish_reason and stats)
    runner  → gateway   Error          (ends one request, or the connection if request_id is null)
    gateway → runner    Cancel         (the runner answers with a final Chunk, finish "cancelled")
    either way          Heartbeat      (liveness, both directions)
    runner  → gateway   Drain          (take no new requests; in-flight ones finish)
    runner  → gateway   Batch          (several chunks, of any requests, in one message)
    runner  → gateway   ModelStatus    (a model it serves was loaded, is loading or was unloaded)
    runner  → gateway   CacheHeld      (prefixes of conversations its KV caches now hold, or
                                        no longer hold: what the gateway routes by)
"""

from __future__ import annotations

from typing import Literal, get_args

import attrs

PROTOCOL_VERSION = 5
"""Bumped on any change a peer of the previous version could not handle."""

RUNNER_PATH = "/v1/runner/ws"
"""Where on the gateway runners open their WebSocket."""

FinishReason = Literal["stop", "length", "tool_calls", "cancelled"]
""""tool_calls": the model stopped after calling one or more tools."""

ErrorCode = Literal[
    "invalid_request",
    "context_length_exceeded",
    "model_not_found",
    "over_capacity",
    "model_load_failed",
    "internal_error",
]
""""model_load_failed": the runner could not load the request's model (a failed download, not
enough memory, a broken model directory); the message says which and why."""

ModelState = Literal["loaded", "loading", "loadable"]
""""loaded": in memory, serving at once; "loading": being downloaded or loaded (requests for
it wait on the runner); "loadable": the runner loads it when a request asks for it."""


@attrs.frozen
class Download:
    """A model's download from the Hugging Face Hub, in progress."""

    done_bytes: int
    total_bytes: int


@attrs.frozen
class SamplingDefaults:
    """What a runner gives a request for a model when the request sets none of these
    (`orchard runner --temp/--top-p/--top-k/--min-p/--max-tokens`; None: the dialect's own
    default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None


@attrs.frozen
class ModelInfo:
    """A model a runner serves, loaded or loadable on demand."""

    id: str
    context_length: int | None
    """None until the runner has the model's config (one it has not downloaded yet)."""
    engine: str | None = None
    """What generates with it and which versions ("mlx-lm 0.32.2, mlx 0.32.4, gpu"), for the
    `system_fingerprint` OpenAI clients see."""
    state: ModelState = "loaded"
    size_bytes: int | None = None
    """Its weights' bytes, once known: what it takes of the runner's memory budget."""
    download: Download | None = None
    """While it downloads: how far along."""
    error: str | None = None
    """Why its last load failed (it stays loadable: the next request tries again)."""
    defaults: SamplingDefaults | None = None
    """The runner's sampling defaults for it, where it has any."""
    draft_model: str | None = None
    """The model it drafts with (speculative decoding), if any."""
    kv_bits: int | None = None
    """Its KV cache's quantization (4 or 8 bits), if any."""
    adapter: str | None = None
    """The LoRA adapter it was loaded with (a directory or a Hub id), if any."""


@attrs.frozen
class Hardware:
    """What the runner runs on, for operators reading `/v1/runners`."""

    chip: str
    cpu_count: int
    memory_bytes: int
    backend: str
    """MLX device the engine uses: "gpu" (Metal/CUDA) or "cpu"."""
    platform: str
    accelerator: str | None = None
    """The GPU MLX computes on (its device name, e.g. "Apple M2 Pro" or "NVIDIA H200"), if
    it computes on one."""
    gpu_cores: int | None = None
    """The GPU's cores, where the system says (Apple silicon)."""
    accelerator_memory_bytes: int | None = None
    """Memory the GPU can address (on Apple silicon, the unified memory)."""
    accelerator_limit_bytes: int | None = None
    """The most memory MLX should keep resident on the GPU (Metal's recommended working set
    size): the ceiling for a model plus its KV caches."""


@attrs.frozen
class Hello:
    """First frame a runner sends: who it is and what it serves."""

    protocol_version: int
    runner_name: str
    models: tuple[ModelInfo, ...]
    max_concurrent: int
    hardware: Hardware
    memory_budget_bytes: int | None = None
    """What the runner's loaded models may take together (`--max-memory`), when it loads
    models on demand."""
    members: tuple[Hardware, ...] = ()
    """A runner group (one model split across several machines): every member's hardware,
    rank 0's (`hardware`) first; empty for a single runner."""


@attrs.frozen
class Welcome:
    """The gateway's answer to Hello."""

    runner_id: str
    protocol_version: int
    heartbeat_interval: float
    """Seconds between heartbeats the gateway expects from the runner."""


@attrs.frozen
class ToolCall:
    """A tool call an assistant made earlier in the conversation, as the client sent it back."""

    id: str
    name: str
    arguments: str
    """JSON text, as the model wrote it."""


@attrs.frozen
class Message:
    """One chat message, content already flattened to text by the gateway."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    """An assistant message's calls."""
    tool_call_id: str | None = None
    """A tool message: the call it answers."""
    reasoning: str | None = None
    """An assistant message's reasoning, as the client gave it back (chat's
    `reasoning_content`, a Responses reasoning item, Anthropic thinking blocks, Ollama's
    `thinking`). The chat template decides where it is rendered: the families' templates
    keep the reasoning of a turn still calling tools and drop that of answered turns."""


@attrs.frozen
class Tool:
    """A function the model may call."""

    name: str
    description: str | None = None
    parameters: str | None = None
    """Its arguments' JSON Schema, as JSON text; None: no arguments schema."""
    strict: bool = False


ToolChoice = Literal["none", "auto", "required", "function"]
""""function": the model must call `Generate.tool_name`."""


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


@attrs.frozen
class ResponseFormat:
    """What shape the content must have: free text, any JSON object, or a JSON Schema."""

    type: Literal["text", "json_object", "json_schema"]
    schema: str | None = None
    """json_schema only: the schema, as JSON text."""
    name: str | None = None
    strict: bool = False


@attrs.frozen
class LogitBias:
    token: int
    bias: float


Defaultable = Literal["temperature", "top_p", "top_k", "min_p"]
"""A sampling parameter a runner may give a default for (`SamplingParams.unset`)."""
DEFAULTABLE: tuple[Defaultable, ...] = get_args(Defaultable)


def unset_of(**given: float | None) -> tuple[Defaultable, ...]:
    """Which of `DEFAULTABLE` a client left out: those not in `given`, or given as None (a
    dialect that has no such parameter leaves it out of `given`)."""
    unknown = given.keys() - set(DEFAULTABLE)
    if unknown:
        raise TypeError(f"not a defaultable sampling parameter: {', '.join(sorted(unknown))}")
    return tuple(name for name in DEFAULTABLE if given.get(name) is None)


@attrs.frozen
class SamplingParams:
    """How to pick each token. Defaults are OpenAI's."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 means no top-k filter."""
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[LogitBias, ...] = ()
    unset: tuple[Defaultable, ...] = ()
    """Which of temperature, top_p, top_k and min_p the client did not set (they hold the
    dialect's defaults): a runner's defaults for the model replace those (`SamplingDefaults`)."""


@attrs.frozen
class Generate:
    """Run one completion: of a chat (`messages`, through the model's chat template) or of a
    raw prompt (`prompt` text or `prompt_tokens`, as given; `messages` is then empty)."""

    request_id: str
    model: str
    messages: tuple[Message, ...]
    max_tokens: int | None = None
    """Bound on completion tokens (visible plus reasoning); None: up to the context length."""
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = SamplingParams()
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    """Ignored without tools."""
    tool_name: str | None = None
    """The function tool_choice "function" names."""
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    """None: free text."""
    logprobs: bool = False
    """Send each completion token's log-probability."""
    top_logprobs: int = 0
    """With logprobs: also the this many most likely tokens at each position."""
    chat_template_kwargs: str | None = None
    """Extra variables for the chat template, as a JSON object's text (vLLM's pass-through)."""
    n: int = 1
    """Choices to generate from the one prompt (see `Chunk.index`)."""
    reasoning_effort: ReasoningEffort | None = None
    """For a model with think markers: "none" and "minimal" turn thinking off through the chat
    template (`enable_thinking=False`), the others leave it on."""
    prompt: str | None = None
    """A raw prompt, tokenized as the model's tokenizer does (its beginning-of-text token
    included where it adds one), with no chat template."""
    prompt_tokens: tuple[int, ...] | None = None
    """A raw prompt as token ids, given to the model as they are."""
    echo: bool = False
    """The first chunk of each choice carries the prompt back (`Chunk.echo`)."""
    prompt_logprobs: bool = False
    """With echo: also each prompt token's log-probability given the ones before it (and the
    `top_logprobs` most likely tokens there)."""
    prefix: tuple[str, ...] = ()
    """The gateway's hashes of the request's prefixes (`protocol.prefix`): the runner tags
    the KV cache it keeps of this request with them, and reports them held (`CacheHeld`)."""


@attrs.frozen
class Cancel:
    """Stop a request; the runner answers with a final chunk whose finish_reason is cancelled."""

    request_id: str


@attrs.frozen
class Usage:
    """Token accounting for one request so far; `total_tokens` is derived."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class GenerationStats:
    """Speed figures, sent on a request's last chunk."""

    prompt_tps: float
    generation_tps: float
    peak_memory_bytes: int
    time_to_first_token: float
    """Seconds from the runner receiving Generate to the first token being ready."""
    cached_disk_tokens: int = 0
    """Of `Usage.cached_tokens`, those read back from the runner's disk cache for this
    request (the others were in memory)."""


@attrs.frozen
class ToolCallDelta:
    """Part of a tool call the model is writing. A call's first delta has its id and name;
    the next ones only more of the arguments' JSON text."""

    index: int
    """Which call of the completion, from 0."""
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@attrs.frozen
class TopLogprob:
    """One of the most likely tokens at a position."""

    token: str
    logprob: float
    bytes: tuple[int, ...]
    """The token's UTF-8 bytes (a token may hold part of a character)."""


@attrs.frozen
class TokenLogprob:
    """A generated token's log-probability, and the most likely alternatives."""

    token: str
    logprob: float
    bytes: tuple[int, ...]
    top_logprobs: tuple[TopLogprob, ...] = ()


@attrs.frozen
class PromptToken:
    """A prompt token sent back with `echo`: its log-probability given the tokens before it
    (None for the first, which nothing precedes) and the most likely tokens there."""

    token: str
    bytes: tuple[int, ...]
    logprob: float | None = None
    top_logprobs: tuple[TopLogprob, ...] = ()


@attrs.frozen
class Echo:
    """A raw prompt sent back (`Generate.echo`): its text (the text given, or the decoded
    token ids) and, with `prompt_logprobs`, its tokens (a beginning-of-text token the
    tokenizer added is not part of the text and not listed)."""

    text: str
    tokens: tuple[PromptToken, ...] = ()


@attrs.frozen
class Chunk:
    """Output of one or more tokens of a request.

    `seq` counts chunks of the request from 0 with no gaps. `tokens` is how many completion
    tokens this chunk covers (text may be empty for a token held back, e.g. a partial stop
    string). The last chunk of a request has a finish_reason and stats.
    """

    request_id: str
    seq: int
    text: str
    reasoning: str
    tokens: int
    usage: Usage
    finish_reason: FinishReason | None = None
    stats: GenerationStats | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    """One entry per content token this chunk covers (requests asking for logprobs)."""
    index: int = 0
    """Which choice of a request with `n` > 1 the chunk belongs to (`usage` is still the
    whole request's)."""
    choice_finish: FinishReason | None = None
    """n > 1: this choice ended, others go on. The request's last chunk has `finish_reason`
    instead (the reason of the choice that ended last): that one still ends the request."""
    echo: Echo | None = None
    """The prompt, on the first chunks of each choice of a request with `echo` (a long one in
    pieces, joined in order, before the choice's completion)."""
    matched_stop: str | None = None
    """On the chunk that ends a request (or a choice) with finish "stop" because one of its
    stop strings completed: that string (Anthropic's `stop_sequence`, Ollama's and vLLM's
    stop reason). None when the model ended on its own."""


@attrs.frozen
class Error:
    """A failure. With a request_id it ends that request only."""

    request_id: str | None
    code: ErrorCode
    message: str
    param: str | None = None
    """The request parameter at fault, as OpenAI names it ("logit_bias", "messages")."""


@attrs.frozen
class Speculation:
    """What a model's draft has done on a runner since it started (speculative decoding)."""

    model: str
    draft_model: str
    drafted: int
    """Tokens the draft proposed."""
    accepted: int
    """Of those, the ones the model kept."""


@attrs.frozen
class Heartbeat:
    """Liveness, sent both ways; `sent_at` is the sender's wall clock (seconds).

    A runner's heartbeats also carry its KV-cache memory, for `/v1/runners`.
    """

    sent_at: float
    kv_bytes: int | None = None
    kv_limit_bytes: int | None = None
    kv_prefix_bytes: int | None = None
    """Of `kv_bytes`, those of kept prompt caches (the prefix cache's memory tier)."""
    kv_disk_bytes: int | None = None
    """What the prefix cache's files take on disk, and may take at most."""
    kv_disk_limit_bytes: int | None = None
    speculation: tuple[Speculation, ...] = ()
    """Each model with a draft: its drafted and accepted tokens so far."""


@attrs.frozen
class Drain:
    """The runner is shutting down: send it nothing new; it closes once its requests end."""

    reason: str = "shutting down"


@attrs.frozen
class Batch:
    """Chunks that were ready together, in order, as one WebSocket message: per-message costs
    (framing, a receive, a decode) are paid once for all of them."""

    frames: tuple[Chunk, ...]


@attrs.frozen
class ModelStatus:
    """One of the runner's models changed: it is loading (with download progress), loaded,
    or back to loadable (unloaded, or its load failed). `model` replaces what the gateway
    knew of that model; it must be one the runner's hello listed."""

    model: ModelInfo


@attrs.frozen
class CacheHeld:
    """The prefix hashes (`Generate.prefix`) of `model` the runner's caches started to hold
    (`added`) and stopped holding in any tier (`removed`). The first of a connection for a
    model has `reset`: its `added` is all the runner holds then (a restarted runner's disk
    cache included), and replaces what the gateway knew."""

    model: str
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    reset: bool = False


RunnerFrame = Hello | Chunk | Error | Heartbeat | Drain | Batch | ModelStatus | CacheHeld
"""Frames a runner sends."""

GatewayFrame = Welcome | Generate | Cancel | Heartbeat
"""Frames the gateway sends."""

Frame = (
    Hello
    | Welcome
    | Generate
    | Cancel
    | Chunk
    | Error
    | Heartbeat
    | Drain
    | Batch
    | ModelStatus
    | CacheHeld
)

TAGS: dict[type, str] = {
    Hello: "hello",
    Welcome: "welcome",
    Generate: "generate",
    Cancel: "cancel",
    Chunk: "chunk",
    Error: "error",
    Heartbeat: "heartbeat",
    Drain: "drain",
    Batch: "batch",
    ModelStatus: "model_status",
    CacheHeld: "cache_held",
}
"""The `type` value of each frame on the wire."""
