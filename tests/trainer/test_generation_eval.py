"""main_generation (N responses per prompt to parquet) and main_eval (mean/best/maj@N per data source)."""

from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest
import torch

from hybridrl.trainer.offline.evaluation import run_eval
from hybridrl.trainer.offline.generation import generate_responses, run_generation
from hybridrl.utils.config_loader import ConfigError


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import Qwen2ForCausalLM

    from hybridrl.data.builtin_task import make_rl_rows
    from hybridrl.models.builtin import build_model_config
    from hybridrl.models.tokenizer_builder import build_tokenizer

    root = tmp_path_factory.mktemp("gen")
    model = str(root / "model")
    tok = build_tokenizer(model)
    torch.manual_seed(0)
    Qwen2ForCausalLM(
        build_model_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    ).save_pretrained(model)
    prompts = str(root / "prompts.parquet")
    pd.DataFrame(make_rl_rows(3, seed=0, split="val")).to_parquet(prompts)
    return {"root": root, "model": model, "prompts": prompts}


def gen_args(tiny, out, **extra) -> dict:
    cfg = {
        "model": {"path": tiny["model"]},
        "data": {"path": tiny["prompts"], "n_samples": 4, "output_path": str(out)},
        "rollout": {"name": "hf", "temperature": 1.0, "response_length": 6, "seed": 0},
    }
    for dotted, value in extra.items():
        section, key = dotted.split("__")
        cfg[section][key] = value
    return cfg


# ----------------------------------------------------------------------------------------------
# generation
# ----------------------------------------------------------------------------------------------
def test_generation_then_eval_on_three_prompts(tiny, tmp_path):
    out = run_generation(gen_args(tiny, tmp_path / "out.parquet"))
    df = pd.read_parquet(out)
    src = pd.read_parquet(tiny["prompts"])
    assert list(df.columns) == list(src.columns) + ["responses"]
    assert df["data_source"].tolist() == src["data_source"].tolist()
    assert [len(r) for r in df["responses"]] == [4, 4, 4]
    # character tokenizer: at most response_length characters per response
    assert all(isinstance(r, str) and len(r) <= 6 for rs in df["responses"] for r in rs)
    result = run_eval({"data": {"path": out}})
    summary = result["summary"]["hybridrl/arith"]
    assert set(summary) == {"mean@4", "best@4", "maj@4"}
    assert all(0.0 <= v <= 1.0 for v in summary.values())
    assert summary["mean@4"] <= summary["best@4"]


def test_sampling_is_seeded(tiny, tmp_path):
    a = pd.read_parquet(run_generation(gen_args(tiny, tmp_path / "a.parquet")))["responses"].tolist()
    b = pd.read_parquet(run_generation(gen_args(tiny, tmp_path / "b.parquet")))["responses"].tolist()
    c = pd.read_parquet(run_generation(gen_args(tiny, tmp_path / "c.parquet", rollout__seed=1)))[
        "responses"
    ].tolist()
    assert [list(x) for x in a] == [list(x) for x in b]
    assert [list(x) for x in a] != [list(x) for x in c]


def test_greedy_matches_a_hand_written_argmax_loop(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = run_generation(gen_args(tiny, tmp_path / "g.parquet", rollout__temperature=0.0, data__n_samples=2))
    responses = pd.read_parquet(out)["responses"].tolist()
    tok = AutoTokenizer.from_pretrained(tiny["model"])
    model = AutoModelForCausalLM.from_pretrained(tiny["model"]).eval()
    for row, got in zip(pd.read_parquet(tiny["prompts"]).to_dict("records"), responses):
        text = tok.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        new = []
        with torch.no_grad():
            for _ in range(6):
                nxt = int(model(input_ids=ids).logits[0, -1].argmax())
                if nxt == tok.eos_token_id:
                    break
                new.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        expected = tok.decode(new, skip_special_tokens=True)
        assert list(got) == [expected, expected]


def test_batching_does_not_change_greedy_output(tiny):
    from transformers import AutoTokenizer

    from hybridrl.trainer.offline.generation import build_rollout, load_generation_config

    tok = AutoTokenizer.from_pretrained(tiny["model"])
    config = load_generation_config(
        gen_args(tiny, "unused.parquet", rollout__temperature=0.0, rollout__response_length=5)
    )
    rollout = build_rollout(config, tiny["model"], tok, device="cpu")
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in ("1+1=", "12+34=", "99+99=")
    ]
    one = generate_responses(rollout, tok, prompts, batch_size=1)
    three = generate_responses(rollout, tok, prompts, batch_size=3)
    assert one == three  # left padding inside a batch does not change what greedy decoding writes
    assert [len(r) for r in one] == [1, 1, 1]


def test_generation_config_errors(tiny, tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.temprature.*rollout\.temperature"):
        run_generation({**gen_args(tiny, tmp_path / "x.parquet"), "rollout": {"temprature": 1.0}})
    with pytest.raises(ConfigError, match="rollout.name='sglang'"):
        run_generation(gen_args(tiny, tmp_path / "x.parquet", rollout__name="sglang"))
    with pytest.raises(ValueError, match=r"prompts\.parquet' row 0.*rollout\.prompt_length=4"):
        run_generation(gen_args(tiny, tmp_path / "x.parquet", rollout__prompt_length=4))
    with pytest.raises(KeyError, match="no column 'question'"):
        run_generation(gen_args(tiny, tmp_path / "x.parquet", data__prompt_key="question"))


# ----------------------------------------------------------------------------------------------
# evaluation with hand-derived values
# ----------------------------------------------------------------------------------------------
def _responses_file(path, rows) -> str:
    """Rows as main_generation writes them: a distinct prompt per row unless a row names its own."""
    rows = [{"prompt": [{"role": "user", "content": f"question {i}"}], **row} for i, row in enumerate(rows)]
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def test_eval_mean_best_maj_by_hand(tmp_path):
    rm = lambda gt: {"style": "rule", "ground_truth": gt}  # noqa: E731
    rows = [
        # scores 1, 0, 1 -> mean 2/3, best 1; majority string "#### 46" scores 1
        {
            "data_source": "hybridrl/arith",
            "reward_model": rm("46"),
            "responses": ["#### 46", "#### 45", "#### 46"],
        },
        # scores 0, 0, 0
        {
            "data_source": "hybridrl/arith",
            "reward_model": rm("10"),
            "responses": ["#### 11", "#### 12", "#### 11"],
        },
        # scores 1, 0, 0 -> best 1; all answers differ, the tie goes to the first: maj 1
        {
            "data_source": "hybridrl/arith",
            "reward_model": rm("5"),
            "responses": ["#### 5", "#### 7", "#### 8"],
        },
        # a second data source, one row: scores 0, 1 -> mean 1/2, best 1, tie -> first: maj 0
        {"data_source": "openai/gsm8k", "reward_model": rm("72"), "responses": ["#### 7", "so #### 72.0"]},
    ]
    result = run_eval({"data": {"path": _responses_file(tmp_path / "r.parquet", rows)}})
    arith, gsm = result["summary"]["hybridrl/arith"], result["summary"]["openai/gsm8k"]
    assert arith["mean@3"] == pytest.approx(1 / 3)
    assert arith["best@3"] == pytest.approx(2 / 3)
    assert arith["maj@3"] == pytest.approx(2 / 3)
    assert (gsm["mean@2"], gsm["best@2"], gsm["maj@2"]) == (0.5, 1.0, 0.0)
    assert result["metrics"]["val-core/hybridrl/arith/reward/mean@3"] == pytest.approx(1 / 3)


def test_eval_majority_uses_the_scorers_pred(tmp_path):
    fn = tmp_path / "reward.py"
    fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n"
        "    pred = solution_str.split()[-1]\n"
        "    return {'score': float(pred == ground_truth) + bonus, 'pred': pred, 'acc': pred == ground_truth}\n"
    )
    rows = [
        {"data_source": "my/task", "reward_model": {"ground_truth": "3"}, "responses": ["x 4", "a 3", "b 3"]}
    ]
    path = _responses_file(tmp_path / "r.parquet", rows)
    result = run_eval({"data": {"path": path}, "custom_reward_function": {"path": str(fn)}})
    # by raw strings the tie would pick "x 4" (score 0); by pred, "3" wins 2:1 (score 1)
    assert result["summary"]["my/task"] == {"mean@3": pytest.approx(2 / 3), "best@3": 1.0, "maj@3": 1.0}
    assert result["metrics"]["val-core/my/task/acc/mean@3"] == pytest.approx(2 / 3)
    bonus = run_eval(
        {"data": {"path": path}, "custom_reward_function": {"path": str(fn), "reward_kwargs": {"bonus": 1}}}
    )
    assert bonus["summary"]["my/task"]["mean@3"] == pytest.approx(5 / 3)


def test_eval_single_response_strings_and_output_file(tmp_path):
    rows = [{"data_source": "hybridrl/arith", "reward_model": {"ground_truth": "2"}, "responses": "#### 2"}]
    out = tmp_path / "m.json"
    result = run_eval(
        {"data": {"path": _responses_file(tmp_path / "r.parquet", rows)}, "output_path": str(out)}
    )
    assert result["summary"]["hybridrl/arith"] == {"mean@1": 1.0, "best@1": 1.0, "maj@1": 1.0}
    assert out.exists() and "mean@1" in out.read_text()


def test_eval_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="data.path is not set"):
        run_eval({})
    rows = [{"data_source": "hybridrl/arith", "reward_model": {"ground_truth": "2"}, "answers": ["#### 2"]}]
    with pytest.raises(KeyError, match=r"r\.parquet.*no column 'responses'"):
        run_eval({"data": {"path": _responses_file(tmp_path / "r.parquet", rows)}})
    rows = [{"data_source": "nobody/knows", "reward_model": {"ground_truth": "2"}, "responses": ["#### 2"]}]
    with pytest.raises(ConfigError, match="row 0.*'nobody/knows'.*custom_reward_function.path"):
        run_eval({"data": {"path": _responses_file(tmp_path / "u.parquet", rows)}})  # before any scoring
    rows = [{"data_source": "hybridrl/arith", "reward_model": {"answer": "2"}, "responses": ["#### 2"]}]
    with pytest.raises(ValueError, match="row 0.*no key 'ground_truth'"):
        run_eval({"data": {"path": _responses_file(tmp_path / "g.parquet", rows)}})


def test_eval_groups_the_rows_of_one_prompt(tmp_path):
    """data.prompt_key: rows with the same prompt are one group for best@N and maj@N."""
    rm = {"style": "rule", "ground_truth": "4"}
    same = [{"role": "user", "content": "2 + 2?"}]
    rows = [
        {
            "prompt": same,
            "data_source": "hybridrl/arith",
            "reward_model": rm,
            "responses": ["#### 4", "#### 5"],
        },
        {
            "prompt": same,
            "data_source": "hybridrl/arith",
            "reward_model": rm,
            "responses": ["#### 5", "#### 5"],
        },
    ]
    path = _responses_file(tmp_path / "r.parquet", rows)
    grouped = run_eval({"data": {"path": path}})["summary"]["hybridrl/arith"]
    # one group of four responses: one correct -> best 1; "#### 5" wins the vote 3:1 -> maj 0
    assert grouped == {"mean@4": 0.25, "best@4": 1.0, "maj@4": 0.0}
    # without a prompt column each row is its own group of two
    per_row = run_eval({"data": {"path": path, "prompt_key": None}})["summary"]["hybridrl/arith"]
    assert per_row == {"mean@2": 0.25, "best@2": 0.5, "maj@2": 0.5}


def test_eval_missing_prompt_column_names_the_key(tmp_path):
    rows = [{"data_source": "hybridrl/arith", "reward_model": {"ground_truth": "2"}, "responses": ["#### 2"]}]
    path = tmp_path / "p.parquet"
    pd.DataFrame(rows).to_parquet(path)
    with pytest.raises(KeyError, match=r"p\.parquet.*no column 'prompt'"):
        run_eval({"data": {"path": str(path)}})
    assert (
        run_eval({"data": {"path": str(path), "prompt_key": None}})["summary"]["hybridrl/arith"]["mean@1"]
        == 1.0
    )


# ----------------------------------------------------------------------------------------------
# slow: vLLM, command lines
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_greedy_matches_hf_greedy(tiny, tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    common = {"rollout__temperature": 0.0, "data__n_samples": 2, "rollout__response_length": 12}
    hf = run_generation(gen_args(tiny, tmp_path / "hf.parquet", **common))
    vl = run_generation(
        gen_args(tiny, tmp_path / "vl.parquet", rollout__name="vllm", rollout__prompt_length=64, **common)
    )
    hf_r = [list(r) for r in pd.read_parquet(hf)["responses"]]
    vl_r = [list(r) for r in pd.read_parquet(vl)["responses"]]
    assert hf_r == vl_r


@pytest.mark.slow
def test_command_lines(tiny, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "cli.parquet"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridrl.trainer.main_generation",
            f"model.path={tiny['model']}",
            f"data.path={tiny['prompts']}",
            "data.n_samples=2",
            f"data.output_path={out}",
            "rollout.response_length=4",
        ],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    done = subprocess.run(
        [sys.executable, "-m", "hybridrl.trainer.main_eval", f"data.path={out}"],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert "hybridrl/arith: best@2" in done.stdout


def test_greedy_eval_matches_the_builtin_models_own_evaluator(tmp_path):
    """GreedyEval (HFRollout + weight sync + scorer) == hybridrl.models.builtin.evaluate_accuracy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridrl.data.builtin_task import make_rl_rows
    from hybridrl.models.builtin import evaluate_accuracy, get_builtin_model_path
    from hybridrl.trainer.offline.evaluation import GreedyEval

    try:
        path = get_builtin_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    rows = [
        {**r, "ground_truth": r["reward_model"]["ground_truth"]}
        for r in make_rl_rows(24, seed=1, split="val")
    ]
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    evaluator = GreedyEval(rows, prompts, tok, path, max_new_tokens=10, batch_size=8, device="cpu")
    evaluator.update_weights(AutoModelForCausalLM.from_pretrained(path).named_parameters())
    metrics = evaluator.score()
    expected = evaluate_accuracy(path, n=24, seed=1)
    assert metrics["val/greedy_acc"] == pytest.approx(expected)
    assert 0.0 < expected < 1.0  # the warm-started model gets some, not all, right
    assert metrics["val-core/hybridrl/arith/reward/mean@1"] == pytest.approx(expected)
