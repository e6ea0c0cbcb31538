"""Per-token provenance in training: resumed samples and stale-token masking (pure tensors, no model)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flexmarl.errors import InvalidArgument
from flexmarl.experience import ExperienceRecord, version_spans_array
from traind import losses
from traind.batches import pack_micro_batch
from traind.losses import LossAggregation, PolicyLossConfig

# A sample interrupted twice: tokens 0-1 by version 3, 2-3 by version 4, 4 by version 6.
SPANS = [(0, 3), (2, 4), (4, 6)]
BEHAVIOR = [-0.1, -0.2, -0.3, -0.4, -0.5]


def _record(spans: list[tuple[int, int]] | None = SPANS, behavior_version: int = 3) -> ExperienceRecord:
    return ExperienceRecord(
        experience_id="job-1/0/0/0/a/0", job_id="job-1", agent="a", task_id="job-1/0/0", group_id="job-1/0/0/a",
        sample_index=0, episode_id="job-1/0/0/0", turn=0, behavior_version=behavior_version, reward=1.0,
        prompt_token_ids=np.asarray([1, 2], dtype=np.int32),
        response_token_ids=np.asarray([5, 6, 7, 8, 9], dtype=np.int32),
        response_logprobs=np.asarray(BEHAVIOR, dtype=np.float32), group_size=2,
        **({"response_version_spans": version_spans_array(spans)} if spans is not None else {}),
    )


def test_version_spans_round_trip_and_old_records_read_as_one_span() -> None:
    record = ExperienceRecord.from_proto(_record().to_proto())
    assert record.response_version_spans.tolist() == [list(span) for span in SPANS]
    assert record.token_versions().tolist() == [3, 3, 4, 4, 6]
    old = ExperienceRecord.from_proto(_record(spans=None).to_proto())  # written without spans
    assert old.response_version_spans.shape == (0, 2) and old.token_versions().tolist() == [3] * 5


@pytest.mark.parametrize("spans", [[(1, 3)], [(0, 3), (0, 4)], [(0, 4), (2, 5)], [(0, 3), (2, 2)], [(0, 3), (5, 4)]])
def test_malformed_version_spans_are_rejected(spans: list[tuple[int, int]]) -> None:
    with pytest.raises(InvalidArgument, match="response_version_spans"):
        ExperienceRecord.from_proto(_record(spans).to_proto())


def test_a_resumed_sample_is_trained_on_each_tokens_own_behaviour_logprob() -> None:
    packed = pack_micro_batch([_record()], [1.0])
    # Prompt of 2: logits[:, 1 + i] predict response token i.
    assert packed.behavior_logprobs[0, 1:6].tolist() == pytest.approx(BEHAVIOR)
    assert packed.response_mask[0].tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    current = torch.full((1, 6), -0.25, dtype=torch.float64)
    terms = losses.policy_loss_per_token(current, packed.behavior_logprobs, packed.advantages, packed.response_mask,
                                         PolicyLossConfig(clip_eps_low=0.9, clip_eps_high=0.9))
    expected = [math.exp(-0.25 - b) for b in BEHAVIOR]  # one ratio per token, against its own version's logprob
    assert terms.ratio[0, 1:6].tolist() == pytest.approx(expected, rel=1e-6)


def test_masked_stale_tokens_contribute_nothing() -> None:
    # Training version 7 with max_staleness 2: tokens of versions < 5 are masked, only token 4 trains.
    packed = pack_micro_batch([_record()], [1.0], min_token_version=5)
    assert packed.response_mask[0].tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert packed.stale_tokens == 4
    current = torch.full((1, 6), -0.45, dtype=torch.float64, requires_grad=True)
    terms = losses.policy_loss_per_token(current, packed.behavior_logprobs, packed.advantages, packed.response_mask,
                                         PolicyLossConfig())
    total = losses.aggregate_sum(terms.loss, packed.response_mask, LossAggregation.TOKEN_MEAN)
    (grad,) = torch.autograd.grad(total, current)
    assert grad[0, :5].abs().sum().item() == 0.0 and grad[0, 5].item() != 0.0
    alone = -math.exp(-0.45 + 0.5)  # the trained token's term: A = 1, its ratio inside the clip range
    assert total.item() == pytest.approx(alone, rel=1e-6)
    # The token count the step normaliser is checked against counts only the trained tokens.
    assert int(packed.response_mask.sum().item()) == 1
    # No bound: nothing masked.
    assert pack_micro_batch([_record()], [1.0]).stale_tokens == 0
    assert losses.stale_token_mask(torch.tensor([3, 4, 6]), 4).tolist() == [0.0, 1.0, 1.0]
