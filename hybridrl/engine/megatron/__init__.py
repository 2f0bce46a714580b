"""The Megatron-core training engine (`strategy=megatron`); see docs/megatron.md.

Importing this package does not import megatron-core: each module imports it inside functions,
so hybridrl runs without the `megatron` extra until a role asks for strategy=megatron.
"""

from hybridrl.engine.megatron.engine import MegatronEngine  # noqa: E402  (registers "megatron")

__all__ = ["MegatronEngine"]
