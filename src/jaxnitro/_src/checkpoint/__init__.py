"""Checkpoints. `store` is the facade: `TopKCheckpointer` (saving, in the background too,
and the Top-K store of a directory) with `load_checkpoint`, `read_manifest`, `verify_checkpoint`
and `validate_int`. Behind it, by concern: the on-disk pieces both writers share (`format`), a
checkpoint's meta.json record (`record`), its leaves between device and disk (`leaves`), its
arrays through Orbax (`orbax_io`, with Orbax's log filters in `quiet`), loading and verifying
(`loading`), the manifest (`manifest`), the directory's hygiene (`directory`), which
checkpoints are kept (`retention`), the corrupted ones moved aside (`quarantine`) and the
messages of a failure (`messages`); the shards of a multi-process run (`shards`), and one
writer per run directory (`runlock`).

It may import `core`, `compile`, `experiment`, `optim` and `dist`; `data` is its sibling and
neither imports the other.
"""
