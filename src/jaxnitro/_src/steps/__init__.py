"""Pure steps on a `TrainState`: the pytree and the low-level `jn.train_step`
(`state`), the train/eval/predict step builders (`step`), the custom `train_step` hook and its
helpers (`custom`), populations under `vmap` (`population`), exact (sum, count) metrics
(`metrics`).

It may import `core`, `experiment`, `compile` (the low-level step's program cache) and `data`
(a population's per-member loaders); and, in annotations only (under `TYPE_CHECKING`), `run`'s
`Nitro` and `RunSpec`.
"""
