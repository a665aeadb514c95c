"""`python -m bench.grammars`: the grammar libraries for constrained decoding, side by side.

Candidates: llguidance, xgrammar and outlines-core, each driven through the same small
adapter (`Backend`). Three figures:

(a) per-token cost: compute the next-token bitmask, apply it to an mlx logits array (one
    `mx.where` over the unpacked bits, as the runner does) and advance the matcher, on a
    realistic JSON document, for 1 and 8 independent matchers per step (the runner's batch
    has one grammar per row), on the demo tokenizer (~1k tokens) and on a ~50k byte-level
    BPE trained here on the Python standard library's sources (no hub access);
(b) compile time of a large schema (60 properties, $defs, anyOf, enums, patterns, formats):
    from the schema text to a matcher's first mask, cold (no library cache);
(c) coverage of the JSON Schema subset OpenAI's strict mode accepts: per feature, whether
    valid documents pass and invalid ones are refused, or how the schema is refused.

Each library runs in a child process (`--child`), so one that needs another interpreter
(xgrammar needs torch: `--python xgrammar=/path/to/python`) or hangs (a timeout) does not
take the others down. A library that is not installed is reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bench.schemas import COVERAGE, ORDER, ORDER_SCHEMA, large_schema

LIBRARIES = ("llguidance", "xgrammar", "outlines-core")
EOS = "<|endoftext|>"
SEPARATORS = (", ", ": ")
"""json.dumps' defaults; every backend is configured to write exactly these."""
BPE_VOCAB = 50_000

# Tokenizers


def demo_tokenizer_path() -> Path:
    from runner.demo_model import resolve_model

    return Path(resolve_model("orchard-demo")) / "tokenizer.json"


def bpe_tokenizer_path() -> Path:
    """A ~50k byte-level BPE trained on the standard library's sources, built once."""
    from runner.demo_model import cache_dir

    target = cache_dir() / "bench" / f"stdlib-bpe-{BPE_VOCAB}.json"
    if target.exists():
        return target
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(os.__file__).parent
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    print(f"training a {BPE_VOCAB}-token BPE on {len(files)} stdlib files...", flush=True)
    tokenizer.train_from_iterator(_texts(files), trainer)
    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(target))
    return target


def _texts(files: list[Path]) -> Iterator[str]:
    for path in files:
        try:
            yield path.read_text("utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few test files are deliberately not UTF-8


class Vocab:
    """A tokenizers.Tokenizer and what every backend needs of it."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.path = path
        self.tokenizer = Tokenizer.from_file(str(path))
        self.size = self.tokenizer.get_vocab_size()
        # The demo model ends on <|im_end|>; the trained BPE has only EOS.
        eos = self.tokenizer.token_to_id("<|im_end|>") or self.tokenizer.token_to_id(EOS)
        assert eos is not None
        self.eos = eos
        self.special = {t["id"] for t in json.loads(self.tokenizer.to_str())["added_tokens"]}

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def token_bytes(self) -> dict[int, bytes]:
        """Each ordinary token's bytes (byte-level BPE: one character per byte)."""
        decode = _byte_level_decoder()
        return {
            i: bytes(decode[c] for c in s)
            for s, i in self.tokenizer.get_vocab().items()
            if i not in self.special
        }


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-character table, reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


# Backends: compile a schema, make matchers, fill masks, advance.


class Backend:
    name = ""
    has_parallel = False
    """Whether `fill_parallel` is the library's own batch call."""

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab

    def compile(self, schema: str) -> Any:
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        raise NotImplementedError

    def fill(self, matchers: list[Any], bitmask: np.ndarray[Any, Any]) -> None:
        """Row i of `bitmask` gets matcher i's next-token mask, one matcher after another."""
        raise NotImplementedError

    def fill_parallel(self, matchers: list[Any], bitmask: np.ndarray[Any, Any]) -> None:
        """As `fill`, with the library's own batch call (`has_parallel`)."""
        raise NotImplementedError

    def consume(self, matcher: Any, token: int) -> bool:
        raise NotImplementedError

    def accepts_end(self, matcher: Any) -> bool:
        raise NotImplementedError


class Llguidance(Backend):
    name = "llguidance"
    has_parallel = True

    def __init__(self, vocab: Vocab) -> None:
        super().__init__(vocab)
        import llguidance

        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(vocab.tokenizer.to_str(), eos_token=vocab.eos)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: str) -> Any:
        options = {
            "whitespace_flexible": False,
            "item_separator": SEPARATORS[0],
            "key_separator": SEPARATORS[1],
        }
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]
        is_error, messages = self.llg.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer
        )
        if is_error:
            raise ValueError(messages[0])
        return grammar

    def matcher(self, compiled: Any) -> Any:
        matcher = self.llg.LLMatcher(self.tokenizer, compiled)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, matchers: list[Any], bitmask: np.ndarray[Any, Any]) -> None:
        size = bitmask.shape[1] * 4
        base = bitmask.ctypes.data
        for i, matcher in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(base + i * size, size)

    def fill_parallel(self, matchers: list[Any], bitmask: np.ndarray[Any, Any]) -> None:
        self.executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)],
            bitmask.ctypes.data,
            bitmask.shape[1] * 4,
            bitmask.shape[0],
        )

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def accepts_end(self, matcher: Any) -> bool:
        return bool(matcher.is_accepting())


class Xgrammar(Backend):
    name = "xgrammar"
    has_parallel = True

    def __init__(self, vocab: Vocab) -> None:
        super().__init__(vocab)
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xg = xgrammar
        eos_text = vocab.tokenizer.id_to_token(vocab.eos)
        hf = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
            tokenizer_object=vocab.tokenizer, eos_token=eos_text
        )
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab.size)
        # Cache off: (b) measures a cold compile.
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: str) -> Any:
        return self.compiler.compile_json_schema(
            schema, any_whitespace=False, separators=SEPARATORS, strict_mode=False
        )

    def matcher(self, compiled: Any) -> Any:
        return self.xg.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: np.ndarray[Any, Any]) -> None:
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)

    def fill_parallel(self, matchers: list[Any], bitmask: np.ndarray[Any, Any]) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def accepts_end(self, matcher: Any) -> bool:
        return bool(matcher.accept_token(self.vocab.eos))


class OutlinesCore(Backend):
    name = "outlines-core"

    def __init__(self, vocab: Vocab) -> None:
        super().__init__(vocab)
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc = outlines_core
        self.build_regex = build_regex_from_schema
        by_bytes: dict[bytes, list[int]] = {}
        for token, data in vocab.token_bytes().items():
            by_bytes.setdefault(data, []).append(token)
        self.vocabulary = outlines_core.Vocabulary(vocab.eos, by_bytes)

    def compile(self, schema: str) -> Any:
        return self.oc.Index(self.build_regex(schema, r"[ ]?"), self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, matchers: list[Any], bitmask: np.ndarray[Any, Any]) -> None:
        words = bitmask.shape[1]
        base = bitmask.ctypes.data
        for i, guide in enumerate(matchers):
            guide.write_mask_into(base + i * words * 4, words, 4)

    def consume(self, matcher: Any, token: int) -> bool:
        try:
            matcher.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def accepts_end(self, matcher: Any) -> bool:
        return bool(matcher.is_finished())


BACKENDS: dict[str, type[Backend]] = {
    "llguidance": Llguidance,
    "xgrammar": Xgrammar,
    "outlines-core": OutlinesCore,
}


def apply_bitmask(logits: Any, bitmask: np.ndarray[Any, Any]) -> Any:
    """The runner's way: unpack the bits on the host (numpy), one `mx.where` on the logits."""
    import mlx.core as mx

    allowed = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")
    allowed = allowed[:, : logits.shape[-1]].view(np.bool_)
    return mx.where(mx.array(allowed), logits, -mx.inf)


def apply_bitmask_device(logits: Any, bitmask: np.ndarray[Any, Any]) -> Any:
    """The alternative: ship the int32 words, unpack them with mx ops."""
    import mlx.core as mx

    words = mx.array(bitmask)
    bits = (words[:, :, None] >> mx.arange(32, dtype=mx.int32)) & 1
    allowed = bits.reshape(words.shape[0], -1)[:, : logits.shape[-1]]
    return mx.where(allowed.astype(mx.bool_), logits, -mx.inf)


# The child's measurements.


def measure_tokens(backend: Backend, batch: int, runs: int) -> dict[str, Any]:
    """(a): µs per step (mask + apply + advance for `batch` matchers) over ORDER's tokens."""
    import mlx.core as mx

    tokens = backend.vocab.encode(json.dumps(ORDER, separators=SEPARATORS))
    compiled = backend.compile(json.dumps(ORDER_SCHEMA))
    logits = mx.random.normal((batch, backend.vocab.size))
    mx.eval(logits)
    words = (backend.vocab.size + 31) // 32
    result: dict[str, Any] = {"tokens": len(tokens)}
    modes = ["sequential", "parallel"] if backend.has_parallel and batch > 1 else ["sequential"]
    for mode in modes:
        parts: list[tuple[float, float, float]] = []
        for _ in range(runs):
            matchers = [backend.matcher(compiled) for _ in range(batch)]
            bitmask = np.zeros((batch, words), np.int32)
            mask_time = apply_time = advance_time = 0.0
            for token in tokens:
                start = time.perf_counter()
                if mode == "parallel":
                    backend.fill_parallel(matchers, bitmask)
                else:
                    backend.fill(matchers, bitmask)
                filled = time.perf_counter()
                mx.eval(apply_bitmask(logits, bitmask))
                applied = time.perf_counter()
                for matcher in matchers:
                    if not backend.consume(matcher, token):
                        raise RuntimeError(f"{backend.name} refused a token of a valid document")
                advanced = time.perf_counter()
                mask_time += filled - start
                apply_time += applied - filled
                advance_time += advanced - applied
                if not bitmask[0, token // 32] >> (token % 32) & 1:
                    raise RuntimeError(f"{backend.name}'s mask left out a valid token")
            if not backend.accepts_end(matchers[0]):
                raise RuntimeError(f"{backend.name} does not accept the whole document")
            n = len(tokens) / 1e6
            parts.append((mask_time / n, apply_time / n, advance_time / n))
        mask_us, apply_us, advance_us = (statistics.median(p) for p in zip(*parts, strict=True))
        result[mode] = {"mask_us": mask_us, "apply_us": apply_us, "advance_us": advance_us}
    return result


def measure_apply(vocab: Vocab, batch: int, runs: int = 200) -> dict[str, float]:
    """The apply step alone, both ways (µs per call, median)."""
    import mlx.core as mx

    logits = mx.random.normal((batch, vocab.size))
    mx.eval(logits)
    rng = np.random.default_rng(0)
    bitmask = rng.integers(-(2**31), 2**31, (batch, (vocab.size + 31) // 32), dtype=np.int32)
    figures = {}
    for name, apply in (("host", apply_bitmask), ("device", apply_bitmask_device)):
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            mx.eval(apply(logits, bitmask))
            times.append(time.perf_counter() - start)
        figures[name] = statistics.median(times) * 1e6
    base = []
    for _ in range(runs):
        start = time.perf_counter()
        mx.eval(logits * 1.0)
        base.append(time.perf_counter() - start)
    figures["one mx op"] = statistics.median(base) * 1e6
    return figures


def measure_compile(backend: Backend, runs: int) -> float:
    """(b): seconds from the large schema's text to a matcher's first mask (median)."""
    schema = json.dumps(large_schema())
    bitmask = np.zeros((1, (backend.vocab.size + 31) // 32), np.int32)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        matcher = backend.matcher(backend.compile(schema))
        backend.fill([matcher], bitmask)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_coverage(backend: Backend) -> list[tuple[str, str]]:
    """(c): per feature, "enforced", what is not enforced, or the refusal's text."""
    results = []
    for feature, schema, valid, invalid in COVERAGE:
        try:
            compiled = backend.compile(json.dumps(schema))
            backend.matcher(compiled)
        except Exception as exc:
            message = " ".join(str(exc).split())
            results.append((feature, f"refused: {type(exc).__name__}: {message[:160]}"))
            continue
        wrong_refusals = [d for d in valid if not _accepts(backend, compiled, d)]
        let_through = [d for d in invalid if _accepts(backend, compiled, d)]
        if wrong_refusals:
            verdict = f"refuses valid {json.dumps(wrong_refusals[0])}"
        elif let_through:
            verdict = f"not enforced: accepts {json.dumps(let_through[0])}"
        else:
            verdict = "enforced" if invalid else "compiles"
        results.append((feature, verdict))
    return results


def _accepts(backend: Backend, compiled: Any, document: Any) -> bool:
    matcher = backend.matcher(compiled)
    tokens = backend.vocab.encode(json.dumps(document, separators=SEPARATORS))
    return all(backend.consume(matcher, t) for t in tokens) and backend.accepts_end(matcher)


def child(library: str, task: str, tokenizer: str, runs: int) -> None:
    """Runs one task of one library; prints one JSON line."""
    try:
        backend = BACKENDS[library](Vocab(Path(tokenizer)))
    except ImportError as exc:
        print(json.dumps({"missing": str(exc)}))
        return
    out: Any
    if task == "tokens":
        out = {str(b): measure_tokens(backend, b, runs) for b in (1, 8)}
    elif task == "compile":
        out = measure_compile(backend, runs)
    elif task == "apply":
        out = {str(b): measure_apply(backend.vocab, b) for b in (1, 8)}
    else:
        out = measure_coverage(backend)
    print(json.dumps({"result": out}))


# The parent: one child per (library, task, tokenizer), tables at the end.


def _run_child(command: list[str], timeout: float) -> dict[str, Any]:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"no result in {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": tail[:200]}
    answer: dict[str, Any] = json.loads(lines[-1])
    return answer


def _cell(answer: dict[str, Any], render: Callable[[Any], str]) -> str:
    if "missing" in answer:
        return "not installed"
    if "error" in answer:
        return f"failed: {answer['error']}"
    try:
        return render(answer["result"])
    except KeyError:
        return "-"


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    print(flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.grammars", description=__doc__)
    parser.add_argument("--runs", type=int, default=3, help="repetitions per figure (median)")
    parser.add_argument("--libraries", nargs="*", default=list(LIBRARIES), choices=LIBRARIES)
    parser.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="LIBRARY=PATH",
        help="another interpreter for one library, e.g. xgrammar=/venv/bin/python (it needs torch)",
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds per library task")
    parser.add_argument("--child", nargs=3, metavar=("LIBRARY", "TASK", "TOKENIZER"))
    args = parser.parse_args()
    if args.child:
        library, task, tokenizer = args.child
        child(library, task, tokenizer, runs=args.runs)
        return 0
    pythons = dict(entry.split("=", 1) for entry in args.python)
    tokenizers = {"demo (1k)": demo_tokenizer_path(), "BPE (50k)": bpe_tokenizer_path()}

    def run(library: str, task: str, tokenizer: Path, runs: int = args.runs) -> dict[str, Any]:
        python = pythons.get(library, sys.executable)
        command = [python, "-m", "bench.grammars", "--child", library, task, str(tokenizer)]
        return _run_child([*command, "--runs", str(runs)], args.timeout)

    print("## (a) per-token cost, µs per step (each row's matcher: mask, advance; then apply)\n")
    rows = []
    for label, path in tokenizers.items():
        for library in args.libraries:
            answer = run(library, "tokens", path)
            for batch in ("1", "8"):

                def figure(mode: str, part: str, batch: str = batch) -> Callable[[Any], str]:
                    return lambda result: f"{result[batch][mode][part]:.0f}"

                rows.append(
                    [
                        label,
                        library,
                        batch,
                        _cell(answer, figure("sequential", "mask_us")),
                        _cell(answer, figure("parallel", "mask_us")),
                        _cell(answer, figure("sequential", "advance_us")),
                        _cell(answer, figure("sequential", "apply_us")),
                    ]
                )
    header = ["tokenizer", "library", "rows", "masks, one by one", "masks, library's batch call"]
    _print_table([*header, "advance", "apply"], rows)

    print("### applying one step's masks to mlx logits, µs per step\n")
    apply_rows = []
    for label, path in tokenizers.items():
        answer = run("llguidance", "apply", path)
        for batch in ("1", "8"):
            apply_rows.append(
                [label, batch]
                + [
                    _cell(answer, lambda r, b=batch, k=key: f"{r[b][k]:.0f}")  # type: ignore[misc]
                    for key in ("host", "device", "one mx op")
                ]
            )
    header = ["tokenizer", "rows", "runner's way (host unpack, one where)", "mx unpack + where"]
    _print_table([*header, "x * 1.0 (eval floor)"], apply_rows)

    print("## (b) large schema (60 properties, $defs, anyOf, enums): cold compile, s\n")
    compile_rows = [
        [library]
        + [
            _cell(run(library, "compile", path), lambda r: f"{r:.3f}")
            for path in tokenizers.values()
        ]
        for library in args.libraries
    ]
    _print_table(["library", *tokenizers], compile_rows)

    print("## (c) JSON Schema features (demo tokenizer)\n")
    coverage = {
        library: run(library, "coverage", tokenizers["demo (1k)"], 1) for library in args.libraries
    }
    coverage_rows = [
        [feature]
        + [_cell(coverage[library], lambda r, i=i: str(r[i][1])) for library in args.libraries]  # type: ignore[misc]
        for i, (feature, *_) in enumerate(COVERAGE)
    ]
    _print_table(["feature", *args.libraries], coverage_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
