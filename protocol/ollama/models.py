"""Ollama's model endpoints' bodies: `/api/tags`, `/api/ps`, `/api/show`, `/api/version`. No I/O.

Orchard's models are what its runners registered (`ModelInfo`: the id, the context length
and the engine); it knows no file sizes, digests or quantization, so those fields are left
out (the ollama library reads them as None) rather than made up. Every served model is
loaded and stays so: `/api/ps` lists the same models as `/api/tags`, with their context
length and no `expires_at`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from protocol.frames import ModelInfo
from protocol.ollama.stream import created_at

OLLAMA_VERSION = "0.12.0"
"""The Ollama release whose API this follows, answered by `/api/version` (clients compare it
to decide which features they may use)."""

CAPABILITIES = ("completion", "tools")
"""What every model takes here: prompts and tool definitions (through its chat template)."""


@attrs.frozen
class ServedModel:
    """A model as the pool serves it: what a runner registered, and since when (the first
    runner still connected that serves it)."""

    info: ModelInfo
    since_ns: int


def _details(info: ModelInfo) -> dict[str, Any]:
    engine = info.engine or ""
    return {
        "parent_model": "",
        "format": "mlx" if engine.startswith("mlx") else "",
        "family": "",
        "families": None,
        "parameter_size": "",
        "quantization_level": "",
    }


def _entry(model: ServedModel) -> dict[str, Any]:
    name = model.info.id
    return {"name": name, "model": name, "modified_at": created_at(model.since_ns)}


def tags_body(models: Iterable[ServedModel]) -> dict[str, Any]:
    """`GET /api/tags`: every model the pool serves, by name."""
    return {
        "models": [
            {**_entry(m), "details": _details(m.info)}
            for m in sorted(models, key=lambda m: m.info.id)
        ]
    }


def ps_body(models: Iterable[ServedModel]) -> dict[str, Any]:
    """`GET /api/ps`: the loaded models."""
    return {
        "models": [
            {
                "name": m.info.id,
                "model": m.info.id,
                "details": _details(m.info),
                "context_length": m.info.context_length,
            }
            for m in sorted(models, key=lambda m: m.info.id)
        ]
    }


def show_body(model: ServedModel) -> dict[str, Any]:
    """`POST /api/show`: what is known of one model. Its `model_info` follows Ollama's
    `<architecture>.context_length` convention with the architecture "orchard"."""
    info = model.info
    model_info: dict[str, Any] = {
        "general.architecture": "orchard",
        "general.basename": info.id,
        "orchard.context_length": info.context_length,
    }
    if info.engine:
        model_info["orchard.engine"] = info.engine
    return {
        "details": _details(info),
        "model_info": model_info,
        "capabilities": list(CAPABILITIES),
        "modified_at": created_at(model.since_ns),
    }


def version_body() -> dict[str, Any]:
    return {"version": OLLAMA_VERSION}
