"""Quantized KV caches (`--kv-bits`) where the batch meets them.

mlx-lm 0.32.2 quantizes a lone request's cache (`generate_step`'s `kv_bits`: a `KVCache`
becomes a `QuantizedKVCache` once it holds `quantized_kv_start` tokens), but its batch cannot
hold one: `BatchKVCache` has no quantized form, and `QuantizedKVCache` has no `merge`, so
`BatchGenerator` fails the whole batch on a row that starts from one (mlx_lm.server does not
batch with `--kv-bits` for this reason). So batch rows run on plain caches:

- a quantized cache entering the batch (a kept prompt's view, a lone request handed over) is
  dequantized first (`dequantized`): the values attention read from it, at full width;
- a row's cache leaving the batch to be kept is quantized as `generate_step` would have done
  it (`quantized`), so that the prefix cache and its disk tier hold quantized bytes whichever
  path made them.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from runner.engine.prefix_cache import KVCache, QuantizedKVCache


def is_quantized(cache: list[Any]) -> bool:
    """Whether any layer of `cache` is quantized."""
    return any(type(layer) is QuantizedKVCache for layer in cache)


def dequantized(cache: list[Any]) -> list[Any]:
    """`cache` with each quantized layer replaced by a plain `KVCache` holding the same
    tokens' keys and values at full width (other layers as they are)."""
    out: list[Any] = []
    for layer in cache:
        if type(layer) is not QuantizedKVCache or layer.keys is None:
            out.append(layer)
            continue
        plain = KVCache()
        plain.keys = _dequantize(layer.keys, layer.offset, layer.group_size, layer.bits)
        plain.values = _dequantize(layer.values, layer.offset, layer.group_size, layer.bits)
        plain.offset = layer.offset
        out.append(plain)
    return out


def quantized(cache: list[Any], options: dict[str, Any]) -> list[Any]:
    """`cache` as `generate_step` would leave it with `options` (`MlxModel.kv_quantization`):
    each plain layer holding at least `quantized_kv_start` tokens quantized; as it is without
    options."""
    if not options:
        return cache
    start, bits, group_size = (
        options["quantized_kv_start"],
        options["kv_bits"],
        options["kv_group_size"],
    )
    out = [
        layer.to_quantized(group_size=group_size, bits=bits)
        if type(layer) is KVCache and layer.keys is not None and layer.offset >= start
        else layer
        for layer in cache
    ]
    mx.eval([c.state for c in out])
    return out


def _dequantize(parts: tuple[Any, Any, Any], offset: int, group_size: int, bits: int) -> Any:
    weights, scales, biases = (p[..., :offset, :] for p in parts)
    return mx.contiguous(mx.dequantize(weights, scales, biases, group_size=group_size, bits=bits))
