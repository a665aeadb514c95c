"""What every built-in demo model's tokenizer is made from, and which tokens none of them picks.

`runner.demo_model` (the built-in model) and `runner.demo_families` (one per model family) train
their byte-level BPE on `CORPUS` and silence the same kinds of tokens (`silent_token_ids`).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

CONTEXT_LENGTH = 2048
"""The demo models' context, in tokens."""

# Written for the demo models. The text only has to give BPE enough words to merge.
CORPUS = (
    "An orchard is a patient place. The trees are planted in straight rows, and for the first "
    "few years they give almost nothing back. The grower prunes them in winter, when the "
    "branches are bare and the shape of each tree is easy to read. Cut too much and the tree "
    "throws up a forest of water shoots; cut too little and the fruit hangs in the shade, small "
    "and sour. Good pruning lets light reach every leaf.",
    "In spring the blossom opens over a week or two, white and pale pink, and the bees come. "
    "A late frost on a clear night can ruin a whole year, so growers watch the sky and the "
    "thermometer. Some run fans or sprinklers until morning. When the petals fall, tiny green "
    "fruit are left behind, far more than the tree can carry, and the grower thins them by "
    "hand so that the rest can grow large and sweet.",
    "Summer is for waiting and watching. Apples and pears swell slowly; cherries and plums "
    "ripen first. Birds, wasps and mildew all want a share. The grass between the rows is cut "
    "short, the irrigation lines are checked, and the props go under the heaviest branches so "
    "they do not split. A good grower walks the rows every day and learns to read the trees "
    "the way a sailor reads the wind.",
    "Harvest comes in autumn. Pickers move along the rows with ladders and canvas bags, "
    "twisting each apple upward so the stem stays on. The fruit goes into wooden bins, then "
    "into cold storage, where it can keep for months. Windfalls go to the cider press. By "
    "November the leaves are gone, the ground is quiet, and the cycle starts again with the "
    "pruning saw.",
    "A computer network can work a little like an orchard. Each machine is a tree with its own "
    "strength, its own memory and its own speed. A gateway in the middle takes the requests, "
    "decides which machine should answer, and sends the words back as they are produced, one "
    "token at a time. When a machine goes away, the others carry on. When a new one joins, "
    "it says hello, names the models it can serve, and starts to work.",
    "Language models read a prompt and guess the next token, again and again, until they reach "
    "a stop sequence or a limit. Small models are fast and often wrong; large models are slow "
    "and usually better. This little model was never trained at all. Its weights are random "
    "numbers, so it writes nonsense, but it writes the same nonsense every time, and it does so "
    "very quickly, which is exactly what a test needs.",
    "Questions and answers, lists and numbers: one, two, three, four, five, six, seven, eight, "
    "nine, ten. Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. January, "
    "February, March, April, May, June, July, August, September, October, November, December. "
    "Red, orange, yellow, green, blue, indigo, violet. North, south, east and west. "
    "Hello, world! How are you today? I am fine, thank you. What time is it? It is half past "
    "ten (10:30), and the price is $4.99 or 5%. Email me at someone@example.com; see "
    "https://example.com/path?query=1 for details. def main() -> None: print('hi')",
    # JSON and tool calls, so that they take few tokens (`{"`, `":`, ` "`, `"}}` merge).
    "Tools and structured answers. A model can call a function: it writes a json object with "
    "the function name and its arguments, and the gateway hands the call to the client. The "
    'tools come as {"type": "function", '
    '"function": {"name": "get_weather", "description": "Get the current weather in a city.", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string", '
    '"description": "The name of the city."}}, "required": ["city"]}}}, and a call reads '
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>. '
    'Answers in JSON: {"name": "pear", "count": 3, "ripe": true}, {"id": 12, "tags": ["red", '
    '"sweet"], "price": 4.99, "note": null}, [1, 2, 3], {"city": "London", "day": "Monday", '
    '"rain": false}, {"items": [{"type": "apple", "size": "small"}, {"type": "plum", "size": '
    '"large"}], "ok": true, "error": null}, {"note": "sweet", "count": 2, "city": "Paris"}, '
    '{"city": "London", "note": "Paris", "count": 5}, {"name": "London", "tags": ["sweet"]}.',
)


def silent_token_ids(tokenizer: Tokenizer, markers: Collection[str]) -> list[int]:
    """Tokens a model should never pick by itself: `markers`, and bytes that are not text.

    A lone byte of a multi-byte character decodes to U+FFFD; control characters other than
    newline and tab would only garble a terminal.
    """
    silent = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if text in markers or any(
            char == "\ufffd" or (unicodedata.category(char) == "Cc" and char not in "\n\t")
            for char in text
        ):
            silent.append(token_id)
    return silent
