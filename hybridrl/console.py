"""Console commands installed with the package, each the same as its `python -m` module.

    hybridrl-ppo       python -m hybridrl.trainer.main_ppo          PPO, GRPO and relatives
    hybridrl-async     python -m hybridrl.trainer.main_async        asynchronous (AReaL-style) PPO
    hybridrl-sft       python -m hybridrl.trainer.main_sft          supervised fine-tuning
    hybridrl-rm        python -m hybridrl.trainer.main_rm           reward-model training on preference pairs
    hybridrl-dpo       python -m hybridrl.trainer.main_dpo          DPO, IPO, SimPO on preference pairs
    hybridrl-generate  python -m hybridrl.trainer.main_generation   N responses per prompt, to parquet
    hybridrl-eval      python -m hybridrl.trainer.main_eval         score generated responses offline
    hybridrl-merge     python -m hybridrl.model_merger              checkpoint -> Hugging Face model

Every command takes the same arguments as its module (`key=value` overrides; `--help`). The trainers
return their metrics to Python callers; as commands they exit 0 after a run, as `python -m` does.
"""

from __future__ import annotations

import importlib

# command -> the module that `python -m` runs; tests/test_console.py checks pyproject.toml against it
COMMANDS = {
    "hybridrl-ppo": "hybridrl.trainer.main_ppo",
    "hybridrl-async": "hybridrl.trainer.main_async",
    "hybridrl-sft": "hybridrl.trainer.main_sft",
    "hybridrl-rm": "hybridrl.trainer.main_rm",
    "hybridrl-dpo": "hybridrl.trainer.main_dpo",
    "hybridrl-generate": "hybridrl.trainer.main_generation",
    "hybridrl-eval": "hybridrl.trainer.main_eval",
    "hybridrl-merge": "hybridrl.model_merger",
}


def _run(module: str) -> int:
    mod = importlib.import_module(module)
    if module == "hybridrl.model_merger":
        return mod.main()  # argparse: its own exit status
    mod.main()
    return 0


def ppo() -> int:
    return _run(COMMANDS["hybridrl-ppo"])


def async_ppo() -> int:
    return _run(COMMANDS["hybridrl-async"])


def sft() -> int:
    return _run(COMMANDS["hybridrl-sft"])


def reward_model() -> int:
    return _run(COMMANDS["hybridrl-rm"])


def dpo() -> int:
    return _run(COMMANDS["hybridrl-dpo"])


def generation() -> int:
    return _run(COMMANDS["hybridrl-generate"])


def evaluation() -> int:
    return _run(COMMANDS["hybridrl-eval"])


def model_merger() -> int:
    return _run(COMMANDS["hybridrl-merge"])
