"""The driver: `jn.train` (`driver`), `jn.validate` and `jn.evaluate`
(`evaluation`), `jn.predict` (`prediction`), `jn.lr_find` (`lr_find`), early stopping
(`early_stop`) and the history (`history`).

It may import every part but `cli`, `export` and `serve`.
"""
