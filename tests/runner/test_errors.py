"""runner.errors: the tree its docstring draws is the class tree."""

from __future__ import annotations

import inspect
import re

import runner.errors
from runner.errors import EngineStateError, RequestError, RunnerError


def drawn_tree() -> dict[str, str | None]:
    """Each error the docstring draws, with its parent (None for the root)."""
    parents: dict[str, str | None] = {}
    path: list[str] = []
    for line in (runner.errors.__doc__ or "").splitlines():
        match = re.match(r"^ {4}([ │├└─]*)([A-Z]\w+) ", line)
        if match is None:
            continue
        depth = len(match.group(1)) // 4
        del path[depth:]
        parents[match.group(2)] = path[-1] if path else None
        path.append(match.group(2))
    return parents


def test_the_docstring_draws_the_class_tree() -> None:
    classes = {
        name: cls
        for name, cls in inspect.getmembers(runner.errors, inspect.isclass)
        if issubclass(cls, RunnerError)
    }
    tree = drawn_tree()
    assert set(tree) == set(classes)
    for name, parent in tree.items():
        base = classes[name].__bases__[0]
        assert base is (Exception if parent is None else classes[parent]), name


def test_a_state_error_is_a_runtime_error() -> None:
    assert issubclass(EngineStateError, RuntimeError)


def test_a_request_error_carries_its_code() -> None:
    error = RequestError("context_length_exceeded", "too long")
    assert (error.code, str(error)) == ("context_length_exceeded", "too long")
