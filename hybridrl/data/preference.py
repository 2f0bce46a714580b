"""Preference pairs: TRL's preference format, its tokenisation, start-up checks, and the built-in pairs.

A row holds one prompt and two completions of it, the preferred (`chosen`) and the other
(`rejected`), in any of TRL's preference layouts:

* explicit prompt, plain text:      {"prompt": "12+34=", "chosen": "#### 46", "rejected": "#### 45"}
* explicit prompt, conversational:  {"prompt": [{"role": "user", ...}], "chosen": [{"role": "assistant",
                                     "content": ...}], "rejected": [...]}
* implicit prompt: no prompt column; `chosen` / `rejected` hold the whole text (their longest common
  prefix, cut back to a word boundary, is the prompt) or the whole conversation (the messages
  before the last one, which must be equal in both, are the prompt).

and an optional numeric `margin` column (how much better chosen is; the reward-model loss's m).

Each completion is tokenised as SFT and RL see a sample: the prompt rendered with the tokenizer's
chat template (with the generation prompt; `use_chat_template=False`: a plain-text prompt as is),
then the completion's text tokens and EOS. So a reward model trained here scores exactly the
token sequences that PPO's batch holds (prompt + generated response + EOS).

An item is (L_c,) `chosen_ids` and (L_r,) `rejected_ids` (unpadded), their completion masks
`chosen_mask` / `rejected_mask` (1 on completion tokens incl. EOS), and `margin` (a float).
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridrl.data import builtin_task
from hybridrl.data.rl_dataset import as_messages, read_rows

__all__ = [
    "PreferenceDataConfig",
    "PreferenceDataset",
    "ensure_builtin_preference_data",
    "make_preference_rows",
    "pad_pairs",
    "pair_batch",
]

TRUNCATION_MODES = ("error", "right")


@dataclass(frozen=True)
class PreferenceDataConfig:
    """The data keys of preference training.

    Attributes:
        prompt_key / chosen_key / rejected_key: the columns; a missing prompt column means the
            implicit-prompt layout.
        margin_key: an optional numeric column (None: every margin is 0).
        max_prompt_length: the longest rendered prompt in tokens; a longer one is an error.
        max_length: the longest prompt + completion + EOS in tokens.
        truncation: "error" (a longer sample fails at start-up) or "right" (cut the completion's tail).
        max_samples: > 0: only the first rows.
        use_chat_template: render the prompt with the tokenizer's chat template.
    """

    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    margin_key: str | None = None
    max_prompt_length: int = 512
    max_length: int = 1024
    truncation: str = "error"
    max_samples: int = -1
    use_chat_template: bool = True
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation={self.truncation!r} is not one of {list(TRUNCATION_MODES)}")
        if self.max_prompt_length < 1 or self.max_length <= self.max_prompt_length:
            raise ValueError(
                f"data.max_prompt_length={self.max_prompt_length} must be >= 1 and below data.max_length="
                f"{self.max_length} (which also holds the completion)"
            )


def _common_text_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    if n < min(len(a), len(b)) and n > 0 and a[n - 1] != " " and " " in a[:n]:
        n = a[:n].rindex(" ") + 1  # back to the start of the word that differs
    return a[:n]


class PreferenceDataset:
    """Tokenised preference pairs of parquet / jsonl file(s); every row is read and checked at once.

    Raises:
        ValueError: naming the file and row: a missing column, chosen equal to rejected, an empty
            completion, a prompt longer than `max_prompt_length`, a sample longer than `max_length`
            (truncation=error), a margin that is not a number.
    """

    def __init__(
        self, files: Any, tokenizer: Any, config: PreferenceDataConfig, files_key: str = "data.train_files"
    ) -> None:
        for name in ("pad_token_id", "eos_token_id"):
            if getattr(tokenizer, name, None) is None:
                raise ValueError(
                    f"the tokenizer has no {name[:-9]} token; preference training needs pad and eos"
                )
        self.tokenizer, self.config, self.files_key = tokenizer, config, files_key
        required = [config.chosen_key, config.rejected_key] + (
            [config.margin_key] if config.margin_key else []
        )
        rows, self._sources = read_rows(files, files_key, required)
        if config.max_samples > 0:
            rows, self._sources = rows[: config.max_samples], self._sources[: config.max_samples]
        self.explicit_prompt = bool(rows) and config.prompt_key in rows[0]
        self.items = [self._tokenise(i, row) for i, row in enumerate(rows)]
        self.rows = rows

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]

    def _where(self, i: int) -> str:
        path, row = self._sources[i]
        return f"{self.files_key} file {path!r} row {row}"

    # -- one row ---------------------------------------------------------------------------------
    def split_row(self, i: int, row: dict[str, Any]) -> tuple[Any, str, str]:
        """(prompt: str or messages, chosen text, rejected text) of any TRL layout."""
        c, where = self.config, self._where(i)
        chosen, rejected = row[c.chosen_key], row[c.rejected_key]
        if self.explicit_prompt:
            if c.prompt_key not in row or row[c.prompt_key] is None:
                raise ValueError(f"{where}: column {c.prompt_key!r} (data.prompt_key) is missing or null")
            prompt = row[c.prompt_key]
            return (
                prompt,
                self._completion(chosen, where, c.chosen_key),
                self._completion(rejected, where, c.rejected_key),
            )
        cm, rm = as_messages(chosen, where), as_messages(rejected, where)
        if cm is not None and rm is not None:
            if cm[:-1] != rm[:-1] or not cm[:-1]:
                raise ValueError(
                    f"{where}: implicit-prompt conversations must share every message but the last (the prompt); "
                    "store the prompt in its own column (data.prompt_key) instead"
                )
            return (
                cm[:-1],
                self._completion(cm[-1:], where, c.chosen_key),
                self._completion(rm[-1:], where, c.rejected_key),
            )
        if not (isinstance(chosen, str) and isinstance(rejected, str)):
            raise ValueError(
                f"{where}: columns {c.chosen_key!r} / {c.rejected_key!r} must both be text or both messages"
            )
        prefix = _common_text_prefix(chosen, rejected)
        if not prefix:
            raise ValueError(
                f"{where}: no prompt column ({c.prompt_key!r}) and chosen / rejected share no prefix to take as "
                "the prompt; add a prompt column or set data.prompt_key"
            )
        return prefix, chosen[len(prefix) :], rejected[len(prefix) :]

    @staticmethod
    def _completion(value: Any, where: str, column: str) -> str:
        if isinstance(value, str):
            return value
        messages = as_messages(value, where)
        if messages is None or len(messages) != 1 or messages[0].get("role") != "assistant":
            raise ValueError(
                f"{where}: column {column!r} must hold a text or one assistant message, got {value!r:.120}"
            )
        return str(messages[0]["content"])

    def render_prompt(self, prompt: Any, where: str) -> str:
        c = self.config
        messages = as_messages(prompt, where)
        if not c.use_chat_template:
            if messages is not None:
                raise ValueError(f"{where}: the prompt is a message list but data.use_chat_template=False")
            return prompt
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"{where}: the tokenizer has no chat_template; set data.use_chat_template=False")
        messages = messages if messages is not None else [{"role": "user", "content": prompt}]
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **dict(c.apply_chat_template_kwargs)
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _tokenise(self, i: int, row: dict[str, Any]) -> dict[str, Any]:
        c, where = self.config, self._where(i)
        prompt, chosen, rejected = self.split_row(i, row)
        if chosen == rejected:
            raise ValueError(
                f"{where}: chosen equals rejected ({chosen!r:.80}); a pair needs two different completions: drop the row"
            )
        for column, text in ((c.chosen_key, chosen), (c.rejected_key, rejected)):
            if not text.strip():
                raise ValueError(f"{where}: column {column!r} has an empty completion; drop the row")
        prompt_ids = self._encode(self.render_prompt(prompt, where))
        if len(prompt_ids) > c.max_prompt_length:
            raise ValueError(
                f"{where}: the prompt is {len(prompt_ids)} tokens, longer than data.max_prompt_length="
                f"{c.max_prompt_length}; raise data.max_prompt_length or drop the row"
            )
        item: dict[str, Any] = {"margin": self._margin(row, where)}
        for name, text in (("chosen", chosen), ("rejected", rejected)):
            completion = self._encode(text) + [self.tokenizer.eos_token_id]
            ids = prompt_ids + completion
            if len(ids) > c.max_length:
                if c.truncation == "error":
                    raise ValueError(
                        f"{where}: prompt + {name} is {len(ids)} tokens, longer than data.max_length={c.max_length}; "
                        "raise data.max_length or set data.truncation=right"
                    )
                ids = ids[: c.max_length]
            item[f"{name}_ids"] = torch.tensor(ids, dtype=torch.long)
            mask = torch.zeros(len(ids), dtype=torch.long)
            mask[len(prompt_ids) :] = 1
            item[f"{name}_mask"] = mask
        return item

    def _margin(self, row: dict[str, Any], where: str) -> float:
        key = self.config.margin_key
        if not key:
            return 0.0
        value = row.get(key)
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"{where}: column {key!r} (data.margin_key) must hold a number, got {value!r}"
            ) from None


def pad_pairs(
    items: Sequence[dict[str, Any] | None], pad_id: int, extra_column: bool = False
) -> dict[str, torch.Tensor]:
    """Pairs -> right-padded (2B, W) tensors, the B chosen rows first, then the B rejected rows.

    Returns input_ids, attention_mask, position_ids, loss_mask (completion tokens), `valid` (2B,)
    (0 for None padding items, which repeat item 0) and `margin` (B,). `extra_column` adds one more
    pad column, so that a per-position head evaluated at positions 0..W-1 covers every last token.
    """
    real = [it for it in items if it is not None]
    seqs, masks, valid = [], [], []
    for name in ("chosen", "rejected"):
        for it in items:
            src = it if it is not None else real[0]
            seqs.append(src[f"{name}_ids"])
            masks.append(src[f"{name}_mask"])
            valid.append(0.0 if it is None else 1.0)
    width = max(len(s) for s in seqs) + int(extra_column)
    n = len(seqs)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    loss = torch.zeros((n, width), dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)], attn[i, : len(s)], loss[i, : len(s)] = s, 1, m
    margin = torch.tensor([0.0 if it is None else it["margin"] for it in items], dtype=torch.float32)
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
        "loss_mask": loss,
        "valid": torch.tensor(valid),
        "margin": margin,
    }


def pair_batch(items: Sequence[dict[str, Any] | None], pad_id: int) -> dict[str, torch.Tensor]:
    """Pairs -> (2B, P + T) tensors in the veRL layout, the B chosen rows first, then the B rejected.

    Each row is [prompt, left-padded to P | completion + EOS, right-padded to T], the layout the
    engines' shared-prompt forward takes (a pair's two rows share their prompt columns).

    Returns input_ids, attention_mask, position_ids (B2, P + T); responses and response_mask
    (2B, T) (the completion tokens); `valid` (2B,) (0 for None padding items, which repeat item 0)
    and `margin` (B,).
    """
    real = [it for it in items if it is not None]
    rows, valid = [], []
    for name in ("chosen", "rejected"):
        for it in items:
            src = it if it is not None else real[0]
            ids, mask = src[f"{name}_ids"], src[f"{name}_mask"].bool()
            start = int(mask.long().argmax()) if bool(mask.any()) else len(ids)
            rows.append((ids[:start], ids[start:]))
            valid.append(0.0 if it is None else 1.0)
    p = max(len(prompt) for prompt, _ in rows)
    t = max(len(completion) for _, completion in rows)
    n = len(rows)
    ids = torch.full((n, p + t), pad_id, dtype=torch.long)
    attn = torch.zeros((n, p + t), dtype=torch.long)
    for i, (prompt, completion) in enumerate(rows):
        ids[i, p - len(prompt) : p], attn[i, p - len(prompt) : p] = prompt, 1
        ids[i, p : p + len(completion)], attn[i, p : p + len(completion)] = completion, 1
    margin = torch.tensor([0.0 if it is None else it["margin"] for it in items], dtype=torch.float32)
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, p:],
        "response_mask": attn[:, p:],
        "valid": torch.tensor(valid),
        "margin": margin,
    }


# ----------------------------------------------------------------------------------------------
# built-in pairs: the built-in task's prompt, its correct answer, and a wrong one
# ----------------------------------------------------------------------------------------------
DEFAULT_N_PREF_TRAIN = 4096
DEFAULT_N_PREF_VAL = 200
PREF_TASK_VERSION = 1


def _wrong_answer(a: int, b: int, rng: random.Random) -> str:
    """A wrong response of the kinds a small model makes: a units or tens digit off, a near miss,
    digits swapped, or the answer without its marker."""
    right = a + b
    kind = rng.random()
    if kind < 0.35:
        wrong = right + rng.choice([-3, -2, -1, 1, 2, 3])
    elif kind < 0.6:
        wrong = right + rng.choice([-20, -10, 10, 20])
    elif kind < 0.75:
        wrong = right + rng.randint(-30, 30)
    elif kind < 0.9:
        s = str(right)
        wrong = int(s[::-1]) if s[::-1] != s and not s.endswith("0") else right + 11
    else:
        return str(right)  # no "####": the rule scores it 0
    if wrong == right or wrong < 0:
        wrong = right + 1
    return f"{builtin_task.ANSWER_MARKER} {wrong}"


def make_preference_rows(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """`n` built-in pairs of `split`: the question, its correct response (chosen), a wrong one (rejected).

    Prompts follow the built-in task's train / val split, so held-out pairs have unseen prompts.
    Rows also carry `data_source` and `ground_truth` (the rule scorer's columns, for greedy validation).
    """
    rng = random.Random(f"pref:{split}:{seed}")
    rows = []
    for a, b in builtin_task.sample_pairs(n, seed, split):
        rows.append(
            {
                "prompt": builtin_task.format_question(a, b),
                "chosen": builtin_task.format_response(a, b),
                "rejected": _wrong_answer(a, b, rng),
                "data_source": builtin_task.BUILTIN_DATA_SOURCE,
                "ground_truth": builtin_task.format_answer(a, b),
            }
        )
    return rows


def ensure_builtin_preference_data(
    data_dir: str | os.PathLike | None = None,
    n_train: int = DEFAULT_N_PREF_TRAIN,
    n_val: int = DEFAULT_N_PREF_VAL,
) -> dict[str, str]:
    """Write the built-in preference files once (pref_train / pref_val parquet) and return their paths."""
    import json

    root = Path(data_dir if data_dir is not None else builtin_task.default_data_dir()).expanduser().resolve()
    spec = {
        "version": PREF_TASK_VERSION,
        "task_version": builtin_task.TASK_VERSION,
        "n_train": n_train,
        "n_val": n_val,
    }
    paths = {"pref_train": str(root / "pref_train.parquet"), "pref_val": str(root / "pref_val.parquet")}
    manifest = root / "pref_manifest.json"
    try:
        if all(Path(p).exists() for p in paths.values()) and json.loads(manifest.read_text()) == spec:
            return paths
    except (OSError, json.JSONDecodeError):
        pass
    builtin_task.write_parquet(
        make_preference_rows(n_train, builtin_task.DEFAULT_TRAIN_SEED, "train"), paths["pref_train"]
    )
    builtin_task.write_parquet(
        make_preference_rows(n_val, builtin_task.DEFAULT_VAL_SEED, "val"), paths["pref_val"]
    )
    tmp = manifest.with_name(f".pref_manifest.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(spec))
    os.replace(tmp, manifest)
    return paths
