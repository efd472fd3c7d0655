"""Bad model input gets a clear error instead of an AttributeError deep inside a forward pass."""

from __future__ import annotations

import pytest
from transformers import BertConfig, BertForSequenceClassification

from refppo.errors import ShapeError
from refppo.models.roles import RewardModel
from refppo.models.tiny import tiny_reward_model


def test_reward_model_without_a_per_position_score_head_is_refused() -> None:
    # BERT's classifier pools the first token: there is no per-position `score` head to read at
    # each row's last real token.
    cfg = BertConfig(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=1,
    )
    with pytest.raises(ShapeError, match=r"per-position `score` head .* got BertForSequenceClassification"):
        RewardModel(BertForSequenceClassification(cfg))
    assert isinstance(tiny_reward_model("gpt2", 32), RewardModel)  # the supported kind still loads
