"""Loggers: the `jn.Logger` protocol, the JSONL log every run writes, and loggers made of
others (`logger=False`, `logger=[a, b]`). A logger for another backend is one module here."""

from .base import FanoutLogger, Logger, NullLogger, check_logger, make_logger
from .jsonl import JSONLogger, LogWarning, LogWriteError, read_jsonl

__all__ = [
    "FanoutLogger",
    "JSONLogger",
    "LogWarning",
    "LogWriteError",
    "Logger",
    "NullLogger",
    "check_logger",
    "make_logger",
    "read_jsonl",
]
