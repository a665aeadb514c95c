"""Ollama's model endpoints: `GET /api/tags`, `GET /api/ps`, `POST /api/show`,
`GET /api/version`, and the model-management calls, which Orchard answers with an error:
its models are served by runners (`orchard runner --model ...`), not pulled or created here.

Bodies are protocol.ollama.models'; errors are written in Ollama's shape by path. The
OpenAPI document describes all but the model-management calls (gateway.ollama.openapi): they
take nothing and always answer 501.
"""

from __future__ import annotations

from typing import Any

import orjson
from litestar import Request, Response, get, post, route
from litestar.datastructures import State

from gateway.errors import ModelNotFound
from gateway.http_errors import api_error_for
from gateway.ollama.openapi import PsOperation, ShowOperation, TagsOperation, VersionOperation
from gateway.pool.pool import Pool
from protocol.core.errors import ApiError, invalid_request
from protocol.core.fields import fail_type, fail_unknown, read_json, read_object
from protocol.ollama.models import ServedModel, ps_body, show_body, tags_body, version_body
from protocol.ollama.request import in_ollama_terms

MANAGEMENT = (
    "/api/pull",
    "/api/push",
    "/api/create",
    "/api/copy",
    "/api/delete",
    "/api/blobs/{digest:str}",
)


def served(pool: Pool, *, loaded: bool = False) -> dict[str, ServedModel]:
    """Each model the pool serves (with `loaded`, only those some runner has in memory), with
    the first registration of a runner still serving it; described as a runner that has it
    loaded does, when one does (it knows the context length)."""
    models: dict[str, ServedModel] = {}
    for conn in pool.runners.values():
        since = int(conn.connected_at * 1e9)
        for info in conn.infos():
            if loaded and info.state != "loaded":
                continue
            known = models.get(info.id)
            if known is None:
                models[info.id] = ServedModel(info, since)
                continue
            better = info if info.state == "loaded" and known.info.state != "loaded" else known.info
            models[info.id] = ServedModel(better, min(since, known.since_ns))
    return models


@get("/api/tags", operation_class=TagsOperation)
async def tags(state: State) -> dict[str, Any]:
    """The models the pool serves (Ollama's list)."""
    return tags_body(served(state.pool).values())


@get("/api/ps", operation_class=PsOperation)
async def ps(state: State) -> dict[str, Any]:
    """The models loaded on some runner now (a runner with several loads them on demand)."""
    return ps_body(served(state.pool, loaded=True).values())


@get("/api/version", operation_class=VersionOperation)
async def version() -> dict[str, Any]:
    """The Ollama version whose API this follows."""
    return version_body()


@post("/api/show", status_code=200, operation_class=ShowOperation)
async def show(request: Request[Any, Any, Any], state: State) -> Response[bytes]:
    """What is known of one model."""
    data = read_object(read_json(await request.body()))
    for key in data:
        if key not in ("model", "name", "verbose"):
            fail_unknown(key)
    model = data.get("model", data.get("name"))  # "name" is the field's older spelling
    if model is None:
        raise invalid_request(
            "Missing required parameter: 'model'.", "model", "missing_required_parameter"
        )
    if type(model) is not str:
        fail_type("model", "a string", model)
    verbose = data.get("verbose")
    if verbose is not None and type(verbose) is not bool:
        fail_type("verbose", "a boolean", verbose)
    pool: Pool = state.pool
    try:
        pool.check_model(model)
    except Exception as exc:
        raise in_ollama_terms(api_error_for(exc), model) from exc
    found = served(pool).get(model)
    if found is None:  # the last runner left meanwhile
        raise in_ollama_terms(api_error_for(ModelNotFound(model)), model)
    return Response(content=orjson.dumps(show_body(found)), media_type="application/json")


@route(list(MANAGEMENT), http_method=["POST", "DELETE"], include_in_schema=False)
async def manage(request: Request[Any, Any, Any]) -> None:
    """Pulling, pushing, creating, copying and deleting models: not here."""
    call = request.url.path.removeprefix("/api/").split("/")[0]
    raise ApiError(
        501,
        f"/api/{call} is not available: Orchard's models are served by its runners "
        "(start one with `orchard runner --model <model>`), not managed through this API.",
        "invalid_request_error",
        None,
        "model_management_unsupported",
    )


ROUTES: list[Any] = [tags, ps, version, show, manage]
"""The model endpoints, registered with the chat and generate routes (gateway.ollama.routes)."""
