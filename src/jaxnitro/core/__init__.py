"""The core: errors, byte sizes, the JSON sanitiser and the version.

Imported by every other part; it imports nothing of ours.
"""
