"""From rows to device batches: `jn.DataLoader` (`loader`), the feed to the
programs (`feed`), row tables (`tables`), transform workers (`workers`), grain splits
(`grain_source`), batches kept on the device (`device_batches`), waits for data (`waits`) and
the offline datasets (`datasets`, public as `jaxnitro.datasets`).

It may import `core`, `compile`, `experiment`, `optim` and `dist`; `checkpoint` is its sibling
and neither imports the other. What a split's first batch showed is `splits.SplitSpec`.
"""
