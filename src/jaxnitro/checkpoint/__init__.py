"""Checkpoints: the format both writers share (`format`), the Top-K store,
loading, verifying and the manifest (`store`), the shards of a multi-process run (`shards`),
and one writer per run directory (`runlock`).

It may import `core` and `dist`.
"""
