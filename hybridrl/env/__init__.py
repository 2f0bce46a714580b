"""Environments for agentic RL: the reset/step interface (base), episodes in their own processes
(host), the `env_agent` loop (loop) and the built-in guess-the-number game (guess_number)."""
