"""A built-in visual task generated in code: "What colour is the shape?" on small drawn images.

Each image is a 56 x 56 picture with one filled square or disc in one of four colours on a white
background, at a random place, its side 36-56 pixels (large shapes: the tiny model's vision tower
has to pick the colour out of 4 image tokens; with sides of 14-28 pixels it barely learned it even
supervised); the prompt asks for its colour and the reference answer is
``#### red`` (the built-in tasks' ``####`` convention). Rows use veRL's multimodal schema (as
``examples/data_preprocess/geo3k.py`` writes it): ``prompt`` with an ``<image>`` placeholder and an
``images`` column of ``{"bytes": <PNG>}`` dicts, so the same files exercise the geo3k path.
"""

from __future__ import annotations

import io
import random
from typing import Any

VISUAL_DATA_SOURCE = "hybridrl/shapes"
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
SHAPES = ("square", "disc")
IMAGE_SIZE = 56
QUESTION = "<image>What colour is the shape?"


def draw_shape(colour: str, shape: str, rng: random.Random, size: int = IMAGE_SIZE) -> bytes:
    """PNG bytes of one filled `shape` in `colour` on white (size x size pixels)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (255, 255, 255))
    side = rng.randint(size // 2 + 8, size)
    x, y = rng.randint(0, size - side), rng.randint(0, size - side)
    box = (x, y, x + side - 1, y + side - 1)
    draw = ImageDraw.Draw(img)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLOURS[colour])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def make_rl_rows(n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """`n` RL rows: prompt, images ([{"bytes": png}]), data_source, reward_model, extra_info.

    The split only changes the seed stream (train and val draw different pictures).
    """
    rng = random.Random(f"{split}:{seed}")
    rows = []
    for i in range(n):
        colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
        rows.append(
            {
                "data_source": VISUAL_DATA_SOURCE,
                "prompt": [{"role": "user", "content": QUESTION}],
                "images": [{"bytes": draw_shape(colour, shape, rng)}],
                "ability": "vision",
                "reward_model": {"style": "rule", "ground_truth": colour},
                "extra_info": {"split": split, "index": i, "shape": shape},
            }
        )
    return rows


def write_rl_parquet(path: str, n: int, seed: int, split: str = "train") -> str:
    """Write :func:`make_rl_rows` to a parquet file (images as PNG bytes); returns the path."""
    from hybridrl.data.builtin_task import write_parquet

    return write_parquet(make_rl_rows(n, seed, split), path)


VIDEO_QUESTION = "<video>What colour is the moving shape?"


def make_video_rows(n: int, seed: int, frames: int = 3, split: str = "train") -> list[dict[str, Any]]:
    """`n` RL rows with a ``videos`` column (veRL's ``[{"video": [frame, ...]}]``, PNG-bytes frames of
    one shape moving); every other row also has a picture (``<image><video>`` prompts).

    `frames` odd exercises the padding of the last temporal patch (Qwen2-VL groups 2 frames).
    """
    rng = random.Random(f"video:{split}:{seed}")
    rows = []
    for i in range(n):
        colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
        clip = [{"bytes": draw_shape(colour, shape, rng)} for _ in range(frames)]
        with_image = i % 2 == 0
        rows.append(
            {
                "data_source": VISUAL_DATA_SOURCE,
                "prompt": [{"role": "user", "content": ("<image>" if with_image else "") + VIDEO_QUESTION}],
                "images": [{"bytes": draw_shape(colour, shape, rng)}] if with_image else [],
                "videos": [{"video": clip}],
                "ability": "vision",
                "reward_model": {"style": "rule", "ground_truth": colour},
                "extra_info": {"split": split, "index": i, "shape": shape},
            }
        )
    return rows


def write_video_parquet(path: str, n: int, seed: int, frames: int = 3, split: str = "train") -> str:
    """Write :func:`make_video_rows` to a parquet file (frames as PNG bytes); returns the path."""
    from hybridrl.data.builtin_task import write_parquet

    return write_parquet(make_video_rows(n, seed, frames, split), path)


def compute_score(solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """1.0 when the text after the last ``####`` (or the whole reply) names the colour, else 0.0."""
    text = solution_str.rsplit("####", 1)[-1].strip().lower()
    return 1.0 if text.split()[:1] == [ground_truth.lower()] else 0.0
