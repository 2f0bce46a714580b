"""A mixture-of-experts actor through main_ppo (HF rollout, FSDP2): rollout routing replay (R3) with
the shared-prompt forward and the router load-balancing loss, and R2 with the separate old-log-prob
pass; the MoE metrics are in the step log. The in-process backend (`trainer.backend=local`, the same
training as the Ray backend: test_local_backend.py) keeps the runs short."""

from __future__ import annotations

import pytest

from tests.e2e.ppo_runs import assert_finite, run

MOE_KEYS = ["actor/moe/aux_loss", "actor/moe/load_max_over_mean", "actor/moe/layer_1/load_max_over_mean",
            "actor/moe/tokens_per_expert/0", "actor/pg_loss", "actor/grad_norm"]  # fmt: skip


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    from hybridrl.models.builtin import build_moe_model_config
    from hybridrl.models.tokenizer_builder import build_tokenizer

    path = tmp_path_factory.mktemp("tiny_moe")
    tok = build_tokenizer(path)
    torch.manual_seed(0)
    cfg = build_moe_model_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(path))
    return str(path)


def _common(path):
    return [
        f"actor_rollout_ref.model.path={path}",
        "actor_rollout_ref.rollout.name=hf",
        "trainer.backend=local",
        "algorithm.adv_estimator=grpo",
        "+actor_rollout_ref.model.override_config.output_router_logits=true",
        "+actor_rollout_ref.model.override_config.router_aux_loss_coef=0.01",
    ]


def test_r3_with_the_shared_prompt_forward(moe_model, tmp_path):
    rows = run(
        [*_common(moe_model), "actor_rollout_ref.actor.router_replay.mode=R3",
         "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
         "actor_rollout_ref.actor.skip_on_policy_old_log_prob=false"],
        tmp_path,
    )  # fmt: skip
    assert_finite(rows, MOE_KEYS)
    coefs = [r["actor/router_aux_loss_coef"] for r in rows if "actor/router_aux_loss_coef" in r]
    assert coefs and all(c == pytest.approx(0.01) for c in coefs), coefs


def test_r2_replays_the_old_log_prob_pass(moe_model, tmp_path):
    rows = run(
        [*_common(moe_model), "actor_rollout_ref.actor.router_replay.mode=R2",
         "actor_rollout_ref.actor.skip_on_policy_old_log_prob=false", "actor_rollout_ref.actor.use_prefix_grouper=false"],
        tmp_path,
    )  # fmt: skip
    assert_finite(rows, MOE_KEYS)


@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_megatron_actor_replays_routing(moe_model, tmp_path, mode):
    """The same modes on the Megatron engine (megatron-core's RouterReplay): R2 records in the
    old-log-prob pass, R3 replays the HF rollout's routing. On the Ray backend: megatron-core run
    inside the test process would leave state that the forked ranks of later tests inherit."""
    pytest.importorskip("megatron.core")
    replay = ["actor_rollout_ref.actor.router_replay.mode=" + mode]
    if mode == "R3":
        replay.append("actor_rollout_ref.rollout.enable_rollout_routing_replay=true")
    rows = run(
        [f"actor_rollout_ref.model.path={moe_model}", "actor_rollout_ref.rollout.name=hf", "trainer.backend=ray",
         "algorithm.adv_estimator=grpo", *replay, "actor_rollout_ref.actor.strategy=megatron",
         "actor_rollout_ref.actor.skip_on_policy_old_log_prob=false", "actor_rollout_ref.actor.use_prefix_grouper=false"],
        tmp_path,
    )  # fmt: skip
    assert_finite(rows, ["actor/pg_loss", "actor/grad_norm"])
