"""schemathesis against the gateway's own OpenAPI schema (`/schema/openapi.json`): no 5xx,
no status, content type or body outside the schema. Bounded here; `just fuzz` runs longer.

The schemathesis CLI is used (its pytest plugin does not support pytest 9 yet).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import UNIT, Gateway

EXAMPLES = os.environ.get("ORCHARD_FUZZ_EXAMPLES", "25")
CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,"
    "response_schema_conformance"
)


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    gw = Gateway()
    yield gw
    gw.stop()


def test_schemathesis_finds_nothing(gateway: Gateway) -> None:
    cli = Path(sys.executable).with_name("schemathesis")
    out = subprocess.run(
        [
            str(cli),
            "run",
            f"{gateway.base}/schema/openapi.json",
            "--checks",
            CHECKS,
            "--max-examples",
            EXAMPLES,
            "--seed",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300 * UNIT,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-4000:]
    assert "Tested: 25" in out.stdout  # every operation in the schema was exercised
    assert " passed" in out.stdout
    assert "failed" not in out.stdout.split("Test cases:")[-1]
