"""A local code sandbox (namespaces + rlimits) and its SandboxFusion-compatible front (`fusion`)."""

from hybridrl.sandbox.core import Sandbox, SandboxLimits, SandboxResult, SandboxUnavailable

__all__ = ["Sandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailable"]
