"""A GRPO run in which 10% of the episodes fail: the run must finish, the failures scored 0 and counted.

    python bench/env_faults.py [--steps 20] [--out outputs/bench/env_faults]

Guess-the-number on the built-in model; every 10th row plays an environment of
bench/env_fault_envs.py that raises, hangs past the env_agent deadline (`timeout_s` 5 s) or returns
a malformed step (in turn), so about 10% of the samples of each step fail. Prints, per step and in
total, the samples that failed by kind (the step metrics `env/errors`, `env/timeouts`,
`env/malformed`) beside the number expected from the batch's rows, and the exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAULTS = ("fault_raise", "fault_hang", "fault_malformed")
KINDS = ("errors", "timeouts", "malformed")  # the batch counts env/<kind> of each step


def write_data(out: Path, n: int) -> None:
    import pandas as pd

    sys.path.insert(0, str(REPO))
    from hybridrl.env.guess_number import make_rows

    out.mkdir(parents=True, exist_ok=True)
    rows = make_rows(n, 0)
    for i, row in enumerate(rows):
        if i % 10 == 9:
            row["extra_info"]["env_name"] = FAULTS[(i // 10) % 3]
    pd.DataFrame(rows).to_parquet(out / "train.parquet", index=False)
    pd.DataFrame(make_rows(8, 1)).to_parquet(out / "val.parquet", index=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="outputs/bench/env_faults")
    ap.add_argument("--batch", type=int, default=10, help="prompts per step (rollout.n = 2)")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    write_data(out / "data", args.steps * args.batch)
    loops = out / "loops.yaml"
    loops.write_text(
        "- {name: env_agent, _target_: hybridrl.env.loop.EnvAgentLoop, timeout_s: 5, start_timeout_s: 600}\n"
    )
    cmd = [
        sys.executable, "-m", "hybridrl.trainer.main_ppo", "algorithm.adv_estimator=grpo",
        f"data.train_files={out}/data/train.parquet", f"data.val_files={out}/data/val.parquet",
        "data.shuffle=false", "data.return_raw_chat=true", "data.max_prompt_length=16",
        "data.max_response_length=64", f"data.train_batch_size={args.batch}", "actor_rollout_ref.rollout.n=2",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}", "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.model.external_lib=bench.env_fault_envs",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4",
        "actor_rollout_ref.rollout.agent.default_agent_loop=env_agent",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
        "trainer.n_gpus_per_node=1", "trainer.cpus_per_worker=1", f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.logger=[console,file]",
        "trainer.progress_bar=false", "trainer.resume_mode=disable", f"trainer.default_local_dir={out}/ckpt",
    ]  # fmt: skip
    env = {**os.environ, "HYBRIDRL_LOG_DIR": str(out / "logs"), "PYTHONPATH": str(REPO)}
    env.setdefault("RAY_AUTH_MODE", "disabled")
    t0 = time.time()
    rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
    wall = time.time() - t0
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    samples = args.batch * 2
    totals = dict.fromkeys(KINDS, 0.0)
    print("step  " + "  ".join(KINDS) + "  expected  score/mean")
    for r in rows:
        if "env/errors" not in r:
            continue
        counts = {k: round(r[f"env/{k}"]) for k in KINDS}
        step = int(r.get("training/global_step", r.get("step", 0)))
        first = (step - 1) * args.batch
        expected = 2 * sum(1 for i in range(first, first + args.batch) if i % 10 == 9)
        for k in KINDS:
            totals[k] += counts[k]
        print(f"{step:4d}  " + "  ".join(f"{counts[k]:10d}" for k in KINDS) + f"  {expected:8d}  "
              f"{r.get('critic/score/mean', float('nan')):.3f}")  # fmt: skip
    load = os.getloadavg()
    print(json.dumps({"exit_status": rc, "steps_logged": len(rows), "samples": samples * len(rows),
                      "failed": totals, "wall_s": round(wall), "load_avg_end": [round(x, 1) for x in load]}))  # fmt: skip
    sys.exit(rc)


if __name__ == "__main__":
    main()
