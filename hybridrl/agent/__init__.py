"""Multi-turn rollouts: agent loops (single_turn_agent, tool_agent), tools, tool-call parsers and
the batching queue that lets many trajectories share one rollout engine. See docs/agent.md."""
