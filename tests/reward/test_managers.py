"""Reward managers, the DAPO overlong penalty and custom reward functions. Fast, CPU only.

The tokenizer is a character-level one built here with the `tokenizers` library: pad id 0, eos id 1.
"""

from __future__ import annotations

import logging
import pickle
import signal
import sys
import time

import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hybridrl.protocol import DataProto
from hybridrl.reward import (
    BatchRewardManager,
    DAPORewardManager,
    NaiveRewardManager,
    PrimeRewardManager,
    get_reward_manager_cls,
    load_custom_reward_fn,
    load_reward_manager,
    register_reward_manager,
    reward_manager_names,
)

PAD, EOS = 0, 1
P, T = 6, 8


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789 #+=.-")
    vocab = {"<pad>": PAD, "</s>": EOS, "<unk>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    t.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def make_batch(
    tok, prompts, responses, sources, truths, *, eos=None, extra=None, masks=("attention", "response")
):
    """Left-padded prompts (P), right-padded responses (T); `eos[i]` appends </s> to response i."""
    b = len(prompts)
    prompt_ids = torch.full((b, P), PAD)
    resp_ids = torch.full((b, T), PAD)
    attn = torch.zeros(b, P + T, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        pi = tok.encode(p, add_special_tokens=False)
        ri = tok.encode(r, add_special_tokens=False) + ([EOS] if eos and eos[i] else [])
        prompt_ids[i, P - len(pi) :] = torch.tensor(pi, dtype=torch.long)
        if ri:
            resp_ids[i, : len(ri)] = torch.tensor(ri, dtype=torch.long)
        attn[i, P - len(pi) : P + len(ri)] = 1
    tensors = {"prompts": prompt_ids, "responses": resp_ids}
    if "attention" in masks:
        tensors["attention_mask"] = attn
    if "response" in masks:
        tensors["response_mask"] = attn[:, P:].clone()
    non = {"data_source": list(sources), "reward_model": [{"ground_truth": g} for g in truths]}
    if extra is not None:
        non["extra_info"] = extra
    return DataProto.from_dict(tensors=tensors, non_tensors=non)


def exact(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == ground_truth)


def with_acc(data_source, solution_str, ground_truth, extra_info=None):
    pred = solution_str.split("#")[-1].strip()
    return {"score": 2.0 * (pred == ground_truth), "acc": pred == ground_truth, "pred": pred}


@pytest.fixture
def batch(tok):
    # response lengths (tokens): "15" -> 2, "7" + eos -> 2, "" -> 0, "12345678" -> 8 (full)
    return make_batch(
        tok,
        ["1+2=", "3+4=", "a", "x=y"],
        ["15", "7", "", "12345678"],
        ["arith", "arith", "arith", "other"],
        ["15", "7", "0", "12345678"],
        eos=[False, True, False, False],
    )


# ---------------------------------------------------------------------------------------------- naive
def test_naive_score_lands_on_last_valid_token(tok, batch):
    reward = NaiveRewardManager(tok, num_examine=0, compute_score=exact)(batch)
    assert reward.shape == (4, T) and reward.dtype == torch.float32
    expected = torch.zeros(4, T)
    expected[0, 1] = 1.0  # "15": tokens 0-1
    expected[1, 1] = 1.0  # "7</s>": the eos is the last valid token; decoding skips it, so "7" == "7"
    expected[2, 0] = 0.0  # empty response: position 0, scored "" vs "0" -> 0
    expected[3, 7] = 1.0  # full length
    assert torch.equal(reward, expected)


def test_response_mask_alone_gives_the_same_result(tok, batch):
    only_resp = make_batch(
        tok,
        ["1+2=", "3+4=", "a", "x=y"],
        ["15", "7", "", "12345678"],
        ["arith", "arith", "arith", "other"],
        ["15", "7", "0", "12345678"],
        eos=[False, True, False, False],
        masks=("response",),
    )
    mgr = NaiveRewardManager(tok, num_examine=0, compute_score=exact)
    assert torch.equal(mgr(only_resp), mgr(batch))


def test_decoding_passes_valid_text_and_extra_info(tok):
    seen = []

    def record(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return 0.5

    data = make_batch(
        tok, ["1+2="], ["3"], ["arith"], ["3"], eos=[True], extra=[{"split": "train", "index": 7}]
    )
    out = NaiveRewardManager(tok, 0, compute_score=record)(data, return_dict=True)
    assert seen == [("arith", "3", "3", {"split": "train", "index": 7})]
    assert out["reward_tensor"][0, 1] == 0.5 and out["reward_tensor"].sum() == 0.5
    assert out["reward_extra_info"] == {}


def test_decode_samples_rows_with_repeated_prompts(tok):
    """Each row gets its own prompt and response text: repeated prompts (a GRPO group) are decoded
    once and handed to every row of the group, padding and EOS never reach the text."""
    from hybridrl.reward.manager import decode_samples

    prompts = ["1+2=", "1+2=", "ab", "1+2=", "ab"]
    responses = ["3", "", "zz", "12345678", "q"]
    data = make_batch(tok, prompts, responses, ["s"] * 5, ["t"] * 5, eos=[True, False, True, False, False])
    samples = decode_samples(tok, data)
    assert [(x.prompt, x.response) for x in samples] == list(zip(prompts, responses))
    assert [x.response_length for x in samples] == [2, 0, 3, 8, 1]


def test_dict_scores_give_aligned_extra_info(tok):
    data = make_batch(tok, ["q", "q"], ["a #### 4", "a #### 5"], ["s", "s"], ["4", "4"])
    out = NaiveRewardManager(tok, 0, compute_score=with_acc)(data, return_dict=True)
    assert out["reward_tensor"][0, 7] == 2.0 and out["reward_tensor"][1].sum() == 0.0
    assert out["reward_extra_info"] == {"score": [2.0, 0.0], "acc": [True, False], "pred": ["4", "5"]}


def test_reward_kwargs_are_forwarded(tok):
    def scaled(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
        return scale * float(solution_str == ground_truth)

    data = make_batch(tok, ["q"], ["9"], ["s"], ["9"])
    assert NaiveRewardManager(tok, 0, compute_score=scaled, scale=3.0)(data)[0, 0] == 3.0


def test_signature_mismatch_fails_at_construction(tok):
    def no_extra(data_source, solution_str, ground_truth):
        return 0.0

    with pytest.raises(TypeError, match="extra_info"):
        NaiveRewardManager(tok, 0, compute_score=no_extra)
    with pytest.raises(TypeError, match="scale"):
        NaiveRewardManager(tok, 0, compute_score=exact, scale=2.0)


def test_rm_scores_are_returned_as_is(tok, batch):
    batch.batch["rm_scores"] = torch.full((4, T), 0.25)
    out = NaiveRewardManager(tok, 0, compute_score=exact)(batch, return_dict=True)
    assert torch.equal(out["reward_tensor"], torch.full((4, T), 0.25))


# ---------------------------------------------------------------------------------------------- errors
def test_raising_reward_fn_names_source_index_response_and_truth(tok, batch):
    def boom(data_source, solution_str, ground_truth, extra_info=None):
        if ground_truth == "7":
            raise ZeroDivisionError("bad parse")
        return 0.0

    with pytest.raises(RuntimeError) as info:
        NaiveRewardManager(tok, 0, compute_score=boom)(batch)
    msg = str(info.value)
    assert "data_source='arith'" in msg and "sample index 1" in msg
    assert "response[:200]='7'" in msg and "ground_truth='7'" in msg and "bad parse" in msg
    assert isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1.0", None, [1.0], {"acc": 1}])
def test_nan_or_non_number_is_a_value_error(tok, batch, bad):
    def returns_bad(data_source, solution_str, ground_truth, extra_info=None):
        return bad if data_source == "other" else 1.0

    with pytest.raises(ValueError) as info:
        NaiveRewardManager(tok, 0, compute_score=returns_bad)(batch)
    msg = str(info.value)
    assert "data_source='other'" in msg and "sample index 3" in msg and "ground_truth='12345678'" in msg


def test_numpy_tensor_and_bool_scores_are_numbers(tok):
    values = iter([np.float32(0.5), torch.tensor(2.0), True])

    def varied(data_source, solution_str, ground_truth, extra_info=None):
        return next(values)

    data = make_batch(tok, ["q"] * 3, ["1", "2", "3"], ["s"] * 3, ["1"] * 3)
    reward = NaiveRewardManager(tok, 0, compute_score=varied)(data)
    assert reward[:, 0].tolist() == [0.5, 2.0, 1.0]


def test_missing_ground_truth_and_source_are_clear(tok, batch):
    batch.non_tensor_batch["reward_model"][2] = {"style": "rule"}
    with pytest.raises(KeyError, match="row 2.*ground_truth"):
        NaiveRewardManager(tok, 0, compute_score=exact)(batch)
    with pytest.raises(KeyError, match="data.reward_fn_key"):
        NaiveRewardManager(tok, 0, compute_score=exact, reward_fn_key="task")(batch)


def test_num_examine_prints_per_data_source(tok, batch, capsys):
    NaiveRewardManager(tok, num_examine=1, compute_score=exact)(batch)
    out = capsys.readouterr().out
    assert out.count("[response]") == 2  # one for "arith", one for "other"
    assert "[prompt] 1+2=" in out and "[response] 15" in out and "[ground_truth] 15" in out
    assert "[score] 1.0" in out and "data_source=other" in out


# ---------------------------------------------------------------------------------------------- batch
def test_batch_manager_calls_once_and_places_scores(tok, batch):
    calls = []

    def batch_fn(data_sources, solution_strs, ground_truths, extra_infos):
        calls.append(list(solution_strs))
        return [{"score": float(s == g), "len": len(s)} for s, g in zip(solution_strs, ground_truths)]

    out = BatchRewardManager(tok, 0, compute_score=batch_fn)(batch, return_dict=True)
    assert calls == [["15", "7", "", "12345678"]]
    naive = NaiveRewardManager(tok, 0, compute_score=exact)(batch)
    assert torch.equal(out["reward_tensor"], naive)
    assert out["reward_extra_info"]["len"] == [2, 1, 0, 8]


def test_batch_manager_errors(tok, batch):
    with pytest.raises(ValueError, match="custom_reward_function.path"):
        BatchRewardManager(tok, 0)
    with pytest.raises(ValueError, match="returned 3 results for 4 samples"):
        BatchRewardManager(
            tok, 0, compute_score=lambda data_sources, solution_strs, ground_truths, extra_infos: [1] * 3
        )(batch)

    def raising(data_sources, solution_strs, ground_truths, extra_infos):
        raise OSError("judge offline")

    with pytest.raises(RuntimeError, match=r"judge offline.*4 samples.*\['arith', 'other'\]") as info:
        BatchRewardManager(tok, 0, compute_score=raising)(batch)
    assert isinstance(info.value.__cause__, OSError)


# ---------------------------------------------------------------------------------------------- registry
def test_unknown_manager_lists_known_and_names_key(tok):
    with pytest.raises(ValueError, match=r"reward_model.reward_manager.*batch, dapo, naive, prime"):
        get_reward_manager_cls("nope")


def test_registering_a_taken_name_fails():
    with pytest.raises(ValueError, match="already registered"):

        @register_reward_manager("naive")
        class Other(NaiveRewardManager):
            pass


@pytest.mark.parametrize("name", reward_manager_names())
def test_every_registered_manager_scores_the_last_token(tok, batch, name):
    if name == "batch":

        def fn(data_sources, solution_strs, ground_truths, extra_infos):
            return [exact(d, s, g) for d, s, g in zip(data_sources, solution_strs, ground_truths)]

    else:
        fn = exact
    mgr = load_reward_manager(name, tok, 0, compute_score=fn)
    try:
        out = mgr(batch, return_dict=True)
    finally:
        if hasattr(mgr, "close"):
            mgr.close()
    assert torch.equal(out["reward_tensor"], NaiveRewardManager(tok, 0, compute_score=exact)(batch))


# ---------------------------------------------------------------------------------------------- prime
def slow_on_demand(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "7":
        time.sleep(30)
    if ground_truth == "0":
        try:  # a scorer that swallows everything still cannot swallow the timeout
            time.sleep(30)
        except Exception:
            return 1.0
    return exact(data_source, solution_str, ground_truth)


def test_prime_times_out_counts_and_warns(tok, batch, caplog):
    mgr = PrimeRewardManager(tok, 0, compute_score=slow_on_demand, num_workers=2, timeout=0.5)
    try:
        mgr._get_pool()  # the pool's start (a fresh forkserver imports torch) is not what is timed
        t0 = time.perf_counter()
        with caplog.at_level(logging.WARNING, logger="hybridrl.reward.prime"):
            out = mgr(batch, return_dict=True)
        elapsed = time.perf_counter() - t0
    finally:
        mgr.close()
    assert elapsed < 10
    expected = torch.zeros(4, T)
    expected[0, 1] = 1.0
    expected[3, 7] = 1.0  # samples 1 and 2 timed out -> 0
    assert torch.equal(out["reward_tensor"], expected)
    assert out["reward_extra_info"]["reward/timed_out"] == [False, True, True, False]
    assert out["reward_extra_info"]["reward/timeout_count"] == [2, 2, 2, 2]
    warned = [r.getMessage() for r in caplog.records if "timed out" in r.getMessage()]
    assert len(warned) == 2 and "sample index 1" in warned[0] and "sample index 2" in warned[1]


def ignores_alarm(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "7":  # behaves like C code that never returns to the interpreter
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        time.sleep(60)
    return exact(data_source, solution_str, ground_truth)


def test_prime_kills_a_stuck_worker_and_recovers(tok, batch, caplog):
    mgr = PrimeRewardManager(tok, 0, compute_score=ignores_alarm, num_workers=2, timeout=0.1)
    mgr.deadline_grace_s = 0.3
    try:
        out = mgr(batch, return_dict=True)
        assert out["reward_extra_info"]["reward/timeout_count"][0] == 1
        assert out["reward_tensor"][1].sum() == 0 and out["reward_tensor"][0, 1] == 1.0
        batch.non_tensor_batch["reward_model"][1] = {"ground_truth": "8"}
        again = mgr(batch, return_dict=True)  # a fresh pool after the kill
        assert again["reward_extra_info"]["reward/timeout_count"][0] == 0
    finally:
        mgr.close()


def test_prime_equals_naive_and_reports_errors(tok, batch):
    offset = 0.25  # a closure: travels to the workers by value

    def closure(data_source, solution_str, ground_truth, extra_info=None):
        if ground_truth == "12345678":
            raise KeyError("no such table")
        return exact(data_source, solution_str, ground_truth) + offset

    mgr = PrimeRewardManager(tok, 0, compute_score=with_acc, num_workers=2, timeout=5)
    bad = PrimeRewardManager(tok, 0, compute_score=closure, num_workers=1, timeout=5)
    try:
        out = mgr(batch, return_dict=True)
        ref = NaiveRewardManager(tok, 0, compute_score=with_acc)(batch, return_dict=True)
        assert torch.equal(out["reward_tensor"], ref["reward_tensor"])
        assert out["reward_extra_info"]["pred"] == ref["reward_extra_info"]["pred"]
        with pytest.raises(RuntimeError, match=r"no such table.*'other', sample index 3") as info:
            bad(batch)
        assert isinstance(info.value.__cause__, KeyError)
    finally:
        mgr.close()
        bad.close()


def test_prime_survives_pickling(tok):
    mgr = PrimeRewardManager(tok, 0, compute_score=exact, num_workers=1, timeout=1)
    copy = pickle.loads(pickle.dumps(mgr))
    assert copy.num_workers == 1 and copy.timeout == 1.0


# ---------------------------------------------------------------------------------------------- dapo
@pytest.mark.parametrize(
    "factor, expected",
    [
        # T = max_resp_len = 8, buffer 4: no penalty up to 4 tokens, then -factor/4 per token
        (1.0, [0.0, 0.0, -0.25, -0.5, -0.75, -1.0]),
        (0.5, [0.0, 0.0, -0.125, -0.25, -0.375, -0.5]),
    ],
)
def test_dapo_overlong_penalty_hand_values(tok, factor, expected):
    responses = ["123", "1234", "12345", "123456", "1234567", "12345678"]
    data = make_batch(tok, ["q"] * 6, responses, ["s"] * 6, responses)
    cfg = {"enable": True, "len": 4, "penalty_factor": factor, "log": True}
    mgr = DAPORewardManager(tok, 0, compute_score=exact, max_resp_len=T, overlong_buffer_cfg=cfg)
    out = mgr(data, return_dict=True)
    rewards = [out["reward_tensor"][i, len(r) - 1].item() for i, r in enumerate(responses)]
    assert rewards == pytest.approx([1.0 + e for e in expected])
    assert out["reward_tensor"].sum().item() == pytest.approx(sum(rewards))
    assert out["reward_extra_info"]["overlong_reward"] == pytest.approx(expected)
    assert out["reward_extra_info"]["overlong"] == [e < 0 for e in expected]


def test_dapo_adds_penalty_to_reward_not_to_score(tok, batch):
    cfg = {"enable": True, "len": 4, "penalty_factor": 1.0, "log": True}
    mgr = DAPORewardManager(tok, 0, compute_score=with_acc, max_resp_len=T, overlong_buffer_cfg=cfg)
    data = make_batch(tok, ["q", "q"], ["#### 4", "#### 42"], ["s", "s"], ["4", "42"])  # 6 and 7 tokens
    out = mgr(data, return_dict=True)
    # T=8, buffer 4: expected length 4; 6 tokens -> -0.5, 7 tokens -> -0.75
    assert out["reward_tensor"][0, 5].item() == pytest.approx(2.0 - 0.5)
    assert out["reward_tensor"][1, 6].item() == pytest.approx(2.0 - 0.75)
    info = out["reward_extra_info"]
    assert info["score"] == [2.0, 2.0]
    assert info["overlong_reward"] == pytest.approx([-0.5, -0.75]) and info["overlong"] == [True, True]


def test_dapo_disabled_is_naive(tok, batch):
    mgr = DAPORewardManager(tok, 0, compute_score=exact, max_resp_len=T)
    assert torch.equal(mgr(batch), NaiveRewardManager(tok, 0, compute_score=exact)(batch))


def test_dapo_config_errors(tok):
    with pytest.raises(ValueError, match="max_resp_len"):
        DAPORewardManager(tok, 0, compute_score=exact, overlong_buffer_cfg={"enable": True, "len": 4})
    with pytest.raises(ValueError, match="overlong_buffer_cfg.len=0"):
        DAPORewardManager(tok, 0, compute_score=exact, max_resp_len=8, overlong_buffer_cfg={"enable": True})
    with pytest.raises(ValueError, match="unknown keys.*'length'"):
        DAPORewardManager(tok, 0, compute_score=exact, max_resp_len=8, overlong_buffer_cfg={"length": 4})


# ---------------------------------------------------------------------------------------------- custom
CUSTOM = """
import dataclasses

@dataclasses.dataclass
class Judge:
    bonus: float = 0.0

def helper(x):
    return x

def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return Judge(bonus).bonus + float(solution_str == ground_truth)

NOT_A_FUNCTION = 3
"""


def test_custom_fn_loads_binds_kwargs_and_pickles_by_value(tmp_path, tok):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    fn = load_custom_reward_fn(str(path), "compute_score", {"bonus": 0.5})
    assert fn(data_source="s", solution_str="4", ground_truth="4") == 1.5
    assert fn.__name__ == "compute_score"
    data = make_batch(tok, ["q"], ["4"], ["s"], ["4"])
    assert NaiveRewardManager(tok, 0, compute_score=fn)(data)[0, 0] == 1.5
    import cloudpickle

    payload = cloudpickle.dumps(fn)
    sys.modules.pop(fn.func.__module__)  # a process that never loaded the file
    assert pickle.loads(payload)(data_source="s", solution_str="4", ground_truth="5") == 0.5
    assert load_custom_reward_fn(None, "compute_score") is None


def test_custom_fn_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="custom_reward_function.path"):
        load_custom_reward_fn(str(tmp_path / "missing.py"), "compute_score")
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    with pytest.raises(
        AttributeError, match=r"custom_reward_function.name='score'.*\['Judge', 'compute_score', 'helper'\]"
    ):
        load_custom_reward_fn(str(path), "score")
    with pytest.raises(TypeError, match="not a function"):
        load_custom_reward_fn(str(path), "NOT_A_FUNCTION")
    with pytest.raises(TypeError, match="reward_kwargs.*temperature"):
        load_custom_reward_fn(str(path), "compute_score", {"temperature": 1.0})
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    with pytest.raises(ImportError, match="broken.py") as info:
        load_custom_reward_fn(str(broken), "compute_score")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
