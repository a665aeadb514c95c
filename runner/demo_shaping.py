"""How the built-in model learns to call its demo tool and to finish JSON: seconds of training.

The random model of `runner.demo_model` (64 wide, 2 layers) writes nonsense, which is what the
tests want for ordinary prompts. This module widens it to 96 and adds two layers, and trains
only what it added, so that ordinary prompts still get exactly that nonsense while JSON and
tool calls get a small trained network:

- JSON tokens (any with one of `{ } [ ] "`, and `<tool_call>` `</tool_call>`) get a random
  embedding in the 32 new dimensions; every other token's is zero there. The base layers
  neither read nor write the new dimensions, and the new layers only move what is already in
  them: their attention values and the `up` half of their MLP read only the new dimensions,
  and they write only there. So with no JSON token in the context the new dimensions stay
  zero, the new layers add nothing, and the logits are the base model's (its norms rescaled
  for the width). The base model's output rows of the JSON tokens and of bare whitespace are
  zero, like those of the markers: it never starts JSON by itself;
- once a JSON token is in the context, the new dimensions fill and the new layers and their
  output columns take over (being large, they also shrink the base model's share in the final
  norm). They are trained with the base frozen: `_STEPS` Adam steps, `_BATCH` examples each,
  over `_EXAMPLES` short JSON objects (keys and string values from short word lists, small
  numbers, booleans, null, arrays of one or two items, one level of nesting) and
  `_CALL_EXAMPLES` tool calls (of the demo tool, or of others with such arguments; two calls
  when the user lists two cities in JSON, as in the parallel conversation, one otherwise),
  answering ordinary prompts with the first token given (as a grammar or the template gives
  it), and over the fixed tool conversations of `runner.demo_model`, whose calls they learn by
  heart. Most objects and arrays have one member, so that greedy decoding closes them soon;
  half the examples split quotes off as a grammar may force (`{` then `"`, a bare closing
  `"`), some strings hold odd characters (so that a string still closes after a temperature-1
  detour), and where a string closes, tokens with a brace but no quote (which would go on
  inside it) are made unlikely.

Training runs the base layers once over the examples and then only the new parts, with a copy
of their arithmetic (the tests check it against mlx-lm's). Every draw is seeded and the order
fixed, so a machine builds the same model every time.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.optimizers as optim
from mlx.nn.layers.activations import silu
from mlx.nn.layers.base import Module
from mlx.nn.losses import cross_entropy
from mlx.nn.utils import value_and_grad
from mlx.utils import tree_unflatten
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import load as load_tokenizer

OLD_DIMS = 64
NEW_DIMS = 32
WIDTH = OLD_DIMS + NEW_DIMS
HEAD_DIM = 16
NEW_LAYERS = 2
UNITS = 128
"""The MLP width of every layer: the base layers' units, and the new layers' own."""
EPS = 1e-5
"""RMSNorm's epsilon (the base config's)."""

_MODE_SCALE = 5.0
"""The size of the JSON tokens' new embedding: large, so that the new part dominates."""
_OUT_SCALE = 5.0
_HEAD_SCALE = 3.0
_STEPS = 60
_LEARNING_RATE = 3e-3
_WARMUP = 5
_BATCH = 8
_EXAMPLES = 96
_CALL_EXAMPLES = 32
_TOOL_WEIGHT = 3.0
"""The fixed tool conversations weigh this much against one batch of examples."""
_PAST_EVERY = 4
"""Steps between updates of the new layers' keys and values over the tool conversations'
shared prompt (not trained through; fresh for the last steps)."""
_UNLIKELY = 1.0
"""The weight of keeping braces out where strings close (`_Batch.closing`)."""
_SPLIT = 0.5
"""Share of examples whose value strings close with a bare `"`."""

_KEYS = ("name", "city", "id", "type", "count", "ok", "tags", "note")
_VALUES = ("apple", "pear", "red", "sweet", "Paris", "London", "Monday")
_ODD = (",", ":", " ", ".", "e", "s", "1", "_", "x", "apple", " red", "-", "!", "}", "}}", "]")
"""Pieces of the odd strings."""
_CITIES = ("Paris", "Paris", "Paris", "London")
_PROMPTS = (
    "Tell me about apples.",
    "What is 2+2?",
    "Hello",
    "Write a poem about the sea.",
    "Why is the sky blue?",
    "List three fruits.",
    "Answer in JSON.",
    "Give me a JSON object.",
    "Describe a tree.",
    "What is the weather like in Paris today?",
    "Who are you?",
    "Hi",
)

Weights = dict[str, mx.array]
Example = tuple[list[int], int]
"""Tokens, and the index of the first one to learn."""
Conversation = tuple[Sequence[dict[str, Any]], Sequence[dict[str, Any]], Sequence[dict[str, Any]]]
"""Tools, messages, and the calls (`{"name", "arguments"}`) that answer them."""
Past = list[tuple[mx.array, mx.array]]
"""Each new layer's keys and values over a prompt."""


def mode_tokens(texts: Sequence[str]) -> list[int]:
    """The JSON tokens (by id, from each token's text): those that switch the new part on."""
    return [
        i
        for i, text in enumerate(texts)
        if any(char in text for char in '{}[]"') or text in ("<tool_call>", "</tool_call>")
    ]


def whitespace_tokens(texts: Sequence[str]) -> list[int]:
    return [i for i, text in enumerate(texts) if text and text.isspace()]


def config(base: dict[str, Any]) -> dict[str, Any]:
    """The shaped model's config.json, from the base model's."""
    return {
        **base,
        "hidden_size": WIDTH,
        "intermediate_size": UNITS,
        "num_hidden_layers": base["num_hidden_layers"] + NEW_LAYERS,
        "num_attention_heads": WIDTH // HEAD_DIM,
        "num_key_value_heads": WIDTH // HEAD_DIM // 2,
        "head_dim": HEAD_DIM,
    }


def shape(
    base: Weights,
    base_config: dict[str, Any],
    tokenizer_path: Path,
    conversations: Sequence[Conversation],
) -> Weights:
    """Train the added parts of the base model (`base`: mlx-lm Llama weights, by name) and
    return the shaped model's weights, whose config is `config(base_config)`.

    `tokenizer_path` holds the model's tokenizer files (its chat template renders the
    examples). Draws from its own keys: the caller's MLX generator is left alone.
    """
    tokenizer = load_tokenizer(tokenizer_path)
    vocab_size = base["lm_head.weight"].shape[0]
    texts = [tokenizer.decode([i], skip_special_tokens=False) for i in range(vocab_size)]
    model = llama.Model(llama.ModelArgs.from_dict(base_config))  # type: ignore[no-untyped-call]
    model.update(tree_unflatten(list(base.items())))
    is_mode = mx.zeros((vocab_size, 1))
    is_mode[mx.array(mode_tokens(texts))] = 1.0
    embedding_key, shaper_key = mx.random.split(mx.random.key(0))
    mode_embedding = mx.random.normal((vocab_size, NEW_DIMS), key=embedding_key) * _MODE_SCALE
    mode_embedding = mode_embedding * is_mode
    base_run = BaseRun(model, base, mode_embedding, texts)
    braces = mx.array([0.0 if '"' in t or not set(t) & set("{}[]") else 1.0 for t in texts])
    shaper = Shaper(vocab_size, shaper_key)

    rng = random.Random(0)
    examples = sorted(_examples(tokenizer, texts, rng), key=lambda example: len(example[0]))
    groups = [examples[i : i + _BATCH] for i in range(0, len(examples) - _BATCH + 1, _BATCH)]
    rng.shuffle(groups)
    # Batches of like lengths, padded to a few shapes (the training step compiles per shape).
    batches = [
        base_run.batch(
            group,
            _round_up(max(len(tokens) for tokens, _ in group) - 1, 16),
            _round_up(sum(len(tokens) - first for tokens, first in group), 64),
        )
        for group in groups
    ]
    prompt, rests = _conversations(tokenizer, conversations)
    prompt_batch = base_run.batch([([*prompt, 0], len(prompt) + 1)], len(prompt), 1)
    # The conversations as one batch, run past their shared prompt.
    calls = base_run.batch(
        [([*prompt, *tokens], len(prompt) + first) for tokens, first in rests],
        len(prompt) + max(len(tokens) for tokens, _ in rests) - 1,
        sum(len(tokens) - first for tokens, first in rests),
    ).after(len(prompt))

    def loss(shaper: Shaper, arrays: list[mx.array]) -> mx.array:
        batch = _Batch(*arrays[: len(_Batch._fields)])
        rest = arrays[len(_Batch._fields) :]
        past = [(rest[2 * i], rest[2 * i + 1]) for i in range(NEW_LAYERS)]
        logits = shaper(batch)
        # Where a string closes, a brace without a quote would leave it open (a grammar allows
        # it): make those unlikely, so that a masked closing token is not replaced by one.
        braced = (mx.softmax(logits, axis=-1) * braces).sum(-1)
        unlikely = -(mx.log1p(-braced + 1e-6) * batch.closing).sum() / batch.closing.sum()
        tools = _cross_entropy(shaper(calls, past), calls)
        return _cross_entropy(logits, batch) + _UNLIKELY * unlikely + _TOOL_WEIGHT * tools

    schedule = optim.join_schedules(
        [
            optim.linear_schedule(_LEARNING_RATE / 10, _LEARNING_RATE, _WARMUP),
            optim.cosine_decay(_LEARNING_RATE, _STEPS - _WARMUP, _LEARNING_RATE * 0.3),
        ],
        [_WARMUP],
    )
    optimizer = optim.Adam(learning_rate=schedule)
    loss_and_grad = value_and_grad(shaper, loss)
    state = [shaper.state, optimizer.state]

    def step(*arrays: mx.array) -> mx.array:
        value, grads = loss_and_grad(shaper, list(arrays))
        optimizer.update(shaper, grads)
        return value  # type: ignore[no-any-return]

    compiled: Callable[..., mx.array] = mx.compile(step, inputs=state, outputs=state)
    past: list[mx.array] = []
    for i in range(_STEPS):
        if i % _PAST_EVERY == 0 or i >= _STEPS - _PAST_EVERY:
            past = [array for pair in shaper.past(prompt_batch) for array in pair]
            mx.eval(past)
        mx.eval(compiled(*batches[i % len(batches)], *past), state)
    return widen(base, shaper, mode_embedding, base_config["num_hidden_layers"])


class _Batch(NamedTuple):
    """Examples through the base layers: all that the new part reads, and its targets."""

    old: mx.array
    """The base layers' output (batch, length, OLD_DIMS): the new layers leave it as it is."""
    old_squares: mx.array
    """Its sum of squares per position, for the norms."""
    new: mx.array
    """The new dimensions of the input: the JSON tokens' embedding."""
    positions: mx.array
    """The flat positions whose next token is learnt (padded with position 0)."""
    old_logits: mx.array
    """The base's logits there before the final norm's scale (its part of the last hidden
    state is fixed, so its logits only scale with the norm)."""
    targets: mx.array
    weights: mx.array
    """1 for the positions to learn, 0 for padding."""
    closing: mx.array
    """1 where a string closes (a word, then a token starting with `"`): there, the tokens
    that would go on inside the string with braces are pushed down."""

    def after(self, start: int) -> _Batch:
        """The batch from position `start` on (all its positions to learn lie past it)."""
        length = self.old.shape[1]
        rows, columns = self.positions // length, self.positions % length
        return self._replace(
            old=self.old[:, start:],
            old_squares=self.old_squares[:, start:],
            new=self.new[:, start:],
            positions=rows * (length - start) + columns - start,
        )


class BaseRun:
    """The base model's layers, run over the widened input: their norms see the new part."""

    def __init__(
        self, model: Any, weights: Weights, mode_embedding: mx.array, texts: Sequence[str]
    ) -> None:
        self.texts = texts
        self.model = model
        self.mode_embedding = mode_embedding
        self.head = weights["lm_head.weight"]
        self.final_norm = weights["model.norm.weight"]
        self.rescale = math.sqrt(OLD_DIMS / WIDTH)

    def batch(self, examples: Sequence[Example], length: int, count: int) -> _Batch:
        """`examples` padded to `length` input tokens and `count` positions to learn."""
        tokens = mx.array([t[:-1] + [0] * (length - len(t) + 1) for t, _ in examples])
        positions = [
            row * length + i - 1
            for row, (t, first) in enumerate(examples)
            for i in range(first, len(t))
        ]
        targets = [token for t, first in examples for token in t[first:]]
        texts = self.texts
        closing = [
            float(texts[t[i]][:1] == '"' and texts[t[i - 1]][-1:].isalnum())
            for t, first in examples
            for i in range(first, len(t))
        ]
        closing += [0.0] * (count - len(closing))
        weights = [1.0] * len(positions) + [0.0] * (count - len(positions))
        positions += [0] * (count - len(positions))
        targets += [0] * (count - len(targets))
        new = self.mode_embedding[tokens]
        new_squares = (new * new).sum(-1, keepdims=True)
        old = self.model.model.embed_tokens(tokens)
        for layer in self.model.model.layers:
            x = self._normed(old, new_squares, layer.input_layernorm.weight)
            old = old + layer.self_attn(x, "causal")
            old = old + layer.mlp(
                self._normed(old, new_squares, layer.post_attention_layernorm.weight)
            )
        index = mx.array(positions)
        last = old.reshape(-1, OLD_DIMS)[index] * self.final_norm * self.rescale
        batch = _Batch(
            old,
            (old * old).sum(-1, keepdims=True),
            new,
            index,
            last @ self.head.T,
            mx.array(targets),
            mx.array(weights),
            mx.array(closing),
        )
        mx.eval(*batch)
        return batch

    def _normed(self, old: mx.array, new_squares: mx.array, weight: mx.array) -> mx.array:
        squares = (old * old).sum(-1, keepdims=True) + new_squares
        return old * mx.rsqrt(squares / WIDTH + EPS) * (weight * self.rescale)


class _NewLayer(Module):
    """The trained part of one added transformer block, and its arithmetic.

    In the full block (`widen`) its two query heads and one key/value head follow the base's
    four and two; its values and MLP `up` read only the new dimensions; it writes only them.
    """

    def __init__(self, key: mx.array) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx leaves it unannotated
        keys = mx.random.split(key, 7)

        def uniform(i: int, shape: tuple[int, int], scale: float = 1.0) -> mx.array:
            bound = scale / math.sqrt(shape[1])
            return mx.random.uniform(-bound, bound, shape, key=keys[i])

        self.norm1 = mx.ones((WIDTH,))
        self.norm2 = mx.ones((WIDTH,))
        self.wq = uniform(0, (NEW_DIMS, WIDTH))
        self.wk = uniform(1, (NEW_DIMS // 2, WIDTH))
        self.wv = uniform(2, (NEW_DIMS // 2, NEW_DIMS))
        self.wo = uniform(3, (NEW_DIMS, NEW_DIMS), _OUT_SCALE)
        self.gate = uniform(4, (UNITS, WIDTH))
        self.up = uniform(5, (UNITS, NEW_DIMS))
        self.down = uniform(6, (NEW_DIMS, UNITS), _OUT_SCALE)

    def __call__(
        self,
        batch: _Batch,
        new: mx.array,
        past: tuple[mx.array, mx.array] | None = None,
        keep: Past | None = None,
    ) -> mx.array:
        """The new dimensions after the block; `past`: keys and values before these positions
        (a shared prompt); `keep` receives this call's."""
        rows, length, _ = new.shape
        offset = 0 if past is None else past[0].shape[2]
        x = _normed(batch, new, self.norm1)
        heads, kv_heads = NEW_DIMS // HEAD_DIM, NEW_DIMS // HEAD_DIM // 2
        q = (x @ self.wq.T).reshape(rows, length, heads, HEAD_DIM).transpose(0, 2, 1, 3)
        k = (x @ self.wk.T).reshape(rows, length, kv_heads, HEAD_DIM).transpose(0, 2, 1, 3)
        v = (x[..., OLD_DIMS:] @ self.wv.T).reshape(rows, length, kv_heads, HEAD_DIM)
        v = v.transpose(0, 2, 1, 3)
        q = mx.fast.rope(q, HEAD_DIM, traditional=False, base=10000.0, scale=1.0, offset=offset)
        k = mx.fast.rope(k, HEAD_DIM, traditional=False, base=10000.0, scale=1.0, offset=offset)
        if keep is not None:
            keep.append((k, v))
        if past is not None:
            k = mx.concatenate([mx.repeat(past[0], rows, axis=0), k], axis=2)
            v = mx.concatenate([mx.repeat(past[1], rows, axis=0), v], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=HEAD_DIM**-0.5, mask="causal")
        new = new + out.transpose(0, 2, 1, 3).reshape(rows, length, -1) @ self.wo.T
        x = _normed(batch, new, self.norm2)
        hidden: mx.array = silu(x @ self.gate.T) * (x[..., OLD_DIMS:] @ self.up.T)
        return new + hidden @ self.down.T


def _normed(batch: _Batch, new: mx.array, weight: mx.array) -> mx.array:
    """RMSNorm over the whole width, the base's part and the new one."""
    squares = batch.old_squares + (new * new).sum(-1, keepdims=True)
    return mx.concatenate([batch.old, new], axis=-1) * mx.rsqrt(squares / WIDTH + EPS) * weight


class Shaper(Module):
    """What is trained: the new layers, the final norm's new dimensions and their output
    columns."""

    def __init__(self, vocab_size: int, key: mx.array) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # mlx leaves it unannotated
        keys = mx.random.split(key, NEW_LAYERS + 1)
        self.layers = [_NewLayer(keys[i]) for i in range(NEW_LAYERS)]
        self.norm = mx.ones((NEW_DIMS,))
        bound = _HEAD_SCALE / math.sqrt(NEW_DIMS)
        self.head = mx.random.uniform(-bound, bound, (vocab_size, NEW_DIMS), key=keys[-1])

    def __call__(self, batch: _Batch, past: Past | None = None) -> mx.array:
        """The logits at the batch's positions to learn."""
        new = batch.new
        for i, layer in enumerate(self.layers):
            new = layer(batch, new, None if past is None else past[i])
        new = new.reshape(-1, NEW_DIMS)[batch.positions]
        old_squares = batch.old_squares.reshape(-1, 1)[batch.positions]
        scale = mx.rsqrt((old_squares + (new * new).sum(-1, keepdims=True)) / WIDTH + EPS)
        return batch.old_logits * scale + (new * scale * self.norm) @ self.head.T

    def past(self, batch: _Batch) -> Past:
        """The new layers' keys and values over a one-row batch, not trained through."""
        past: Past = []
        new = batch.new
        for layer in self.layers:
            keep: Past = []
            new = layer(batch, new, keep=keep)
            past.append((mx.stop_gradient(keep[0][0]), mx.stop_gradient(keep[0][1])))
        return past


def widen(base: Weights, shaper: Shaper, mode_embedding: mx.array, base_layers: int) -> Weights:
    """The shaped model's weights (mlx-lm Llama names): the base's, widened with zeros, and
    the trained parts in their places."""
    rescale = math.sqrt(OLD_DIMS / WIDTH)

    def place(shape: tuple[int, int], block: mx.array, row: int = 0, column: int = 0) -> mx.array:
        out = mx.zeros(shape)
        out[row : row + block.shape[0], column : column + block.shape[1]] = block
        return out

    def norm(weight: mx.array) -> mx.array:
        return mx.concatenate([weight * rescale, mx.ones((NEW_DIMS,))])

    out: Weights = {
        "model.embed_tokens.weight": mx.concatenate(
            [base["model.embed_tokens.weight"], mode_embedding], axis=1
        ),
        "model.norm.weight": mx.concatenate([base["model.norm.weight"] * rescale, shaper.norm]),
        "lm_head.weight": mx.concatenate([base["lm_head.weight"], shaper.head], axis=1),
    }
    kv = WIDTH // 2
    for i in range(base_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = norm(base[p + "input_layernorm.weight"])
        out[p + "post_attention_layernorm.weight"] = norm(
            base[p + "post_attention_layernorm.weight"]
        )
        for name, rows in (("q_proj", WIDTH), ("k_proj", kv), ("v_proj", kv), ("o_proj", WIDTH)):
            weight = base[p + f"self_attn.{name}.weight"]
            out[p + f"self_attn.{name}.weight"] = place((rows, WIDTH), weight)
        for name in ("gate_proj", "up_proj"):
            out[p + f"mlp.{name}.weight"] = place((UNITS, WIDTH), base[p + f"mlp.{name}.weight"])
        out[p + "mlp.down_proj.weight"] = place((WIDTH, UNITS), base[p + "mlp.down_proj.weight"])
    old_kv = OLD_DIMS // 2
    for j, layer in enumerate(shaper.layers):
        p = f"model.layers.{base_layers + j}."
        out[p + "input_layernorm.weight"] = layer.norm1
        out[p + "post_attention_layernorm.weight"] = layer.norm2
        attention = {
            "q_proj": place((WIDTH, WIDTH), layer.wq, row=OLD_DIMS),
            "k_proj": place((kv, WIDTH), layer.wk, row=old_kv),
            "v_proj": place((kv, WIDTH), layer.wv, row=old_kv, column=OLD_DIMS),
            "o_proj": place((WIDTH, WIDTH), layer.wo, row=OLD_DIMS, column=OLD_DIMS),
        }
        for name, weight in attention.items():
            out[p + f"self_attn.{name}.weight"] = weight
        out[p + "mlp.gate_proj.weight"] = layer.gate
        out[p + "mlp.up_proj.weight"] = place((UNITS, WIDTH), layer.up, column=OLD_DIMS)
        out[p + "mlp.down_proj.weight"] = place((WIDTH, UNITS), layer.down, row=OLD_DIMS)
    return out


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _cross_entropy(logits: mx.array, batch: _Batch) -> mx.array:
    losses = cross_entropy(logits, batch.targets, reduction="none")
    return (losses * batch.weights).sum() / batch.weights.sum()


def _conversations(
    tokenizer: Any, conversations: Sequence[Conversation]
) -> tuple[list[int], list[Example]]:
    """The conversations' shared prompt, and the rest of each with its answer."""
    end = tokenizer.eos_token_id
    rows = []
    for tools, messages, calls in conversations:
        prompt = tokenizer.apply_chat_template(
            list(messages), tools=list(tools), add_generation_prompt=True
        )
        answer = {"role": "assistant", "content": "", "tool_calls": list(calls)}
        full = tokenizer.apply_chat_template([*messages, answer], tools=list(tools))
        assert full[: len(prompt)] == prompt, "the answer extends the prompt"
        rows.append((full[: full.index(end, len(prompt)) + 1], len(prompt)))
    shared = 0
    while all(shared < first and tokens[shared] == rows[0][0][shared] for tokens, first in rows):
        shared += 1
    return rows[0][0][:shared], [(tokens[shared:], first - shared) for tokens, first in rows]


def _examples(tokenizer: Any, texts: Sequence[str], rng: random.Random) -> list[Example]:
    """JSON answers and tool calls after ordinary prompts, the first token given."""

    def encode(text: str) -> list[int]:
        ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
        return ids

    def cut(text: str) -> list[int]:
        # A grammar may force other splits than the canonical one: after `{` (its first
        # choice) the key's quote comes alone, and a value may close with a bare `"` (keys
        # keep `":`, so that a bare quote after `{` is not read as closing one).
        tokens = encode(text)
        if text.startswith('{"') and rng.random() < 0.7:
            tokens = encode("{") + encode(text[1:])
        if rng.random() < _SPLIT:
            closing = [
                i
                for i, token in enumerate(tokens[1:], 1)
                if texts[token][:1] == '"'
                and texts[token][1:2] not in ("", ":")
                and texts[tokens[i - 1]][-1:].isalnum()
            ]
            for i in reversed(closing):
                tokens[i : i + 1] = encode('"') + encode(texts[tokens[i]][1:])
        return tokens

    end = tokenizer.eos_token_id
    examples = []
    for i in range(_EXAMPLES + _CALL_EXAMPLES):
        content = rng.choice(_PROMPTS)
        if i < _EXAMPLES:
            answer = json.dumps(_json_object(rng, 0))
        elif rng.random() < 0.25:
            # Several calls when asked about a list of cities, as in the parallel conversation;
            # one call otherwise.
            cities = rng.sample(_VALUES, 2)
            content = f"What is the weather like in these cities: {json.dumps(cities)}?"
            calls = [{"name": "get_weather", "arguments": {"city": city}} for city in cities]
            answer = "\n".join(f"<tool_call>\n{json.dumps(call)}\n</tool_call>" for call in calls)
        else:
            answer = f"<tool_call>\n{json.dumps(_call(rng))}\n</tool_call>"
        messages = [{"role": "user", "content": content}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        examples.append(([*prompt, *cut(answer), end], len(prompt) + 1))
    rng.shuffle(examples)
    return examples


def _call(rng: random.Random) -> dict[str, Any]:
    """A call of the demo tool, or of another with any arguments (a grammar gives the name)."""
    if rng.random() < 0.5:
        return {"name": "get_weather", "arguments": {"city": rng.choice(_CITIES)}}
    return {"name": rng.choice(_KEYS), "arguments": _json_object(rng, 0)}


def _json_object(rng: random.Random, depth: int) -> dict[str, Any]:
    size = rng.choices((1, 2, 3), (7, 2, 1))[0]
    return {key: _json_value(rng, depth) for key in rng.sample(_KEYS, size)}


def _json_value(rng: random.Random, depth: int) -> Any:
    kind = rng.random()
    if depth == 0 and kind < 0.1:
        return _json_object(rng, 1)
    if depth == 0 and kind < 0.35:
        size = rng.choices((1, 2, 3), (14, 5, 1))[0]
        if rng.random() < 0.7:
            return [_string(rng) for _ in range(size)]
        return [_json_value(rng, 1) for _ in range(size)]
    kind = rng.random()
    if kind < 0.6:
        return _string(rng)
    if kind < 0.8:
        return rng.randrange(100) if rng.random() < 0.8 else rng.randrange(1000)
    if kind < 0.95:
        return rng.random() < 0.5
    return None


def _string(rng: random.Random) -> str:
    if rng.random() < 0.85:
        return rng.choice(_VALUES)
    return "".join(rng.choice(_ODD) for _ in range(rng.randint(1, 3)))
