"""Write docs/reference/config.md: every config key of every entry point, from the typed schemas.

    python scripts/gen_config_reference.py           # rewrite the page
    python scripts/gen_config_reference.py --check   # exit 1 when the committed page is stale

The entry points are the `hybridrl/trainer/main_*.py` modules; each names its schema (a dataclass)
and its shipped yaml in its call of `hydra_cli` or `check_command_line`. For every key: the type
as annotated, the schema's default (and the shipped yaml's value where it differs: that is what a
run without that key gets), and the comment on the field in the schema (or in the yaml).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import io
import json
import sys
import textwrap
import tokenize
import typing
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reference" / "config.md"
CONFIG_DIR = ROOT / "hybridrl" / "trainer" / "config"
ENTRY_HELPERS = {"hydra_cli", "check_command_line"}


@dataclasses.dataclass
class Key:
    name: str
    type: str
    default: str
    yaml: str | None
    meaning: str


def entry_points() -> list[tuple[str, type, str]]:
    """(module, schema class, yaml name) of every main_*.py, read from its entry-helper call."""
    found = []
    for path in sorted((ROOT / "hybridrl" / "trainer").glob("main_*.py")):
        module = f"hybridrl.trainer.{path.stem}"
        mod = importlib.import_module(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ENTRY_HELPERS):
                continue
            names = [a.id for a in node.args if isinstance(a, ast.Name)]
            schema = next(
                (getattr(mod, n) for n in names if dataclasses.is_dataclass(getattr(mod, n, None))), None
            )
            yaml = next(
                (a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)), None
            )
            if schema is not None and yaml is not None:
                found.append((module, schema, yaml))
                break
        else:
            raise SystemExit(f"{path}: no hydra_cli/check_command_line call naming a schema and a yaml")
    return found


@cache
def field_comments(cls: type) -> dict[str, str]:
    """{field: comment} from the class source: the comment on the field's line, else the comment
    lines right above it; a field the class inherits takes its base class's comment."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(base):
            out.update({k: v for k, v in _own_field_comments(base).items() if v})
    out.update({k: v for k, v in _own_field_comments(cls).items() if v or k not in out})
    return out


def _own_field_comments(cls: type) -> dict[str, str]:
    """{field: comment} of the fields written in `cls` itself."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    src = textwrap.dedent("".join(lines))
    lines = src.splitlines()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    tree = ast.parse(src)
    out = {}
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            text = comments.get(node.end_lineno)
            if text is None:
                above, line = [], node.lineno - 1
                while line in comments and lines[line - 1].lstrip().startswith("#"):
                    above.insert(0, comments[line])
                    line -= 1
                text = " ".join(above)
            out[node.target.id] = text
    return out


def yaml_comments(name: str) -> dict[str, str]:
    """{dotted key: comment} of a shipped yaml (the comment on the key's line or right above)."""
    path = CONFIG_DIR / f"{name}.yaml"
    out, stack, pending = {}, [], []
    for raw in path.read_text().splitlines() if path.exists() else []:
        stripped = raw.strip()
        if not stripped or stripped.startswith("- "):
            pending = []
            continue
        indent = len(raw) - len(raw.lstrip())
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        if ":" not in stripped:
            continue
        key = stripped.split(":", 1)[0].strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        dotted = ".".join(k for _, k in stack)
        trailing = stripped.split(" #", 1)[1].strip() if " #" in stripped else ""
        out[dotted] = trailing or " ".join(pending) if indent > 0 else trailing
        pending = []
    return out


def yaml_values(name: str) -> dict[str, object]:
    from omegaconf import OmegaConf

    path = CONFIG_DIR / f"{name}.yaml"
    if not path.exists():
        return {}
    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    flat: dict[str, object] = {}

    def walk(node, prefix):
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            flat[prefix[:-1]] = node

    walk(cfg, "")
    return flat


def show(value) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return repr(value)


def default_of(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def keys(cls: type, prefix: str, yaml: dict, ycomments: dict) -> list[Key]:
    out = []
    hints = typing.get_type_hints(cls, include_extras=False) if cls.__module__ in sys.modules else {}
    comments = field_comments(cls)
    for f in dataclasses.fields(cls):
        if f.name.startswith("_"):
            continue
        name = f"{prefix}{f.name}"
        value = default_of(f)
        sub = value if dataclasses.is_dataclass(value) else None
        hinted = hints.get(f.name)
        if sub is None and isinstance(hinted, type) and dataclasses.is_dataclass(hinted):
            sub = hinted
        if sub is not None:
            out += keys(type(sub) if not isinstance(sub, type) else sub, f"{name}.", yaml, ycomments)
            continue
        shown = "required" if value is dataclasses.MISSING else show(value)
        in_yaml = show(yaml[name]) if name in yaml else None
        meaning = comments.get(f.name) or ycomments.get(name, "")
        typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        out.append(Key(name, typ, shown, in_yaml if in_yaml not in (None, shown) else None, meaning))
    return out


def cell(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated by `python scripts/gen_config_reference.py` from the typed config dataclasses; do not",
        "edit by hand (a test fails when this page is stale). Every key of every entry point: its type,",
        "its default in the schema (veRL's default where veRL has the key), the value the entry's shipped",
        "yaml gives it where that differs (a run that does not set the key gets that one), and the comment",
        "on the field. Set a key on the command line as `key=value`; [the configuration guide](../config.md)",
        "explains the keys that behave differently from veRL and the start-up checks.",
        "",
    ]
    entries = sorted(entry_points(), key=lambda e: (not e[0].endswith("main_ppo"), e[0]))
    first: dict[tuple[type, str], str] = {}
    for module, schema, yaml_name in entries:
        command = module.rsplit(".", 1)[-1]
        lines += [f"## {command}", ""]
        where = f"schema `{schema.__module__}.{schema.__name__}`, shipped yaml `hybridrl/trainer/config/{yaml_name}.yaml`"
        if (schema, yaml_name) in first:
            lines += [
                f"`python -m {module}`: {where}: the same keys as [{first[schema, yaml_name]}](#{first[schema, yaml_name]}).",
                "",
            ]
            continue
        first[schema, yaml_name] = command
        all_keys = keys(schema, "", yaml_values(yaml_name), yaml_comments(yaml_name))
        lines += [f"`python -m {module}`: {where}; {len(all_keys)} keys.", ""]
        sections: dict[str, list[Key]] = {}
        for k in all_keys:
            sections.setdefault(k.name.split(".")[0], []).append(k)
        for section, ks in sections.items():
            lines += [
                f"### {command}: `{section}`",
                "",
                "| key | type | default | meaning |",
                "|---|---|---|---|",
            ]
            for k in ks:
                default = f"`{cell(k.default, 60)}`" + (f" (yaml: `{cell(k.yaml, 40)}`)" if k.yaml else "")
                lines.append(f"| `{k.name}` | `{cell(k.type, 50)}` | {default} | {cell(k.meaning) or '-'} |")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the committed page differs")
    args = ap.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(
                f"{OUT.relative_to(ROOT)} is stale: run python scripts/gen_config_reference.py",
                file=sys.stderr,
            )
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}: {text.count(chr(10))} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
