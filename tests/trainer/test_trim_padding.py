import torch

from hybridrl.protocol import DataProto
from hybridrl.trainer.ppo_trainer import trim_left_padding


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
