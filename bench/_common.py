"""Shared pieces of the benchmarks in bench/: machine facts, memory sampling, the ~30M model, stats.

Nothing here is imported by the library. Every benchmark prints the date, the machine and the load
average next to its numbers, because these machines are shared and noisy (ratios are measured side
by side in one run, never asserted in tests).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/x.py` from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

# One torch thread per process: on this 2-core machine more than one thread per process is
# catastrophically slow under any other load (OpenMP threads spin while other processes hold the
# cores). Every benchmark child and every Ray worker here runs with exactly one thread.
ONE_THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "WANDB_MODE": "disabled",
}

# The ~30M-parameter Qwen2 of the benchmarks: hidden 768, 12 heads of 64, 4 layers, MLP 2304, the
# built-in 103-token tokenizer, tied embeddings: 30,766,080 parameters (30,686,976 outside embeddings).
MODEL_30M = dict(
    hidden_size=768,
    num_hidden_layers=4,
    num_attention_heads=12,
    intermediate_size=2304,
    max_position_embeddings=512,
)


# ------------------------------------------------------------------------------------- machine
def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def machine_info() -> dict:
    """Date, CPU, core count, memory and library versions: printed next to every table."""
    import torch
    import transformers

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = None
    try:
        import psutil

        mem_gib = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": mem_gib,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_avg_1_5_15": [round(x, 2) for x in load_average()],
    }


def print_header(title: str, info: dict | None = None) -> dict:
    info = info or machine_info()
    print(f"== {title}")
    print(
        f"   {info['date']} | {info['cpu']} | {info['cores']} cores | {info['mem_gib']} GiB | "
        f"torch {info['torch']} | transformers {info['transformers']} | "
        f"load avg {info['load_avg_1_5_15']}"
    )
    return info


# ---------------------------------------------------------------------------------------- CPU
def tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process and its live descendants (Ray workers included).

    On a machine shared with other jobs the wall clock stretches with the load while the CPU time
    a run needs does not (apart from cache contention and threads that spin), so tokens per
    CPU-second is the load-robust companion of tokens per second.
    """
    import psutil

    root = psutil.Process()
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


# ------------------------------------------------------------------------------------- memory
class TreeRSSSampler:
    """Peak resident memory of a process and all its descendants, sampled every `interval` s.

    Reports the peak of the *sum* over the tree (what the machine had to hold: for hybridrl the
    driver, Ray's GCS/raylet and the worker processes) and the peak of the largest single process.
    """

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.interval = interval
        self.peak_sum = 0
        self.peak_single = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        import psutil

        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        total = biggest = 0
        for p in procs:
            try:
                rss = p.memory_info().rss
            except psutil.Error:
                continue
            total += rss
            biggest = max(biggest, rss)
        self.peak_sum = max(self.peak_sum, total)
        self.peak_single = max(self.peak_single, biggest)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> TreeRSSSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_child(
    args: Sequence[str], result_path: str | os.PathLike, env: dict | None = None, timeout: float | None = None
) -> dict:
    """Run `python <args>` with one torch thread; the child writes a JSON result to `result_path`.

    Returns the child's JSON plus `peak_rss_tree_mib` / `peak_rss_max_proc_mib` (sampled from
    outside the child) and `child_wall_s` (process start to exit, including imports and start-up).
    """
    full_env = {**os.environ, **ONE_THREAD_ENV, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    Path(result_path).unlink(missing_ok=True)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], env=full_env, cwd=str(REPO))
    with TreeRSSSampler(proc.pid) as mem:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"benchmark child {' '.join(args)} ran past {timeout} s") from None
    wall = time.perf_counter() - start
    if rc != 0:
        raise RuntimeError(f"benchmark child {' '.join(args)} exited with {rc}; see its output above")
    with open(result_path) as f:
        out = json.load(f)
    out["peak_rss_tree_mib"] = mem.peak_sum / 2**20
    out["peak_rss_max_proc_mib"] = mem.peak_single / 2**20
    out["child_wall_s"] = wall
    return out


# ------------------------------------------------------------------------------------- models
def ensure_model_30m(out_dir: str | os.PathLike | None = None, seed: int = 0) -> str:
    """Write the ~30M-parameter Qwen2 (random init, seed 0, built-in tokenizer) once; returns its folder.

    Random weights are fine for throughput: the random model rarely emits EOS, so every response
    runs to the length limit (in both libraries alike).
    """
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from hybridrl.models.builtin import build_model_config, get_builtin_model_path

    root = Path(
        out_dir or os.environ.get("HYBRIDRL_BENCH_DIR", Path.home() / ".cache" / "hybridrl" / "bench")
    )
    folder = root / f"qwen2_30m_seed{seed}"
    if (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists():
        return str(folder)
    tiny = Path(get_builtin_model_path())
    tiny_cfg = json.loads((tiny / "config.json").read_text())
    cfg = build_model_config(
        vocab_size=tiny_cfg["vocab_size"],
        bos_token_id=tiny_cfg["bos_token_id"],
        eos_token_id=tiny_cfg["eos_token_id"],
        pad_token_id=tiny_cfg["pad_token_id"],
        **MODEL_30M,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float()
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, tmp / name)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return str(folder)


def resolve_bench_model(name: str) -> str:
    """'tiny' -> the shipped built-in model folder; '30m' -> the benchmark's 30M model; else a path."""
    from hybridrl.models.builtin import get_builtin_model_path

    if name == "tiny":
        return get_builtin_model_path()
    if name == "30m":
        return ensure_model_30m()
    if not os.path.isdir(name):
        raise FileNotFoundError(f"--model {name!r}: use 'tiny', '30m' or a Hugging Face model folder")
    return name


# ------------------------------------------------------------------------------------- stats
def median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None or x != x:
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A GitHub-markdown table (pastes straight into docs/benchmarks.md)."""
    cols = list(zip(*([list(headers)] + [list(r) for r in rows])))
    widths = [max(len(str(c)) for c in col) for col in cols]
    print("| " + " | ".join(str(h).ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")


def write_json(path: str | os.PathLike | None, obj: dict) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1, default=float))
    print(f"results written to {path}")


_MATMUL_CHILD = """
import sys, time, torch
torch.set_num_threads(1)
a, b = torch.randn(512, 512), torch.randn(512, 512)
for _ in range(5):
    a @ b
n, t = 0, time.perf_counter()
while time.perf_counter() - t < float(sys.argv[1]):
    a @ b
    n += 1
print(2 * 512**3 * n / (time.perf_counter() - t))
"""


def parallel_capacity(seconds: float = 3.0) -> dict:
    """How much one-thread matmul throughput two concurrent processes get against one alone.

    `capacity` = (sum of both processes' FLOP/s) / (one process alone): 2.0 means two independent
    cores, ~1.0 means the two "cores" share one core's compute (hyper-threads, a busy host). It
    bounds what running two stages side by side (asynchronous rollout and training) can gain.
    """

    def spawn():
        return subprocess.Popen(
            [sys.executable, "-c", _MATMUL_CHILD, str(seconds)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **ONE_THREAD_ENV},
        )

    alone = float(spawn().communicate()[0])
    pair = [spawn(), spawn()]
    both = [float(p.communicate()[0]) for p in pair]
    return {
        "alone_gflops": alone / 1e9,
        "pair_gflops": [x / 1e9 for x in both],
        "capacity": sum(both) / alone,
    }
