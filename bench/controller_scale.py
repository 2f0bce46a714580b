"""The single controller's own cost as workers, batch and length grow: a PPO step's data flow, no model.

One PPO step of the synchronous trainer (hybridrl/trainer/ppo/trainer.py, `fit`), stage by stage,
through the real single controller: a `RayWorkerGroup` of W Ray actors, `@register` dispatch
(`DP_COMPUTE_PROTO`: split the batch over the ranks, concatenate the results), `DataProto`, and the
advantage estimators of `hybridrl.algos` on the driver. The workers hold no model: each method
returns tensors of the shapes and dtypes the real worker returns (responses and masks int64,
log-probs / values / scores float32), so what is measured is what the controller itself costs:

    generate_sequences  prompts (B, P) out; input_ids / attention_mask / position_ids (B, P+T),
                        responses / response_mask (B, T), rollout_log_probs (B, T) back
    compute_rm_score    the whole batch out; rm_scores (B, T) back
    compute_log_prob    the whole batch out; old_log_probs, entropys (B, T) back
    compute_ref_log_prob  the whole batch out; ref_log_prob (B, T) back
    compute_values      (GAE) the whole batch out; values (B, T) back
    advantages          on the driver (GRPO: group statistics; GAE: the reverse scan)
    update_critic       (GAE) the whole batch out; metrics back
    update_actor        the whole batch out; metrics back

`--data-path ref` runs the same step with the batch held by reference (`BatchRef`,
hybridrl/single_controller/batch_ref.py), as main_ppo's fit loop does on Ray workers: the
token-level tensors stay in the object store and move worker to worker; the driver sends the
prompts once and receives per-sample values (scores, the GAE whitening moments) and metrics; the
per-token advantage work runs on the workers (`apply_batch_fn`), the group statistics on the
driver. `--data-path driver` (the default) is the through-the-driver flow above (main_async's).

`--fanout on` sends every blocking call through one dispatcher actor per node
(hybridrl/single_controller/ray/fanout.py): the driver submits one task per node, the dispatcher
one per local rank; `--fanout off,on` measures both, alternating, per configuration. With
`--nodes N` the workers spread over N virtual nodes of a `ray.cluster_utils.Cluster` (one
dispatcher each).

Printed per configuration (workers W, sequences B, response tokens T): the bytes that pass through
the driver per step (tensors sent to and received from the workers), the driver's peak RSS, and the
control-plane seconds per step (the step's wall time less the time the workers spent building their
outputs), the driver's CPU seconds per step (its own work: dispatch, serialisation, collection;
`time.process_time`), each the median over the measured steps; then the factor each grows by per doubling of
W, B and T. Each configuration runs in a fresh process so that its peak RSS is its own.

    python bench/controller_scale.py                                     # a small grid
    python bench/controller_scale.py --workers 2,8,32 --batch 1024 --length 1024
    python bench/controller_scale.py --workers 8 --batch 1024,2048,4096,8192 --length 4096 --estimator gae
    python bench/controller_scale.py --workers 8 --nodes 2               # a 2-node ray.cluster_utils cluster
    python bench/controller_scale.py --data-path driver,ref --workers 2,8,32 --batch 2048 --length 1024
    python bench/controller_scale.py --data-path ref --fanout off,on --workers 2,8,32 --batch 2048 --length 1024
    python bench/controller_scale.py --data-path ref --fanout off,on --workers 32 --nodes 4 --batch 2048

Each simulated worker is a real hybridrl Worker process (torch and tensordict imported): the
median worker's proportional set size is printed with each row, and bounds how many workers fit
in memory.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

os.environ.update({k: v for k, v in C.ONE_THREAD_ENV.items() if k not in os.environ})


# ----------------------------------------------------------------------------------- one config
def _worker_class():
    """The simulated colocated worker (actor, rollout, reference, critic and reward model in one
    process, as hybridrl colocates roles that share a device slot)."""
    import torch

    from hybridrl.protocol import DataProto
    from hybridrl.single_controller import Dispatch, Worker, register

    class SimulatedWorker(Worker):
        def __init__(self, response_length: int) -> None:
            super().__init__()
            self.T = response_length
            self.busy_s = 0.0

        def _out(self, tensors: dict, metrics: dict | None = None) -> DataProto:
            return DataProto.from_dict(tensors, meta_info={"metrics": metrics} if metrics else None)

        def _f32(self, b: int) -> torch.Tensor:
            return torch.full((b, self.T), -1.0, dtype=torch.float32)

        def _timed(self, fn, data):
            t0 = time.perf_counter()
            out = fn(len(data), data)
            self.busy_s += time.perf_counter() - t0
            return out

        @register(Dispatch.DP_COMPUTE_PROTO)
        def generate_sequences(self, prompts: DataProto) -> DataProto:
            def build(b, data):
                p = data.batch["input_ids"]
                responses = torch.ones((b, self.T), dtype=torch.int64)
                mask = torch.ones((b, p.shape[1] + self.T), dtype=torch.int64)
                return self._out(
                    {
                        "prompts": p,
                        "responses": responses,
                        "input_ids": torch.cat([p, responses], dim=1),
                        "attention_mask": mask,
                        "position_ids": mask.cumsum(-1) - 1,
                        "response_mask": torch.ones((b, self.T), dtype=torch.int64),
                        "rollout_log_probs": self._f32(b),
                    }
                )

            return self._timed(build, prompts)

        @register(Dispatch.DP_COMPUTE_PROTO)
        def compute_rm_score(self, data: DataProto) -> DataProto:
            return self._timed(lambda b, _: self._out({"rm_scores": self._f32(b)}), data)

        @register(Dispatch.DP_COMPUTE_PROTO)
        def compute_log_prob(self, data: DataProto) -> DataProto:
            return self._timed(
                lambda b, _: self._out({"old_log_probs": self._f32(b), "entropys": self._f32(b)}), data
            )

        @register(Dispatch.DP_COMPUTE_PROTO)
        def compute_ref_log_prob(self, data: DataProto) -> DataProto:
            return self._timed(lambda b, _: self._out({"ref_log_prob": self._f32(b)}), data)

        @register(Dispatch.DP_COMPUTE_PROTO)
        def compute_values(self, data: DataProto) -> DataProto:
            return self._timed(lambda b, _: self._out({"values": self._f32(b)}), data)

        @register(Dispatch.DP_COMPUTE_PROTO)
        def update_critic(self, data: DataProto) -> DataProto:
            return self._timed(lambda b, d: self._out({}, {"critic/vf_loss": [float(len(d))]}), data)

        @register(Dispatch.DP_COMPUTE_PROTO)
        def update_actor(self, data: DataProto) -> DataProto:
            return self._timed(lambda b, d: self._out({}, {"actor/pg_loss": [float(len(d))]}), data)

        @register(Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
        def apply_batch_fn(self, fn, data: DataProto) -> DataProto:
            return self._timed(lambda b, d: fn(d), data)

        @register(Dispatch.ONE_TO_ALL)
        def take_busy_s(self) -> float:
            busy, self.busy_s = self.busy_s, 0.0
            return busy

        @register(Dispatch.ONE_TO_ALL)
        def pss_mib(self) -> float:
            """This process's proportional set size (Linux; 0 elsewhere)."""
            try:
                with open("/proc/self/smaps_rollup") as f:
                    return next(int(x.split()[1]) for x in f if x.startswith("Pss:")) / 1024
            except (OSError, StopIteration):
                return 0.0

    return SimulatedWorker


def nbytes(data) -> int:
    """Bytes of a DataProto's tensors and numpy arrays (object arrays: their pickled size)."""
    import pickle

    total = sum(t.numel() * t.element_size() for t in data.batch.values()) if data.batch is not None else 0
    for arr in data.non_tensor_batch.values():
        total += len(pickle.dumps(arr)) if arr.dtype == object else arr.nbytes
    return total


# ------------------------------------------------------------ per-token stages run on the workers
def _per_sample(data, columns: dict):
    """A DataProto of no tensors and these (b,) numpy columns (they go to the driver)."""
    from tensordict import TensorDict

    from hybridrl.protocol import DataProto

    return DataProto(batch=TensorDict({}, batch_size=[len(data)]), non_tensor_batch=columns)


def stage_outcome_scores(data):
    """GRPO, worker side: s_i from the rewards (rm_scores here, as token_level_scores) -> driver."""
    from hybridrl import algos

    return _per_sample(
        data, {"score": algos.outcome_scores(data.batch["rm_scores"], data.batch["response_mask"]).numpy()}
    )


def stage_broadcast_advantages(data):
    """GRPO, worker side: the driver's per-response A_i onto the tokens."""
    import numpy as np
    import torch

    from hybridrl import algos
    from hybridrl.protocol import DataProto

    adv = algos.broadcast_to_tokens(
        torch.from_numpy(np.asarray(data.non_tensor_batch["grpo_adv"], dtype=np.float32)),
        data.batch["response_mask"],
    )
    return DataProto.from_dict({"advantages": adv, "returns": adv})


def stage_gae(data, gamma: float = 1.0, lam: float = 1.0):
    """GAE, worker side: A_t, R_t of each row, plus the row moments the whitening needs."""
    from hybridrl import algos
    from hybridrl.protocol import DataProto

    b, mask = data.batch, data.batch["response_mask"]
    adv, ret = algos.gae_before_whitening(b["rm_scores"], b["values"], mask, gamma, lam)
    mom = algos.masked_row_moments(adv, mask).numpy()
    return DataProto.from_dict(
        {"gae_raw": adv, "returns": ret * mask},
        non_tensors={"mom_sum": mom[:, 0], "mom_sq": mom[:, 1], "mom_n": mom[:, 2]},
    )


def stage_whiten(data, mean: float, var: float, epsilon: float = 1e-8):
    """GAE, worker side: whiten with the batch's mean and variance (from the row moments)."""
    import torch

    from hybridrl.protocol import DataProto

    adv = (data.batch["gae_raw"] - mean) * torch.rsqrt(torch.tensor(var + epsilon, dtype=torch.float32))
    return DataProto.from_dict({"advantages": adv * data.batch["response_mask"]})


def _ref_step(wg, step: int, batch: int, prompt_length: int, n: int, estimator: str, moved: dict) -> None:
    """One step's data flow with the batch held by reference; `moved` counts what the driver sends
    (per-sample columns, the prompts it puts) and receives (per-sample columns, pulled tensors)."""
    import functools

    import numpy as np
    import torch

    from hybridrl import algos
    from hybridrl.protocol import DataProto
    from hybridrl.single_controller.batch_ref import TRANSFER, BatchRef, column_bytes

    def call(method: str, *args):
        data = args[-1]
        put, pulled = TRANSFER["put"], TRANSFER["pulled"]
        moved["out"] += column_bytes({}, data.non_tensor_batch)
        out = getattr(wg, method)(*args)
        moved["in"] += column_bytes({}, out.non_tensor_batch) + TRANSFER["pulled"] - pulled
        moved["out"] += TRANSFER["put"] - put
        return out

    prompts = torch.ones((batch // n, prompt_length), dtype=torch.int64)
    pmask = torch.ones_like(prompts)
    put0 = TRANSFER["put"]
    p = BatchRef.from_proto(
        DataProto.from_dict(
            {"input_ids": prompts, "attention_mask": pmask, "position_ids": pmask.cumsum(-1) - 1}
        )
    )
    moved["out"] += TRANSFER["put"] - put0
    uid = np.array([f"{step}-{i}" for i in range(batch // n)], dtype=object)
    gen_in = p.select_idxs(np.repeat(np.arange(batch // n), n))  # rollout.n, by row index
    b = call("generate_sequences", gen_in)
    b.non_tensor_batch["uid"] = np.repeat(uid, n)
    b = b.union(call("compute_rm_score", b))
    b = b.union(call("compute_log_prob", b))
    b = b.union(call("compute_ref_log_prob", b))
    if estimator == "gae":
        b = b.union(call("compute_values", b))
        g = call("apply_batch_fn", stage_gae, b.select(["rm_scores", "values", "response_mask"]))
        mom = np.stack(
            [np.asarray(g.non_tensor_batch[k], np.float64) for k in ("mom_sum", "mom_sq", "mom_n")], -1
        )
        mean, var = algos.mean_var_from_moments(torch.from_numpy(mom))
        g.non_tensor_batch = {}
        b = b.union(g)
        whiten = functools.partial(stage_whiten, mean=mean, var=var)
        b = b.union(call("apply_batch_fn", whiten, b.select(["gae_raw", "response_mask"])))
        b.pop(["gae_raw"])
    else:
        s = call("apply_batch_fn", stage_outcome_scores, b.select(["rm_scores", "response_mask"]))
        adv = algos.grpo_response_advantages(
            torch.from_numpy(np.asarray(s.non_tensor_batch["score"], dtype=np.float32)),
            b.non_tensor_batch["uid"],
        )
        adv_in = b.select(["response_mask"])
        adv_in.non_tensor_batch = {"grpo_adv": adv.numpy()}
        b = b.union(call("apply_batch_fn", stage_broadcast_advantages, adv_in))
    if estimator == "gae":
        call("update_critic", b)
    call("update_actor", b)


def run_one(workers: int, batch: int, length: int, prompt_length: int, n: int, estimator: str,
            steps: int, nodes: int, data_path: str = "driver", fanout: str = "off") -> dict:  # fmt: skip
    """One configuration in this process: start Ray and the group, run `steps` PPO steps' data flow.

    fanout: "on" sends the group's calls through one dispatcher actor per node, "off" calls every
    rank directly (RayWorkerGroup(fanout=...)).
    """
    import numpy as np
    import ray
    import torch

    from hybridrl import algos
    from hybridrl.protocol import DataProto
    from hybridrl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    torch.set_num_threads(1)
    cpus = os.cpu_count() or 2
    cluster = None
    if nodes > 1:
        from ray.cluster_utils import Cluster

        cluster = Cluster()
        per_node = math.ceil(workers / nodes)
        for _ in range(nodes):  # virtual nodes: each its own raylet and a small object store
            cluster.add_node(num_cpus=max(1, cpus // nodes), object_store_memory=2 * 2**30)
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    else:
        per_node = workers
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    slot_cpus = min(1.0, max(1, cpus // max(nodes, 1)) / per_node) * 0.99
    pool = RayResourcePool([per_node] * (nodes if nodes > 1 else 1), use_gpu=False, cpus_per_slot=slot_cpus)
    wg = RayWorkerGroup(
        pool,
        RayClassWithInitArgs(_worker_class(), response_length=length),
        name_prefix="sim",
        fanout=fanout == "on",
    )
    worker_pss = statistics.median(wg.pss_mib())
    rss_start_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def call(method: str, data: DataProto, moved: dict) -> DataProto:
        moved["out"] += nbytes(data)
        out = getattr(wg, method)(data)
        moved["in"] += nbytes(out)
        return out

    results = []
    for step in range(steps + 1):  # step 0 warms up
        moved = {"out": 0, "in": 0}
        t0, cpu0 = time.perf_counter(), time.process_time()
        if data_path == "ref":
            _ref_step(wg, step, batch, prompt_length, n, estimator, moved)
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            busy = max(wg.take_busy_s())
            if step:
                results.append(
                    {
                        "wall_s": wall,
                        "cpu_s": cpu,
                        "worker_s": busy,
                        "bytes": moved["out"] + moved["in"],
                        **moved,
                    }
                )
            continue
        prompts = torch.ones((batch // n, prompt_length), dtype=torch.int64)
        pmask = torch.ones_like(prompts)
        b = DataProto.from_dict(
            {"input_ids": prompts, "attention_mask": pmask, "position_ids": pmask.cumsum(-1) - 1},
            non_tensors={"uid": np.array([f"{step}-{i}" for i in range(batch // n)], dtype=object)},
        ).repeat(repeat_times=n, interleave=True)
        gen_in = b.select(batch_keys=["input_ids", "attention_mask", "position_ids"])
        out = call("generate_sequences", gen_in, moved)
        b.pop(batch_keys=["input_ids", "attention_mask", "position_ids"])
        b = b.union(out)
        b = b.union(call("compute_rm_score", b, moved))
        b.batch["token_level_scores"] = b.batch["rm_scores"]
        b = b.union(call("compute_log_prob", b, moved))
        b = b.union(call("compute_ref_log_prob", b, moved))
        if estimator == "gae":
            b = b.union(call("compute_values", b, moved))
        b.batch["token_level_rewards"] = b.batch["token_level_scores"]
        adv, ret = algos.get_adv_estimator_fn(estimator)(
            b.batch["token_level_rewards"],
            b.batch["response_mask"],
            index=b.non_tensor_batch["uid"],
            values=b.batch["values"] if "values" in b.batch.keys() else None,
            gamma=1.0,
            lam=1.0,
        )
        b.batch["advantages"], b.batch["returns"] = adv, ret
        if estimator == "gae":
            call("update_critic", b, moved)
        call("update_actor", b, moved)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        busy = max(wg.take_busy_s())
        if step:
            results.append(
                {"wall_s": wall, "cpu_s": cpu, "worker_s": busy, "bytes": moved["out"] + moved["in"], **moved}
            )
        del b, out
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    wg.shutdown()
    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()
    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
    return {
        "workers": workers, "batch": batch, "length": length, "nodes": nodes, "estimator": estimator,
        "data_path": data_path, "fanout": fanout, "worker_pss_mib": worker_pss,
        "bytes_per_step": med["bytes"], "bytes_out": med["out"], "bytes_in": med["in"],
        "control_s": max(med["wall_s"] - med["worker_s"], 0.0), "wall_s": med["wall_s"],
        "driver_cpu_s": med["cpu_s"],
        "peak_rss_mib": peak_kib / 1024, "rss_after_start_mib": rss_start_kib / 1024,
    }  # fmt: skip


# ------------------------------------------------------------------------------------ the grid
def _slopes(rows: list[dict], axis: str, keys: tuple[str, ...]) -> list[str]:
    """Growth factor per doubling of `axis`, between neighbouring rows that differ only in it."""
    others = [
        a for a in ("data_path", "fanout", "workers", "batch", "length", "nodes", "estimator") if a != axis
    ]
    lines = []
    for _, group in itertools.groupby(sorted(rows, key=lambda r: [r[a] for a in others] + [r[axis]]),
                                      key=lambda r: [r[a] for a in others]):  # fmt: skip
        group = list(group)
        for a, b in zip(group, group[1:]):
            doublings = math.log2(b[axis] / a[axis])
            if doublings <= 0:
                continue
            f = {k: (b[k] / a[k]) ** (1 / doublings) if a[k] > 0 else float("nan") for k in keys}
            lines.append(
                f"  {axis} {a[axis]} -> {b[axis]}: "
                + ", ".join(f"{k} x{v:.2f}" for k, v in f.items())
                + f"  (at workers={b['workers']} batch={b['batch']} length={b['length']}, {b['data_path']}, "
                f"fan-out {b['fanout']})"
            )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="2,8", help="comma list of worker counts")
    ap.add_argument("--batch", default="256,1024", help="comma list of sequences per step (prompts x n)")
    ap.add_argument("--length", default="512", help="comma list of response lengths (tokens)")
    ap.add_argument("--prompt-length", type=int, default=256)
    ap.add_argument("--n", type=int, default=8, help="responses per prompt (GRPO group size)")
    ap.add_argument("--estimator", default="grpo", choices=["grpo", "gae"])
    ap.add_argument("--steps", type=int, default=3, help="measured steps per configuration (after 1 warm-up)")
    ap.add_argument("--nodes", type=int, default=1, help=">1: a multi-node ray.cluster_utils.Cluster")
    ap.add_argument(
        "--data-path", default="driver", help="comma list of driver (through the driver), ref (BatchRef)"
    )
    ap.add_argument(
        "--fanout",
        default="off",
        help="comma list of off (the driver calls every rank) and on (one dispatcher actor per node); "
        "the values alternate within each configuration",
    )
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        w, b, t = (int(x) for x in args.one.split(","))
        row = run_one(
            w, b, t, args.prompt_length, args.n, args.estimator, args.steps, args.nodes, args.data_path,
            args.fanout,
        )  # fmt: skip
        print("ROW " + json.dumps(row))
        return

    print(json.dumps(C.machine_info()), "load", C.load_average())
    rows = []
    sizes = itertools.product(*(map(int, s.split(",")) for s in (args.workers, args.batch, args.length)))
    configs = itertools.product(list(sizes), args.data_path.split(","), args.fanout.split(","))
    for (w, b, t), path, fan in configs:
        cmd = [sys.executable, __file__, "--one", f"{w},{b},{t}", "--prompt-length", str(args.prompt_length),
               "--n", str(args.n), "--estimator", args.estimator, "--steps", str(args.steps),
               "--nodes", str(args.nodes), "--data-path", path, "--fanout", fan]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("ROW ")), None)
        if proc.returncode or line is None:
            print(
                f"{path} fan-out {fan}: workers={w} batch={b} length={t}: failed (exit {proc.returncode})\n"
                f"{proc.stderr[-2000:]}"
            )
            continue
        rows.append(json.loads(line[4:]))
        r = rows[-1]
        print(
            f"{path:6s} fan-out {fan:3s}  workers {w:4d}  batch {b:5d}  length {t:5d}"
            f"  | driver MB/step {r['bytes_per_step'] / 1e6:9.1f}"
            f"  peak RSS MiB {r['peak_rss_mib']:7.0f}  control s/step {r['control_s']:7.3f}"
            f"  driver CPU s/step {r['driver_cpu_s']:7.3f}  (wall {r['wall_s']:.3f}; worker PSS "
            f"{r['worker_pss_mib']:.0f} MiB; load {C.load_average()[0]:.1f})",
            flush=True,
        )
    keys = ("bytes_per_step", "peak_rss_mib", "control_s", "driver_cpu_s")
    print("growth per doubling:")
    for axis in ("workers", "batch", "length"):
        for line in _slopes(rows, axis, keys):
            print(line)
    print("load", C.load_average())
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
