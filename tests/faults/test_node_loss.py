"""A node of a multi-node Ray cluster leaves mid-step (``ray.cluster_utils.Cluster``: 3 nodes of 1 CPU
on this machine, one worker per node).

* The toy group: the error names the node and the ranks that were on it.
* main_ppo with ``trainer.max_restarts=1``: the node is removed in step 2 and added back; the run
  restarts from the step-1 checkpoint and finishes all 3 steps.
* The same without adding it back (the command line, in a subprocess): the run stops with an error
  naming the node, the key and the newest checkpoint, a non-zero exit code, and no actor or placement
  group of it left on the cluster.
* main_async (1 training and 2 rollout slots): a worker node leaves mid-run; the output names it and
  the run finishes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from hybridrl.utils import checkpointing as ck
from tests.e2e.ppo_runs import SMALL, read_metrics

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
]  # a 3-node cluster starts in ~30-60 s on 2 loaded cores

_TAG = f"nodes-{uuid.uuid4().hex[:8]}"

REMOVER = '''
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Scores 0; on the first sample of step 2 asks the test to remove a node and waits for it (once)."""
    d = "{fault_dir}"
    calls = os.path.join(d, "calls")
    with open(calls, "a") as f:
        f.write("x")
    if os.path.getsize(calls) == 13:  # 3 prompts x 4 answers scored per step
        open(os.path.join(d, "remove"), "w").close()
        for _ in range(600):
            if os.path.exists(os.path.join(d, "removed")):
                break
            time.sleep(0.1)
    return 0.0
'''


@pytest.fixture(scope="module")
def cluster():
    """A head node and two more, 1 CPU each (every rank of a 3-slot run gets its own node)."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    os.environ["HYBRIDRL_FAULT_TAG"] = _TAG  # the actors of this module's runs carry it
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    # Cluster writes its address where a plain ray.init() on this machine would pick it up (other
    # test processes): only RAY_ADDRESS / address= reach this cluster
    ray._common.utils.reset_ray_address()
    workers = [c.add_node(num_cpus=1) for _ in range(2)]
    c.wait_for_nodes()
    c.removable = workers
    yield c
    if ray.is_initialized():
        ray.shutdown()
    c.shutdown()


def _drive(
    c, tmp_path, extra: list[str], add_back: bool, entry: str = "main_ppo", pick=None
) -> subprocess.CompletedProcess:
    """Run `entry` on the cluster in a subprocess; remove a worker node (`pick(c)`, default the first
    one that is not the head) when its reward function asks (and add one back 2 s later). The cluster
    is driven from this process's main thread."""
    env = {
        **os.environ,
        "RAY_ADDRESS": c.address,
        "HYBRIDRL_FAULT_DIR": str(tmp_path),
        "HYBRIDRL_LOG_DIR": str(tmp_path / "logs"),
    }
    args = [*SMALL, f"trainer.default_local_dir={tmp_path}/ckpt", *_overrides(tmp_path, extra)]
    out, err = open(tmp_path / "out.txt", "w+"), open(tmp_path / "err.txt", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", f"hybridrl.trainer.{entry}", *args], env=env, stdout=out, stderr=err
    )
    deadline = time.monotonic() + 900
    while proc.poll() is None and not (tmp_path / "remove").exists():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    if proc.poll() is None:
        node = pick(c) if pick else c.removable[0]
        c.removable.remove(node)
        (tmp_path / "node").write_text(node.node_id)
        c.remove_node(node)
        (tmp_path / "removed").touch()
        if add_back:
            time.sleep(2)
            c.removable.append(c.add_node(num_cpus=1))
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out.seek(0), err.seek(0)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())


THREE_RANKS = [  # main_ppo: one rank on each of the 3 nodes; 3 prompts x 4 answers = 4 rows per rank
    "trainer.nnodes=3",
    "data.train_batch_size=3",
    "actor_rollout_ref.actor.ppo_mini_batch_size=3",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "critic.ppo_micro_batch_size_per_gpu=4",
]


def _overrides(tmp_path, extra):
    fn = tmp_path / "remover.py"
    fn.write_text(REMOVER.format(fault_dir=tmp_path))
    return [
        "trainer.backend=ray",
        "trainer.n_gpus_per_node=1",
        "trainer.total_training_steps=3",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        "trainer.reward_timeout_s=0",  # score in the calling thread
        f"custom_reward_function.path={fn}",
        *extra,
    ]


def _our_actor_processes() -> list[int]:
    pids = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("HYBRIDRL_FAULT_TAG") == _TAG and env.get("HYBRIDRL_WORKER_GROUP"):
            pids.append(p.pid)
    return pids


@pytest.mark.parametrize("fanout", [False, True], ids=["direct", "fanout"])
def test_a_lost_node_is_named_with_its_ranks(cluster, tmp_path, fanout):
    import fault_workers
    import ray

    from hybridrl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from hybridrl.single_controller.ray.nodes import NodeLostError

    ray.init(address=cluster.address, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(fault_workers)
    try:
        pool = RayResourcePool([1, 1, 1], use_gpu=False, cpus_per_slot=1, name_prefix="toy")
        wg = RayWorkerGroup(
            pool, RayClassWithInitArgs(fault_workers.NapWorker), name_prefix="toy", fanout=fanout
        )
        assert len(set(wg.pid())) == 3  # with the fan-out: through a dispatcher on each node
        node = cluster.removable.pop(0)
        tables = [ray.util.placement_group_table(pg)["bundles_to_node_id"][0] for pg in pool._pgs]
        rank = tables.index(node.node_id)
        cluster.remove_node(node)
        with pytest.raises(NodeLostError) as info:
            wg.nap(-1, 0.0)
        err = info.value
        assert err.node_id == node.node_id and err.lost == {"toy": [rank]}
        assert node.node_id[:12] in str(err) and f"group 'toy' ranks [{rank}]" in str(err)
        assert "trainer.max_restarts" in str(err)
        wg.shutdown()
        pool.remove()
        cluster.removable.append(cluster.add_node(num_cpus=1))  # the next test gets 3 nodes again
        cluster.wait_for_nodes()
    finally:
        ray.shutdown()


def test_the_run_restarts_when_the_node_comes_back_and_finishes(cluster, tmp_path):
    done = _drive(cluster, tmp_path, [*THREE_RANKS, "trainer.max_restarts=1"], add_back=True)
    assert done.returncode == 0, done.stderr[-4000:]
    node = (tmp_path / "node").read_text()
    assert "restart 1/1 (trainer.max_restarts): NodeLostError" in done.stderr, done.stderr[-4000:]
    assert f"node {node[:12]}" in done.stderr
    root = str(tmp_path / "ckpt")
    assert ck.list_checkpoints(root)[-1] == 3 and ck.read_meta(ck.step_dir(root, 3))["global_step"] == 3
    steps = [r["step"] for r in read_metrics(tmp_path / "logs" / "metrics.jsonl") if "actor/pg_loss" in r]
    assert sorted(set(steps)) == [1, 2, 3] and steps.count(2) == 1  # step 2 was logged once: it restarted
    assert _our_actor_processes() == []


def test_without_the_node_the_run_stops_naming_it_and_leaves_nothing(cluster, tmp_path):
    import ray

    extra = [*THREE_RANKS, "trainer.max_restarts=1", "trainer.resources_timeout_s=5"]
    try:
        done = _drive(cluster, tmp_path, extra, add_back=False)
    finally:
        cluster.removable.append(cluster.add_node(num_cpus=1))  # the next test gets 3 nodes again
    node = (tmp_path / "node").read_text()
    assert done.returncode != 0, done.stdout[-3000:]
    err = done.stderr
    assert f"node {node[:12]}" in err and "trainer.resources_timeout_s=5" in err, err[-4000:]
    assert f"Newest checkpoint: {ck.step_dir(str(tmp_path / 'ckpt'), 1)}" in err, err[-4000:]
    assert ck.list_checkpoints(str(tmp_path / "ckpt")) == [1]
    # nothing of the run is left: no actor process, no placement group, no live actor
    assert _our_actor_processes() == []
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        pgs = ray.util.placement_group_table().values()
        assert [p["name"] for p in pgs if p["state"] != "REMOVED"] == []
        assert [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"] == []
    finally:
        ray.shutdown()


def test_async_run_loses_a_node_and_finishes(cluster, tmp_path):
    """main_async, 1 training slot and 2 rollout slots on the 3 nodes, trainer.max_restarts=1: a worker
    node leaves mid-run (added back 2 s later). Whichever pool it served, the output names the node
    and the run finishes: a rollout worker's loss drops that worker and the run goes on with the
    other; the training rank's loss restarts the run from its latest checkpoint."""
    extra = [
        "trainer.nnodes=1",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "async_training.rollout_nnodes=2",
        "async_training.rollout_n_gpus_per_node=1",
        "trainer.max_restarts=1",
    ]
    done = _drive(cluster, tmp_path, extra, add_back=True, entry="main_async")
    out = done.stdout + done.stderr
    assert (tmp_path / "node").exists(), out[-4000:]  # a node was removed while the run trained
    node = (tmp_path / "node").read_text()
    assert done.returncode == 0, out[-4000:]
    dropped = "left the Ray cluster while worker group 'rollout' ran 'generate_sequences'" in out
    restarted = "restart 1/1 (trainer.max_restarts): NodeLostError" in out
    assert f"node {node[:12]}" in out and (dropped or restarted), out[-4000:]
    if dropped:
        assert "group 'hybridrl_rollout' ranks [" in out and "1 left" in out, out[-4000:]
    assert ck.list_checkpoints(str(tmp_path / "ckpt"))[-1] == 3
    assert _our_actor_processes() == []
