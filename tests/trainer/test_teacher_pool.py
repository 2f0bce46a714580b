"""The separate teacher pool's row split (trainer/ppo/teacher_pool.py) with plain replica objects;
the real pool (its own Ray processes) is tests/e2e/test_distillation_e2e.py."""

from __future__ import annotations

import torch

from hybridrl.protocol import DataProto
from hybridrl.trainer.ppo.teacher_pool import TeacherReplicas
from hybridrl.utils.batch_ops import row_parts


class Replica:
    """Answers each row's log-prob as its row id (column 0 of `responses`), and records what it saw."""

    world_size = 1

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        rows = data.batch["responses"][:, 0]
        self.seen.append(rows.tolist())
        return DataProto.from_dict({"ref_log_prob": rows[:, None].float().expand(-1, 3).clone()})


def test_row_parts_cover_the_rows_in_order():
    assert row_parts(5, 2) == [(0, 3), (3, 5)]
    assert row_parts(2, 4) == [(0, 1), (1, 2)]  # more replicas than rows: no empty part
    assert row_parts(0, 2) == []


def test_rows_split_across_replicas_and_come_back_in_row_order():
    replicas = [Replica(), Replica(), Replica()]
    data = DataProto.from_dict({"responses": torch.arange(7)[:, None].repeat(1, 3)})
    out = TeacherReplicas(replicas).compute_ref_log_prob(data)
    assert out.batch["ref_log_prob"][:, 0].tolist() == list(range(7))
    assert [r.seen for r in replicas] == [[[0, 1, 2]], [[3, 4]], [[5, 6]]]
    one = Replica()
    TeacherReplicas([one, Replica()]).compute_ref_log_prob(data.slice(0, 1))
    assert one.seen == [[0]]
