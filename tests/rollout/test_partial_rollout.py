"""Partial rollout on HFRollout: an interrupted-and-resumed generation equals the uninterrupted one.

The interruption is the real one: HFRollout's stopping criterion asks `abort_requested` after
every decode step (here a step counter; in the async trainer a weight update sets it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rollout_testlib import AbortAfter, carry_partial, make_prompts, with_partial

from hybridrl.rollout import RolloutConfig, create_rollout
from hybridrl.rollout.resume import PARTIAL_KEYS, generate_resumable
from hybridrl.weight_sync import sync_weights

TEXTS = ["12+34=", "7+1=", "abc", "9"]
T = 12


def _rollout(tiny_model_dir, tokenizer, source_model, **kw):
    base = dict(name="hf", dtype="float32", prompt_length=8, response_length=T, load_format="dummy")
    base.update(kw)
    rollout = create_rollout(RolloutConfig(**base), tiny_model_dir, tokenizer, device="cpu")
    sync_weights(rollout, source_model.state_dict().items())
    return rollout


@pytest.mark.parametrize("ignore_eos", [True, False])
@pytest.mark.parametrize("micro", [None, 2])
def test_interrupted_greedy_equals_uninterrupted(tiny_model_dir, tokenizer, source_model, ignore_eos, micro):
    rollout = _rollout(
        tiny_model_dir,
        tokenizer,
        source_model,
        calculate_log_probs=True,
        ignore_eos=ignore_eos,
        log_prob_micro_batch_size_per_gpu=micro,
    )
    meta = {"validate": True}  # greedy
    plain = rollout.generate_sequences(make_prompts(tokenizer, TEXTS, meta))
    full = generate_resumable(rollout, with_partial(make_prompts(tokenizer, TEXTS, meta)), version=3)
    assert torch.equal(full.batch["responses"], plain.batch["responses"])  # fresh rows: the plain call
    assert all(full.non_tensor_batch["partial_done"])
    rollout.abort_requested = AbortAfter(4)
    part = generate_resumable(rollout, with_partial(make_prompts(tokenizer, TEXTS, meta)), version=3)
    assert rollout.last_generate_aborted
    assert not all(part.non_tensor_batch["partial_done"])
    lengths = part.batch["response_mask"].sum(-1).tolist()
    assert max(lengths) <= 5 and max(lengths) >= 1, lengths
    rollout.abort_requested = None
    resumed = generate_resumable(
        rollout, with_partial(make_prompts(tokenizer, TEXTS, meta), carry_partial(part)), 4
    )
    assert all(resumed.non_tensor_batch["partial_done"])
    assert torch.equal(resumed.batch["responses"], plain.batch["responses"])
    assert torch.equal(resumed.batch["response_mask"], plain.batch["response_mask"])
    assert torch.allclose(resumed.batch["rollout_log_probs"], plain.batch["rollout_log_probs"], atol=1e-5)
    # per-token versions: the prefix keeps version 3, the continuation is version 4, padding -1
    for i, n0 in enumerate(lengths):
        n = int(resumed.batch["response_mask"][i].sum())
        row = resumed.batch["rollout_versions"][i].tolist()
        assert row == [3] * n0 + [4] * (n - n0) + [-1] * (T - n), (i, row)
    assert not set(PARTIAL_KEYS[:3]) & set(resumed.non_tensor_batch)


def test_abort_twice_and_done_rows_pass_through(tiny_model_dir, tokenizer, source_model):
    rollout = _rollout(tiny_model_dir, tokenizer, source_model, ignore_eos=True)
    meta = {"validate": True}
    plain = rollout.generate_sequences(make_prompts(tokenizer, TEXTS, meta)).batch["responses"]
    cols = None
    for version in range(3):  # 3 + 3 tokens, then the rest
        rollout.abort_requested = AbortAfter(2) if version < 2 else None
        out = generate_resumable(rollout, with_partial(make_prompts(tokenizer, TEXTS, meta), cols), version)
        cols = carry_partial(out)
    assert torch.equal(out.batch["responses"], plain)
    assert out.batch["rollout_versions"][0].tolist() == [0] * 3 + [1] * 3 + [2] * (T - 6)
    # a done row is not generated again: its tokens and versions are kept as given
    cols["partial_done"][:] = True
    cols["partial_versions"][1] = [7] * T
    again = generate_resumable(rollout, with_partial(make_prompts(tokenizer, TEXTS, meta), cols), 9)
    assert torch.equal(again.batch["responses"], plain)
    assert again.batch["rollout_versions"][1].tolist() == [7] * T
    assert again.meta_info["metrics"]["rollout/num_response_tokens"] == 0


def test_unfinished_group_prefixes_round_trip():
    """The manager's bookkeeping: groups with an unfinished row come back with their prefixes."""
    from hybridrl.protocol import DataProto
    from hybridrl.rollout.resume import chunk_partial_columns, unfinished_group_prefixes

    responses = torch.tensor([[5, 6, 0], [7, 0, 0], [8, 9, 1], [0, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    versions = torch.where(mask.bool(), torch.tensor(3), torch.tensor(-1))
    out = DataProto.from_dict(
        {"responses": responses, "response_mask": mask, "rollout_versions": versions},
        {"partial_done": np.array([True, False, True, False], dtype=object)},
    )
    back = unfinished_group_prefixes(out, n=2)  # group 0: rows 0-1, group 1: rows 2-3
    assert set(back) == {0, 1} and "partial_done" not in out.non_tensor_batch
    assert back[0]["partial_response"].tolist() == [[5, 6], [7]]
    assert back[0]["partial_done"].tolist() == [True, False]
    assert back[1]["partial_versions"].tolist() == [[3, 3, 3], []]
    cols = chunk_partial_columns([None, back[0]], n=2)
    assert cols["partial_response"].tolist() == [[], [], [5, 6], [7]]
    assert cols["partial_done"].tolist() == [False, False, True, False]
    none = DataProto.from_dict(
        {"responses": responses[3:], "response_mask": mask[3:], "rollout_versions": versions[3:]},
        {"partial_done": np.array([False], dtype=object)},
    )
    assert unfinished_group_prefixes(none, n=1) == {0: None}  # no token yet: a fresh start
