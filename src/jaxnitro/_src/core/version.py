"""The package's version, in one place: `jn.__version__` and what a bundle records."""

__version__ = "0.1.0"
