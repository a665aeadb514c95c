"""Constrained decoding: a request's response format or forced tool calls as a grammar that
masks the logits of every step, with llguidance.

    constraint_for(generate, tokenizer, ...)   at intake (`MlxModel.prepare`): the request's
                                               compiled grammar, or None; RequestError if the
                                               schema cannot be enforced
    Constraint.processor()                     when the request starts decoding: a fresh matcher
                                               in a `masking.ConstraintProcessor` (the masks
                                               of one run; `masking.BatchConstraints`: a
                                               batch's rows, masked together)

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
import re
import threading
import weakref
from typing import Any

import llguidance

from protocol.frames import Generate
from runner.engine.masking import ConstraintProcessor
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

    def processor(self, *, forcing: bool = True) -> ConstraintProcessor:
        """A fresh processor, at the grammar's start (`forcing`: see its `forced_next`)."""
        return ConstraintProcessor(
            self._matcher.deep_copy(), self._vocab_size, self._eos, forcing=forcing
        )


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
