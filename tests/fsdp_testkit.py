"""Shared pieces of the FSDP engine / actor / critic tests: a tiny Qwen2, batches, 2-process spawn.

Tests spawn real processes (torch.multiprocessing, gloo on CPU) and run real FSDP2; the worker
functions live in the test modules and call `init_dist` first.
"""

from __future__ import annotations

import gc
import os
import socket
import traceback

import torch
import transformers

import hybridrl.engine.checkpoint
import hybridrl.engine.fsdp
import hybridrl.workers.actor
import hybridrl.workers.critic

# Imported (and lazily-loaded classes resolved) before forking the workers, see `spawn`.
_PRELOADED = (
    hybridrl.workers.actor,
    hybridrl.workers.critic,
    hybridrl.engine.checkpoint,
    transformers.AutoModelForCausalLM,
    transformers.AutoModelForTokenClassification,
    transformers.AutoModelForSequenceClassification,
    transformers.Qwen2ForCausalLM,
)

VOCAB = 64
PAD = 0


def count_calls(monkeypatch, owner, name: str) -> dict[str, int]:
    """Wrap `owner.name` so that its calls are counted (the real function still runs); returns the
    counter {"calls": n}."""
    n = {"calls": 0}
    real = getattr(owner, name)

    def counting(*args, **kwargs):
        n["calls"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return n


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tiny_model_dir(path: str, seed: int = 0) -> str:
    """Save a random tiny Qwen2 (hidden 128, 2 layers, 2 heads of 64, vocab 64) to `path`."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float()
    model.save_pretrained(path)
    return path


def make_batch(
    bsz: int, prompt_len: int = 6, response_len: int = 5, seed: int = 0
) -> dict[str, torch.Tensor]:
    """veRL layout: left-padded prompts, right-padded responses, varying lengths."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, VOCAB, (bsz, prompt_len), generator=g)
    responses = torch.randint(3, VOCAB, (bsz, response_len), generator=g)
    p_mask = torch.ones(bsz, prompt_len, dtype=torch.long)
    r_mask = torch.ones(bsz, response_len, dtype=torch.long)
    for i in range(bsz):
        p_pad = int(torch.randint(0, prompt_len - 1, (1,), generator=g))
        r_len = int(torch.randint(1, response_len + 1, (1,), generator=g))
        p_mask[i, :p_pad] = 0
        r_mask[i, r_len:] = 0
    prompts = prompts * p_mask
    responses = responses * r_mask
    input_ids = torch.cat([prompts, responses], dim=1)
    attention_mask = torch.cat([p_mask, r_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "responses": responses,
        "response_mask": r_mask,
    }


def init_dist(rank: int, world: int, port: int, threads: int = 1) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads)
    from hybridrl.utils.device import init_process_group

    init_process_group(rank=rank, world_size=world, timeout_s=120)


def run_worker(rank: int, fn, world: int, port: int, err_dir: str, *args) -> None:
    """Entry point for mp.spawn: init the process group, run fn, record a traceback on failure."""
    import torch.distributed as dist

    # Objects inherited through fork (e.g. a process group an earlier in-process test dropped) must
    # never be garbage-collected here: their C++ threads do not exist in the child, and the gloo
    # destructor's thread join then hangs forever. `spawn` collects them in the parent first.
    gc.freeze()
    ok = False
    try:
        init_dist(rank, world, port)
        fn(rank, world, *args)
        ok = True
    except BaseException:
        with open(os.path.join(err_dir, f"error_rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            if ok:
                # Every rank has finished its collectives before any rank closes its connections: a
                # gloo peer whose socket closes while it still reads the last message aborts the process.
                dist.barrier()
                open(os.path.join(err_dir, f"done_rank{rank}"), "w").close()
            dist.destroy_process_group()


def spawn(fn, world: int, tmp_path, *args) -> None:
    """Run fn(rank, world, *args) in `world` processes; fail with the first rank's traceback.

    Processes are forked, so they inherit the modules the test already imported (importing torch
    and transformers again in every child costs far more than the checks on a 2-core machine).
    """
    import torch.multiprocessing as mp

    err_dir = str(tmp_path)
    gc.collect()  # destroy dropped process groups here, where their threads live (see run_worker)
    try:
        mp.start_processes(
            run_worker,
            args=(fn, world, free_port(), err_dir, *args),
            nprocs=world,
            join=True,
            start_method="fork",
        )
    except BaseException as e:  # incl. pytest-timeout's interrupt: never leave ranks blocked in a collective
        import multiprocessing

        for child in multiprocessing.active_children():
            child.kill()
        if not isinstance(e, Exception):
            raise
        msgs = []
        for r in range(world):
            p = os.path.join(err_dir, f"error_rank{r}.txt")
            if os.path.exists(p):
                msgs.append(f"--- rank {r} ---\n" + open(p).read())
        done = [r for r in range(world) if os.path.exists(os.path.join(err_dir, f"done_rank{r}"))]
        if not msgs:
            msgs.append(f"{e} (ranks that finished their work before it: {done or 'none'})")
        raise AssertionError("\n".join(msgs) or str(e)) from None
