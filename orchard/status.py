"""`orchard status`: the pool as a table, from the gateway's `/v1/runners` and `/v1/models`.

`fetch` reads one endpoint (standard library only: httpx is a test dependency); `render` is
pure, so the table is tested from recorded JSON without a network. A gateway whose TLS
certificate this machine does not trust yet gets its certificate authority's fingerprint and
one line that saves the authority and trusts it.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from protocol.pinning import PROOF_PATH, fingerprint
from runner.errors import UntrustedGateway
from runner.pinning import authority

HEADERS = ("NAME", "MODELS", "HARDWARE", "ACTIVE", "DRAINING", "TOKENS", "CONNECTED", "KV CACHE")


class StatusError(Exception):
    """Why the gateway could not be read, as one line for the operator."""


def fetch(base: str, path: str, api_key: str | None, timeout: float = 5.0) -> dict[str, Any]:
    """GET `base + path` as JSON, with the API key as a bearer token when one is given."""
    if not base.startswith(("http://", "https://")):
        raise StatusError(f"the gateway URL must start with http:// or https://, not {base!r}")
    url = base.rstrip("/") + path
    # http(s) only, checked above.
    request = urllib.request.Request(url, headers={"Accept": "application/json"})  # noqa: S310
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            body = response.read()
    except urllib.error.HTTPError as exc:
        exc.close()  # it holds the response's socket
        if exc.code == 401:
            raise StatusError(
                f"the gateway at {base} refused the API key (HTTP 401): "
                "pass --api-key or set ORCHARD_API_KEY"
            ) from None
        raise StatusError(f"the gateway at {base} answered HTTP {exc.code} on {path}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, ssl.SSLCertVerificationError):
            raise StatusError(_untrusted(base)) from None
        raise StatusError(f"cannot reach the gateway at {base}: {reason}") from None
    try:
        data = json.loads(body)
    except ValueError:
        raise StatusError(f"the gateway at {base} did not answer {path} with JSON") from None
    if not isinstance(data, dict):
        raise StatusError(f"the gateway at {base} did not answer {path} with a JSON object")
    return data


def _untrusted(base: str) -> str:
    """What to do about a gateway certificate this machine does not trust: the fingerprint of
    the authority that issued it (the root of the chain the gateway serves), to compare with
    the gateway's start-up log, and one line that saves that authority and trusts it."""
    parts = urllib.parse.urlsplit(base)
    host, port = parts.hostname or "", parts.port or 443
    try:
        pem = ssl.get_server_certificate((host, port), timeout=5)
        leaf = ssl.PEM_cert_to_DER_cert(pem)
        chain = _served_chain(base)
        root = authority(leaf, chain, f"{host}:{port}")
    except (OSError, ValueError, UntrustedGateway) as exc:
        return f"the gateway at {base} shows a certificate this machine does not trust ({exc})"
    if chain is None:  # a gateway from before its authority, or an operator's own certificate
        fetch_it = f"import ssl; print(ssl.get_server_certificate(({host!r}, {port})))"
        return (
            f"the gateway at {base} shows a certificate this machine does not trust "
            f"(self-signed), SHA-256 fingerprint {fingerprint(root)}. Compare it with the "
            f'gateway\'s start-up log, then trust it: python3 -c "{fetch_it}" > gateway.pem '
            '&& export SSL_CERT_FILE="$PWD/gateway.pem"'
        )
    fetch_it = (
        "import json, ssl, urllib.request as u; "
        f"print(json.load(u.urlopen({_proof_url(base)!r}, "
        "context=ssl._create_unverified_context()))['chain'][-1])"
    )
    return (
        f"the gateway at {base} shows a certificate this machine does not trust, issued by "
        f"the gateway's own certificate authority, SHA-256 fingerprint {fingerprint(root)}. "
        "Compare it with the gateway's start-up log, then trust the authority: "
        f'python3 -c "{fetch_it}" > orchard-ca.pem && export SSL_CERT_FILE="$PWD/orchard-ca.pem"'
    )


def _proof_url(base: str) -> str:
    # The proof's nonce matters to runners only; the chain comes with any.
    return f"{base.rstrip('/')}{PROOF_PATH}?nonce=orchard-status-chain"


def _served_chain(base: str) -> object:
    """The chain the gateway says it serves (its proof answer's, unverified: `authority`
    checks it against the certificate shown), or None when it names none."""
    insecure = ssl.create_default_context()
    insecure.check_hostname = False
    insecure.verify_mode = ssl.CERT_NONE
    try:
        # https only: the caller saw a certificate there.
        with urllib.request.urlopen(_proof_url(base), timeout=5, context=insecure) as answer:  # noqa: S310
            body = json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        exc.close()
        return None
    return body.get("chain") if isinstance(body, dict) else None


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'; whole bytes below 1 KiB."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def human_duration(seconds: float) -> str:
    """How long ago, coarsest two units: '45s', '12m 05s', '3h 07m', '2d 04h'."""
    s = max(0, int(seconds))
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d {hours:02d}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {s:02d}s"
    return f"{s}s"


def _hardware(hw: dict[str, Any]) -> str:
    cells = [hw["chip"], f"{hw['cpu_count']} cpu", human_bytes(hw["memory_bytes"]), hw["backend"]]
    accelerator = hw.get("accelerator")
    if accelerator and accelerator != hw["chip"]:
        cells.append(accelerator)
    if hw.get("gpu_cores"):
        cells.append(f"{hw['gpu_cores']} gpu cores")
    if hw.get("accelerator_limit_bytes"):
        cells.append(f"gpu limit {human_bytes(hw['accelerator_limit_bytes'])}")
    return ", ".join(cells)


def _group(members: list[dict[str, Any]]) -> str:
    """A runner group (one model split across machines): how many, after rank 0's hardware."""
    return f", group of {len(members)}" if len(members) > 1 else ""


def _kv_cache(kv: dict[str, Any] | None) -> str:
    """Memory held / its budget, then the kept prompts: in memory (of the first figure) and
    on disk."""
    if not kv or kv.get("bytes") is None:
        return "-"
    limit = kv.get("limit_bytes")
    text = f"{human_bytes(kv['bytes'])} / {human_bytes(limit) if limit else 'unbounded'}"
    kept = []
    if kv.get("prefix_bytes") is not None:
        kept.append(f"{human_bytes(kv['prefix_bytes'])} kept")
    if kv.get("disk_bytes") is not None:
        kept.append(f"disk {human_bytes(kv['disk_bytes'])}")
    return f"{text} ({', '.join(kept)})" if kept else text


def _model(model: dict[str, Any]) -> str:
    """A runner's model: its name, and how far from serving it is unless loaded."""
    state = model.get("state", "loaded")
    if state == "loaded":
        return str(model["id"])
    download = model.get("download")
    if state == "loading" and download and download["total_bytes"]:
        share = 100 * download["done_bytes"] // download["total_bytes"]
        return f"{model['id']} (downloading {share}%)"
    if state == "loadable" and model.get("error"):
        return f"{model['id']} (load failed)"
    return f"{model['id']} ({state})"


def row(runner: dict[str, Any], now: float) -> tuple[str, ...]:
    """One runner of `/v1/runners` as the table's cells."""
    return (
        runner["name"],
        ", ".join(_model(m) for m in runner["models"]) or "-",
        _hardware(runner["hardware"]) + _group(runner.get("members") or []),
        f"{runner['active']}/{runner['max_concurrent']}",
        "yes" if runner["draining"] else "no",
        f"{runner['tokens_generated']:,}",
        human_duration(now - runner["connected_since"]) + " ago",
        _kv_cache(runner.get("kv_cache")),
    )


def render(runners: dict[str, Any], models: dict[str, Any] | None, now: float) -> str:
    """The pool as text: a table of runners, then one line of totals."""
    rows = [row(r, now) for r in runners["data"]]
    lines: list[str] = []
    if rows:
        widths = [max(len(cells[i]) for cells in (HEADERS, *rows)) for i in range(len(HEADERS))]
        for cells in (HEADERS, *rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
    else:
        lines.append("no runners connected")
    model_ids = (
        [m["id"] for m in models["data"]]
        if models is not None
        else sorted({m["id"] for r in runners["data"] for m in r["models"]})
    )
    count = len(rows)
    lines.append("")
    lines.append(
        f"{count} runner{'' if count == 1 else 's'}; "
        f"models: {', '.join(model_ids) or 'none'}; "
        f"queue depth: {runners.get('queue_depth', 0)}"
    )
    return "\n".join(lines) + "\n"
