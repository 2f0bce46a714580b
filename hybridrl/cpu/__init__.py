"""CPU-only speed paths, each behind the switch it has always had and equal to the plain path up to
float rounding. They depend on nothing else in hybridrl, so the engines and the rollouts above
use them without importing each other.

- `onednn`: torch's oneDNN linear op, its packed weights, and whether this build has it.
- `train_linear`: training linears through oneDNN (`fsdp_config.onednn_linear`).
- `decode_gemm`: the HF rollout's decode-step linears (`rollout.hf_decode_gemm_max_rows`).
- `gqa_attention`: grouped-query attention under a padding mask without copying K/V heads
  (the HF rollout on CPU).
- `kv_cache`: the HF rollout's key/value cache that grows in place.
- `sampler`: inverse-CDF sampling for large vocabularies (`rollout.hf_sampler`).
- `adamw`: torch's fused AdamW step for parameters in CPU memory.
- `linear_class`: undoing the class swap the two linear paths install.

Each module's docstring says what its path does, when it is on, and which bench/ script measures it.
"""
