"""The role-level contract every registered training engine meets, checked the same way for each.

Parametrised over the registry (`ENGINE_NAMES`: dp = FSDP2, megatron) plus the one-file test engine
of tests/engine/toy_engine.py (the example of docs/extending.md). Each engine is built
through the registry, as the workers build it (`get_engine(strategy).engine_cls.build_role`), for
the actor, reference and critic roles on a tiny random Qwen2, and driven through `PPOActor` /
`PPOCritic`:

* compute_log_prob (log-probs and entropy, temperature 0.7) equals a plain HF forward (1e-5);
* update_policy takes one step: pg_loss is the hand-derived on-policy value -token-mean(A), the
  grad norm is the one of a plain HF backward of the same loss, lr is the configured one, and the
  weights move;
* iter_params (the weight sync's route, with the worker's loader and the rollout dtype) yields
  every HF parameter name, full shapes, and the checkpoint's values before training;
* save_checkpoint + load_checkpoint: a freshly built engine gets the trained log-probs back, its
  `extra`, and then takes the same next step as the engine that was saved (optimizer restored);
* the reference (no optimizer) gives the HF log-probs and refuses optimizer_step clearly;
* the critic's compute_values equal an HF token-classification forward with the engine's own
  weights, and update_critic steps.

Every engine runs in its own forked 1-rank gloo process (fsdp_testkit.spawn), so Megatron's
process-wide state (parallel groups, CPU shims) never reaches the other tests. Megatron runs at
TP=1 here; its layouts are compared with FSDP in tests/engine/megatron/.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_testkit import make_batch, make_tiny_model_dir, spawn  # noqa: E402

from hybridrl.engine.base import (  # noqa: E402
    ENGINE_NAMES,
    all_spellings,
    canonical_engine_name,
    register_engine,
    unregister_engine,
)

all_spellings()  # imports the built-in engines, so that ENGINE_NAMES holds them at collection
ENGINES = [*ENGINE_NAMES, "toy"]
ROWS = 4
TEMPERATURE = 0.7
LR = 1e-3
TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def toy_registered():
    """The test engine in the registry for this module only (the forked ranks inherit it)."""
    import toy_engine

    register_engine("toy", toy_engine.ToyEngine)  # idempotent: importing registered it already
    yield
    unregister_engine("toy")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("contract") / "model"))


def _needs(name: str) -> None:
    if name == "megatron":
        pytest.importorskip("megatron.core")


# ----------------------------------------------------------------------------------------------
# config sections and the registry's build, as the workers do it
# ----------------------------------------------------------------------------------------------
def _sections(name: str, model_dir: str):
    """(model, actor, ref, critic) sections on engine `name`: fp32, weight decay 0, 2-row micro-batches."""
    from hybridrl.config.megatron import MegatronConfig
    from hybridrl.config.roles import (
        ActorConfig,
        CriticConfig,
        FSDPConfig,
        MixedPrecisionConfig,
        ModelConfig,
        OptimConfig,
        RefConfig,
    )

    fsdp = FSDPConfig(model_dtype="fp32", mixed_precision=MixedPrecisionConfig(param_dtype="fp32"))
    megatron = MegatronConfig(dtype="float32")
    optim = OptimConfig(lr=LR, weight_decay=0.0)
    batches = dict(ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=2, optim=optim, megatron=megatron)
    actor = ActorConfig(strategy=name, fsdp_config=fsdp, **batches)
    ref = RefConfig(strategy=name, fsdp_config=fsdp, megatron=megatron)
    critic = CriticConfig(strategy=name, **batches)
    critic = dataclasses.replace(
        critic, model=dataclasses.replace(critic.model, path=model_dir, fsdp_config=fsdp)
    )
    return ModelConfig(path=model_dir), actor, ref, critic


def _build(role: str, name: str, model_dir: str):
    """The role's engine from the registry, built the way worker_setup.build_engine does."""
    from hybridrl.engine.base import EngineBuildSpec, TrainEngine, get_engine
    from hybridrl.workers.parallel_dims import ParallelDims

    model, actor, ref, critic = _sections(name, model_dir)
    section, optim, key, model_key = {
        "actor": (actor, actor.optim, "actor_rollout_ref.actor", "actor_rollout_ref.model"),
        "ref": (ref, None, "actor_rollout_ref.ref", "actor_rollout_ref.model"),
        "critic": (critic, critic.optim, "critic", "critic.model"),
    }[role]
    model = critic.model if role == "critic" else model
    mesh = ParallelDims.for_role(1, section, key).train_mesh()
    spec = EngineBuildSpec(role, model, section, optim, key, model_key, mesh, 0)
    engine = get_engine(section.strategy, f"{key}.strategy").engine_cls.build_role(spec)
    assert isinstance(engine, TrainEngine) and engine.role == role
    assert (engine.dp_size, engine.dp_rank, engine.dp_group) == (1, 0, None)
    return engine, section


def _data(seed: int = 3):
    from hybridrl.protocol import DataProto

    batch = make_batch(ROWS, seed=seed)
    g = torch.Generator().manual_seed(seed)
    t = batch["responses"].shape[1]
    batch["advantages"] = torch.randn(ROWS, t, generator=g)
    batch["values"] = 0.1 * torch.randn(ROWS, t, generator=g)
    batch["returns"] = torch.randn(ROWS, t, generator=g)
    return DataProto.from_dict(batch)


# ----------------------------------------------------------------------------------------------
# plain Hugging Face references
# ----------------------------------------------------------------------------------------------
def _hf_response_logits(model, data) -> torch.Tensor:
    """(B, T, V) float32: the logits at the positions that predict the response tokens."""
    b, t = data.batch, data.batch["responses"].shape[-1]
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"])
    return out.logits[:, -t - 1 : -1].float()


def _hf_log_probs(model_dir: str, data):
    """(log-probs, entropy, grad norm of the on-policy PPO loss -token-mean(A * ratio)) of plain HF."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logits = _hf_response_logits(model, data) / TEMPERATURE
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, data.batch["responses"][..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    mask = data.batch["response_mask"].float()
    (-(data.batch["advantages"] * lp * mask).sum() / mask.sum()).backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    return lp.detach(), entropy.detach(), float(grad_norm)


def _hf_params(model_dir: str, role: str) -> dict[str, torch.Tensor]:
    from hybridrl.config.roles import ModelConfig
    from hybridrl.models.hf import build_hf_model

    model = build_hf_model(ModelConfig(path=model_dir), role=role)
    return {k: v.detach() for k, v in model.named_parameters()}


def _close(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, what: str, tol: float = TOL) -> None:
    diff = float((a - b)[mask.bool()].abs().max())
    assert diff < tol, f"{what}: max |diff| {diff:.2e} over the response tokens (tolerance {tol})"


def _weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.iter_params()}


def _moved(before: dict, after: dict) -> float:
    return max(float((after[k] - before[k]).abs().max()) for k in before)


# ----------------------------------------------------------------------------------------------
# the checks (run on the forked rank)
# ----------------------------------------------------------------------------------------------
def _check_iter_params(engine, section, model_dir: str, role: str) -> None:
    """The weight sync's call: the worker's loader for the engine, the rollout's dtype."""
    from hybridrl.rollout.parallel import weight_loader_for

    loader = weight_loader_for("auto", section.strategy)
    expected = _hf_params(model_dir, role)
    got = dict(engine.iter_params(dtype=torch.bfloat16, loader=loader))
    assert set(got) == set(expected), f"names differ: {sorted(set(got) ^ set(expected))}"
    for name, tensor in got.items():
        assert tensor.shape == expected[name].shape, (name, tensor.shape, expected[name].shape)
        assert tensor.dtype == torch.bfloat16, (name, tensor.dtype)
        if not name.startswith("score."):  # the critic's fresh value head is each engine's own draw
            torch.testing.assert_close(tensor, expected[name].bfloat16(), atol=0, rtol=0, msg=name)
    with pytest.raises(ValueError, match="loader"):
        engine.iter_params(loader="no-such-loader")


def _actor(engine, section):
    from hybridrl.workers.actor import PPOActor
    from hybridrl.workers.batch_sizes import normalize_actor_batch_sizes

    sizes = normalize_actor_batch_sizes(section, rollout_n=1, dp_size=engine.dp_size)
    return PPOActor(section, engine, batch_sizes=sizes)


def _log_probs(actor, data):
    out = actor.compute_log_prob(data, calculate_entropy=True, micro_batch_size=3, temperature=TEMPERATURE)
    assert out.log_probs.shape == data.batch["responses"].shape and out.log_probs.dtype == torch.float32
    return out


def _check_update(actor, data, hf_grad_norm: float) -> dict[str, list[float]]:
    data.batch["old_log_probs"] = _log_probs(actor, data).log_probs
    before = _weights(actor.engine)
    metrics = actor.update_policy(data, temperature=TEMPERATURE)
    mask = data.batch["response_mask"].float()
    on_policy = float(-(data.batch["advantages"] * mask).sum() / mask.sum())  # ratio 1: -token-mean(A)
    (pg_loss,), (grad_norm,), (lr,) = (
        metrics["actor/pg_loss"],
        metrics["actor/grad_norm"],
        metrics["actor/lr"],
    )
    assert abs(pg_loss - on_policy) < TOL, (pg_loss, on_policy)
    assert abs(grad_norm - hf_grad_norm) < 1e-4 * hf_grad_norm, (grad_norm, hf_grad_norm)
    assert lr == pytest.approx(LR) and metrics["actor/step_skipped"] == [0.0]
    assert _moved(before, _weights(actor.engine)) > 1e-4, "update_policy did not change the weights"
    return metrics


def _check_checkpoint(engine, actor, name: str, model_dir: str, ckpt: str) -> None:
    """Save; a fresh engine loads it: same log-probs, same extra, then the same next step."""
    data = _data()
    trained = _log_probs(actor, data).log_probs
    engine.save_checkpoint(ckpt, global_step=7, extra={"rollout_calls": 3})
    fresh, section = _build("actor", name, model_dir)
    again = _actor(fresh, section)
    mask = data.batch["response_mask"]
    untrained = _log_probs(again, data).log_probs
    assert float((untrained - trained)[mask.bool()].abs().max()) > 1e-4  # the load has work to do
    state = fresh.load_checkpoint(ckpt)
    assert state["extra"] == {"rollout_calls": 3}, state
    _close(_log_probs(again, data).log_probs, trained, mask, "log-probs after load_checkpoint", 1e-6)
    nxt = _data(seed=11)
    nxt.batch["old_log_probs"] = _log_probs(actor, nxt).log_probs
    m_saved, m_loaded = actor.update_policy(nxt), again.update_policy(nxt)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/lr"):
        assert m_saved[key] == pytest.approx(m_loaded[key], rel=1e-6, abs=1e-7), key
    w_saved, w_loaded = _weights(engine), _weights(fresh)
    assert max(float((w_saved[k] - w_loaded[k]).abs().max()) for k in w_saved) < 1e-6


def _actor_contract(rank, world, name, model_dir, ckpt):
    data = _data()
    hf_lp, hf_ent, hf_grad_norm = _hf_log_probs(model_dir, data)
    engine, section = _build("actor", name, model_dir)
    _check_iter_params(engine, section, model_dir, "actor")
    actor = _actor(engine, section)
    out = _log_probs(actor, data)
    mask = data.batch["response_mask"]
    _close(out.log_probs, hf_lp, mask, "log-probs vs a plain HF forward")
    _close(out.entropy, hf_ent, mask, "entropy vs a plain HF forward")
    _check_update(actor, data, hf_grad_norm)
    _check_checkpoint(engine, actor, name, model_dir, ckpt)


def _ref_contract(rank, world, name, model_dir):
    from hybridrl.workers.actor import PPOActor

    data = _data()
    hf_lp, _, _ = _hf_log_probs(model_dir, data)
    engine, section = _build("ref", name, model_dir)
    assert engine.optimizer is None
    ref = PPOActor(section.policy_config(), engine)
    lp = ref.compute_log_prob(data, micro_batch_size=2, temperature=TEMPERATURE).log_probs
    _close(lp, hf_lp, data.batch["response_mask"], "reference log-probs vs a plain HF forward")
    for refused in (lambda: engine.optimizer_step(1.0), engine.lr):
        with pytest.raises(RuntimeError, match="built forward-only"):
            refused()
    with pytest.raises(RuntimeError, match="needs an optimizer"):
        ref.update_policy(data)


def _critic_contract(rank, world, name, model_dir):
    from hybridrl.models.hf import build_hf_model
    from hybridrl.workers.batch_sizes import normalize_critic_batch_sizes
    from hybridrl.workers.critic import PPOCritic

    data = _data()
    engine, section = _build("critic", name, model_dir)
    _check_iter_params(engine, section, model_dir, "critic")
    critic = PPOCritic(section, engine, batch_sizes=normalize_critic_batch_sizes(section, dp_size=1))
    values = critic.compute_values(data, micro_batch_size=3)
    hf = build_hf_model(section.model, role="critic", key="critic.model")
    weights = _weights(engine)
    with torch.no_grad():
        for k, p in hf.named_parameters():
            p.copy_(weights[k])
    hf.eval()
    mask = data.batch["response_mask"]
    hf_values = _hf_response_logits(hf, data)[..., 0].detach() * mask
    _close(values, hf_values, mask, "values vs an HF token-classification forward")
    assert torch.all(values[~mask.bool()] == 0)
    metrics = critic.update_critic(data)
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/lr"):
        assert len(metrics[key]) == 1 and torch.isfinite(torch.tensor(metrics[key][0])), (key, metrics)
    assert metrics["critic/grad_norm"][0] > 0 and metrics["critic/lr"][0] == pytest.approx(LR)
    assert _moved(weights, _weights(engine)) > 1e-4, "update_critic did not change the weights"
    assert float((critic.compute_values(data) - values)[mask.bool()].abs().max()) > 1e-5


# ----------------------------------------------------------------------------------------------
# the tests
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ENGINES)
def test_actor_contract(name, model_dir, tmp_path):
    _needs(name)
    spawn(_actor_contract, 1, tmp_path, name, model_dir, str(tmp_path / "ckpt"))


@pytest.mark.parametrize("name", ENGINES)
def test_ref_contract(name, model_dir, tmp_path):
    _needs(name)
    spawn(_ref_contract, 1, tmp_path, name, model_dir)


@pytest.mark.parametrize("name", ENGINES)
def test_critic_contract(name, model_dir, tmp_path):
    _needs(name)
    spawn(_critic_contract, 1, tmp_path, name, model_dir)


def test_model_engine_and_strategy_select_a_registered_engine():
    """`model_engine=toy` puts actor, ref and critic on the test engine; `*.strategy=toy` one role."""
    from hydra import compose, initialize_config_module

    from hybridrl.trainer.ppo.config import load_config

    def load(overrides):
        with initialize_config_module("hybridrl.trainer.config", version_base=None):
            return load_config(compose("ppo_trainer", overrides=overrides))

    c = load(["model_engine=toy"])
    assert (c.actor_rollout_ref.actor.strategy, c.actor_rollout_ref.ref.strategy, c.critic.strategy) == (
        "toy",
        "toy",
        "toy",
    )
    c = load(["critic.strategy=toy"])
    assert (c.actor_rollout_ref.actor.strategy, c.critic.strategy) == ("fsdp", "toy")


def test_unregister_engine_removes_every_spelling():
    import toy_engine

    register_engine("contract-tmp", toy_engine.ToyEngine, aliases=("contract-alias",))
    assert canonical_engine_name("contract-alias") == "contract-tmp"
    unregister_engine("contract-tmp")
    assert "contract-tmp" not in ENGINE_NAMES
    with pytest.raises(ValueError, match="model_engine='contract-alias' is not a registered"):
        canonical_engine_name("contract-alias")
    with pytest.raises(KeyError, match="no training engine is registered"):
        unregister_engine("contract-tmp")
