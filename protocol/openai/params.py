"""The request parameters the OpenAI APIs read alike: sampling, stop, stream options,
reasoning effort, metadata, and the fields accepted with no effect. Validated as strictly as
the chat request (protocol.openai.chat.request), with the same 400s."""

from __future__ import annotations

from typing import Any, get_args

from protocol.core.errors import invalid_request
from protocol.core.fields import (
    check_keys,
    check_range,
    clip,
    fail_too_long,
    fail_too_many,
    fail_type,
    fail_unsupported_value,
    fail_value,
    read_bool,
    read_int,
    read_number,
    read_str,
    show,
)
from protocol.core.limits import (
    INT64_MAX,
    INT64_MIN,
    MAX_STOP,
    SAMPLING_RANGES,
    TOP_K_MIN,
    check_stop_string,
    read_stop_strings,
)
from protocol.frames import (
    LogitBias,
    ReasoningEffort,
    SamplingParams,
    unset_of,
)

MAX_LOGIT_BIAS = 1024
MAX_TOKEN_ID = 2**31 - 1


_STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation", "continuous_usage_stats"})


MAX_N = 128
"""OpenAI's bound on `n`; a gateway sets its own, lower one (`ChatRequest.check_ceilings`)."""


_REASONING_EFFORTS: tuple[str, ...] = get_args(ReasoningEffort)


def parse_reasoning_effort(value: Any) -> ReasoningEffort | None:
    if value is None:
        return None
    if type(value) is not str:
        fail_type("reasoning_effort", "a string", value)
    if value not in _REASONING_EFFORTS:
        fail_value("reasoning_effort", value, _REASONING_EFFORTS)
    effort: ReasoningEffort = value  # type: ignore[assignment]  # checked against the Literal
    return effort


def parse_stream_options(value: Any, stream: bool) -> tuple[bool, bool]:
    if value is None:
        return False, False
    if not stream:
        raise invalid_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            "stream_options",
            "invalid_parameter_combination",
        )
    if type(value) is not dict:
        fail_type("stream_options", "an object", value)
    check_keys(value, "stream_options", _STREAM_OPTIONS)
    include_usage = read_bool(value, "include_usage", "stream_options") or False
    # We never obfuscate; OpenAI's default is to, and false only saves bandwidth.
    read_bool(value, "include_obfuscation", "stream_options")
    continuous = read_bool(value, "continuous_usage_stats", "stream_options") or False
    if continuous and not include_usage:
        raise invalid_request(
            "'stream_options.continuous_usage_stats' requires "
            "'stream_options.include_usage' to be true.",
            "stream_options.continuous_usage_stats",
            "invalid_parameter_combination",
        )
    return include_usage, continuous


_DEFAULTS = SamplingParams()


def parse_sampling(data: dict[str, Any]) -> SamplingParams:
    defaults = _DEFAULTS
    temperature = read_number(data, "temperature", *SAMPLING_RANGES["temperature"])
    top_p = read_number(data, "top_p", *SAMPLING_RANGES["top_p"])
    top_k = read_int(data, "top_k", TOP_K_MIN, INT64_MAX)
    min_p = read_number(data, "min_p", *SAMPLING_RANGES["min_p"])
    presence = read_number(data, "presence_penalty", *SAMPLING_RANGES["presence_penalty"])
    frequency = read_number(data, "frequency_penalty", *SAMPLING_RANGES["frequency_penalty"])
    seed = read_int(data, "seed", INT64_MIN, INT64_MAX)
    return SamplingParams(
        temperature=defaults.temperature if temperature is None else temperature,
        top_p=defaults.top_p if top_p is None else top_p,
        top_k=0 if top_k is None or top_k < 0 else top_k,
        min_p=defaults.min_p if min_p is None else min_p,
        seed=seed,
        presence_penalty=defaults.presence_penalty if presence is None else presence,
        frequency_penalty=defaults.frequency_penalty if frequency is None else frequency,
        logit_bias=_logit_bias(data.get("logit_bias")),
        unset=unset_of(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p),
    )


def parse_stop(value: Any) -> tuple[str, ...]:
    if type(value) is str:
        return (check_stop_string(value, "stop"),)
    return read_stop_strings(value, "stop", MAX_STOP, "one of a string or array of strings")


def _logit_bias(value: Any) -> tuple[LogitBias, ...]:
    if value is None:
        return ()
    if type(value) is not dict:
        fail_type("logit_bias", "an object", value)
    if len(value) > MAX_LOGIT_BIAS:
        fail_too_many("logit_bias", MAX_LOGIT_BIAS, len(value))
    biases: dict[int, float] = {}
    for key, bias in value.items():
        if not (len(key) <= 10 and key.isascii() and key.isdigit() and int(key) <= MAX_TOKEN_ID):
            raise invalid_request(
                f"Invalid key in 'logit_bias': {show(key)} is not a token id (a non-negative "
                "integer, as a string).",
                "logit_bias",
                "invalid_value",
            )
        param = f"logit_bias.{key}"
        if type(bias) not in (int, float):
            fail_type(param, "a number", bias)
        check_range(param, "decimal", bias, -100, 100)
        biases[int(key)] = float(bias)
    return tuple(LogitBias(token=token, bias=bias) for token, bias in biases.items())


def check_accepted(data: dict[str, Any]) -> None:
    """Type-check the fields that are accepted but change nothing here."""
    audio = data.get("audio")
    if audio is not None and type(audio) is not dict:
        fail_type("audio", "an object", audio)
    read_str(data, "user")
    read_str(data, "prompt_cache_key")
    safety_identifier = read_str(data, "safety_identifier")
    if safety_identifier is not None and len(safety_identifier) > 64:
        fail_too_long("safety_identifier", 64, len(safety_identifier))
    retention = read_str(data, "prompt_cache_retention")
    if retention is not None and retention not in ("in_memory", "24h"):
        fail_value("prompt_cache_retention", retention, ("in_memory", "24h"))
    options = data.get("prompt_cache_options")
    if options is not None:
        if type(options) is not dict:
            fail_type("prompt_cache_options", "an object", options)
        check_keys(options, "prompt_cache_options", ("ttl", "mode"))
        ttl = read_str(options, "ttl", "prompt_cache_options")
        if ttl is not None and ttl != "30m":
            fail_value("prompt_cache_options.ttl", ttl, ("30m",))
        mode = read_str(options, "mode", "prompt_cache_options")
        if mode == "explicit":
            # Our prefix cache is always implicit; it cannot be limited to breakpoints.
            fail_unsupported_value("prompt_cache_options.mode", mode, "implicit")
        if mode not in (None, "implicit"):
            fail_value("prompt_cache_options.mode", mode, ("implicit", "explicit"))


MAX_METADATA_KEYS = 16


MAX_METADATA_KEY_CHARS = 64


MAX_METADATA_VALUE_CHARS = 512


def parse_metadata(value: Any, param: str = "metadata") -> dict[str, str] | None:
    """Validate a `metadata` object (OpenAI's Metadata: at most 16 keys of up to 64
    characters, string values of up to 512). None: not given (JSON null)."""
    if value is None:
        return None
    if type(value) is not dict:
        fail_type(param, "an object", value)
    if len(value) > MAX_METADATA_KEYS:
        fail_too_many(param, MAX_METADATA_KEYS, len(value))
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            fail_too_long(f"{param}.{clip(key)}", MAX_METADATA_KEY_CHARS, len(key))
        if type(item) is not str:
            fail_type(f"{param}.{key}", "a string", item)
        if len(item) > MAX_METADATA_VALUE_CHARS:
            fail_too_long(f"{param}.{key}", MAX_METADATA_VALUE_CHARS, len(item))
    return dict(value)
