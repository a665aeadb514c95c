"""What each demo layout can split into and the choice of split (runner.group.split)."""

from __future__ import annotations

import pytest

from runner.demo_model import DEMO_MODEL_ID, DEMO_PIPELINE_MODEL_ID
from runner.group import GroupError, split

# --- the split ------------------------------------------------------------------------------


@pytest.mark.usefixtures("demo_model_path")  # the session's copy, not a build of its own
def test_what_each_demo_layout_can_split_into() -> None:
    llama = split.supported(split.model_path(DEMO_MODEL_ID), 2)
    assert llama == {
        "pipeline": "mlx-lm's llama model has no pipeline stages",
        "tensor": "num_key_value_heads (3) not divisible by 2",
    }
    qwen2 = split.model_path(DEMO_PIPELINE_MODEL_ID)
    assert split.supported(qwen2, 2) == {
        "pipeline": None,
        "tensor": "num_key_value_heads (3) not divisible by 2",
    }
    assert split.supported(qwen2, 5)["pipeline"] == "4 layers cannot make 5 stages"
    assert split.supported(qwen2, 3) == {
        "pipeline": None,
        "tensor": "intermediate_size (128) not divisible by 3",
    }


def test_choose_split() -> None:
    both: dict[str, str | None] = {"pipeline": None, "tensor": None}
    assert split.choose("auto", both, "ring") == "pipeline"
    assert split.choose("auto", both, "jaccl") == "tensor"
    assert split.choose("auto", {"pipeline": "no", "tensor": None}, "ring") == "tensor"
    assert split.choose("tensor", both, "ring") == "tensor"
    with pytest.raises(GroupError, match="cannot split the model by tensor: heads"):
        split.choose("tensor", {"pipeline": None, "tensor": "heads"}, "ring")
    with pytest.raises(GroupError, match="pipeline: a; tensor: b"):
        split.choose("auto", {"pipeline": "a", "tensor": "b"}, "ring")
