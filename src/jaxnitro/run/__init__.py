"""A run: the options of `jn.Nitro(...)` validated into `Settings` (`settings`), the
setup sequence (`setup`) that builds the frozen `RunSpec` (`spec`), the frozen `Progress`
(`progress`), the I/O half of a handle (`services`), the `Nitro` handle and `jn.member`
(`nitro`), and the live controls (`live`: `jn.set_device`, `jn.request_stop`, `jn.history`).

It may import every part but `cli`, `export` and `serve`.
"""
