"""Assemble a PPO run from a validated config: tokenizer, data, rewards, tracker, workers, trainer."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from hybridrl.data.builtin_task import ensure_builtin_data
from hybridrl.data.custom_sampler import build_custom_sampler
from hybridrl.data.rl_dataset import RLDataConfig, collate_fn, create_rl_dataset
from hybridrl.data.sampler import ResumableSampler, RLDataLoader
from hybridrl.models.builtin import resolve_model_path
from hybridrl.models.hf import load_tokenizer
from hybridrl.models.shm import copy_to_shm
from hybridrl.reward.custom import load_custom_reward_fn
from hybridrl.reward.manager import load_reward_manager
from hybridrl.trainer.ppo.checkpoints import RunCheckpoints
from hybridrl.trainer.ppo.compile_auto import resolve_compile_layers
from hybridrl.trainer.ppo.config import PPOConfig
from hybridrl.trainer.ppo.data_checks import check_data_files
from hybridrl.trainer.ppo.genrm_config import genrm_reward_kwargs
from hybridrl.trainer.ppo.plugin_checks import check_plugins, wrap_reward_errors
from hybridrl.trainer.ppo.reward_kwargs import reward_manager_class, reward_manager_kwargs
from hybridrl.trainer.ppo.roles import check_trainer_cls
from hybridrl.trainer.ppo.startup_checks import check_first_rows, check_model_inputs, read_model_config
from hybridrl.trainer.ppo.step_floors import measure_step_floors
from hybridrl.trainer.ppo.trainer import RayPPOTrainer
from hybridrl.trainer.ppo.vlm_setup import load_run_processor
from hybridrl.trainer.ppo.workers import (
    shutdown_on_error,
    start_reward_loop,
    start_workers,
    use_gpu,
    uses_ray,
    worker_classes,
)
from hybridrl.utils import deadlines
from hybridrl.utils.deadlines import RewardWithDeadline
from hybridrl.utils.flops import get_peak_flops
from hybridrl.utils.torch_utils import str_to_dtype
from hybridrl.utils.tracking import Tracking


def resolve_builtin(config: PPOConfig) -> None:
    """Point unset data files at the built-in task and `builtin:*` model paths at the shipped model."""
    d = config.data
    if d.reasoning_gym.tasks:
        resolve_reasoning_gym(d)
    if d.train_files is None or d.val_files is None:
        paths = ensure_builtin_data(d.builtin_data_dir)
        d.train_files = d.train_files or paths["train"]
        d.val_files = d.val_files or paths["val"]
    m = config.actor_rollout_ref.model
    m.path = resolve_model_path(m.path, "actor_rollout_ref.model.path")
    if m.tokenizer_path:
        m.tokenizer_path = resolve_model_path(m.tokenizer_path, "actor_rollout_ref.model.tokenizer_path")
    c = config.critic.model
    c.path = resolve_model_path(c.path, "critic.model.path") if c.path else m.path
    c.tokenizer_path = c.tokenizer_path or m.tokenizer_path or m.path
    if config.reward_model.model.path:
        rm = config.reward_model.model
        rm.path = resolve_model_path(rm.path, "reward_model.model.path")
    if m.use_shm:
        m.path = copy_to_shm(m.path, "actor_rollout_ref.model.use_shm")
    if c.use_shm:
        c.path = copy_to_shm(c.path, "critic.model.use_shm")


def resolve_reasoning_gym(d) -> None:
    """Generate the rows of `data.reasoning_gym.tasks` and point the data files at them."""
    if d.train_files is not None or d.val_files is not None:
        raise ValueError(
            "data.reasoning_gym.tasks generates the training and validation rows, so data.train_files and "
            f"data.val_files must be null; got {d.train_files!r} / {d.val_files!r}. Drop one or the other."
        )
    from hybridrl.data.reasoning_gym_task import ensure_reasoning_gym_data

    rg = d.reasoning_gym
    paths = ensure_reasoning_gym_data(list(rg.tasks), rg.data_dir, rg.system_prompt)
    d.train_files, d.val_files = paths["train"], paths["val"]


def driver_tokenizer_config(config: PPOConfig):
    """The model section the driver's tokenizer (data, reward decoding) is loaded from:
    `data.tokenizer` (veRL) names another tokenizer, `data.trust_remote_code` allows its code."""
    m, d = config.actor_rollout_ref.model, config.data
    return dataclasses.replace(
        m,
        tokenizer_path=d.tokenizer or m.tokenizer_path,
        trust_remote_code=m.trust_remote_code or d.trust_remote_code,
    )


def total_steps(config: PPOConfig, steps_per_epoch: int) -> int:
    tr = config.trainer
    steps = steps_per_epoch * tr.total_epochs
    if tr.total_training_steps is not None and tr.total_training_steps > 0:
        steps = tr.total_training_steps
    return steps


def build_datasets(config: PPOConfig, tokenizer, processor=None):

    d = config.data
    raw = {f.name: getattr(d, f.name) for f in dataclasses.fields(d)}
    custom = d.custom_cls
    train = create_rl_dataset(
        d.train_files,
        tokenizer,
        RLDataConfig.from_verl(raw, "train"),
        processor=processor,
        custom_cls_path=custom.path,
        custom_cls_name=custom.name,
        files_key="data.train_files",
    )
    val = create_rl_dataset(
        d.val_files,
        tokenizer,
        RLDataConfig.from_verl(raw, "val"),
        processor=processor,
        custom_cls_path=custom.path,
        custom_cls_name=custom.name,
        files_key="data.val_files",
    )
    if len(train) < d.train_batch_size:
        raise ValueError(
            f"data.train_files has {len(train)} prompts, fewer than data.train_batch_size={d.train_batch_size}; "
            "lower the batch size or add data"
        )
    workers = d.dataloader_num_workers
    sampler = build_custom_sampler(
        d.sampler, train, OmegaConf.create(dataclasses.asdict(d)), workers
    ) or ResumableSampler(len(train), shuffle=d.shuffle, seed=d.seed)
    train_loader = RLDataLoader(train, d.train_batch_size, sampler, collate_fn, True, num_workers=workers)
    val_bs = d.val_batch_size or len(val)
    val_loader = RLDataLoader(
        val, val_bs, ResumableSampler(len(val), shuffle=False, seed=0), collate_fn, False, num_workers=workers
    )
    return train_loader, _OneEpoch(val_loader)


class _OneEpoch:
    """Iterate a loader for exactly one pass (validation)."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        n = len(self.loader) if len(self.loader) > 0 else 1
        it = iter(self.loader)
        for _ in range(n):
            yield next(it)


def build_reward_fns(config: PPOConfig, tokenizer):

    crf = config.custom_reward_function
    compute_score = load_custom_reward_fn(crf.path, crf.name, dict(crf.reward_kwargs)) if crf.path else None
    sandbox = config.reward_model.sandbox_fusion
    if sandbox.url and compute_score is None:  # code data sources run on SandboxFusion
        import functools

        from hybridrl.reward.scorers.sandbox_fusion import SandboxSettings, compute_score_with_sandbox

        settings = SandboxSettings(sandbox.url, sandbox.max_concurrent, sandbox.memory_limit_mb)
        compute_score = functools.partial(compute_score_with_sandbox, sandbox=settings)
    name = config.reward_model.reward_manager
    extra = reward_manager_kwargs(config)  # hybridrl's keys + reward_model.reward_kwargs (one setting)
    extra.update(genrm_reward_kwargs(config, compute_score))  # the judge's client, filled by the reward loop
    key = config.data.reward_fn_key
    cls = reward_manager_class(config)  # reward_manager.source=importlib
    if cls is not None:
        return tuple(
            RewardWithDeadline(cls(tokenizer, n, compute_score=compute_score, reward_fn_key=key, **extra))
            for n in (0, 1)
        )
    train = load_reward_manager(name, tokenizer, 0, compute_score, reward_fn_key=key, **extra)
    val = load_reward_manager(name, tokenizer, 1, compute_score, reward_fn_key=key, **extra)
    return RewardWithDeadline(train), RewardWithDeadline(val)


@dataclasses.dataclass
class RunParts:
    """What every trainer needs besides its workers (built by `prepare_run`)."""

    tokenizer: Any
    train_loader: Any
    val_loader: Any
    reward_fn: Any
    val_reward_fn: Any
    tracker: Any


def prepare_run(config: PPOConfig) -> RunParts:
    """Seeds, tokenizer, data, step counts, reward functions and the tracker: the driver-side part
    of a run, shared by the synchronous and the asynchronous trainer (workers start after it)."""
    import random

    resolve_builtin(config)
    deadlines.configure(config.trainer)
    seed = config.trainer.seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    check_data_files(config)  # every used row of the train/val files: a bad row names file, row, column
    model_cfg = read_model_config(config)  # a broken config.json names the key (before the tokenizer)
    tokenizer = load_tokenizer(driver_tokenizer_config(config))
    check_model_inputs(config, tokenizer, model_cfg)
    check_plugins(config)  # tools, interactions, agent loops, the tool-call parser (after external_lib)
    train_loader, val_loader = build_datasets(config, tokenizer, load_run_processor(config))
    check_first_rows(train_loader, val_loader)  # a bad prompt column fails here, before Ray
    steps = total_steps(config, len(train_loader))
    config.trainer.total_training_steps = steps
    config.actor_rollout_ref.actor.optim.total_training_steps = steps
    config.critic.optim.total_training_steps = steps
    resolve_compile_layers(config, model_cfg, use_gpu(config))  # null: auto, printed (compile_auto.py)
    reward_fn, val_reward_fn = wrap_reward_errors(config, lambda: build_reward_fns(config, tokenizer))
    tracker = Tracking(
        config.trainer.project_name,
        config.trainer.experiment_name,
        config.trainer.logger,
        config=dataclasses.asdict(config),
        log_dir=os.environ.get("HYBRIDRL_LOG_DIR"),
        console_every=config.trainer.log_freq,
    )
    return RunParts(tokenizer, train_loader, val_loader, reward_fn, val_reward_fn, tracker)


def build_trainer(
    config: PPOConfig, init_ray=None, role_worker_mapping=None, trainer_cls: type = RayPPOTrainer
) -> RayPPOTrainer:
    """Everything a run needs, in order; workers start last (they are the slow part).

    role_worker_mapping / trainer_cls: the user's worker and trainer classes (trainer/ppo/roles.py)."""
    check_trainer_cls(trainer_cls, RayPPOTrainer)
    worker_classes(config, role_worker_mapping)  # a wrong class fails before anything starts

    checkpoints = RunCheckpoints(config)
    checkpoints.plan_resume()  # another run's checkpoint folder is refused before anything starts
    run = prepare_run(config)
    peak = _peak_flops(config)
    if init_ray is not None and uses_ray(config):
        init_ray(config)
    workers = start_workers(config, peak_flops=peak, role_worker_mapping=role_worker_mapping)
    with shutdown_on_error(workers):
        workers.reward_loop = start_reward_loop(config, run.reward_fn, run.val_reward_fn)
        trainer = trainer_of(trainer_cls, config, run, workers)
        trainer.checkpoints = checkpoints
        trainer.floors = measure_step_floors(config)  # trainer.log_floors: perf/floor/* each step
    return trainer


def trainer_of(trainer_cls: type, config, run, workers):
    """`trainer_cls` over a prepared run (`prepare_run`) and its started workers."""
    return trainer_cls(
        config,
        run.tokenizer,
        workers,
        run.train_loader,
        run.val_loader,
        run.reward_fn,
        run.val_reward_fn,
        run.tracker,
    )


def _peak_flops(config: PPOConfig) -> float | None:

    mp = config.actor_rollout_ref.actor.fsdp_config
    dtype = (
        str_to_dtype(mp.mixed_precision.param_dtype)
        if mp.model_dtype in ("fp32", "float32")
        else str_to_dtype(mp.model_dtype)
    )
    threads = torch.get_num_threads()
    if not torch.cuda.is_available():  # one slot's peak: measure with the slot's thread count
        torch.set_num_threads(max(1, int(config.trainer.cpus_per_worker)))
    try:
        peak = get_peak_flops(dtype=dtype)
    finally:
        torch.set_num_threads(threads)
    return peak or None
