"""A run: the options of `jn.Nitro(...)` validated into `Settings` (`settings`), the
setup sequence (`setup/`, one module per concern) that builds the frozen `RunSpec` (`spec`),
the frozen `Progress` (`progress`, early stopping's state included), the early-stopping
rule (`early_stop`), the history (`history`), the I/O half of a handle
and the `Checkpointer` protocol (`services`), the `Nitro` handle and `jn.member`
(`nitro`), and the live controls (`live`: `jn.set_device`, `jn.request_stop`, `jn.history`).

It may import every layer below it (`core` to `observe`); `train` and above never.
"""
