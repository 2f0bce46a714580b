"""hybridrl's typed config: the dataclasses every layer above reads, and their own checks.

Hydra/OmegaConf stay at the entry points; library code receives these validated dataclasses.
They import nothing above `utils` and `algos`, so an engine, a rollout, a reward manager or an
agent loop reads its section without importing the workers or the trainer.

- `roles`: the training roles' sections (`actor`, `ref`, `critic`, `model`, FSDP, optimizer,
  checkpoint) and their key names.
- `megatron`: the Megatron sections (`megatron`, MTP) and their validation.
- `batch`: `PerRankBatchSizes`, the per-rank sizes derived once on the driver.
- `rollout`: the `rollout` section (engine kwargs, sampling, multi-turn and agent sub-sections).
- `agent`: the `multi_turn` / agent-loop sections; `agent_server`: the agent HTTP server section.
"""
