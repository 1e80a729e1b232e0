"""The driver: `jn.train` (`driver`) and its epoch, one function of values (`epoch`; the
step lines of a read-back chunk in `steplines`, the read-back in `readback`), `jn.validate`
and `jn.evaluate` (`evaluation`), `jn.predict` (`prediction`), `jn.lr_find` (`lr_find`),
early stopping (`early_stop`: the frozen rule and state, and the pure step between them) and
the history (`history`).

It may import every part but `cli`, `export` and `serve`.
"""
