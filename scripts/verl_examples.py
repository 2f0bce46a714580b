"""Measure how many of veRL's own launch scripts pass hybridrl's config stage unchanged.

Each `examples/**/*.sh` of a veRL checkout runs under bash with recording stand-ins for
`python`/`python3` (and `ray job submit ... -- python3 ...`, `uv run ... python3`, `torchrun`) first on PATH: the
stand-in writes its argv to a file and exits 0, so nothing trains and nothing is downloaded.
Every recorded `-m verl.trainer.main_ppo` call then goes through hybridrl's config stage exactly
as `python -m hybridrl.trainer.main_ppo <the same overrides>` would: Hydra compose of hybridrl's
ppo_trainer.yaml with the overrides, the typed schema merge, start-up validation and the
driver-side per-rank batch checks. No Ray, no model, no training. `--show-failures` also names
the overrides veRL's own Hydra config (the checkout's verl/trainer/config) refuses for a script.

A script that calls `--config-path/--config-name` with one of its own yaml files (which extends
veRL's ppo_trainer.yaml) has that file's keys applied first, as overrides.

Scripts that use Megatron (a `*.megatron.*` key, `strategy=megatron`, `ppo_megatron_trainer`)
or images (VLM models, `image_key`, geo3k) are counted apart, as the issue asks. A missing data
file or model is not a config failure (this machine has no GSM8K); it is replaced by an empty placeholder (the report lists where).
The same holds for a path a script requires from its user without a default (`DIST_CKPT_PATH`, the Megatron
checkpoint of the Moonlight script): it is set to an empty folder.

Usage:
    python scripts/verl_examples.py --verl /path/to/verl [--json out.json] [--show-failures] [--only REGEX]
`--verl` may be a work tree or a bare git directory (the `fetch` tool's mirror; its HEAD is
extracted to a temporary folder).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SHIM = r"""#!/usr/bin/env bash
# Recording stand-in: append this call's argv (one JSON list per line) and succeed.
# A probe for Ascend's torch_npu fails, as the real python does here (scripts pick DEVICE=npu from it).
if [ "$1" = "-c" ] && [[ "$2" == *torch_npu* ]]; then exit 1; fi
python_real="__PYTHON__"
"$python_real" -c 'import json,sys; print(json.dumps(sys.argv[1:]))' "$(basename "$0")" "$@" >> "$H13_RECORD"
exit 0
"""
RAY_SHIM = r"""#!/usr/bin/env bash
# `ray job submit [opts] -- cmd ...` runs cmd (which hits the python stand-in); other ray calls no-op.
if [ "$1" = "job" ] && [ "$2" = "submit" ]; then
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do shift; done
  shift
  exec "$@"
fi
exit 0
"""
UV_SHIM = r"""#!/usr/bin/env bash
# `uv run [opts] python3 ...` runs python3 ... (the python stand-in); other uv calls no-op.
if [ "$1" = "run" ]; then
  while [ $# -gt 0 ] && [ "$1" != "python" ] && [ "$1" != "python3" ]; do shift; done
  [ $# -gt 0 ] && exec "$@"
fi
exit 0
"""
NOOPS = (
    "nvidia-smi",
    "huggingface-cli",
    "hf",
    "wget",
    "curl",
    "pip",
    "pip3",
    "modelscope",
    "sleep",
    "npu-smi",
)
ENTRY = "verl.trainer.main_ppo"
MEGATRON = re.compile(r"megatron", re.I)
IMAGE = re.compile(
    r"(image_key|[-_/.]vl[-_/.0-9]|_vl\b|geo3k|glm41v|glm-4\.1v|minicpm-?o|vlm|multimodal)", re.I
)


def extract_checkout(verl: Path, rev: str | None = None) -> Path:
    """A work tree of `verl` at `rev` (None: the work tree itself, or a bare directory's HEAD)."""
    if (verl / "examples").is_dir() and rev is None:
        return verl
    out = Path(tempfile.mkdtemp(prefix="verl_src_"))
    git_dir = verl / ".git" if (verl / ".git").exists() else verl
    archive = subprocess.run(
        ["git", f"--git-dir={git_dir}", "archive", rev or "HEAD"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


def make_shims(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("python", "python3", "torchrun"):
        p = folder / name
        p.write_text(SHIM.replace("__PYTHON__", sys.executable))
        p.chmod(0o755)
    (folder / "ray").write_text(RAY_SHIM)
    (folder / "ray").chmod(0o755)
    (folder / "uv").write_text(UV_SHIM)
    (folder / "uv").chmod(0o755)
    for name in NOOPS:
        (folder / name).write_text("#!/usr/bin/env bash\nexit 0\n")
        (folder / name).chmod(0o755)


def record_script(script: Path, root: Path, shims: Path, home: Path) -> list[list[str]]:
    """Run `script` with the stand-ins; returns the argv lists of every python call it made."""
    record = home / "record.jsonl"
    record.write_text("")
    env = {
        "PATH": f"{shims}:{os.environ['PATH']}",
        "HOME": str(home),
        "H13_RECORD": str(record),
        "LANG": "C.UTF-8",
        # paths a script requires from the user (no default in the script): an empty stand-in folder
        "DIST_CKPT_PATH": str(home / "dist_ckpt"),
    }
    try:
        subprocess.run(
            ["bash", str(script)], cwd=root, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pass
    return [json.loads(line) for line in record.read_text().splitlines() if line.strip()]


def split_call(argv: list[str]) -> tuple[list[str], str | None, str | None] | None:
    """(overrides, config_path, config_name) of a main_ppo call, or None for another program."""
    args = argv[1:]
    if ENTRY not in args and not any(a.endswith("verl/trainer/main_ppo.py") for a in args):
        return None
    idx = next(i for i, a in enumerate(args) if a == ENTRY or a.endswith("main_ppo.py"))
    rest, overrides = args[idx + 1 :], []
    cpath = cname = None
    i = 0
    while i < len(rest):
        a = rest[i]
        for flag in ("--config-path", "--config-name"):
            if a == flag and i + 1 < len(rest):
                val, i = rest[i + 1], i + 1
            elif a.startswith(flag + "="):
                val = a.split("=", 1)[1]
            else:
                continue
            if flag == "--config-path":
                cpath = val
            else:
                cname = val
            break
        else:
            if "=" in a or a.startswith("~"):
                overrides.append(a)
        i += 1
    return overrides, cpath, cname


def yaml_overrides(root: Path, script: Path, cpath: str | None, cname: str | None) -> list[str]:
    """The keys a script's own --config-name yaml sets (veRL's own ppo_trainer/megatron: none)."""
    from omegaconf import OmegaConf

    if not cname or cname.removesuffix(".yaml") in ("ppo_trainer", "ppo_megatron_trainer"):
        return []
    base = Path(cpath) if cpath else root / "verl/trainer/config"
    if not base.is_absolute():
        base = (script.parent / base) if (script.parent / base).is_dir() else root / base
    f = base / (cname if cname.endswith(".yaml") else cname + ".yaml")
    if not f.exists():
        return [f"__missing_config__={cname}"]
    cfg = OmegaConf.load(f)
    body = {k: v for k, v in OmegaConf.to_container(cfg).items() if k not in ("defaults", "hydra")}
    out = []

    def walk(node, prefix):
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and v:
                walk(v, key + ".")
            else:
                out.append(f"{key}={json.dumps(v) if not isinstance(v, str) else v}")

    walk(body, "")
    return out


def categorise(script: Path, overrides: list[str], cname: str | None) -> str:
    """image (VLM on FSDP), image_megatron, megatron_ep (Megatron with expert parallelism > 1),
    megatron, or text (FSDP)."""
    text = " ".join(overrides) + f" {script} {cname or ''}"
    if IMAGE.search(text):
        return "image_megatron" if MEGATRON.search(text) else "image"
    if MEGATRON.search(text):
        return "megatron_ep" if needs_expert_parallel(overrides) else "megatron"
    return "text"


def is_opd(overrides: list[str]) -> bool:
    """Whether a launch turns on-policy distillation on (`distillation.enabled=True`)."""
    return any(o.partition("=")[0].lstrip("+") == "distillation.enabled" and o.partition("=")[2].strip().lower()
               == "true" for o in overrides)  # fmt: skip


def needs_expert_parallel(overrides: list[str]) -> bool:
    """Whether an override sets an expert-parallel size above 1."""
    for o in overrides:
        key, _, value = o.partition("=")
        if key.endswith(("expert_model_parallel_size", "expert_parallel_size")):
            if value.strip() not in ("", "1", "null", "None"):
                return True
    return False


def base_config(root: Path, script: Path, cpath: str | None, cname: str | None) -> str:
    """hybridrl's yaml a call starts from: ppo_megatron_trainer when the script names veRL's (or a
    yaml of its own whose defaults list extends it), else ppo_trainer."""
    if not cname:
        return "ppo_trainer"
    if cname.removesuffix(".yaml") == "ppo_megatron_trainer":
        return "ppo_megatron_trainer"
    base = Path(cpath) if cpath else root / "verl/trainer/config"
    if not base.is_absolute():
        base = (script.parent / base) if (script.parent / base).is_dir() else root / base
    f = base / (cname if cname.endswith(".yaml") else cname + ".yaml")
    if f.exists() and re.search(r"^\s*-\s*ppo_megatron_trainer\b", f.read_text(), re.M):
        return "ppo_megatron_trainer"
    return "ppo_trainer"


def key_of(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def compose_collecting(overrides: list[str], config_name: str = "ppo_trainer") -> tuple[object, list[str]]:
    """Hydra-compose hybridrl's ppo_trainer.yaml with `overrides`; an override Hydra refuses is
    recorded and dropped, and composing goes on, so every unknown key of a script is found."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException, OverrideParseException

    from hybridrl.trainer.ppo import config_stage

    refused, todo = [], config_stage.prepare_argv(["main_ppo", *overrides])[1:]  # as the CLI does
    while True:
        try:
            with initialize_config_dir(config_dir=config_stage.CONFIG_DIR, version_base=None):
                return compose(config_name=config_name, overrides=todo), refused
        except OverrideParseException as e:  # e.g. a script's `key=<path_to_config>` placeholder
            bad = [o for o in todo if o in str(e)]
            if not bad:
                raise
            refused.append(f"{key_of(bad[0])} (not a valid override: {bad[0].split('=', 1)[-1][:40]})")
            todo.remove(bad[0])
        except ConfigCompositionException as e:
            m = re.search(r"(?:override|at) '([^']+)'", str(e))
            bad = [o for o in todo if m and key_of(o) == m.group(1)]
            group = re.search(r"Override (\S+)=\S* looks like a config group override", str(e))
            if not bad and group:  # veRL's `++actor@actor_rollout_ref.actor=...` group selections
                bad = [o for o in todo if o.startswith(group.group(1) + "=")]
            if not bad:
                raise
            refused.append(m.group(1) if m else key_of(bad[0]))
            todo.remove(bad[0])


def verl_hydra_refusals(
    root: Path, script: Path, overrides: list[str], cpath: str | None, cname: str | None
) -> list[str]:
    """The overrides veRL's OWN Hydra config (the checkout's verl/trainer/config) refuses when composing
    the script's call: keys a script sets that veRL itself does not take (each refused one is dropped and
    composing goes on). veRL's dataclass checks after composing are not run here."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException, OverrideParseException

    conf = root / "verl/trainer/config"
    if cpath:
        own = Path(cpath) if Path(cpath).is_absolute() else script.parent / cpath
        conf = own if own.is_dir() else (root / cpath if (root / cpath).is_dir() else conf)
    if not conf.is_dir():
        return []
    refused, todo = [], list(overrides)
    for _ in range(len(overrides) + 1):
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(conf.resolve()), version_base=None):
                compose(config_name=(cname or "ppo_trainer").removesuffix(".yaml"), overrides=todo)
            break
        except (ConfigCompositionException, OverrideParseException) as e:
            m = re.search(r"override '([^']+)'", str(e))
            bad = [o for o in todo if m and key_of(o) == m.group(1)] or [o for o in todo if o in str(e)]
            if not bad:
                refused.append(str(e).splitlines()[0][:80])
                break
            refused.append(key_of(bad[0]))
            todo.remove(bad[0])
    GlobalHydra.instance().clear()
    return refused


def stand_in_files(cfg, placeholder: str) -> list[str]:
    """Point data files this machine does not have at an empty placeholder (not a config fault)."""
    from omegaconf import OmegaConf

    swapped = []
    for key in ("data.train_files", "data.val_files"):
        val = OmegaConf.select(cfg, key)
        files = list(val) if OmegaConf.is_list(val) else [val]
        if val is not None and any(not os.path.exists(os.path.expanduser(str(f))) for f in files):
            OmegaConf.update(cfg, key, placeholder)
            swapped.append(key)
    return swapped


def blocking_key(message: str) -> str | None:
    for pat in (
        r"unknown config key '([^']+)'",
        r"^([a-z_]+(?:\.[a-z_0-9]+)+)[=:]",
        r"([a-z_]+(?:\.[a-z_0-9]+)+)=",
    ):
        m = re.search(pat, message)
        if m:
            return m.group(1)
    return None


def command_line_refusals(cli: list[str]) -> list[str]:
    """The overrides main_ppo's command line refuses before composing (its unknown-key check)."""
    from hybridrl.compat.verl_layout import layout_knows
    from hybridrl.trainer.ppo.config import PPOConfig
    from hybridrl.utils.config_loader import ConfigError, check_override_keys

    bad = []
    for o in cli:
        try:
            check_override_keys([o], PPOConfig, "ppo_trainer.yaml", layout_knows)
        except ConfigError:
            bad.append(o)
    return bad


def check(
    overrides: list[str],
    root: Path,
    placeholder: str,
    config_name: str = "ppo_trainer",
    cli: list[str] | None = None,
) -> dict:
    """hybridrl's config stage on one call: {'status': pass|fail, 'unknown': [...], 'error': str}.

    On a failure the override behind it is dropped and the stage runs again, so `unknown` lists
    every key that blocks the script (not only the first); `error` is the first message."""
    from hybridrl.trainer.ppo import config_stage

    cwd = os.getcwd()
    os.chdir(root)  # relative paths (custom reward files) resolve as in the script's folder
    out = {"status": "pass", "unknown": [], "error": "", "stand_in": []}
    refused = command_line_refusals(cli or [])  # the command line's check, as `python -m` runs it
    out["unknown"] += [key_of(o) for o in refused]
    todo = [o for o in overrides if o not in refused]
    try:
        for _ in range(60):
            cfg, refused = compose_collecting(todo, config_name)
            out["unknown"] += refused
            out["stand_in"] = stand_in_files(cfg, placeholder)
            try:
                config_stage.check_startup(cfg, explicit_keys={key_of(o) for o in todo})
                break
            except Exception as e:  # noqa: BLE001 - every failure is data for the report
                msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                out["error"] = out["error"] or msg
                key = blocking_key(str(e))
                keep = [
                    o for o in todo if not key or not (key_of(o) == key or key_of(o).startswith(key + "."))
                ]
                if key is None or len(keep) == len(todo):
                    out["unknown"].append(key or msg[:80])
                    break
                out["unknown"].append(key)
                todo = keep
    finally:
        os.chdir(cwd)
    if out["unknown"] or out["error"]:
        out["status"] = "fail"
    return out


def failing_keys(row: dict) -> list[str]:
    if row["unknown"]:
        return row["unknown"]
    m = re.search(r"([a-z_]+(?:\.[a-z_0-9]+)+)", row["error"])
    return [m.group(1) if m else row["error"][:60]]


def measure(root: Path, only: str | None = None) -> list[dict]:
    """One row per example script of the checkout `root` that calls main_ppo (`only`: a regex the
    script's path under examples/ must match)."""
    work = Path(tempfile.mkdtemp(prefix="verl_rec_"))
    make_shims(work / "bin")
    placeholder = work / "placeholder.parquet"
    placeholder.write_text("")
    rows = []
    for script in sorted((root / "examples").rglob("*.sh")):
        if only and not re.search(only, str(script.relative_to(root / "examples"))):
            continue
        calls = [c for c in (split_call(a) for a in record_script(script, root, work / "bin", work)) if c]
        for overrides, cpath, cname in calls[:1]:  # one launch per script (the first)
            full = yaml_overrides(root, script, cpath, cname) + overrides
            cat = categorise(script, full, cname)
            row = {"script": str(script.relative_to(root)), "category": cat, "overrides": full}
            row["opd"] = is_opd(full)
            row.update(
                check(full, root, str(placeholder), base_config(root, script, cpath, cname), cli=overrides)
            )
            row["verl_refuses"] = verl_hydra_refusals(root, script, overrides, cpath, cname)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verl", required=True, type=Path)
    ap.add_argument(
        "--rev", action="append", help="commit(s) of --verl to measure (repeat for several; default HEAD)"
    )
    ap.add_argument("--json", type=Path, help="rows as JSON (one list per --rev, in order)")
    ap.add_argument("--show-failures", action="store_true")
    ap.add_argument("--only", help="measure only the scripts whose path under examples/ matches this regex")
    args = ap.parse_args()
    results = []
    for rev in args.rev or [None]:
        rows = measure(extract_checkout(args.verl.resolve(), rev), args.only)
        print(f"== veRL {rev or 'HEAD'}")
        report(rows, args.show_failures)
        results.append(rows)
    if args.json:
        args.json.write_text(json.dumps(results if args.rev else results[0], indent=1))


LABELS = {
    "text": "FSDP, text-only",
    "megatron": "Megatron, text-only, no expert parallelism",
    "megatron_ep": "Megatron with expert parallelism",
    "image": "FSDP with images (VLM; the processor checks of docs/vlm.md run later, at data loading)",
    "image_megatron": "Megatron with images (VLM: refused when the processor loads)",
}


def report(rows: list[dict], show: bool) -> None:
    by_cat = collections.Counter(r["category"] for r in rows)
    print(f"scripts calling {ENTRY}: {len(rows)} ({dict(by_cat)})")
    for cat, label in LABELS.items():
        group = [r for r in rows if r["category"] == cat]
        ok = [r for r in group if r["status"] == "pass"]
        rate = 100.0 * len(ok) / max(1, len(group))
        print(f"{label}: {len(ok)}/{len(group)} pass the config stage ({rate:.1f}%)")
        keys = collections.Counter(k for r in group if r["status"] == "fail" for k in set(failing_keys(r)))
        if keys:
            print("  failing keys (number of scripts that fail on each; a script may fail on several):")
        for k, n in keys.most_common(25):
            print(f"    {n:3d}  {k}")
        if show:
            for r in group:
                if r["status"] == "fail":
                    print(f"  FAIL {r['script']}: unknown={r['unknown']} {r['error']}")
                if r.get("verl_refuses"):
                    print(f"    veRL's own Hydra config refuses {r['verl_refuses']} ({r['script']})")
    opd = [r for r in rows if r.get("opd")]  # across the categories above (also counted there)
    for r in opd:
        print(f"  on-policy distillation [{r['category']}] {r['status']}: {r['script']}")
    checked = [r for r in opd if r["status"] != "skip"]
    ok = sum(r["status"] == "pass" for r in checked)
    print(f"on-policy distillation (distillation.enabled=True): {ok}/{len(checked)} pass")


if __name__ == "__main__":
    main()
