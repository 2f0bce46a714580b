"""veRL's *.megatron.* keys: each honoured or refused at start-up with a message naming the key.

No megatron-core needed: this is config validation and composition only.
"""

from __future__ import annotations

import pytest

from hybridrl.config.megatron import (
    MegatronConfig,
    check_colocated_megatron,
    validate_megatron_config,
)

KEY = "actor_rollout_ref.actor.megatron"


@pytest.mark.parametrize(
    "kwargs,on_gpu,match",
    [
        (
            {"context_parallel_size": 2, "pipeline_model_parallel_size": 2},
            False,
            "divide the number of ranks",
        ),
        ({"context_parallel_size": 4}, False, "divide the number of ranks"),
        ({"context_parallel_size": 0}, False, "context_parallel_size"),
        (
            {"expert_model_parallel_size": 4},
            False,
            "expert_model_parallel_size .* must divide the number of ranks",
        ),
        ({"expert_model_parallel_size": 0}, False, "expert_model_parallel_size must be >= 1"),
        ({"expert_tensor_parallel_size": 0}, False, "expert_tensor_parallel_size must be >= 1"),
        ({"virtual_pipeline_model_parallel_size": 2}, False, "pipeline_model_parallel_size >= 2"),
        ({"param_offload": True}, True, "offload"),
        ({"dtype": "float16"}, False, "float16"),
        ({"dtype": "int8"}, False, "bfloat16 or float32"),
        ({"use_dist_checkpointing": True}, False, "dist_checkpointing_path"),
        ({"tensor_model_parallel_size": 0}, False, "tensor_model_parallel_size"),
        ({"tensor_model_parallel_size": 4}, False, "divide the number of ranks"),
    ],
)
def test_refused(kwargs, on_gpu, match):
    with pytest.raises(ValueError, match=match) as e:
        validate_megatron_config(MegatronConfig(**kwargs), KEY, world_size=2, on_gpu=on_gpu)
    assert KEY in str(e.value)


def test_expert_parallel_with_tp_turns_sequence_parallel_on():
    """megatron-core's MoE layer needs SP at EP > 1 with TP > 1; veRL's default for it is true."""
    cfg = MegatronConfig(
        expert_model_parallel_size=2, expert_tensor_parallel_size=1, tensor_model_parallel_size=2
    )
    validate_megatron_config(cfg, KEY, world_size=2, on_gpu=False)
    assert cfg.sequence_parallel


def test_accepted_and_no_ops():
    # sequence_parallel at TP=1 (Megatron ignores it) and TP=2 (honoured: test_megatron_engine.py),
    # offload on CPU (no-ops), use_mbridge either way
    for kwargs in (
        {"sequence_parallel": True},
        {"sequence_parallel": True, "tensor_model_parallel_size": 2},
        {"param_offload": True, "grad_offload": True},
        {"use_mbridge": True},
        {"virtual_pipeline_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
        {"context_parallel_size": 2},  # honoured: test_megatron_engine.py
        {"expert_model_parallel_size": 2},  # honoured on MoE models: test_megatron_moe.py
        {"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1},
        {
            "expert_model_parallel_size": 2,
            "expert_tensor_parallel_size": 1,
            "tensor_model_parallel_size": 2,
            "sequence_parallel": True,
        },
    ):
        validate_megatron_config(MegatronConfig(**kwargs), KEY, world_size=2, on_gpu=False)
    # CP with PP (and VPP): honoured, test_megatron_pp2_cp2_matches_fsdp
    for vpp in (None, 2):
        pp_cp = MegatronConfig(
            pipeline_model_parallel_size=2, context_parallel_size=2, virtual_pipeline_model_parallel_size=vpp
        )
        validate_megatron_config(pp_cp, KEY, world_size=4, on_gpu=False)
    from hybridrl.config.roles import ActorConfig
    from hybridrl.workers.parallel_dims import ParallelDims

    mcfg = MegatronConfig(tensor_model_parallel_size=2)
    meg = ActorConfig(strategy="megatron", megatron=mcfg)
    assert ParallelDims.for_role(4, meg, "actor_rollout_ref.actor").data_ranks == 2
    assert ParallelDims.for_role(4, ActorConfig(megatron=mcfg), "actor_rollout_ref.actor").data_ranks == 4


def test_context_parallel_dims_and_mesh():
    """CP ranks share the rows: data ranks = world / (tp * cp); the batch is split over dp only and each
    dp group's result is collected from its cp rank 0 / tp rank 0 (Megatron's rank order tp-cp-dp)."""
    from hybridrl.config.roles import ActorConfig
    from hybridrl.workers.parallel_dims import ParallelDims

    mcfg = MegatronConfig(tensor_model_parallel_size=2, context_parallel_size=2)
    dims = ParallelDims.for_role(
        8, ActorConfig(strategy="megatron", megatron=mcfg), "actor_rollout_ref.actor"
    )
    assert (dims.data_ranks, dims.dp) == (2, 2)
    mesh = dims.train_mesh()
    assert mesh.dp_size == 2
    # ranks 0-3 (tp x cp of replica 0) get dp shard 0, ranks 4-7 shard 1; collected from ranks 0 and 4
    assert [mesh.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [r for r in range(8) if mesh.is_collector(r)] == [0, 4]
    with pytest.raises(ValueError, match="context_parallel_size"):
        ParallelDims.for_role(6, ActorConfig(strategy="megatron", megatron=mcfg), "actor_rollout_ref.actor")


def test_pp_cp_mesh_matches_megatron_rank_order():
    """pp x dp x cp x tp (PP=2, CP=2, TP=2 on 16 ranks: DP=2): every rank's dp / cp / pp / tp group of the
    dispatch mesh is Megatron's own (its RankGenerator, order tp-cp-ep-dp-pp); rows go to the dp groups and
    each is collected once, from the last stage's cp / tp rank 0."""
    pytest.importorskip("megatron.core")
    from megatron.core.parallel_state import RankGenerator

    from hybridrl.config.roles import ActorConfig
    from hybridrl.workers.parallel_dims import ParallelDims

    mcfg = MegatronConfig(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2
    )
    dims = ParallelDims.for_role(
        16, ActorConfig(strategy="megatron", megatron=mcfg), "actor_rollout_ref.actor"
    )
    assert (dims.data_ranks, dims.dp) == (2, 2)
    mesh = dims.train_mesh()
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=2, order="tp-cp-ep-dp-pp")
    for name in ("tp", "cp", "dp", "pp"):
        assert sorted(mesh.groups([name])) == sorted(gen.get_ranks(name)), name
    collectors = [r for r in range(16) if mesh.is_collector(r)]
    assert sorted(mesh.dp_rank(r) for r in collectors) == [0, 1]
    firsts = {name: {g[0] for g in gen.get_ranks(name)} for name in ("tp", "cp")}
    last_stage = {g[-1] for g in gen.get_ranks("pp")}
    assert all(r in last_stage and r in firsts["tp"] and r in firsts["cp"] for r in collectors), collectors


def test_colocated_roles_need_the_same_sizes():
    tp2, pp2 = MegatronConfig(tensor_model_parallel_size=2), MegatronConfig(pipeline_model_parallel_size=2)
    check_colocated_megatron({"a": ("megatron", tp2), "critic": ("megatron", tp2), "r": ("fsdp", pp2)})
    with pytest.raises(ValueError, match="critic.megatron"):
        check_colocated_megatron({"a": ("megatron", tp2), "critic": ("megatron", pp2)})


def test_keys_compose_and_ppo_megatron_trainer(tmp_path):
    from hydra import compose, initialize_config_module

    from hybridrl.trainer.ppo.config import load_config

    over = [
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full",
    ]
    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        cfg = load_config(compose("ppo_megatron_trainer", overrides=over))
    arr = cfg.actor_rollout_ref
    assert (arr.actor.strategy, arr.ref.strategy, cfg.critic.strategy) == ("megatron",) * 3
    assert arr.actor.megatron.tensor_model_parallel_size == 2
    assert arr.ref.megatron.tensor_model_parallel_size == 2  # the reference follows the actor
    assert arr.actor.megatron.override_transformer_config == {"recompute_granularity": "full"}
    assert MegatronConfig().dtype == "bfloat16"  # veRL's default; the quickstart yaml trains in fp32
    assert (arr.actor.megatron.dtype, arr.ref.megatron.dtype, cfg.critic.megatron.dtype) == ("float32",) * 3
    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        bf = load_config(
            compose(
                "ppo_megatron_trainer", overrides=[*over, "actor_rollout_ref.actor.megatron.dtype=bfloat16"]
            )
        )
    assert bf.actor_rollout_ref.ref.megatron.dtype == "bfloat16"  # the reference follows the actor


@pytest.mark.parametrize("key", ["actor_rollout_ref.model", "critic.model"])
def test_remove_padding_accepted_with_megatron(tmp_path, key):
    """Megatron packs the rows when use_remove_padding=True (engine/megatron/forward.py; equal to
    FSDP in test_megatron_engine.py), so the config stage accepts it for both roles."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from hybridrl.trainer.ppo.config_stage import check_startup

    over = [
        "trainer.n_gpus_per_node=2",
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "critic.ppo_micro_batch_size_per_gpu=8",
        f"{key}.use_remove_padding=true",
    ]
    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        cfg = compose("ppo_megatron_trainer", overrides=over)
        fsdp = compose("ppo_trainer", overrides=over)
    assert OmegaConf.select(cfg, f"{key}.use_remove_padding") is True
    check_startup(cfg)
    check_startup(fsdp)


@pytest.mark.parametrize("key", ["actor_rollout_ref.model", "critic.model"])
def test_use_fused_kernels_with_megatron(key):
    """Megatron: False passes; True set by the user is the fused head on the actor (fused_head.py) and
    refused on the critic (no vocabulary); hybridrl's default True (not set by the user) becomes False
    (veRL's Megatron default); FSDP keeps True."""
    from hydra import compose, initialize_config_module

    from hybridrl.trainer.ppo.config import ConfigError
    from hybridrl.trainer.ppo.config_stage import check_startup

    over = [
        "trainer.n_gpus_per_node=2",
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "critic.ppo_micro_batch_size_per_gpu=8",
    ]
    flag = f"{key}.use_fused_kernels"

    def model_of(c):
        return c.actor_rollout_ref.model if key.startswith("actor") else c.critic.model

    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        meg_default = compose("ppo_megatron_trainer", overrides=over)
        meg_true = compose("ppo_megatron_trainer", overrides=[*over, f"{flag}=true"])
        meg_false = compose("ppo_megatron_trainer", overrides=[*over, f"{flag}=false"])
        fsdp = compose("ppo_trainer", overrides=over)
    if key.startswith("critic"):
        with pytest.raises(ConfigError, match=f"{flag}=True with strategy=megatron: the Megatron critic"):
            check_startup(meg_true, explicit_keys=[flag])
    else:
        assert model_of(check_startup(meg_true, explicit_keys=[flag])).use_fused_kernels is True
    assert model_of(check_startup(meg_false, explicit_keys=[flag])).use_fused_kernels is False
    assert model_of(check_startup(meg_default, explicit_keys=[])).use_fused_kernels is False
    assert model_of(check_startup(fsdp, explicit_keys=[])).use_fused_kernels is True


def _startup(name: str, *extra: str):
    from hydra import compose, initialize_config_module

    from hybridrl.trainer.ppo.config_stage import check_startup

    over = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", *extra]
    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        cfg = compose(name, overrides=over)
    return check_startup(cfg)


def test_mtp_keys_at_the_config_stage():
    """model.mtp.* (veRL's keys): Megatron only; enable_rollout puts veRL's speculative-decoding
    arguments into the vllm / sglang engine kwargs (the user's own win) and is refused with HF."""
    from hybridrl.trainer.ppo.config import ConfigError

    m = "actor_rollout_ref.model.mtp"
    on = [f"{m}.enable=true", f"{m}.enable_train=true", f"{m}.mtp_loss_scaling_factor=0.2"]
    cfg = _startup("ppo_megatron_trainer", *on)
    mtp = cfg.actor_rollout_ref.model.mtp
    assert (mtp.enable, mtp.enable_train, mtp.mtp_loss_scaling_factor, mtp.detach_encoder) == (
        True,
        True,
        0.2,
        False,
    )
    assert (
        _startup(
            "ppo_trainer", f"{m}.enable=false", f"{m}.enable_train=true"
        ).actor_rollout_ref.model.mtp.enable
        is False
    )
    with pytest.raises(ConfigError, match=r"mtp.enable=True needs actor strategy=megatron"):
        _startup("ppo_trainer", *on)
    with pytest.raises(ConfigError, match=r"mtp_loss_scaling_factor must be >= 0"):
        _startup("ppo_megatron_trainer", f"{m}.enable=true", f"{m}.mtp_loss_scaling_factor=-1")
    # with CP and with PP: honoured (test_megatron_mtp.py)
    for layout in ("context_parallel_size=2", "pipeline_model_parallel_size=2"):
        cfg = _startup("ppo_megatron_trainer", *on, f"actor_rollout_ref.actor.megatron.{layout}")
        assert cfg.actor_rollout_ref.model.mtp.enable
    with pytest.raises(ConfigError, match=r"enable_rollout=True with rollout.name=hf"):
        _startup("ppo_megatron_trainer", *on, f"{m}.enable_rollout=true", "actor_rollout_ref.rollout.name=hf")
    rollout = "actor_rollout_ref.rollout"
    vllm = _startup(
        "ppo_megatron_trainer",
        *on,
        f"{m}.enable_rollout=true",
        f"{rollout}.name=vllm",
        f"{m}.num_speculative_tokens=3",
    ).actor_rollout_ref.rollout.engine_kwargs.vllm
    assert vllm["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3}
    sgl = _startup(
        "ppo_megatron_trainer", *on, f"{m}.enable_rollout=true", f"{rollout}.name=sglang",
        f"{m}.speculative_num_steps=2", f"+{rollout}.engine_kwargs.sglang.speculative_eagle_topk=4",
    ).actor_rollout_ref.rollout.engine_kwargs.sglang  # fmt: skip
    assert sgl == {
        "speculative_algorithm": "EAGLE",
        "speculative_num_steps": 2,
        "speculative_eagle_topk": 4,  # the user's engine_kwargs win
        "speculative_num_draft_tokens": 4,
    }
