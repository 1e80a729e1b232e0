"""A run's programs, built from its steps: the train, eval and predict programs (`builders`),
the hook calls they trace (`calls`), their keys, compiles and the `ProgramSet` (`keys`), what
they trace and its fingerprints (`traced`), edited code found at an entry point (`stale`),
which of them a run will need and the memory they take (`plan`), and `steps_per_call="auto"`
is measured on a handle, in `train.autotune`.
It may import `core`, `compile`, `experiment`, `optim`, `dist`, `data`, `checkpoint` and
`steps`. What it reads of a run it names in Protocols of its own (`spec.ProgramSpec`),
which the run's `RunSpec` satisfies; it never imports `run`.
"""
