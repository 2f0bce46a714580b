"""End-to-end through main_ppo (in-process backend, FSDP2, HF rollout): veRL's interaction yaml
with `extra_info.interaction_kwargs` rows, and a curriculum `data.sampler` that sees every
trained batch."""

from __future__ import annotations

import json

import pandas as pd

from hybridrl.data import agent_task
from tests.e2e.ppo_runs import assert_finite, run

INTERACTION_YAML = """\
interaction:
  - name: "gsm8k"
    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
    config: {correct_response: "ok", incorrect_response: "no"}
"""

SAMPLER_PY = '''
import json
from hybridrl.data.custom_sampler import AbstractCurriculumSampler


class RecordingCurriculum(AbstractCurriculumSampler):
    """Rows in order; update() writes what it was given to LOG."""

    def __iter__(self):
        return iter(range(len(self.data_source)))

    def __len__(self):
        return len(self.data_source)

    def update(self, batch):
        idx = [int(e["index"]) for e in batch.non_tensor_batch["extra_info"]]
        with open(LOG, "a") as f:
            f.write(json.dumps({"rows": len(batch), "index": sorted(set(idx)),
                                "turn_scores": [list(map(float, t)) for t in batch.non_tensor_batch["turn_scores"]]}) + "\\n")
'''


def test_interaction_and_curriculum_sampler_through_main_ppo(tmp_path):
    rows = agent_task.make_rl_rows(16, 0, "train")
    for r in rows:
        r["extra_info"]["interaction_kwargs"] = {
            "name": "gsm8k",
            "ground_truth": r["reward_model"]["ground_truth"],
        }
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    pd.DataFrame(rows[:8]).to_parquet(tmp_path / "val.parquet")
    (tmp_path / "interaction.yaml").write_text(INTERACTION_YAML)
    log = tmp_path / "updates.jsonl"
    (tmp_path / "curriculum.py").write_text(f"LOG = {str(log)!r}\n" + SAMPLER_PY)
    metrics = run(
        [
            "algorithm.adv_estimator=grpo",
            "trainer.backend=local",
            f"data.train_files={tmp_path}/train.parquet",
            f"data.val_files={tmp_path}/val.parquet",
            "data.return_raw_chat=true",
            "data.max_prompt_length=16",
            "data.max_response_length=64",
            f"data.sampler.class_path={tmp_path}/curriculum.py",
            "data.sampler.class_name=RecordingCurriculum",
            "data.dataloader_num_workers=0",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={tmp_path}/interaction.yaml",
            "actor_rollout_ref.rollout.multi_turn.max_user_turns=1",
            "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode=disable",
        ],
        tmp_path,
    )
    train = [r for r in metrics if "actor/pg_loss" in r]
    assert len(train) == 2
    assert_finite(train, ["actor/pg_loss", "num_turns/mean"])
    updates = [json.loads(line) for line in log.read_text().splitlines()]
    assert [u["rows"] for u in updates] == [16, 16]  # every trained batch (4 prompts x n=4), once
    assert [u["index"] for u in updates] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the sampler's own order
    # each trajectory that reached an assistant turn without a tool call got one interaction turn
    scores = [s for u in updates for s in u["turn_scores"]]
    assert sum(len(s) == 1 for s in scores) > 0 and all(len(s) <= 1 for s in scores)
