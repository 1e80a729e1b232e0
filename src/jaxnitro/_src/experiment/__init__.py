"""What the user declares: `@jn.experiment`, the field markers and the compile
view traced hooks run against (`markers`), hook discovery and batch-field routing (`hooks`),
the adapters over Flax NNX/Linen, Equinox and plain models (`models`), rematerialised blocks
(`remat`).

It may import `core` and `compile` (the fingerprints tell a user's function from a
library's). The options it refuses as GraphConst are declared to it by `run.options`.
"""
