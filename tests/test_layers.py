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


OURS = ("protocol", "gateway", "runner", "orchard", "tests", "bench")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_private_name_is_imported_across_modules() -> None:
    """A name another module needs is public: nothing imports a `_name` of ours."""
    found = [
        (str(path.relative_to(REPO)), module, name)
        for package in OURS
        for path in modules(package)
        for module, name in imported_from(path)
        if module.split(".")[0] in OURS and name.startswith("_") and not name.startswith("__")
    ]
    assert found == []


def import_graph(package: str) -> dict[str, set[str]]:
    """Each module of `package` → the modules of `package` it imports (lazily or not; a
    package's `__init__` only when imported as such)."""
    known = {module_name(path): path for path in modules(package)}
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in known else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {target for target in targets if target in known and target != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize("package", ["gateway", "runner", "protocol", "orchard"])
def test_no_import_cycles(package: str) -> None:
    assert cycles(import_graph(package)) == []


def test_the_cycle_check_can_fail() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


MAX_LINES = 600


def test_no_module_is_over_600_lines() -> None:
    found = [
        (str(path.relative_to(REPO)), lines)
        for package in OURS
        for path in modules(package)
        if (lines := path.read_text().count("\n")) > MAX_LINES
    ]
    assert found == []


def test_the_gateway_is_laid_out_by_concern() -> None:
    """At most 12 modules at gateway/'s top level; the rest in folders by concern."""
    top = sorted(path.name for path in (REPO / "gateway").glob("*.py"))
    assert len([name for name in top if name != "__init__.py"]) <= 12, top


DIALECT_FOLDERS = {
    "protocol.anthropic": "gateway.anthropic",
    "protocol.ollama": "gateway.ollama",
}


@pytest.mark.parametrize("dialect", sorted(DIALECT_FOLDERS))
def test_a_dialects_gateway_code_is_in_its_folder(dialect: str) -> None:
    """Only the dialect's own gateway folder reads its protocol package."""
    folder = DIALECT_FOLDERS[dialect]
    found = [
        module_name(path)
        for path in modules("gateway")
        for module, _ in imported_from(path)
        if module.startswith(dialect) and not module_name(path).startswith(folder)
    ]
    assert found == []


def test_each_route_is_served_from_its_apis_folder() -> None:
    """Every client route is a handler of its API's folder (gateway/openai, anthropic,
    ollama), mounted on that API's router."""
    from gateway.app import MOUNTED

    folders = {
        "openai": "gateway.openai",
        "anthropic": "gateway.anthropic",
        "ollama": "gateway.ollama",
    }
    misplaced = []
    for mounted in MOUNTED:
        for handler in mounted.route_handlers:
            module = handler.fn.__module__  # type: ignore[union-attr]
            own = module.startswith(folders[mounted.api.name])
            if not own and mounted.api.name != "openai":
                misplaced.append((mounted.api.name, module))
            elif not own and not module.startswith("gateway.observability.admin"):
                misplaced.append((mounted.api.name, module))  # the model and runner lists
    assert misplaced == []
    assert {mounted.api.name for mounted in MOUNTED} == set(folders)


def test_one_function_takes_a_streams_first_item() -> None:
    """Every endpoint, the client sockets' included, starts its relay through
    gateway.streaming.endpoint.relay_from_first: nothing else waits for a first item."""
    callers = sorted(
        module_name(path)
        for path in modules("gateway")
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("first_item", "relay_from_first")
    )
    assert callers == [
        "gateway.streaming.endpoint",
        "gateway.streaming.endpoint",
        "gateway.streaming.socket",  # relay_on_socket: the sockets' and background requests
    ]


def test_tests_share_helpers_not_test_modules() -> None:
    """Shared doubles and helpers live in helper modules (tests/support.py, tests/*/
    helpers); no test module imports another test module."""
    found = [
        (str(path.relative_to(REPO)), module)
        for path in modules("tests")
        for module, _ in imported_from(path)
        if module.startswith("tests.") and module.rsplit(".", 1)[-1].startswith("test_")
    ]
    assert found == []
