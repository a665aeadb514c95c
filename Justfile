# Orchard's recipes. Each one creates or updates the virtual environment it needs.
set shell := ["bash", "-euo", "pipefail", "-c"]

python := env("PYTHON", "python3")
venv := ".venv"
bin := venv / "bin"

# List the recipes.
default:
    @just --list

# Create or update .venv (reinstalls only when pyproject.toml changed).
venv:
    #!/usr/bin/env bash
    set -euo pipefail
    if [ ! -x {{bin}}/python ]; then {{python}} -m venv {{venv}}; fi
    want=$(cat pyproject.toml | sha256sum | cut -d' ' -f1)
    if [ "$(cat {{venv}}/.orchard-stamp 2>/dev/null)" != "$want" ]; then
        {{bin}}/python -m pip install --quiet --upgrade pip
        {{bin}}/python -m pip install --quiet -e '.[dev]'
        echo "$want" > {{venv}}/.orchard-stamp
    fi

# Gateway plus a local runner on the built-in model: just serve [--port 8000] [--model M]
serve *ARGS: venv
    {{bin}}/orchard serve {{ARGS}}

# Run the whole test suite (extra arguments go to pytest).
test *ARGS: venv
    {{bin}}/pytest {{ARGS}}

# ruff (lint + format check) and mypy --strict.
lint: venv
    {{bin}}/ruff check .
    {{bin}}/ruff format --check .
    {{bin}}/mypy

# Benchmarks; results go in docs/benchmarks.md: just bench [scenario ...]
bench *ARGS: venv
    {{bin}}/python -m bench {{ARGS}}
