"""The core: errors, byte sizes, the JSON sanitiser, the version, and the aliases that name
what a user passes (`types`: `PyTree`, `Experiment`, `Model`, `Batch`, `Source`).

Imported by every other part; it imports nothing of ours.
"""
