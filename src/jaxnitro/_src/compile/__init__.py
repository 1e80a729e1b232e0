"""Compilation's low floor: the process-wide program cache (`cache`) and its keys (code
`fingerprint`s, re-checked by what they read in `remembered`; the JAX flags and environment
in `context`), why a program differs from the closest one compiled before (`explain`),
compile reports (`report`), program memory (`memory`), and JAX's persistent cache as
jaxnitro uses it (`persistent`, `cache_guard`).
The programs of a run are built above the steps, in `programs`.

It may import `core` only: the steps (`jn.train_step`), the model adapters and the devices'
cache set-up all use it (docs/layout.md).
"""
