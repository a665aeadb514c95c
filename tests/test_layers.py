"""The packages' import rules (docs/architecture.md), checked on the source: protocol/ is
sans-I/O, and the gateway and the runner only meet through it."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.support import REPO

THIRD_PARTY: dict[str, frozenset[str]] = {
    # Pure data and logic: no event loop, no sockets, no web framework, no model.
    "protocol": frozenset({"attrs", "cattrs", "orjson"}),
    "gateway": frozenset(
        {
            "attrs",
            "cattrs",
            "orjson",
            "litestar",
            "uvicorn",
            "prometheus_client",
            "zeroconf",
            "ifaddr",
            "cryptography",
            "protocol",
        }
    ),
    "runner": frozenset(
        {
            "attrs",
            "orjson",
            "websockets",
            "mlx",
            "mlx_lm",
            "tokenizers",
            "llguidance",
            "numpy",
            "psutil",
            "zeroconf",
            "huggingface_hub",
            "httpx2",
            "cryptography",
            "protocol",
        }
    ),
    "orchard": frozenset({"attrs", "click", "uvloop", "protocol", "gateway", "runner"}),
}
"""What each package may import besides the standard library and itself."""

FORBIDDEN_STDLIB: dict[str, frozenset[str]] = {
    "protocol": frozenset({"asyncio", "socket", "threading", "selectors", "ssl"}),
}


def imports(path: Path) -> set[str]:
    """Top-level names a module imports, lazily (inside functions) or not."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(THIRD_PARTY))
def test_each_package_imports_only_what_it_may(package: str) -> None:
    allowed = THIRD_PARTY[package] | {package, "__future__"}
    stdlib = sys.stdlib_module_names
    forbidden = FORBIDDEN_STDLIB.get(package, frozenset())
    found = [
        (str(path.relative_to(REPO)), name)
        for path in modules(package)
        for name in sorted(imports(path))
        if not ((name in stdlib and name not in forbidden) or name in allowed)
    ]
    assert found == []
    assert modules(package), "the package exists"


def test_the_rules_can_fail() -> None:
    """The check reads lazy imports too (the runner's CLI imports are inside functions)."""
    cli = REPO / "orchard" / "cli.py"
    assert {"runner", "gateway", "click"} <= imports(cli)
    assert "gateway" not in THIRD_PARTY["runner"]
    assert "runner" not in THIRD_PARTY["gateway"]


def imported_from(path: Path) -> list[tuple[str, str]]:
    """(module, name) of each `from module import name` in a module."""
    return [
        (node.module, alias.name)
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
        for alias in node.names
    ]


def test_the_core_imports_no_dialect() -> None:
    """protocol/core is every dialect's: it names none of them."""
    dialects = ("protocol.openai", "protocol.anthropic", "protocol.ollama", "protocol.browser")
    found = [
        (str(path.relative_to(REPO)), module)
        for path in modules("protocol/core")
        for module, _ in imported_from(path)
        if module.startswith(dialects)
    ]
    assert found == []
    assert modules("protocol/core"), "the package exists"


BROWSER_FROM_OPENAI = frozenset(
    {
        "protocol.openai.chat.request",
        "protocol.openai.chat.response",
        "protocol.openai.errors",
        "protocol.openai.objects",
        "protocol.openai.params",
    }
)
"""The browser socket carries the Chat Completions API: its request, chunks and error object."""


def test_the_other_dialects_import_nothing_from_openai() -> None:
    found = [
        (str(path.relative_to(REPO)), module)
        for package in ("protocol/anthropic", "protocol/ollama", "protocol/browser")
        for path in modules(package)
        for module, _ in imported_from(path)
        if module.startswith("protocol.openai")
        and not (package == "protocol/browser" and module in BROWSER_FROM_OPENAI)
    ]
    assert found == []


def test_no_private_name_is_imported_across_protocol_modules() -> None:
    found = [
        (str(path.relative_to(REPO)), module, name)
        for path in modules("protocol")
        for module, name in imported_from(path)
        if name.startswith("_") and not name.startswith("__")
    ]
    assert found == []
