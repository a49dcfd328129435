"""The shard layout line of the event-log header, and the checkpoints a rank count cannot split."""

from __future__ import annotations

import pytest

from ledgerserve.shared.tp_layout import SPLIT_RULE, tp_layout

QWEN3_DEMO = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 384}


def test_one_rank_splits_nothing():
    assert tp_layout(QWEN3_DEMO, 1) == ""


def test_kv_heads_split_when_the_ranks_divide_them():
    line = tp_layout(QWEN3_DEMO, 2)
    assert line == f"tp=2 {SPLIT_RULE}; heads 4 -> 2/rank; kv heads 2 -> 1/rank (split)"


def test_kv_heads_replicated_when_there_are_fewer_than_ranks():
    line = tp_layout(QWEN3_DEMO, 4)
    assert line.endswith("heads 4 -> 1/rank; kv heads 2 -> 1/rank (each on 2 ranks: replicated)")


@pytest.mark.parametrize(
    ("hf_config", "num_ranks", "words"),
    [
        (QWEN3_DEMO, 3, "does not divide the model's num_attention_heads (4)"),
        ({**QWEN3_DEMO, "intermediate_size": 385}, 2, "intermediate_size (385)"),
        ({"num_attention_heads": 12, "num_key_value_heads": 3, "intermediate_size": 96}, 4, "one must divide"),
        ({"max_position_embeddings": 4096}, 2, "has no num_attention_heads, intermediate_size"),
        (QWEN3_DEMO, 0, "must be >= 1"),
    ],
)
def test_a_split_the_ranks_cannot_make_is_refused(hf_config, num_ranks, words):
    with pytest.raises(ValueError, match="--tensor-parallel-size") as info:
        tp_layout(hf_config, num_ranks)
    assert words in str(info.value)
