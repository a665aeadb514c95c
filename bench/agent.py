"""`just bench agent`: prompt reuse in agent-like work, Orchard (1 and 3 runners) against
mlx_lm.server on the same model in the same run (docs/benchmarks.md §11).

The model is the built-in one with a 32,768-token context (`orchard-demo-32k`: the same
weights). Every figure comes from the usage the server returns (`cached_tokens`) and the
client's clock (TTFT: request sent to first content chunk, streamed over SSE):

- **shared system prompt**: one request with a 1,355-token system prompt, then 8 at once
  sharing it (each with a question of its own): the cached share of the 8 prompts.
- **chat**: a 10-turn conversation on 3 runners: each turn's cached tokens against the whole
  previous prompt, and prefilled ÷ new tokens (prefilled: prompt - cached; new: prompt -
  the previous prompt); then 6 distinct conversations at once: requests per runner.
- **restart**: 3 turns on 1 runner, the runner restarted (SIGTERM, then started again on the
  same disk cache), a 4th turn: its cached share of the previous prompt.
- **agent**: a system prompt and tools of about 2k tokens, then `--turns` turns each adding a
  tool result of 200-1,500 tokens and a short answer, up to the context: each turn's TTFT
  against the time mlx-lm takes in this process to prefill only that turn's new tokens onto
  the previous prompt's cache (the ideal), on 1 runner, on 3 and on mlx_lm.server; then 8
  such conversations at once on 3 runners sharing the system prompt: how many times each
  runner prefilled it.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import httpx
import orjson

from bench.concurrency import mlx_lm_server
from bench.harness import MEMORY, free_port, stop_process, wait_until
from runner.demo_model import DEMO_LONG_MODEL_ID, resolve_model

MODEL = DEMO_LONG_MODEL_ID
WORDS = [
    "orchard",
    "apple",
    "pear",
    "plum",
    "cherry",
    "branch",
    "root",
    "leaf",
    "blossom",
    "harvest",
    "ladder",
    "basket",
    "soil",
    "rain",
    "sun",
    "frost",
    "prune",
    "graft",
    "bee",
    "hive",
    "cider",
    "press",
    "crate",
    "shade",
    "row",
    "tree",
    "fruit",
    "seed",
    "field",
    "grass",
]


@attrs.frozen
class Turn:
    ttft: float
    prompt_tokens: int
    cached_tokens: int
    text: str


def stream_chat(
    client: httpx.Client, base: str, model: str, messages: list[dict[str, Any]], max_tokens: int
) -> Turn:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = 0.0
    usage: dict[str, Any] = {}
    text: list[str] = []
    with client.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the stream ended with an error: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or ():
                content = choice["delta"].get("content")
                if content:
                    first = first or time.perf_counter()
                    text.append(content)
    details = usage.get("prompt_tokens_details") or {}
    return Turn(
        (first or time.perf_counter()) - start,
        int(usage["prompt_tokens"]),
        int(details.get("cached_tokens") or 0),
        "".join(text),
    )


class Words:
    """Text of about `n` tokens of the built-in model, deterministically random."""

    def __init__(self, model_dir: str, seed: int = 0) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.random = random.Random(seed)

    def text(self, tokens: int) -> str:
        words: list[str] = []
        while True:
            words.extend(self.random.choice(WORDS) for _ in range(max(8, tokens // 4)))
            text = " ".join(words)
            if len(self.tokenizer.encode(text).ids) >= tokens:
                return text


# --- Orchard stacks ------------------------------------------------------------------------


class Pool:
    """A gateway and runners on the long-context model, each runner with its own cache."""

    def __init__(self, runners: int, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.gateway = self._spawn(
            [
                *("gateway", "--port", str(self.port), "--log-level", "warning", *MEMORY),
                # Prefill of long prompts on a CPU, several conversations queued on one
                # runner: minutes, not the defaults' seconds.
                *("--stream-timeout", "900", "--queue-timeout", "900"),
                *("--liveness-timeout", "30"),
            ],
            None,
        )
        wait_until(lambda: httpx.get(f"{self.base}/health", timeout=1).status_code == 200, 30)
        for i in range(runners):
            self.start(f"agent-{i}")
        self.wait_for(runners)

    def _spawn(self, args: list[str], cache: Path | None) -> subprocess.Popen[bytes]:
        env = None
        if cache is not None:
            import os

            env = {**os.environ, "ORCHARD_CACHE_DIR": str(cache)}
        return subprocess.Popen(
            [sys.executable, "-m", "orchard", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )

    def start(self, name: str) -> None:
        cache = self.root / name
        models = cache / "models"
        if not models.exists():
            source = Path(resolve_model(MODEL))
            models.mkdir(parents=True)
            (models / source.name).symlink_to(source)
        self.procs[name] = self._spawn(
            [
                *("runner", "--gateway", self.base, "--name", name, "--model", MODEL),
                *("--max-concurrent", "8", "--log-level", "warning"),
            ],
            cache,
        )

    def stop_runner(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        wait_until(lambda: name not in self.served(), 30)

    def wait_for(self, count: int) -> None:
        wait_until(lambda: len(httpx.get(f"{self.base}/v1/runners").json()["data"]) == count, 180)

    def served(self) -> dict[str, int]:
        data = httpx.get(f"{self.base}/v1/runners", timeout=5).json()["data"]
        return {r["name"]: r["requests_served"] for r in data}

    def prefilled(self) -> dict[str, float]:
        """Prompt tokens each runner prefilled so far (`/metrics`)."""
        found: dict[str, float] = {}
        for line in httpx.get(f"{self.base}/metrics", timeout=5).text.splitlines():
            if (
                line.startswith("orchard_prompt_tokens_by_source_total{")
                and 'source="prefilled"' in line
            ):
                name = line.split('runner="')[1].split('"')[0]
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return found

    def close(self) -> None:
        for proc in [*self.procs.values(), self.gateway]:
            stop_process(proc, 30)


@contextlib.contextmanager
def pool(runners: int) -> Iterator[Pool]:
    with tempfile.TemporaryDirectory(prefix="orchard-bench-agent-") as root:
        made = Pool(runners, Path(root))
        try:
            yield made
        finally:
            made.close()


# --- scenarios -----------------------------------------------------------------------------


def shared_system(base: str, model: str, words: Words) -> float:
    """The cached share of 8 concurrent prompts after one with their system prompt."""
    system = words.text(1355)
    with httpx.Client(timeout=600) as client:
        stream_chat(client, base, model, [sys_msg(system), user("Warm up.")], 4)

        def one(i: int) -> Turn:
            with httpx.Client(timeout=600) as own:
                return stream_chat(own, base, model, [sys_msg(system), user(f"Question {i}?")], 4)

        with ThreadPoolExecutor(8) as pool_:
            turns = list(pool_.map(one, range(8)))
    return sum(t.cached_tokens for t in turns) / sum(t.prompt_tokens for t in turns)


def sys_msg(content: str) -> dict[str, Any]:
    return {"role": "system", "content": content}


def user(content: str) -> dict[str, Any]:
    return {"role": "user", "content": content}


def chat(base: str, model: str, words: Words, turns: int) -> tuple[list[Turn], float]:
    """A conversation; its turns and its prefilled ÷ new tokens after the first."""
    messages = [sys_msg(words.text(300)), user(words.text(60))]
    out: list[Turn] = []
    with httpx.Client(timeout=600) as client:
        for _ in range(turns):
            turn = stream_chat(client, base, model, messages, 16)
            out.append(turn)
            messages += [{"role": "assistant", "content": turn.text}, user(words.text(60))]
    prefilled = sum(t.prompt_tokens - t.cached_tokens for t in out[1:])
    new = sum(b.prompt_tokens - a.prompt_tokens for a, b in itertools.pairwise(out))
    return out, prefilled / new


def distinct(p: Pool, words: Words) -> list[int]:
    """6 conversations with nothing in common, at once: requests per runner."""
    before = p.served()
    systems = [f"{i} {words.text(200)}" for i in range(6)]

    def one(system: str) -> None:
        with httpx.Client(timeout=600) as client:
            stream_chat(client, p.base, MODEL, [sys_msg(system), user("Hi")], 32)

    with ThreadPoolExecutor(6) as pool_:
        list(pool_.map(one, systems))
    after = p.served()
    return [after[name] - before.get(name, 0) for name in sorted(after)]


def restart(words: Words) -> tuple[float, float, float]:
    """(cached share of the previous prompt after the restart, TTFT before, TTFT after)."""
    with pool(1) as p, httpx.Client(timeout=600) as client:
        messages = [sys_msg(words.text(1000)), user(words.text(100))]
        last = None
        for _ in range(3):
            last = stream_chat(client, p.base, MODEL, messages, 16)
            messages += [{"role": "assistant", "content": last.text}, user(words.text(100))]
        assert last is not None
        before = stream_chat(client, p.base, MODEL, messages, 16)  # a 4th turn, for its TTFT
        messages += [{"role": "assistant", "content": before.text}, user(words.text(100))]
        time.sleep(1)  # the last write reaches the disk (the runner drains before it exits)
        p.stop_runner("agent-0")
        p.start("agent-0")
        p.wait_for(1)
        after = stream_chat(client, p.base, MODEL, messages, 16)
        return after.cached_tokens / before.prompt_tokens, before.ttft, after.ttft


@attrs.frozen
class Agent:
    """One agent conversation, scripted: its system prompt and each turn's tool result."""

    system: str
    results: tuple[str, ...]


def agent_script(words: Words, turns: int, context: int) -> Agent:
    system = "You are a coding agent. Tools: " + words.text(2000)
    results, total = [], 2000
    for _ in range(turns):
        size = words.random.randint(200, 1500)
        if total + size + 200 > context:
            break
        results.append(words.text(size))
        total += size + 40
    return Agent(system, tuple(results))


def replay(base: str, model: str, agent: Agent) -> list[Turn]:
    messages = [sys_msg(agent.system), user("Fix the failing test.")]
    out: list[Turn] = []
    with httpx.Client(timeout=1200) as client:
        for i, result in enumerate(agent.results):
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": f"call_{i}",
                            "type": "function",
                            "function": {"name": "run", "arguments": f'{{"step": {i}}}'},
                        }
                    ],
                }
            )
            messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": result})
            turn = stream_chat(client, base, model, messages, 16)
            out.append(turn)
            messages.append({"role": "assistant", "content": turn.text})
            messages.append(user("Go on."))
    return out


def ideal(agent: Agent, turns: list[Turn]) -> list[float]:
    """For each turn: the time mlx-lm takes here to prefill only that turn's new tokens onto
    the previous prompt's cache, to its first token (the same prompts, tokenized here)."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    loaded: Any = mlx_lm.load(resolve_model(MODEL))
    model = loaded[0]
    del agent
    # One cache, grown turn by turn: each turn's new tokens are prefilled (and timed) onto
    # exactly the previous prompt's length.
    cache = make_prompt_cache(model)
    times = []
    previous = 0
    for turn in turns:
        started = time.perf_counter()
        for start in range(previous, turn.prompt_tokens, 512):
            end = min(start + 512, turn.prompt_tokens)
            logits = model(mx.array([[1] * (end - start)]), cache=cache)
            mx.eval(logits, [c.state for c in cache])
        mx.eval(mx.argmax(logits[0, -1]))
        times.append(time.perf_counter() - started)
        previous = turn.prompt_tokens
    return times


def prefill_counts(p: Pool, words: Words, conversations: int, turns: int) -> dict[str, Any]:
    """Several agents at once on one pool sharing a system prompt: each runner's prefilled
    tokens during the first turns, as a count of system prompts."""
    agents = [agent_script(words, turns, 32_000) for _ in range(conversations)]
    system = agents[0].system
    agents = [Agent(system, a.results) for a in agents]
    before = p.prefilled()
    first_turns: list[Turn] = []
    lock = threading.Lock()

    def run(agent: Agent) -> list[Turn]:
        turns_ = replay(p.base, MODEL, agent)
        with lock:
            first_turns.append(turns_[0])
        return turns_

    with ThreadPoolExecutor(conversations) as pool_:
        all_turns = list(pool_.map(run, agents))
    after = p.prefilled()
    system_tokens = len(words.tokenizer.encode(system).ids)
    per_runner = {n: after.get(n, 0) - before.get(n, 0) for n in after}
    cold = [t for t in first_turns if t.cached_tokens < system_tokens // 2]
    return {
        "conversations": conversations,
        "turns": sum(len(t) for t in all_turns),
        "first turns that prefilled the system prompt": len(cold),
        "prefilled tokens per runner": per_runner,
        "turn TTFT p50": statistics.median(t.ttft for ts in all_turns for t in ts),
    }


TURNS = 20
"""Turns of the agent replay (`just bench agent --turns N`)."""


def main(runs: int, tokens: int) -> None:
    del runs, tokens
    turns = TURNS
    model_dir = resolve_model(MODEL)
    words = Words(model_dir)
    print(f"§11 prompt reuse, model {MODEL} (context 32,768)", flush=True)

    def say(line: str) -> None:
        print(line, flush=True)

    agent = agent_script(words, turns, 32_000)
    with mlx_lm_server(model_dir, 8) as server:
        share_server = shared_system(server, model_dir, words)
        say(
            "shared system prompt, 8 at once after one: mlx_lm.server cached share "
            f"{share_server:.3f}"
        )
        server_turns = replay(server, model_dir, agent)
        say(f"agent replay on mlx_lm.server: {_turns(server_turns)}")
    with pool(1) as p:
        share_one = shared_system(p.base, MODEL, words)
        say(f"shared system prompt, 8 at once after one: 1 runner cached share {share_one:.3f}")
        one_turns = replay(p.base, MODEL, agent)
        say(f"agent replay on 1 runner: {_turns(one_turns)}")
    with pool(3) as p:
        share_three = shared_system(p.base, MODEL, words)
        say(f"shared system prompt, 8 at once after one: 3 runners cached share {share_three:.3f}")
        chat_turns, ratio = chat(p.base, MODEL, words, 10)
        reused = all(b.cached_tokens >= a.prompt_tokens for a, b in itertools.pairwise(chat_turns))
        say(
            f"10-turn chat on 3 runners: every turn reused the whole previous prompt: {reused}; "
            f"prefilled / new {ratio:.2f}"
        )
        say(f"6 distinct conversations at once, requests per runner: {distinct(p, words)}")
        three_turns = replay(p.base, MODEL, agent)
        say(f"agent replay on 3 runners: {_turns(three_turns)}")
    share_after, ttft_before, ttft_after = restart(words)
    say(
        f"after a runner restart: cached share of the previous prompt {share_after:.3f}; "
        f"TTFT {ttft_before:.2f} s before, {ttft_after:.2f} s after"
    )
    best = ideal(agent, one_turns)
    say(f"agent replay ({len(agent.results)} turns): TTFT per turn, s")
    say("  turn  prompt  ideal  1 runner  3 runners  mlx_lm.server   (ratio to ideal)")
    for i, (ideal_s, a, b, c) in enumerate(
        zip(best, one_turns, three_turns, server_turns, strict=False)
    ):
        say(
            f"  {i + 1:>4}  {a.prompt_tokens:>6}  {ideal_s:5.2f}  {a.ttft:8.2f}  {b.ttft:9.2f}  "
            f"{c.ttft:13.2f}   ({a.ttft / ideal_s:.2f} {b.ttft / ideal_s:.2f} "
            f"{c.ttft / ideal_s:.2f})"
        )
    _plot(best, one_turns, three_turns, server_turns)
    with pool(3) as p:
        many = prefill_counts(p, words, 8, min(turns, 8))
    say(f"8 agents at once on 3 runners, sharing the system prompt: {many}")


def _turns(turns: list[Turn]) -> str:
    """Each turn as prompt/cached tokens and TTFT."""
    return " ".join(f"{t.prompt_tokens}/{t.cached_tokens}:{t.ttft:.2f}s" for t in turns)


def _plot(best: list[float], one: list[Turn], three: list[Turn], server: list[Turn]) -> None:
    from bench.plot import line_chart

    line_chart(
        Path("docs/img/agent-ttft.svg"),
        "Agent replay: time to first token per turn",
        [str(i + 1) for i in range(len(best))],
        {
            "mlx-lm in-process, new tokens only, 512-token chunks": best,
            "Orchard, 1 runner": [t.ttft for t in one],
            "Orchard, 3 runners": [t.ttft for t in three],
            "mlx_lm.server": [t.ttft for t in server],
        },
        "seconds",
    )
