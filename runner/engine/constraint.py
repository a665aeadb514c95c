"""Constrained decoding: a request's response format or forced tool calls as a grammar that
masks the logits of every step, with llguidance.

    constraint_for(generate, tokenizer, ...)   at intake (`MlxModel.prepare`): the request's
                                               compiled grammar, or None; RequestError if the
                                               schema cannot be enforced
    Constraint.processor()                     when the request starts decoding: a fresh matcher
    ConstraintProcessor(tokens, logits)        an mlx-lm logits processor, run after all others
                                               (a lone `stream_generate`); also the state of a
                                               batch row
    BatchConstraints                           the batch decoder's: its constrained rows,
                                               masked together once a step, inside the model
                                               call (`wrap`)

What is constrained:

- `response_format` json_object: any JSON object; json_schema: its schema, strict or not
  (OpenAI's non-strict mode is best effort; we enforce it all the same);
- `tool_choice` "required" / "function" (with tools), on models whose mlx-lm tool parser is
  `json_tools` (Hermes, Qwen 2.5/3): `<tool_call>\\n{"name": "<fn>", "arguments": <its
  parameters>}\\n</tool_call>`, one call ("function", or `parallel_tool_calls` false) or
  several separated by a newline, each with its own function's schema. Other tool-call formats
  cannot be forced: RequestError;
- `tool_choice` "auto" with tools and a JSON response format: tool calls or the JSON.

JSON is written with json.dumps' separators (", " and ": ") and no other whitespace, so a model
cannot pad it forever. When the prompt opens a think span, the model first reasons freely up
to the think end marker; a model that would open one itself is constrained from its first
token, so it does not reason. A finished grammar allows only end-of-sequence tokens, so the
request ends with finish "stop" by itself.

Compiling costs milliseconds (more for large schemas): compiled grammars are kept per
tokenizer, least recently used first out, keyed by the grammar text; each request decodes on a
copy of the compiled matcher.
"""

from __future__ import annotations

import collections
import copy
import json
import os
import re
import sys
import threading
import weakref
from typing import Any

import llguidance
import mlx.core as mx
import numpy as np
from mlx_lm.generate import GenerationBatch

from protocol.frames import Generate
from runner.errors import RequestError
from runner.harmony import harmony_markers
from runner.tool_formats import forceable, format_for, grammars
from runner.tool_formats.base import ForcedTool

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How every constrained JSON value is written (llguidance's `x-guidance` options)."""
CACHE_SIZE = 64
"""Compiled grammars kept per tokenizer."""
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
"""A tool with no `parameters` takes none (OpenAI's reading)."""

# llguidance's own errors are ours to report, not to print on stderr; and they should not
# echo the request's schema and state into logs.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class Constraint:
    """A request's compiled grammar; `processor()` gives the logits processor of one run."""

    def __init__(
        self, grammar: str, matcher: llguidance.LLMatcher, vocab_size: int, eos: list[int]
    ) -> None:
        self.grammar = grammar
        """The llguidance grammar (Lark, with inline JSON Schemas)."""
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._eos = eos

    def processor(self) -> ConstraintProcessor:
        """A fresh processor, at the grammar's start."""
        return ConstraintProcessor(self._matcher.deep_copy(), self._vocab_size, self._eos)


class ConstraintProcessor:
    """The mlx-lm logits processor of one constrained run: masks every disallowed token.

    mlx-lm calls it once per generated token, with the token context so far: on the first
    call the prompt (or only its part after the prefix cache), then with the token just
    sampled appended, which the matcher consumes before the next mask is computed. The
    token is read before this step's forward pass is started (`mx.async_eval`), so the mask
    is computed while the forward pass runs. A row of a batch is not called: its
    `BatchConstraints` advances and masks it with the batch's other rows.

    Neither raises (an exception inside a batch step would fail every row of the batch): if
    the matcher refuses a token, `error` says why and only end-of-sequence tokens are allowed
    from then on; the decoder then fails this request alone.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos: list[int]) -> None:
        self.error: str | None = None
        self.matcher = matcher
        self.eos = eos
        self.started = False
        """Past its first call (the one on the prompt)."""
        self.words = (vocab_size + 31) // 32
        """32-bit words in a mask."""
        self._bitmask = np.zeros((1, self.words), dtype=np.int32)

    def __call__(self, tokens: Any, logits: Any) -> Any:
        if not self.started:
            self.started = True
        else:
            # Read the new token first: evaluated after the forward pass, it would wait for it.
            self.consume(int(tokens[-1].item()))
            mx.async_eval(logits)  # type: ignore[no-untyped-call]  # mlx's stub lacks types
        if self.error is None:
            bitmask = self._bitmask
            self.matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
            if not self.matcher.is_error():
                return apply_bitmask(logits, bitmask)
            self.error = self.matcher.get_error()
        return _only(logits, self.eos)

    def consume(self, token: int) -> None:
        """Advance the matcher by the token just sampled."""
        if self.error is None and not self.matcher.consume_token(token):
            self.error = f"the grammar refused token {token}: {self.matcher.get_error()}"


class BatchConstraints:
    """The constrained rows of one mlx-lm `BatchGenerator`, masked together, once a step.

    The generator is built on `wrap(model)`. Its prefill calls pass through untouched; a
    generation step's call (from mlx-lm's `GenerationBatch._step`, found by its caller's
    code object) starts the forward pass (`mx.async_eval`), reads the tokens the step was
    given (the rows' tokens just sampled: scheduled by the previous step, the read waits
    for that step, not for this one), advances every constrained row's matcher by its
    token, computes their masks while the forward pass runs (on llguidance's threads, given
    4 cores or more), and returns the logits with one `mx.where` over the whole batch: a
    constrained row keeps only what its grammar allows, any other row keeps everything.

    So the constraint needs no per-row logits processor, and a batch of requests without
    bias or penalties steps without mlx-lm's per-row slicing, token contexts and
    concatenation. The mask comes before those processors (logit bias, penalties): they
    move finite logits and leave -inf where it is, so the result is the same as masking
    after them. The step's rows are the calling batch's `uids`, in order, and their tokens
    its `_current_tokens` (mlx-lm 0.32's names, checked by the tests).
    """

    def __init__(self) -> None:
        self._rows: dict[int, ConstraintProcessor] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, uid: int, processor: ConstraintProcessor) -> None:
        self._rows[uid] = processor

    def remove(self, uid: int) -> None:
        self._rows.pop(uid, None)

    def clear(self) -> None:
        self._rows.clear()

    def wrap(self, model: Any) -> _MaskedModel:
        """`model` as the batch generator is to call it."""
        return _MaskedModel(model, self)

    def mask(self, uids: list[int], tokens: Any, logits: Any) -> Any:
        """A generation step's `logits` (rows, 1, vocab) for the rows `uids`, with the
        constrained rows masked. `tokens` (rows,) are the tokens the step was given, as the
        previous step scheduled them: not the model's input, which is part of this step's
        graph (reading it would wait for this whole forward pass)."""
        rows = self._rows
        found = [(i, rows[uid]) for i, uid in enumerate(uids) if uid in rows]
        if not found:
            return logits
        # Start this step's forward pass first: it takes the new tokens as they are, on the
        # device; reading them then only waits for the previous step.
        mx.async_eval(logits)  # type: ignore[no-untyped-call]  # mlx's stub lacks types
        vocab = logits.shape[-1]
        try:
            given = tokens.tolist()
            for i, processor in found:
                if processor.started:
                    processor.consume(given[i])
                else:  # its first token: the matcher is at the grammar's start
                    processor.started = True
            masks = _masks([processor for _, processor in found])
        except Exception as exc:  # e.g. mlx-lm's internals changed: end the rows, loudly
            for _, processor in found:
                processor.error = processor.error or f"masking the batch's rows failed: {exc!r}"
            masks = _masks([processor for _, processor in found])
        allowed = _unpack(masks, vocab)
        if len(found) < len(uids):
            # Rows without a constraint allow every token (past the masks' width too).
            every = np.ones((len(uids), vocab), dtype=np.bool_)
            every[[i for i, _ in found]] = allowed
            allowed = every
        return mx.where(mx.array(allowed[:, None, :]), logits, -mx.inf)


def _masks(processors: list[ConstraintProcessor]) -> np.ndarray[Any, Any]:
    """The processors' next-token masks, a row each (only end-of-sequence tokens for a
    processor whose matcher failed)."""
    words = max(p.words for p in processors)
    bitmask = np.zeros((len(processors), words), dtype=np.int32)
    work = [(p.matcher, i) for i, p in enumerate(processors) if p.error is None]
    if len(work) > 1 and _PARALLEL_MASKS:
        _executor().unsafe_compute_mask_ptr(work, bitmask.ctypes.data, words * 4, len(bitmask))
    else:
        for matcher, i in work:
            matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data + i * words * 4, words * 4)
    for i, processor in enumerate(processors):
        if processor.error is None and processor.matcher.is_error():
            processor.error = processor.matcher.get_error()
        if processor.error is not None:
            bits = bitmask.view(np.uint32)
            bits[i] = 0
            for token in processor.eos:
                bits[i, token // 32] |= np.uint32(1 << (token % 32))
    return bitmask


_GENERATION_STEP = GenerationBatch._step.__code__
"""The code of mlx-lm's batch generation step, whose model call `_MaskedModel` masks."""


class _MaskedModel:
    """A model whose generation steps in a `BatchGenerator` return masked logits (see
    `BatchConstraints`); every other use (prefill, attributes) is the model's own."""

    def __init__(self, model: Any, constraints: BatchConstraints) -> None:
        self.model = model
        self._constraints = constraints

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        logits = self.model(inputs, *args, **kwargs)
        if not self._constraints:
            return logits
        caller = sys._getframe(1)
        if caller.f_code is not _GENERATION_STEP:
            return logits  # a prefill chunk: its logits are not sampled
        batch = caller.f_locals["self"]
        return self._constraints.mask(batch.uids, batch._current_tokens, logits)


_PARALLEL_MASKS = (os.cpu_count() or 1) >= 4
"""Compute a batch's masks on llguidance's thread pool. On 2 cores (bench.grammars, §6 of
docs/benchmarks.md) its batch call was no faster than one mask after another, and up to 3x
slower while the forward pass and other processes wanted the same cores."""
_executors: list[llguidance.LLExecutor] = []


def _executor() -> llguidance.LLExecutor:
    """llguidance's thread pool, made on first use."""
    if not _executors:
        _executors.append(llguidance.LLExecutor())
    return _executors[0]


def _unpack(bitmask: np.ndarray[Any, Any], vocab: int) -> np.ndarray[Any, Any]:
    """A (rows, vocab) bool array from (rows, words) bits, little-endian within each word;
    tokens past the mask are refused."""
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little").view(np.bool_)
    if allowed.shape[-1] >= vocab:
        return allowed[:, :vocab]
    return np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[-1])))


def apply_bitmask(logits: Any, bitmask: np.ndarray[Any, Any]) -> Any:
    """`logits` (1, vocab) with every token whose bit is 0 set to -inf.

    The bits are unpacked on the host (numpy, ~1 ns a token) and applied with one `mx.where`,
    which keeps the logits' dtype. A vocabulary wider than the mask (a model's padded
    embedding) has its extra tokens disallowed.
    """
    return mx.where(mx.array(_unpack(bitmask, logits.shape[-1])), logits, -mx.inf)


def _only(logits: Any, tokens: list[int]) -> Any:
    allowed = np.zeros((1, logits.shape[-1]), dtype=np.bool_)
    allowed[0, [t for t in tokens if t < logits.shape[-1]]] = True
    return mx.where(mx.array(allowed), logits, -mx.inf)


# Intake: the request's grammar, compiled.


def constraint_for(
    generate: Generate,
    tokenizer: Any,
    *,
    vocab_size: int | None = None,
    starts_in_reasoning: bool = False,
) -> Constraint | None:
    """The constraint of a request on a model with this (mlx-lm) tokenizer, or None.

    `vocab_size`: the model's (its logits may be wider than the tokenizer's vocabulary);
    `starts_in_reasoning`: the prompt opens a think span. Raises `RequestError` when the
    request asks for a constraint this model or llguidance cannot enforce, naming the
    feature and where it is.
    """
    body = _response_schema(generate)
    if is_harmony(tokenizer):
        return _harmony_constraint(generate, tokenizer, body, vocab_size)
    count = _call_count(generate, tokenizer, with_body=body is not None)
    if body is None and count is None:
        return None
    compiler = _compiler(tokenizer, vocab_size)
    rules = []
    choices = []
    if count is not None:
        rules.append(compiler.calls_rules(generate, count, tokenizer))
        choices.append("calls")
    if body is not None:
        where = "response_format.json_schema.schema"
        rules.append(f"body: {compiler.json_rule(body, where, 'response_format')}")
        if count is None or generate.tool_choice == "auto":
            choices.append("body")  # forced calls leave no content for the format to shape
    start = " | ".join(choices)
    if starts_in_reasoning and tokenizer.has_thinking:
        # The think span is open: free text up to its end marker, then the constrained part.
        end = compiler.token_ref(tokenizer.think_end)
        if end.startswith("<["):
            rules[:0] = [f"start: THINK {end} ({start})", r"THINK: /(.|\n)*/"]
        else:
            # A marker that is text: the span is lazy, so it ends at the marker's first match.
            text = re.escape(tokenizer.think_end).replace("/", "\\/")
            rules[:0] = [f"start: think ({start})", f"think[lazy]: /(.|\\n)*{text}/"]
    else:
        rules.insert(0, f"start: {start}")
    return compiler.compile("\n".join(rules))


def _harmony_constraint(
    generate: Generate, tokenizer: Any, body: dict[str, Any] | None, vocab_size: int | None
) -> Constraint | None:
    """A Harmony (gpt-oss) model's constraint: `grammars.harmony`, the calls forced or offered
    beside a JSON answer as for other models."""
    choice = generate.tool_choice
    offered = bool(generate.tools) and (
        choice in ("required", "function") or (choice == "auto" and body is not None)
    )
    if body is None and not offered:
        return None
    compiler = _compiler(tokenizer, vocab_size)
    tools = compiler.forced_tools(generate) if offered else []
    body_rule = None
    if body is not None and (not offered or choice == "auto"):
        body_rule = compiler.json_rule(
            body, "response_format.json_schema.schema", "response_format"
        )
    grammar = grammars.harmony(_Kit(compiler), tools, body_rule, effort=generate.reasoning_effort)
    return compiler.compile(grammar)


_harmony: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def is_harmony(tokenizer: Any) -> bool:
    """Whether the tokenizer's model writes OpenAI's Harmony format (it has its markers)."""
    known = _harmony.get(tokenizer)
    if known is None:
        known = _harmony[tokenizer] = harmony_markers(tokenizer.get_vocab()) is not None
    return known


def _response_schema(generate: Generate) -> dict[str, Any] | None:
    """The JSON Schema of the response's content, or None for free text."""
    response_format = generate.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "object"}
    return _schema(response_format.schema, "response_format.json_schema.schema", "response_format")


def _call_count(generate: Generate, tokenizer: Any, *, with_body: bool) -> str | None:
    """Whether the grammar has tool calls, and how many: "one" or "many" (None: no calls).

    "required" and "function" force them; "auto" offers them beside a JSON response body.
    """
    choice = generate.tool_choice
    if not generate.tools or choice == "none" or (choice == "auto" and not with_body):
        return None
    format = format_for(tokenizer)
    if format is None or format.grammar is None:
        fmt = "none" if format is None else format.parser
        what = (
            f'tool_choice "{choice}"' if choice != "auto" else "A JSON response_format with tools"
        )
        raise RequestError(
            "invalid_request",
            f"{what} is not supported for this model's tool-call format ({fmt}): calls can "
            f"be enforced in these formats: {', '.join(forceable())}.",
            "tool_choice" if choice != "auto" else "response_format",
        )
    if choice == "function" or not generate.parallel_tool_calls:
        return "one"
    return "many"


def _schema(text: str | None, where: str, param: str) -> dict[str, Any]:
    if text is None:
        raise RequestError("invalid_request", f"{where}: a JSON Schema is required.", param)
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise RequestError("invalid_request", f"{where}: not valid JSON: {exc}", param) from exc
    if not isinstance(schema, dict):
        raise RequestError("invalid_request", f"{where}: must be a JSON object.", param)
    return schema


class _Compiler:
    """One tokenizer's llguidance tokenizer and its cache of compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int | None) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise RequestError(
                "invalid_request",
                "Structured outputs need a fast (Hugging Face tokenizers) tokenizer; this "
                "model's is not one.",
                "response_format",
            )
        # As llguidance.hf.from_tokenizer: the tokenizer's JSON, with no padding or truncation.
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        self.eos = sorted(int(t) for t in tokenizer.eos_token_ids)
        self.tokenizer = llguidance.LLTokenizer(
            backend.to_str(), n_vocab=vocab_size, eos_token=self.eos
        )
        self._encode = tokenizer.encode
        self._cache: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self._checked: set[str] = set()
        self._lock = threading.Lock()

    def compile(self, grammar: str) -> Constraint:
        """The compiled grammar (from the cache when it was compiled lately)."""
        with self._lock:
            matcher = self._cache.get(grammar)
            if matcher is not None:
                self._cache.move_to_end(grammar)
                return Constraint(grammar, matcher, self.tokenizer.vocab_size, self.eos)
        matcher = llguidance.LLMatcher(
            self.tokenizer,
            llguidance.LLMatcher.grammar_from_lark(grammar),
            log_level=0,
            limits=_LIMITS,
        )
        if matcher.is_error():
            # Each schema was checked on its own: this is a bug in the grammar we built.
            raise RuntimeError(f"the constraint grammar does not compile: {matcher.get_error()}")
        with self._lock:
            self._cache[grammar] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return Constraint(grammar, matcher, self.tokenizer.vocab_size, self.eos)

    def json_rule(self, schema: dict[str, Any], where: str, param: str) -> str:
        """A Lark rule's body for a JSON value of `schema`; RequestError naming `where` if
        llguidance cannot enforce it."""
        schema = {**schema, "x-guidance": JSON_OPTIONS}
        text = json.dumps(schema, ensure_ascii=False)
        if text not in self._checked:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                grammar, self.tokenizer, limits=_LIMITS
            )
            if is_error:
                raise RequestError(
                    "invalid_request",
                    f"{where}: this schema cannot be enforced: {messages[0].strip()}",
                    param,
                )
            if len(self._checked) > 4 * CACHE_SIZE:
                self._checked.clear()
            self._checked.add(text)
        return f"%json {text}"

    def calls_rules(self, generate: Generate, count: str, tokenizer: Any) -> str:
        """The Lark rules of `calls`: `count` tool calls in the model's format."""
        format = format_for(tokenizer)
        # Both checked by _call_count.
        assert format is not None
        assert format.grammar is not None
        return format.grammar(_Kit(self), self.forced_tools(generate), count == "many")

    def forced_tools(self, generate: Generate) -> list[ForcedTool]:
        """The tools a forced call may name (the one `tool_choice` names), schemas checked."""
        tools = list(enumerate(generate.tools))
        if generate.tool_choice == "function":
            tools = [(i, tool) for i, tool in tools if tool.name == generate.tool_name]
            if not tools:
                raise RequestError(
                    "invalid_request",
                    f"tool_choice names the function {generate.tool_name!r}, which is not "
                    "among the request's tools.",
                    "tool_choice",
                )
        forced = []
        for i, tool in tools:
            where = f"tools[{i}].function.parameters"
            parameters = (
                NO_PARAMETERS
                if tool.parameters is None
                else _schema(tool.parameters, where, "tools")
            )
            forced.append(ForcedTool(tool.name, parameters, where))
        return forced

    def token_ref(self, marker: str) -> str:
        """A marker in Lark: the special token itself when it is one, else its text."""
        ids = self._encode(marker, add_special_tokens=False)
        if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return _literal(marker)


def _literal(text: str) -> str:
    """A Lark string literal (its escapes are JSON's)."""
    return json.dumps(text, ensure_ascii=False)


class _Kit:
    """A compiler's pieces of grammar, for a format's `grammar` (`GrammarKit`)."""

    def __init__(self, compiler: _Compiler) -> None:
        self._compiler = compiler

    def marker(self, text: str) -> str:
        return self._compiler.token_ref(text)

    def json(self, schema: dict[str, Any], where: str) -> str:
        return self._compiler.json_rule(schema, where, "tools")

    def literal(self, text: str) -> str:
        return _literal(text)


_compilers: weakref.WeakKeyDictionary[Any, _Compiler] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def _compiler(tokenizer: Any, vocab_size: int | None) -> _Compiler:
    """The tokenizer's compiler, made on first use (about a second for a 150k vocabulary)."""
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None:
            compiler = _compilers[tokenizer] = _Compiler(tokenizer, vocab_size)
        return compiler
