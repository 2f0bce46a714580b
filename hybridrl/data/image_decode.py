"""One image, given as veRL's dataset formats allow, decoded to an RGB ``PIL.Image``.

Shared by the multimodal dataset (hybridrl.data.multimodal), video frames (hybridrl.data.video)
and tool responses with images (hybridrl.agent.vision).
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["decode_image"]


def decode_image(image: Any, where: str):
    """One image as an RGB ``PIL.Image``.

    Args:
        image: {"bytes": b} / {"path": p} dict, bytes, a path (str / PathLike), or a PIL image.
        where: "file ... row n image k", named in errors.

    Raises:
        ValueError: unreadable bytes, a missing file, or an unsupported type.
    """
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, Mapping):
        if image.get("bytes") is not None:
            image = image["bytes"]
        elif image.get("path"):
            image = image["path"]
        elif image.get("image") is not None:
            return decode_image(image["image"], where)
        else:
            raise ValueError(
                f"{where}: an image dict needs a 'bytes' or 'path' entry, got keys {sorted(image)}"
            )
    if isinstance(image, (bytes, bytearray, memoryview)):
        source: Any = io.BytesIO(bytes(image))
    elif isinstance(image, (str, os.PathLike)):
        source = os.path.expanduser(os.fspath(image))
        if not os.path.isfile(source):
            raise ValueError(f"{where}: image file not found: {source!r}")
    else:
        raise ValueError(
            f"{where}: an image must be a {{'bytes'|'path'}} dict, bytes, a path or a PIL.Image, "
            f"got {type(image).__name__}"
        )
    try:
        with Image.open(source) as img:
            return img.convert("RGB")
    except Exception as exc:  # PIL raises UnidentifiedImageError, OSError, SyntaxError ...
        raise ValueError(f"{where}: cannot decode the image ({type(exc).__name__}: {exc})") from exc
