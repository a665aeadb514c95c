"""The built-in model's training (runner.demo_shaping), against mlx-lm."""

from __future__ import annotations


def test_the_training_arithmetic_matches_mlx_lm() -> None:
    """demo_shaping trains on its own copy of the added layers' arithmetic: the widened model
    that mlx-lm runs gives the same logits, and so does the copy past a shared prompt."""
    import mlx.core as mx
    import mlx.utils
    from mlx_lm.models import llama

    from runner import demo_shaping
    from runner.demo_model import BASE_CONFIG

    base_config = {**BASE_CONFIG, "vocab_size": 40}
    mx.random.seed(7)
    base_model = llama.Model(llama.ModelArgs.from_dict(base_config))  # type: ignore[no-untyped-call]
    base = dict(mlx.utils.tree_flatten(base_model.parameters()))
    key = mx.random.key(3)
    modes = mx.array([[1.0] if i % 3 == 0 else [0.0] for i in range(40)])
    mode_embedding = mx.random.normal((40, demo_shaping.NEW_DIMS), key=key) * 5 * modes
    shaper = demo_shaping.Shaper(40, mx.random.key(4))
    tokens = [5, 7, 3, 9, 12, 1, 0, 6, 30, 31, 33, 2, 8]
    run = demo_shaping.BaseRun(base_model, base, mode_embedding, [f"t{i}" for i in range(40)])
    batch = run.batch([(tokens, 1)], len(tokens) - 1, len(tokens) - 1)

    model = llama.Model(llama.ModelArgs.from_dict(demo_shaping.config(base_config)))  # type: ignore[no-untyped-call]
    weights = demo_shaping.widen(base, shaper, mode_embedding, base_config["num_hidden_layers"])
    model.update(mlx.utils.tree_unflatten(list(weights.items())))
    expected = model(mx.array([tokens[:-1]]))[0]
    assert mx.allclose(shaper(batch), expected, atol=1e-3).item()

    prompt = run.batch([([*tokens[:5], 0], 5)], 5, 1)
    rest = batch._replace(
        positions=mx.arange(5, len(tokens) - 1), old_logits=batch.old_logits[5:]
    ).after(5)
    assert mx.allclose(shaper(rest, shaper.past(prompt)), expected[5:], atol=1e-3).item()
