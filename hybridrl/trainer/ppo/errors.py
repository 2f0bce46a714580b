"""The one error type of the PPO config stage."""


class ConfigError(ValueError):
    """A config problem found at start-up; the message names the key and the fix."""
