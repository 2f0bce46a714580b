"""Tools written against veRL's newest tool API (verl/tools/*), only the import line changed."""

from typing import Any
from uuid import uuid4

from hybridrl.tools.base_tool import BaseTool
from hybridrl.tools.function_tool import function_tool
from hybridrl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class AnswerCheckTool(BaseTool):
    """veRL style: schema declared by the class, create(create_kwargs=...) -> (id, ToolResponse)."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._state: dict[str, Any] = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        if getattr(self, "tool_schema", None) is not None:
            return self.tool_schema
        return OpenAIFunctionToolSchema.model_validate(
            {
                "type": "function",
                "function": {
                    "name": "check_answer",
                    "description": "Check an answer.",
                    "parameters": {
                        "type": "object",
                        "properties": {"answer": {"type": "string", "description": "the answer"}},
                        "required": ["answer"],
                    },
                },
            }
        )

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid4())
        self._state[instance_id] = kwargs.get("create_kwargs", {}).get("ground_truth")
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs
    ) -> tuple[ToolResponse, float, dict]:
        ok = str(parameters.get("answer")) == str(self._state[instance_id])
        name = self.tool_schema.function.name  # pydantic attribute access, as veRL tools do
        return ToolResponse(text=f"{name}: {'correct' if ok else 'wrong'}"), 1.0 if ok else 0.0, {"ok": ok}


@function_tool
def multiply(a: int, b: int) -> dict:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return {"product": a * b}


@function_tool("lookup")
def _lookup_impl(key: str) -> tuple:
    """Look a key up.

    Args:
        key: what to look up.
    """
    return f"value of {key}", 0.5, {"hits": 1}


@function_tool(
    schema={
        "type": "function",
        "function": {
            "name": "echo",
            "description": "Echo the text.",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string"}},
                "required": ["text"],
            },
        },
    }
)
def echo(text):
    return ToolResponse(text=text)
