"""A generative reward model (GenRM): a real judge (the built-in model, HF generate in a Ray actor)
scores batches through the GenRM recipe's custom reward function (recipes/genrm/judge_reward.py).

The reference answers come from the same model loaded here and run greedily with `generate`,
so a judge answer in the wrong row, a lost row or a wrong sampling default fails the test.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from hybridrl.config.roles import RewardModelConfig, RewardModelModelConfig, RewardRolloutConfig
from hybridrl.models.builtin import resolve_model_path
from hybridrl.protocol import DataProto
from hybridrl.reward.custom import load_custom_reward_fn
from hybridrl.reward.genrm import GenRMClient, GenRMServer, attach_client
from hybridrl.reward.manager import load_reward_manager
from hybridrl.reward.reward_loop import RewardLoopManager, genrm_metrics
from hybridrl.trainer.ppo.config import ConfigError

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "genrm", "judge_reward.py")
QUESTIONS = ["12+34=", "50+27=", "12+34=", "88+91=", "33+44=", "61+19="]
T = 10


@pytest.fixture(scope="module")
def tok():
    from hybridrl.config.roles import ModelConfig
    from hybridrl.models.hf import load_tokenizer

    return load_tokenizer(ModelConfig(path="builtin:tiny"))


@pytest.fixture(scope="module")
def judge_answers(tok):
    """{question: the built-in model's greedy answer}, computed here without hybridrl's GenRM code."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path("builtin:tiny"), dtype=torch.float32
    ).eval()
    out = {}
    for q in dict.fromkeys(QUESTIONS):
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
        out[q] = tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
    return out


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def make_batch(tok, responses: list[str]) -> DataProto:
    prompts, resp, masks = [], [], []
    for q, r in zip(QUESTIONS, responses):
        p = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        p_ids = tok.encode(p, add_special_tokens=False)[-9:]
        r_ids = tok.encode(r, add_special_tokens=False)[:T]
        prompts.append([tok.pad_token_id] * (9 - len(p_ids)) + p_ids)
        resp.append(r_ids + [tok.pad_token_id] * (T - len(r_ids)))
        masks.append([int(i >= 9 - len(p_ids)) for i in range(9)] + [1] * len(r_ids) + [0] * (T - len(r_ids)))
    prompts, resp, mask = torch.tensor(prompts), torch.tensor(resp), torch.tensor(masks)
    truths = [str(eval(q[:-1])) for q in QUESTIONS]
    return DataProto.from_dict(
        {"prompts": prompts, "responses": resp, "attention_mask": mask, "response_mask": mask[:, 9:]},
        non_tensors={
            "data_source": np.array(["hybridrl/arith"] * len(QUESTIONS), dtype=object),
            "reward_model": np.array([{"ground_truth": t} for t in truths], dtype=object),
            "extra_info": np.array([{"question": q} for q in QUESTIONS], dtype=object),
        },
    )


def genrm_config(**rollout) -> RewardModelConfig:
    r = {"name": "hf", "dtype": "float32", "prompt_length": 32, "response_length": 12, "do_sample": False}
    return RewardModelConfig(
        enable=True,
        use_reward_loop=True,
        num_workers=1,  # several workers: tests/reward/test_reward_loop.py (each is a process to start)
        model=RewardModelModelConfig(path="builtin:tiny"),
        rollout=RewardRolloutConfig(**{**r, **rollout}),
    )


def manager(tok, **reward_kwargs):
    fn = load_custom_reward_fn(RECIPE, "compute_score_batch", reward_kwargs)
    placeholders = {"reward_model_client": None, "reward_model_tokenizer": None}
    return load_reward_manager("batch", tok, 0, fn, **placeholders)


def responses_for(answers: dict[str, str]) -> list[str]:
    """Rows 0, 2 and 4 repeat the judge's answer, the others answer 1 more."""
    out = []
    for i, q in enumerate(QUESTIONS):
        n = int(answers[q].split("####")[-1].strip())
        out.append(f"#### {n if i % 2 == 0 else n + 1}")
    return out


@pytest.fixture(scope="module", params=["local", pytest.param("ray", marks=pytest.mark.slow)])
def loop(request, tok):
    """The reward loop of a GenRM run: a reward-loop worker and a judge replica, as objects in this
    process (trainer.backend=local; seconds) or as Ray actors (slow: each actor is a process to start)."""
    use_ray = request.param == "ray"
    if use_ray:
        request.getfixturevalue("ray_cluster")
    started = RewardLoopManager(
        genrm_config(), None, manager(tok), slots=1, use_ray=use_ray, num_threads=1, genrm=True
    )
    yield started
    started.shutdown()


def test_judge_in_ray_actors_scores_a_batch_through_the_custom_function(tok, judge_answers, loop):
    batch = make_batch(tok, responses_for(judge_answers))
    scored, extras = loop.compute_rm_score(batch)
    assert extras["genrm_response"] == [judge_answers[q] for q in QUESTIONS]
    scores = scored.batch["rm_scores"].sum(-1).tolist()
    assert scores == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    last = batch.batch["response_mask"].sum(-1) - 1
    assert (scored.batch["rm_scores"][torch.arange(6), last] == torch.tensor(scores)).all()
    metrics = loop.pop_metrics()
    assert metrics["reward/genrm_parse_failures"] == 0.0
    rule = [
        float(r.split()[-1] == str(eval(q[:-1]))) for q, r in zip(QUESTIONS, responses_for(judge_answers))
    ]
    assert metrics["reward/genrm_agree/mean"] == pytest.approx(sum(s == r for s, r in zip(scores, rule)) / 6)
    assert loop.pop_metrics() == {}


def test_unparsable_judge_answers_are_scored_by_the_function_and_counted(tok, judge_answers, loop):
    """max_tokens=2 cuts every judge answer to '##': no number to compare, so the function scores 0.
    Scored on the driver with the loop's client (as the validation reward manager is)."""
    batch = make_batch(tok, responses_for(judge_answers))
    short = manager(tok, max_tokens=2)
    attach_client(short, loop.client, tok)
    out = short(batch, return_dict=True)
    assert out["reward_tensor"].abs().sum() == 0
    assert all(r == "##" for r in out["reward_extra_info"]["genrm_response"])
    assert genrm_metrics(out["reward_extra_info"])["reward/genrm_parse_failures"] == 6.0


def test_a_judge_that_does_not_answer_in_time_fails_naming_the_timeout_key(tok, loop):
    slow = genrm_config(request_timeout_s=0.001).rollout
    fn = manager(tok, max_tokens=32)  # 9 + 32 tokens fit the max_model_len of 32 + 12
    attach_client(fn, GenRMClient(loop.servers, slow, tok), tok)
    with pytest.raises(RuntimeError, match=r"TimeoutError.*reward_model\.rollout\.request_timeout_s=0\.001"):
        fn(make_batch(tok, ["#### 1"] * len(QUESTIONS)))


def test_genrm_prompt_longer_than_the_judge_allows_names_the_key(tok):
    server = GenRMServer("builtin:tiny", genrm_config(prompt_length=4).rollout, num_threads=1)
    with pytest.raises(ValueError, match="reward_model.rollout.prompt_length=4"):
        GenRMClient([server], genrm_config().rollout, tok).generate(["12+34=+++++"])


def _check(overrides):
    from hydra import compose, initialize_config_module

    from hybridrl.trainer.ppo.config_stage import check_startup, override_key, prepare_argv

    with initialize_config_module("hybridrl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=prepare_argv(["x", *overrides])[1:])
    return check_startup(cfg, explicit_keys={override_key(o) for o in overrides})


def test_genrm_keys_in_verls_new_layout_and_refusals(tmp_path, tok):
    from hybridrl.trainer.ppo.setup import build_reward_fns

    new = [
        "+reward.reward_model.enable=True",
        "+reward.reward_model.model_path=builtin:tiny",
        "+reward.reward_model.rollout.name=hf",
        "+reward.reward_model.rollout.temperature=0.0",
        "+reward.reward_model.rollout.request_timeout_s=5",
        f"+reward.custom_reward_function.path={RECIPE}",
        "+reward.custom_reward_function.name=compute_score",
    ]
    c = _check(new)
    assert c.reward_model.use_reward_loop and c.reward_model.enable
    assert (c.reward_model.rollout.temperature, c.reward_model.rollout.request_timeout_s) == (0.0, 5.0)
    assert build_reward_fns(c, tok)[0].reward_kwargs == {
        "reward_model_client": None,
        "reward_model_tokenizer": None,
    }
    with pytest.raises(ConfigError, match="reward_model.rollout.n=2"):
        _check(new + ["+reward.reward_model.rollout.n=2"])
    with pytest.raises(ConfigError, match="request_timeout_s=0"):
        _check(new + ["+reward.reward_model.rollout.request_timeout_s=0"])
    with pytest.raises(ConfigError, match="ignore_eos=True"):
        _check(new + ["+reward.reward_model.rollout.ignore_eos=true"])
    with pytest.raises(ConfigError, match="prime"):
        _check(new + ["reward_model.reward_manager=prime"])
    f = tmp_path / "verl_style.py"
    f.write_text(
        "async def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address, "
        "reward_model_tokenizer):\n    return 0.0\n"
    )
    c = _check(new[:-2] + [f"+reward.custom_reward_function.path={f}"])
    assert build_reward_fns(c, tok)[0].reward_kwargs == {  # veRL's shape: the router's address
        "reward_router_address": None,
        "reward_model_tokenizer": None,
    }
    g = tmp_path / "rule_only.py"
    g.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 0.0\n")
    with pytest.raises(ValueError, match="neither reward_model_client nor reward_router_address"):
        build_reward_fns(_check(new[:-2] + [f"+reward.custom_reward_function.path={g}"]), tok)


def test_start_reward_loop_gives_both_reward_managers_the_judge(tok, judge_answers):
    """The trainer's wiring (trainer.backend=local): build_reward_fns leaves placeholders, the reward
    loop fills them in the train and the validation manager with one client to the served judge."""
    from hybridrl.trainer.ppo.setup import build_reward_fns
    from hybridrl.trainer.ppo.workers import start_reward_loop

    c = _check(
        [
            "trainer.backend=local",
            "reward_model.enable=True",
            "reward_model.use_reward_loop=True",
            "reward_model.model.path=builtin:tiny",
            "reward_model.rollout.dtype=float32",
            "reward_model.rollout.do_sample=False",
            "reward_model.rollout.prompt_length=32",
            "reward_model.rollout.response_length=12",
            "reward_model.reward_manager=batch",
            f"custom_reward_function.path={RECIPE}",
            "custom_reward_function.name=compute_score_batch",
        ]
    )
    train, val = build_reward_fns(c, tok)
    loop = start_reward_loop(c, train, val)
    try:
        client = train.reward_kwargs["reward_model_client"]
        assert isinstance(client, GenRMClient) and val.reward_kwargs["reward_model_client"] is client
        assert train.reward_kwargs["reward_model_tokenizer"] is not None
        batch = make_batch(tok, responses_for(judge_answers))
        scored, _ = loop.compute_rm_score(batch)
        assert val(batch).sum(-1).tolist() == scored.batch["rm_scores"].sum(-1).tolist() == [1, 0, 1, 0, 1, 0]
    finally:
        loop.shutdown()
