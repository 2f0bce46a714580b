"""`code_interpreter(code)`: the policy's Python code run in the local code sandbox.

The tool takes the schema and the config keys of veRL's SandboxFusion tool, so a veRL tool yaml
changes its `class_name` to `hybridrl.tools.code_tool.CodeSandboxTool` and drops
`sandbox_fusion_url`:

    tools:
      - class_name: hybridrl.tools.code_tool.CodeSandboxTool
        config: {default_timeout: 5, memory_limit_mb: 512, num_workers: 8, isolation: true}

`isolation: false` runs without namespaces (the sandbox says so in the log); on a machine without
them the tool refuses to start otherwise. The response is the program's stdout, then its stderr,
cut to `max_output_chars`; a run that passes its time limit says so.
"""

from __future__ import annotations

from typing import Any

from hybridrl.sandbox import Sandbox, SandboxLimits
from hybridrl.tools.tool import BaseTool, ToolResponse

__all__ = ["CODE_INTERPRETER_SCHEMA", "CodeSandboxTool"]

CODE_INTERPRETER_SCHEMA = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run Python code and see what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the Python program to run"}},
            "required": ["code"],
        },
    },
}
_KEYS = {
    "default_timeout",
    "memory_limit_mb",
    "num_workers",
    "default_language",
    "isolation",
    "max_output_chars",
}


class CodeSandboxTool(BaseTool):
    """Runs `code` in a `Sandbox`; reward 0 per call (score the trajectory with a reward function)."""

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: Any = None) -> None:
        super().__init__(config or {}, tool_schema or CODE_INTERPRETER_SCHEMA)
        cfg = self.config
        if "sandbox_fusion_url" in cfg:
            raise ValueError(
                "CodeSandboxTool runs code in the local sandbox: remove `sandbox_fusion_url` from its config "
                "(to use a SandboxFusion service, run `python -m hybridrl.sandbox.fusion` or keep the service "
                "and its own tool)"
            )
        unknown = sorted(set(cfg) - _KEYS)
        if unknown:
            raise ValueError(f"CodeSandboxTool config: unknown keys {unknown}; known: {sorted(_KEYS)}")
        if cfg.get("default_language", "python") not in ("python", "python3"):
            raise ValueError(
                f"CodeSandboxTool runs Python only; default_language={cfg['default_language']!r}"
            )
        timeout = float(cfg.get("default_timeout", 10))
        limits = SandboxLimits(
            wall_time_s=timeout,
            cpu_time_s=max(1, int(timeout + 0.999)),
            memory_mb=int(cfg.get("memory_limit_mb", 1024)),
        )
        self.max_output_chars = int(cfg.get("max_output_chars", 2000))
        self.sandbox = Sandbox(
            limits, isolation=bool(cfg.get("isolation", True)), max_concurrent=int(cfg.get("num_workers", 8))
        )

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        code = parameters.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ValueError(
                f"code_interpreter needs the argument 'code' (a string); got {sorted(parameters)}"
            )
        result = await self.sandbox.arun_python(code)
        text = result.stdout + result.stderr
        if result.status != "Finished":
            text += f"\n[{result.status}]"
        if len(text) > self.max_output_chars:
            text = text[: self.max_output_chars] + "\n[output cut]"
        metrics = {
            "status": result.status,
            "return_code": result.return_code,
            "wall_time_s": result.wall_time_s,
        }
        return ToolResponse(text=text), 0.0, metrics
