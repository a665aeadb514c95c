"""What a runner's hello says of a model it serves beyond its name and context: the options it
was given for it (`orchard runner --temp/.../--draft-model/--kv-bits/--adapter-path`), which
the gateway shows in `/v1/runners`."""

from __future__ import annotations

import attrs

from protocol.frames import ModelInfo, SamplingDefaults
from runner.model_options import ModelOptions

_NO_DEFAULTS = SamplingDefaults()


def with_options(info: ModelInfo, options: ModelOptions) -> ModelInfo:
    """`info` with the model's sampling defaults (None where none is set), draft model, KV
    quantization and adapter."""
    sampling = options.sampling
    return attrs.evolve(
        info,
        defaults=None if sampling == _NO_DEFAULTS else sampling,
        draft_model=options.draft_model,
        kv_bits=options.kv_bits,
        adapter=options.adapter_path,
    )
