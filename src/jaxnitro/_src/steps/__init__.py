"""Pure steps on a `TrainState`: the pytree and the low-level `jn.train_step`
(`state`), the train/eval/predict step builders (`step`), the custom `train_step` hook and its
helpers (`custom`), populations under `vmap` (`population`), exact (sum, count) metrics
(`metrics`).

It may import `core`, `compile` (the low-level step's program cache), `experiment`, `optim`,
`dist`, `data` (a population's per-member loaders) and `checkpoint`. What it reads of a run
it names in Protocols (`ema.WeightsSource`, `population.OneOrMany`): never `run`'s `Nitro`.
"""
