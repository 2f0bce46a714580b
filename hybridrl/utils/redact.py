"""Secrets out of every logged config (config.json, TensorBoard, wandb, MLflow).

`redact_config(config)` returns a copy in which:

* every value under an ``env_vars`` mapping (``ray_kwargs.ray_init.runtime_env.env_vars``, a
  worker's runtime_env) is replaced by ``<redacted>``: the names stay, so a reader still sees which
  variables were set;
* a string value whose key names a secret (``token``, ``*_token``, ``api_key``, ``secret``,
  ``password``, ``credential(s)``, ``access_key``, ``private_key``; the tokenizer's ``pad_token``,
  ``eos_token``... are not secrets) is ``<redacted>``;
* in any other string, the credentials of a URL (``https://user:pass@host`` ->
  ``https://<redacted>@host``), the values of secret-named query parameters (``?token=...``,
  ``&api_key=...``) and strings shaped like well-known tokens (``hf_...``, ``sk-...``, ``ghp_...``,
  ``xox?-...``, AWS ``AKIA...``) are replaced.

Numbers and booleans are never changed (``max_tokens``, ``token2text`` stay readable).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["REDACTED", "redact_config", "redact_text"]

REDACTED = "<redacted>"
_SECRET_NAME = re.compile(
    r"(^|_)(token|secret|password|passwd|credentials?|api_?key|access_?key|private_?key|auth)s?$", re.I
)
_NOT_SECRET = re.compile(r"(^|_)(pad|eos|bos|unk|sep|cls|mask|image|video|audio|start|end)_token$", re.I)
_URL_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.I)
_QUERY_SECRET = re.compile(
    r"(?P<key>[?&](?:token|access_token|api_key|apikey|key|secret|password|sig|signature)=)[^&#\s]+", re.I
)
_TOKEN_SHAPES = re.compile(
    r"\b(?:hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|xox[abpr]-[A-Za-z0-9-]{10,}"
    r"|AKIA[0-9A-Z]{16})\b"
)


def _secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name)) and not _NOT_SECRET.search(name)


def redact_text(text: str) -> str:
    """``text`` with URL credentials, secret query values and token-shaped substrings replaced."""
    text = _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
    text = _QUERY_SECRET.sub(lambda m: f"{m.group('key')}{REDACTED}", text)
    return _TOKEN_SHAPES.sub(REDACTED, text)


def redact_config(value: Any, key: str = "", under_env: bool = False) -> Any:
    """A copy of a plain config tree (dicts, lists, scalars) with secrets replaced (see the module doc).

    Args:
        value: the config (as ``dataclasses.asdict`` or ``OmegaConf.to_container`` give it).
        key: the name ``value`` is stored under (its parent's key).
        under_env: ``value`` is inside an ``env_vars`` mapping.
    """
    if isinstance(value, dict):
        env = under_env or key == "env_vars"
        return {k: redact_config(v, str(k), env) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_config(v, key, under_env) for v in value)
    if isinstance(value, str):
        if under_env or _secret_name(key):
            return REDACTED if value else value
        return redact_text(value)
    if under_env and value is not None and not isinstance(value, bool):
        return REDACTED
    return value
