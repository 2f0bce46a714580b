"""`verl.tools.base_tool` under hybridrl's import path (see hybridrl.tools)."""

from hybridrl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from hybridrl.tools.tool import BaseTool

__all__ = ["BaseTool", "OpenAIFunctionToolSchema", "ToolResponse"]
