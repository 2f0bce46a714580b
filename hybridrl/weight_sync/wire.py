"""The collective group's metadata in the store: JSON of a fixed shape, checked on every read.

Trainer rank 0 writes three kinds of value into the group's TCPStore (collective.py), and every
rollout worker reads them:

    head    {"version": int, "tp": int, "sharded": bool}                   once per update
    bucket  {"table": [[name, dtype, [dims], offset], ...], "nbytes": int,
             "places": {"<index>": [[full dims], dim, start], ...}}         per bucket
    end     null                                                             after the last bucket

The store listens on the node's address, so any process that reaches its port can write to it.
A value is therefore only ever parsed as JSON (which builds nothing but dicts, lists, strings and
numbers) and then checked field by field: its shape, the integer ranges, the dtype against a
fixed list, every tensor inside the bucket's bytes. Anything else raises `WeightMetadataError`
naming the key; nothing read from the store is ever executed or used to pick code.
"""

from __future__ import annotations

import json
from typing import Any

from hybridrl.weight_sync.buckets import ALIGN

__all__ = [
    "DTYPES",
    "WeightMetadataError",
    "decode_bucket",
    "decode_head",
    "encode_bucket",
    "encode_end",
    "encode_head",
]

DTYPES = {  # dtype name -> bytes per element: the dtypes a weight update may carry
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
MAX_BUCKET_BYTES = 1 << 40  # far above any bucket; bounds what a forged value can make a reader allocate
_MAX_DIMS = 8


class WeightMetadataError(ValueError):
    """A value in the weight-update group's store is not metadata trainer rank 0 wrote."""


# ----------------------------------------------------------------------------------------- write
def _dump(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def encode_head(version: int, tp: int, sharded: bool) -> bytes:
    return _dump({"version": int(version), "tp": int(tp), "sharded": bool(sharded)})


def encode_bucket(
    table: list[tuple[str, str, tuple[int, ...], int]],
    nbytes: int,
    places: dict[int, tuple[tuple[int, ...], int, int]] | None = None,
) -> bytes:
    """A bucket's table (`pack_bucket`'s), its byte size and, for TP slices, where each slice sits
    in its full tensor: {index in the table: (full shape, dim, start)}."""
    value: dict[str, Any] = {
        "table": [[name, dtype, list(shape), int(off)] for name, dtype, shape, off in table],
        "nbytes": int(nbytes),
    }
    if places:
        value["places"] = {
            str(j): [list(full), int(dim), int(start)] for j, (full, dim, start) in places.items()
        }
    return _dump(value)


def encode_end() -> bytes:
    return _dump(None)


# ------------------------------------------------------------------------------------------ read
def _load(raw: bytes, key: str) -> Any:
    try:
        return json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise WeightMetadataError(f"{key}: not JSON ({type(err).__name__})") from None


def _int(value: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    if type(value) is not int or value < lo or (hi is not None and value > hi):
        bound = f" in [{lo}, {hi}]" if hi is not None else f" >= {lo}"
        raise WeightMetadataError(f"{what} must be an integer{bound}, got {value!r:.80}")
    return value


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > _MAX_DIMS:
        raise WeightMetadataError(f"{what} must be a list of at most {_MAX_DIMS} sizes, got {value!r:.80}")
    return tuple(_int(d, f"{what}[{i}]", 0, MAX_BUCKET_BYTES) for i, d in enumerate(value))


def _fields(value: Any, key: str, required: set[str], optional: set[str] = frozenset()) -> dict:
    if not isinstance(value, dict):
        raise WeightMetadataError(f"{key}: expected a JSON object, got {type(value).__name__}")
    missing, extra = required - value.keys(), value.keys() - required - optional
    if missing or extra:
        raise WeightMetadataError(
            f"{key}: fields {sorted(value)}; expected {sorted(required)}"
            + (f" (optional {sorted(optional)})" if optional else "")
        )
    return value


def decode_head(raw: bytes, key: str) -> dict[str, Any]:
    """An update's head: {"version", "tp", "sharded"}, checked."""
    value = _fields(_load(raw, key), key, {"version", "tp", "sharded"})
    if type(value["sharded"]) is not bool:
        raise WeightMetadataError(f"{key}: sharded must be true or false, got {value['sharded']!r:.80}")
    return {
        "version": _int(value["version"], f"{key}: version"),
        "tp": _int(value["tp"], f"{key}: tp", 1, 1 << 16),
        "sharded": value["sharded"],
    }


def decode_bucket(raw: bytes, key: str) -> dict[str, Any] | None:
    """A bucket's metadata, checked ({"table": [(name, dtype, shape, offset)], "nbytes", "places":
    {index: (full shape, dim, start)}}), or None at the end of an update.

    Every tensor of the table must lie inside the bucket's `nbytes`, at an offset that is a
    multiple of ALIGN; a place must hold its tensor inside the full shape.
    """
    value = _load(raw, key)
    if value is None:
        return None
    value = _fields(value, key, {"table", "nbytes"}, {"places"})
    nbytes = _int(value["nbytes"], f"{key}: nbytes", 0, MAX_BUCKET_BYTES)
    rows = value["table"]
    if not isinstance(rows, list):
        raise WeightMetadataError(f"{key}: table must be a list, got {type(rows).__name__}")
    table = []
    for i, row in enumerate(rows):
        what = f"{key}: table[{i}]"
        if not isinstance(row, list) or len(row) != 4:
            raise WeightMetadataError(f"{what} must be [name, dtype, shape, offset], got {row!r:.80}")
        name, dtype, shape, off = row
        if not isinstance(name, str):
            raise WeightMetadataError(f"{what}: the name must be a string, got {name!r:.80}")
        if dtype not in DTYPES:
            raise WeightMetadataError(f"{what}: dtype {dtype!r:.40} is not one of {sorted(DTYPES)}")
        shape = _shape(shape, f"{what} shape")
        off = _int(off, f"{what} offset", 0, nbytes)
        numel = 1
        for d in shape:
            numel *= d
        if off % ALIGN or off + numel * DTYPES[dtype] > nbytes:
            raise WeightMetadataError(
                f"{what}: {name!r:.80} ({dtype}, {list(shape)}) at byte {off} does not fit an aligned place "
                f"in the bucket's {nbytes} bytes"
            )
        table.append((name, dtype, shape, off))
    places = {}
    raw_places = value.get("places", {})
    if not isinstance(raw_places, dict):
        raise WeightMetadataError(f"{key}: places must be an object, got {type(raw_places).__name__}")
    for j, place in raw_places.items():
        what = f"{key}: places[{j!r:.20}]"
        if not (j.isdigit() and int(j) < len(table)) or not isinstance(place, list) or len(place) != 3:
            raise WeightMetadataError(f"{what} must name a table row and be [full shape, dim, start]")
        index = int(j)
        full = _shape(place[0], f"{what} full shape")
        piece = table[index][2]
        dim = _int(place[1], f"{what} dim", 0, max(len(full) - 1, 0))
        start = _int(place[2], f"{what} start", 0, MAX_BUCKET_BYTES)
        if len(full) != len(piece) or any(
            (f < p) if d != dim else (start + p > f) for d, (f, p) in enumerate(zip(full, piece))
        ):
            raise WeightMetadataError(
                f"{what}: a {list(piece)} slice does not fit {list(full)} at dim {dim}, start {start}"
            )
        places[index] = (full, dim, start)
    return {"table": table, "nbytes": nbytes, "places": places}
