"""The command-line shape shared by the Hydra entry points (`python -m hybridrl.trainer.main_*`).

`-h`/`--help` prints the entry's docstring and its shipped yaml; every `key=value` on the command
line is checked against the typed schema first (unknown keys fail naming the key and the closest
known ones, where Hydra alone would say "not in struct"); then Hydra composes the yaml with the
overrides and calls `run(cfg)`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridrl.utils.config_loader import ConfigError, check_override_keys

CONFIG_DIR = Path(__file__).resolve().parent.parent / "trainer" / "config"


def wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def print_help(doc: str | None, config_name: str) -> None:
    print(doc or "")
    print((CONFIG_DIR / f"{config_name}.yaml").read_text())


def check_command_line(
    argv: list[str], schema_cls: type, config_name: str, also_known: Callable[[str], bool] | None = None
) -> None:
    """Exit with `ConfigError: ...` when a command-line key is not in `schema_cls` (nor `also_known`)."""
    try:
        check_override_keys(argv, schema_cls, f"hybridrl/trainer/config/{config_name}.yaml", also_known)
    except ConfigError as e:
        sys.exit(f"ConfigError: {e}")


def hydra_cli(
    doc: str | None,
    config_name: str,
    schema_cls: type,
    run: Callable[[Any], Any],
    also_known: Callable[[str], bool] | None = None,
) -> None:
    """Run one Hydra entry point: help, command-line key check, compose, `run(cfg)`."""
    import hydra

    argv = sys.argv[1:]
    if wants_help(argv):
        print_help(doc, config_name)
        sys.exit(0)
    check_command_line(argv, schema_cls, config_name, also_known)

    @hydra.main(config_path=str(CONFIG_DIR), config_name=config_name, version_base=None)
    def _main(cfg) -> None:
        run(cfg)

    _main()
