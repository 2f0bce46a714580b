import torch

from hybridrl.protocol import DataProto
from hybridrl.trainer.ppo.padding import trim_left_padding


def test_trim_left_padding_drops_only_all_pad_columns():
    ids = torch.tensor([[0, 0, 0, 5, 6], [0, 0, 7, 8, 9]])
    mask = (ids != 0).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = trim_left_padding(
        DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos})
    )
    assert out.batch["input_ids"].tolist() == [[0, 5, 6], [7, 8, 9]]
    assert out.batch["attention_mask"].tolist() == [[0, 1, 1], [1, 1, 1]]
    assert out.batch["position_ids"].tolist() == [[0, 0, 1], [0, 1, 2]]


def test_trim_left_padding_keeps_full_rows():
    ids = torch.tensor([[1, 2], [3, 4]])
    mask = torch.ones_like(ids)
    data = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1}
    )
    assert trim_left_padding(data).batch["input_ids"].tolist() == [[1, 2], [3, 4]]


def _rollout_batch():
    """2 rows, prompt width 2, response budget T=4; the longest response has 2 tokens."""
    prompts = torch.tensor([[0, 5], [6, 7]])
    responses = torch.tensor([[8, 9, 0, 0], [3, 0, 0, 0]])
    resp_mask = (responses != 0).long()
    attn = torch.cat([(prompts != 0).long(), resp_mask], 1)
    return DataProto.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "response_mask": resp_mask,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attn,
            "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
            "token_level_scores": torch.tensor([[0.0, 1.0, 0, 0], [0.5, 0, 0, 0]]),
            "reward_baselines": torch.tensor([0.1, 0.2]),
        }
    )


def test_trim_right_padding_cuts_response_aligned_tensors_to_the_longest_response():
    from hybridrl.trainer.ppo.padding import trim_right_padding

    out = trim_right_padding(_rollout_batch())
    b = out.batch
    assert b["responses"].tolist() == [[8, 9], [3, 0]]
    assert b["response_mask"].tolist() == [[1, 1], [1, 0]]
    assert b["token_level_scores"].tolist() == [[0.0, 1.0], [0.5, 0.0]]
    assert b["input_ids"].tolist() == [[0, 5, 8, 9], [6, 7, 3, 0]]
    assert b["attention_mask"].tolist() == [[0, 1, 1, 1], [1, 1, 1, 0]]
    assert b["position_ids"].tolist() == [[0, 0, 1, 2], [0, 1, 2, 2]]
    assert b["prompts"].tolist() == [[0, 5], [6, 7]]  # prompts are never cut
    assert b["reward_baselines"].shape == (2,)
    assert out.meta_info["max_response_length"] == 4  # the generation budget survives the cut


def test_trim_right_padding_keeps_a_full_width_batch_and_an_empty_response_column():
    from hybridrl.trainer.ppo.padding import trim_right_padding

    full = _rollout_batch()
    full.batch["attention_mask"][0, -1] = 1
    assert trim_right_padding(full).batch["responses"].shape == (2, 4)
    empty = _rollout_batch()
    empty.batch["attention_mask"][:, 2:] = 0
    assert trim_right_padding(empty).batch["responses"].shape == (2, 1)


def test_clip_ratio_metrics_use_the_configured_limits_after_trimming():
    from hybridrl.trainer.ppo.metrics import compute_data_metrics
    from hybridrl.trainer.ppo.padding import trim_right_padding

    batch = trim_right_padding(_rollout_batch())
    by_width = compute_data_metrics(batch, use_critic=False)
    assert by_width["response_length/clip_ratio"] == 0.5  # the trimmed width would call row 0 clipped
    m = compute_data_metrics(batch, use_critic=False, max_prompt_length=8, max_response_length=4)
    assert m["response_length/clip_ratio"] == 0.0 and m["prompt_length/clip_ratio"] == 0.0
    assert m["response_length/max"] == 2.0
