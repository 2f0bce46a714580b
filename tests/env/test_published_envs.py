"""The bridges to published environments, without a trainer: argument checks and row mapping."""

from __future__ import annotations

import json

import pytest


def test_openenv_arguments_are_checked():
    pytest.importorskip("openenv")
    from hybridrl.env.base import get_environment_class

    cls = get_environment_class("openenv")
    with pytest.raises(ValueError, match="base_url is required"):
        cls()
    with pytest.raises(ValueError, match=r"unknown env_kwargs \['obs_field'\]"):
        cls(base_url="http://127.0.0.1:1", obs_field="x")
    with pytest.raises(ValueError, match="first_message"):
        cls(base_url="http://127.0.0.1:1", first_message="both")
    env = cls(base_url="http://127.0.0.1:1", observation_field="echoed_message")
    assert env.observation_text({"echoed_message": "hi", "message_length": 2}) == "hi"
    with pytest.raises(KeyError, match=r"no field 'echoed_message'.*\['text'\]"):
        env.observation_text({"text": "hi"})
    whole = cls(base_url="http://127.0.0.1:1")
    assert json.loads(whole.observation_text({"b": 1, "a": "x"})) == {"a": "x", "b": 1}


def test_verifiers_rows_carry_what_the_environment_needs_back():
    vf = pytest.importorskip("verifiers")
    pytest.importorskip("datasets")
    from datasets import Dataset

    from hybridrl.env.verifiers_bridge import make_rows, rollout_input

    ds = Dataset.from_list([{"question": "1+2=", "answer": "3"}, {"question": "4+4=", "answer": "8"}])
    env = vf.SingleTurnEnv(dataset=ds, eval_dataset=ds.select([1]), system_prompt="Add.", rubric=vf.Rubric())
    rows = make_rows(env, "train")
    assert [r["prompt"] for r in rows] == [
        [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="}],
        [{"role": "system", "content": "Add."}, {"role": "user", "content": "4+4="}],
    ]
    assert [r["extra_info"]["vf_answer"] for r in rows] == ["3", "8"]
    assert len(make_rows(env, "val")) == 1
    task = {"messages": rows[1]["prompt"], "extra_info": rows[1]["extra_info"]}
    got = rollout_input(task)
    assert (
        got["answer"] == "8"
        and got["example_id"] == 1
        and got["prompt"] == rows[1]["prompt"]
        and got["info"] == {}
    )
    with pytest.raises(ValueError, match=r"lacks \['vf_answer', 'vf_example_id'\].*verifiers_bridge data"):
        rollout_input({"messages": [], "extra_info": {}})
    with pytest.raises(ValueError, match="split must be"):
        make_rows(env, "test")
