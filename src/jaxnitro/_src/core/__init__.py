"""The core: errors, byte sizes, the JSON sanitiser, the version, directories only this user
controls (`private_dirs`), and the aliases that name what a user passes (`types`: `PyTree`,
`Experiment`, `Model`, `Batch`, `Source`).

Imported by every other part; it imports nothing of ours.
"""
