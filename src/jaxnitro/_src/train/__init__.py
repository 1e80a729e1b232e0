"""What is done with a handle: `jn.train` (`driver`) and its epoch, one function of values
(`epoch`; the step lines of a read-back chunk in `steplines`, the read-back in `readback`),
`jn.validate` and `jn.evaluate` (`evaluation`), `jn.predict` (`prediction`), `jn.lr_find`
(`lr_find`), `jn.render` (`render`), `jn.inspect`, `jn.explain` and `jn.memory_plan`
(`introspect`), `steps_per_call="auto"` (`autotune`), the out-of-memory report (`oom`),
checkpoints of a run (`checkpointing`) and `jn.start` (`background`).

It may import every layer below it (`core` to `run`); `export`, `serve` and `cli` never.
"""
