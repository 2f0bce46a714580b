"""veRL's tool schemas (`verl.tools.schemas`) under hybridrl's import path.

A tool written for veRL's newest tool API changes only its import line::

    from hybridrl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

The schema models are pydantic, as veRL's, with the same fields and attribute access
(`schema.function.name`); they also read like the plain dicts hybridrl's own tools use
(`schema["function"]["name"]`, `.get`), so both styles of tool code work on one object.
`ToolResponse` is hybridrl's (text, image, video), re-exported.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from hybridrl.tools.tool import ToolResponse

__all__ = [
    "OpenAIFunctionCallSchema",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionParsedSchema",
    "OpenAIFunctionPropertySchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolCall",
    "OpenAIFunctionToolSchema",
    "ToolResponse",
]


class _DictLike(BaseModel):
    """`model["key"]` / `model.get("key")` read the field, so dict-style tool code works unchanged."""

    def __getitem__(self, key: str) -> Any:
        if key not in type(self).model_fields:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in type(self).model_fields else default

    def __contains__(self, key: object) -> bool:
        return key in type(self).model_fields

    def keys(self) -> list[str]:
        return list(type(self).model_fields)


class OpenAIFunctionPropertySchema(_DictLike):
    """One parameter: its JSON type (a list for unions), description and allowed values."""

    type: str | list[str]
    description: str | None = None
    enum: list[Any] | None = None


class OpenAIFunctionParametersSchema(_DictLike):
    """The parameters object of a function schema."""

    type: str
    properties: dict[str, OpenAIFunctionPropertySchema]
    required: list[str] = Field(default_factory=list)


class OpenAIFunctionSchema(_DictLike):
    """name, description, parameters (an empty object by default) and OpenAI's `strict` flag."""

    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema = Field(
        default_factory=lambda: OpenAIFunctionParametersSchema(type="object", properties={}, required=[])
    )
    strict: bool = False


class OpenAIFunctionToolSchema(_DictLike):
    """`{"type": "function", "function": {...}}`, the shape given to the chat template's `tools=`."""

    type: str
    function: OpenAIFunctionSchema


class OpenAIFunctionParsedSchema(_DictLike):
    """A call as parsed from the model's text: the arguments still a JSON string."""

    name: str
    arguments: str


class OpenAIFunctionCallSchema(_DictLike):
    """A call with decoded arguments."""

    name: str
    arguments: dict[str, Any]

    @staticmethod
    def from_openai_function_parsed_schema(
        parsed_schema: OpenAIFunctionParsedSchema,
    ) -> tuple[OpenAIFunctionCallSchema, bool]:
        """Decode the arguments; (call with {} arguments, True) when they are not a JSON object."""
        try:
            arguments = json.loads(parsed_schema.arguments)
        except json.JSONDecodeError:
            return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments={}), True
        if not isinstance(arguments, dict):
            return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments={}), True
        return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments=arguments), False


class OpenAIFunctionToolCall(_DictLike):
    """A tool call in the OpenAI response shape."""

    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema
