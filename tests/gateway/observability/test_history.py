"""The console's last minutes (gateway.observability.history), on a clock the test moves."""

from __future__ import annotations

from gateway.observability.history import PoolHistory, RunnerReading

STUDIO = ("r1", "studio", ("qwen",))


def reading(tokens: int, runner: tuple[str, str, tuple[str, ...]] = STUDIO) -> RunnerReading:
    return RunnerReading(*runner, tokens_generated=tokens)


def test_tokens_go_to_the_buckets_they_were_generated_in() -> None:
    history = PoolHistory(bucket_s=5, buckets=4)
    history.observe_runners(10.0, [reading(100)])  # the baseline: nothing counted yet
    history.observe_runners(12.0, [reading(150)])  # 50 tokens within bucket [10, 15)
    history.observe_runners(17.0, [reading(250)])  # 100 over 12-17: 60 in [10, 15), 40 after
    view = history.view(17.0)
    assert view["bucket_seconds"] == 5
    studio = view["runners"]["studio"]
    # Buckets [0,5) [5,10) [10,15) [15,20): full ones over 5 s, the current one over 2 s.
    assert studio["tokens_per_second"] == [0.0, 0.0, 22.0, 20.0]
    assert view["models"]["qwen"]["tokens_per_second"] == [0.0, 0.0, 22.0, 20.0]
    assert studio["ttft_p50_ms"] == [None, None, None, None]


def test_a_gap_without_readings_is_spread_over_the_buckets_it_covers() -> None:
    history = PoolHistory(bucket_s=5, buckets=4)
    history.observe_runners(0.0, [reading(0)])
    # 20 tokens/s for 20 s, nobody watching: the first 5 s fall before the kept buckets.
    history.observe_runners(20.0, [reading(400)])
    assert history.view(20.0)["runners"]["studio"]["tokens_per_second"] == [
        20.0,
        20.0,
        20.0,
        0.0,
    ]


def test_ttft_percentiles_per_runner_and_per_model_and_old_buckets_drop() -> None:
    history = PoolHistory(bucket_s=5, buckets=3)
    for ms in (10, 20, 30, 40):
        history.first_token("qwen", "studio", ms / 1000, now=1.0)
    history.first_token("llama", "air", 0.5, now=6.0)
    view = history.view(7.0)
    assert view["runners"]["studio"]["ttft_p50_ms"] == [None, 20.0, None]
    assert view["runners"]["studio"]["ttft_p99_ms"] == [None, 40.0, None]
    assert view["models"]["llama"]["ttft_p50_ms"] == [None, None, 500.0]
    assert set(view["models"]) == {"qwen", "llama"}
    # Three buckets later the first one has gone, and with it the runner's series.
    history.first_token("llama", "air", 0.1, now=16.0)
    later = history.view(16.0)
    assert set(later["runners"]) == {"air"}
    assert later["runners"]["air"]["ttft_p50_ms"] == [500.0, None, 100.0]


def test_a_runner_with_two_models_splits_its_tokens_and_a_gone_runner_is_forgotten() -> None:
    both = ("r2", "mini", ("a", "b"))
    history = PoolHistory(bucket_s=5, buckets=2)
    history.observe_runners(5.0, [reading(0, both)])
    history.observe_runners(9.0, [reading(80, both)])
    view = history.view(9.0)
    assert view["runners"]["mini"]["tokens_per_second"] == [0.0, 20.0]
    assert view["models"]["a"]["tokens_per_second"] == [0.0, 10.0]
    history.observe_runners(9.5, [])  # it left: a runner coming back starts a new baseline
    history.observe_runners(9.9, [reading(1000, both)])
    assert history.view(9.9)["runners"]["mini"]["tokens_per_second"] == [0.0, 16.3]  # 80 / 4.9
