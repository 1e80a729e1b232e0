"""Looking at a run, while it runs and after: the progress display (`display`) and what it
says of a population's members (`members`), curves (`plot`), the runs under a directory
(`runs`), phases, step events and signals (`events`), the loggers (`loggers`), throughput and
timing (`throughput`, `timing`) and the profiler window (`profile`).

It may import every layer below `run` (`core` to `programs`). What it reads of a run it names
in Protocols (`events.phases.Phased`, `plot.Curves`, `members.PopulationRun`,
`throughput.ThroughputSpec`): never `run`'s `Nitro` or `RunSpec`. The functions that take the
handle itself (`jn.inspect`, `jn.render`, the out-of-memory report) are in `train`.
"""
