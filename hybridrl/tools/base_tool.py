"""`verl.tools.base_tool` under hybridrl's import path (see hybridrl.tools)."""

from hybridrl.agent.tool import BaseTool
from hybridrl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["BaseTool", "OpenAIFunctionToolSchema", "ToolResponse"]
