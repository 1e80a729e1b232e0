"""Optimizers built from optax pieces: param groups, decoupled decay, clipping and
schedules (`groups`; the public `jaxnitro.schedules` re-exports its schedule factories), and
the per-step hyperparameter vector (`hyper`).

It may import `core` and `compile`; `experiment` is its sibling and neither imports the other.
"""
