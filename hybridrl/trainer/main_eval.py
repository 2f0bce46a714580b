"""`python -m hybridrl.trainer.main_eval [key=value ...]`: score generated responses offline.

    python -m hybridrl.trainer.main_eval data.path=out.parquet data.response_key=responses \\
        data.data_source_key=data_source data.reward_model_key=reward_model \\
        custom_reward_function.path=my_reward.py

Every response of every row is scored with the reward function of the row's data source (the
built-in scorers, or `custom_reward_function.path`). Per data source it prints and returns
mean@N (mean score), best@N (the best of the N responses: "any correct" for 0/1 scores) and
maj@N (the score of the majority answer; answers are the scorer's "pred" when it returns a dict
with one, else the response strings), using `hybridrl.utils.metrics.process_validation_metrics`.
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from hybridrl.trainer.offline.evaluation import CONFIG_DIR, EvalConfig, run_eval

if __name__ == "__main__":
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__)
        print((CONFIG_DIR / "evaluation.yaml").read_text())
        sys.exit(0)
    import hydra

    from hybridrl.trainer.sft.config import SFTConfigError, check_override_keys

    try:
        check_override_keys(sys.argv[1:], EvalConfig, "evaluation")
    except SFTConfigError as e:
        sys.exit(f"SFTConfigError: {e}")

    @hydra.main(config_path="config", config_name="evaluation", version_base=None)
    def _main(cfg: DictConfig) -> None:
        run_eval(cfg)

    _main()
