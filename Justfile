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

# With no arguments: the modules spread over 2 processes (pytest-xdist, each module's tests in
# one of them; ORCHARD_TEST_WORKERS=N for N, 1 for one process), then the tests marked `timing`
# alone, in one process, so that nothing else shares the CPU with them.
# Run the test suite: just test [pytest arguments, e.g. tests/gateway -k sse]
test *ARGS: venv browser js
    #!/usr/bin/env bash
    set -euo pipefail
    if [ -n "{{ARGS}}" ]; then exec {{bin}}/pytest {{ARGS}}; fi
    cores=$(nproc 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 1)
    workers=${ORCHARD_TEST_WORKERS:-$(( cores >= 2 ? 2 : 1 ))}
    spread=()
    if [ "$workers" -gt 1 ]; then spread=(-n "$workers" --dist loadfile); fi
    status=0
    {{bin}}/pytest "${spread[@]}" -m "not timing" || status=$?
    # 5: nothing was collected (no test is marked timing), which is no failure.
    {{bin}}/pytest -m timing || { rc=$?; if [ "$rc" -ne 5 ] && [ "$status" -eq 0 ]; then status=$rc; fi; }
    exit "$status"

# Debian's chromium, which the browser tests drive (installed with apt-get when missing).
browser:
    #!/usr/bin/env bash
    set -euo pipefail
    if [ -x /usr/bin/chromium ]; then exit 0; fi
    if [ "$(id -u)" -eq 0 ]; then
        apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium
    else
        echo "The browser tests need Debian's chromium at /usr/bin/chromium; run:" >&2
        echo "    sudo apt-get update && sudo apt-get install -y chromium" >&2
        exit 1
    fi

# The openai npm package the browser tests load (npm ci in tests/js when its lock file changed).
js:
    #!/usr/bin/env bash
    set -euo pipefail
    cd tests/js
    want=$(sha256sum package-lock.json | cut -d' ' -f1)
    if [ "$(cat node_modules/.orchard-stamp 2>/dev/null)" != "$want" ]; then
        if ! command -v npm >/dev/null; then
            echo "The browser tests load the openai npm package; install Node.js and npm." >&2
            exit 1
        fi
        # tests/js/.npmrc keeps registry hosts out of the lock file (omit-lockfile-registry-resolved).
        npm ci --loglevel=error
        echo "$want" > node_modules/.orchard-stamp
    fi

# ruff (lint + format check) and mypy --strict.
lint: venv
    {{bin}}/ruff check .
    {{bin}}/ruff format --check .
    {{bin}}/mypy

# Benchmarks; results go in docs/benchmarks.md: just bench [scenario ...]
bench *ARGS: venv
    {{bin}}/python -m bench {{ARGS}}

# Longer schemathesis run against a fresh gateway: just fuzz [examples, default 500]
fuzz EXAMPLES="500": venv
    ORCHARD_FUZZ_EXAMPLES={{EXAMPLES}} {{bin}}/pytest -q tests/gateway/test_schemathesis.py tests/gateway/test_hostile.py

# --chaos: the same with faults on a random schedule (runners killed, frozen, drained; the
# gateway restarted) and four dialects at once, every stream classified (bench/chaos.py).
# Soak: gateway + 4 scripted runners, every stream verified: just soak [--requests N] | --chaos [--minutes 60] [--seed S]
soak *ARGS: venv
    {{bin}}/python -m bench.soak {{ARGS}}
