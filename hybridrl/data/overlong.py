"""`data.filter_overlong_prompts_workers`: the prompt lengths of `filter_overlong_prompts` in N processes.

veRL filters over-long prompts with `datasets.filter(num_proc=N)`. Here the rows to check are cut
into N contiguous chunks, each measured in its own worker process by the dataset's own serial
code (`RLHFDataset.prompt_lengths`: the chat template, the tokenizer and, for image rows, the
processor), and the lengths come back in row order, so the rows kept are those of one process.
Workers start with `spawn` (the driver may already run threads: Ray, the tool loop) and receive
the dataset once each, at start-up.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

__all__ = ["parallel_prompt_lengths"]

_DATASET: Any = None  # the dataset, in each worker process


def _init(dataset: Any) -> None:
    global _DATASET
    _DATASET = dataset


def _lengths(rows: list[int]) -> list[int]:
    return _DATASET.prompt_lengths(rows)


def parallel_prompt_lengths(dataset: Any, rows: list[int], workers: int) -> list[int]:
    """The prompt length of each of `rows` (dataset row indices), measured by `workers` processes.

    Args:
        dataset: an RLHFDataset (picklable: its rows, tokenizer, processor and config).
        rows: the row indices to measure, in the order their lengths are returned.
        workers: the number of processes; 1 (or fewer rows than 2 per worker) measures here.
    """
    if workers <= 1 or len(rows) < 2 * workers:
        return dataset.prompt_lengths(rows)
    size = -(-len(rows) // workers)
    chunks = [rows[i : i + size] for i in range(0, len(rows), size)]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(len(chunks), mp_context=ctx, initializer=_init, initargs=(dataset,)) as pool:
        return [n for part in pool.map(_lengths, chunks) for n in part]
