"""Foreign config spellings, translated once into hybridrl's own keys.

hybridrl's own keys are veRL's classic layout (`data.*`, `actor_rollout_ref.*`, `critic.*`,
`reward_model.*`, `algorithm.*`, `trainer.*`). Everything else a user may bring is translated
here, by the entry points, before the rest of the library sees the config:

- `verl_layout` (+ `verl_layout_refusals`): veRL's newest layout (`reward.*`, `critic.fsdp.*`,
  ...) on the raw config, before the schema merge;
- `veomni`: VeOmni's engine keys (`model_engine=veomni`, `*.veomni.*`), run by `verl_layout`;
- `verl_legacy`, `verl_misc`: veRL's deprecated micro-batch keys, its refused keys and its
  algorithm / engine spellings (`*.model.torch_dtype`, `trainer.use_legacy_worker_impl`, ...) on
  the merged config;
- `async_keys`: AReaL's and veRL v1's asynchronous-training keys on main_async's command line;
- `areal_file` (+ `areal_rules`, its key table): a whole AReaL experiment file (`main_async --config file.yaml`).

This package imports nothing above `hybridrl.utils`: the trainer calls it, never the reverse.
"""
