"""Token ids of the non-generated parts of a conversation, and the tokenisation sanity check.

Token-in, token-out: a trajectory's ids are the prompt, then each turn's ids appended. A turn the
policy generated is kept exactly as sampled. A tool turn's ids are the chat template's rendering
of the new messages *in context*, obtained as a difference of two renderings of a fixed stand-in
conversation (never of the real, earlier turns, which are therefore never re-tokenised):

    ids(stand_in + new_messages, add_generation_prompt=True) - ids(stand_in)

`check_tokenization` compares the turn-by-turn ids with a tokenisation of the whole conversation
(veRL's `tokenization_sanity_check_mode`): `strict` wants identical ids, `ignore_strippable`
identical text up to whitespace, `disable` skips the check.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ToolTurnRenderer", "check_tokenization", "conversation_ids"]

_STAND_IN = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


def _render_ids(
    tokenizer: Any, messages: list[dict], add_generation_prompt: bool, tools: Any = None
) -> list[int]:
    kwargs = {"tools": tools} if tools else {}
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, **kwargs
    )
    if isinstance(out, dict) or hasattr(out, "input_ids"):  # transformers 5 may return a BatchEncoding
        out = out["input_ids"]
    return list(out)


class ToolTurnRenderer:
    """Ids of tool-response turns as the chat template writes them after an assistant turn.

    Args:
        tokenizer: a tokenizer with a chat template that accepts role "tool".
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        try:
            self._base = _render_ids(tokenizer, _STAND_IN, add_generation_prompt=False)
        except Exception as e:
            raise ValueError(f"the tokenizer's chat template cannot render a conversation: {e}") from e

    def ids(self, contents: list[str], role: str = "tool") -> list[int]:
        """Ids of the `role` messages `contents` (tool responses, or an interaction's user turn)
        followed by the assistant generation prompt."""
        messages = _STAND_IN + [{"role": role, "content": c} for c in contents]
        try:
            full = _render_ids(self.tokenizer, messages, add_generation_prompt=True)
        except Exception as e:
            raise ValueError(
                f"the chat template cannot render role {role!r} messages ({e}); use a model whose chat "
                "template supports them, or set a custom_chat_template"
            ) from e
        if full[: len(self._base)] != self._base:
            raise ValueError(
                "the chat template renders an earlier turn differently when a tool message follows it; "
                "turn-by-turn tokenisation is impossible with this template"
            )
        return full[len(self._base) :]


def conversation_ids(
    tokenizer: Any, messages: list[dict], ends_with_generation_prompt: bool, tools: Any
) -> list[int]:
    """The whole conversation tokenised at once (the reference of the sanity check)."""
    return _render_ids(tokenizer, messages, add_generation_prompt=ends_with_generation_prompt, tools=tools)


def check_tokenization(tokenizer: Any, turn_ids: list[int], whole_ids: list[int], mode: str) -> bool:
    """True when the turn-by-turn ids agree with the whole-conversation ids under `mode`."""
    if mode == "disable":
        return True
    if mode == "strict":
        return list(turn_ids) == list(whole_ids)
    if mode == "ignore_strippable":
        a = "".join(tokenizer.decode(turn_ids).split())
        b = "".join(tokenizer.decode(whole_ids).split())
        return a == b
    raise ValueError(f"unknown tokenization_sanity_check_mode {mode!r}")
