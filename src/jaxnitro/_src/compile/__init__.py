"""Compilation: tracing user hooks into XLA programs and caching them process-wide.

It also measures `steps_per_call="auto"` (`autotune`).

It may import `core`, `experiment`, `optim`, `steps`, `data` (the feed's call layout) and
`dist`; and, in annotations only (under `TYPE_CHECKING`), `run`'s `RunSpec` and `Nitro`.
"""
