"""`python -m hybridrl.trainer.main_eval [key=value ...]`: score generated responses offline.

    python -m hybridrl.trainer.main_eval data.path=out.parquet data.response_key=responses \\
        data.data_source_key=data_source data.reward_model_key=reward_model \\
        custom_reward_function.path=my_reward.py

Every response of every row is scored with the reward function of the row's data source (the
built-in scorers, or `custom_reward_function.path`). Per data source it prints and returns
mean@N (mean score), best@N (the best of the N responses: "any correct" for 0/1 scores) and
maj@N (the score of the majority answer; answers are the scorer's "pred" when it returns a dict
with one, else the response strings), using `hybridrl.trainer.ppo.metrics.process_validation_metrics`.
"""

from __future__ import annotations

from hybridrl.trainer.offline.evaluation import EvalConfig, run_eval
from hybridrl.utils.cli import hydra_cli


def main() -> None:
    hydra_cli(__doc__, "evaluation", EvalConfig, run_eval)


if __name__ == "__main__":
    main()
