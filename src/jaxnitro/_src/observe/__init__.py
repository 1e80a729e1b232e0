"""Looking at a run, while it runs and after: the progress display (`display`) and what it
says of a population's members (`members`), curves (`plot`), per-sample pictures and heatmaps
(`render`), `jn.inspect`, `jn.explain` and `jn.memory_plan` (`introspect`), the runs under a
directory (`runs`), phases, step events and signals (`events`), and the loggers (`loggers`).

It may import every part but `run`, `cli`, `export` and `serve` (`run`'s `Nitro` in annotations
only, under `TYPE_CHECKING`).
"""
