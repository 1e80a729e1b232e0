"""Loggers: the `jn.Logger` protocol, the JSONL log every run writes, and loggers made of
others (`logger=False`, `logger=[a, b]`). A logger for another backend is one module here:
TensorBoard, MLflow and W&B (each an optional extra, imported when constructed), CSV."""

from jaxnitro._src.observe.loggers.base import (
    FanoutLogger,
    Logger,
    NullLogger,
    check_logger,
    make_logger,
)
from jaxnitro._src.observe.loggers.csv import CSVLogger
from jaxnitro._src.observe.loggers.jsonl import JSONLogger, LogWarning, LogWriteError, read_jsonl
from jaxnitro._src.observe.loggers.mlflow import MLflowLogger
from jaxnitro._src.observe.loggers.tensorboard import TensorBoardLogger
from jaxnitro._src.observe.loggers.wandb import WandbLogger

__all__ = [
    "CSVLogger",
    "FanoutLogger",
    "JSONLogger",
    "LogWarning",
    "LogWriteError",
    "Logger",
    "MLflowLogger",
    "NullLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "check_logger",
    "make_logger",
    "read_jsonl",
]
