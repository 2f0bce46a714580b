"""Tools for the agent loops: hybridrl's tool classes and veRL's tool API under hybridrl's path.

hybridrl's own:

- `tool`: `BaseTool` (the life cycle: create / execute / calc_reward / release), `@function_tool`,
  `ToolResponse`, schema checks.
- `tool_loading`: tools from a tool config file (yaml) and a `function_tool_path` file.
- `tool_runner`: every tool callback off the generation loop, each with a deadline.

veRL's tool API (`verl.tools.*`): change `verl.tools` to `hybridrl.tools` in the import line and a
veRL tool, tool yaml or function-tool file works as is.

- `base_tool.BaseTool`: the same class as `tool.BaseTool`.
- `schemas`: OpenAIFunctionToolSchema and friends (pydantic, as veRL's), ToolResponse.
- `function_tool`: veRL's `@function_tool` (schema from the Google docstring, or `schema=`), its
  registry and its return shapes.
- `tool_registry`: `initialize_tools_from_config` (yaml or json) and `load_all_tools`.

Tools written either way run in the same agent loop (hybridrl.agent), which sits above this package.
"""
