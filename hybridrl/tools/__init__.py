"""veRL's tool API (`verl.tools.*`) under hybridrl's import path: change `verl.tools` to
`hybridrl.tools` in the import line and a veRL tool, tool yaml or function-tool file works as is.

- `base_tool.BaseTool`: the tool life cycle (create / execute / calc_reward / release).
- `schemas`: OpenAIFunctionToolSchema and friends (pydantic, as veRL's), ToolResponse.
- `function_tool`: veRL's `@function_tool` (schema from the Google docstring, or `schema=`), its
  registry and its return shapes.
- `tool_registry`: `initialize_tools_from_config` (yaml or json) and `load_all_tools`.

The classes are hybridrl's own (hybridrl.agent.tool), so tools written either way run in
the same agent loop.
"""
