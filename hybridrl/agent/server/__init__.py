"""The rollout server (`actor_rollout_ref.rollout.mode=server`): an OpenAI-compatible HTTP endpoint in
front of the rollout replicas, through which external agents generate the training trajectories."""
