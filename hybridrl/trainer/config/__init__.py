"""Hydra config files of the trainers (ppo_trainer.yaml, sft_trainer.yaml, ...)."""
