"""jaxnitro: declare the experiment, compile once, train without boilerplate."""

from . import datasets, distributed, schedules
from .checkpoint import TopKCheckpointer, load_checkpoint, read_manifest
from .compile.cache import cache_reset, cache_stats
from .custom import group_grad, optimizer_step
from .data import DataLoader
from .devices import setup_devices
from .early_stop import EarlyStopping
from .errors import (
    BundleError,
    BundleInputError,
    CheckpointError,
    ConfigError,
    DataError,
    ExportError,
    HookError,
    HostFieldError,
    JaxnitroError,
    MemoryPlanError,
    MetricsError,
    NonFiniteLossError,
    RoutingError,
    RunLockedError,
)
from .evaluation import evaluate, validate
from .events import Preempted, StepRecord, every, on_phase
from .experiment import Device, GraphConst, Host, experiment, fields
from .export import Bundle, TensorSpec, export_model, load_bundle
from .grain_source import shard_options
from .history import History
from .introspect import compile, compile_report, explain, inspect, memory_plan
from .live import device_value, history, request_stop, set_device
from .loggers import (
    CSVLogger,
    JSONLogger,
    Logger,
    MLflowLogger,
    TensorBoardLogger,
    WandbLogger,
    read_jsonl,
)
from .loop import TrainResult, train
from .lr_find import LRFindResult, lr_find
from .models import apply, split_model
from .nitro import Dist, Nitro, member
from .plot import plot
from .prediction import predict
from .render import render
from .sharding import Sharding
from .state import TrainState, train_step
from .version import __version__ as __version__

__all__ = [
    "BundleError",
    "BundleInputError",
    "ExportError",
    "Bundle",
    "TensorSpec",
    "export_model",
    "load_bundle",
    "CheckpointError",
    "ConfigError",
    "EarlyStopping",
    "MemoryPlanError",
    "compile",
    "compile_report",
    "explain",
    "inspect",
    "memory_plan",
    "schedules",
    "DataError",
    "DataLoader",
    "Device",
    "Dist",
    "GraphConst",
    "History",
    "Host",
    "HookError",
    "HostFieldError",
    "CSVLogger",
    "JSONLogger",
    "JaxnitroError",
    "Logger",
    "MLflowLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "MetricsError",
    "Nitro",
    "NonFiniteLossError",
    "Preempted",
    "RoutingError",
    "RunLockedError",
    "Sharding",
    "StepRecord",
    "TopKCheckpointer",
    "TrainResult",
    "TrainState",
    "apply",
    "cache_reset",
    "cache_stats",
    "datasets",
    "distributed",
    "device_value",
    "evaluate",
    "every",
    "experiment",
    "fields",
    "history",
    "load_checkpoint",
    "lr_find",
    "LRFindResult",
    "group_grad",
    "member",
    "optimizer_step",
    "on_phase",
    "plot",
    "predict",
    "render",
    "read_jsonl",
    "read_manifest",
    "request_stop",
    "set_device",
    "setup_devices",
    "shard_options",
    "split_model",
    "train",
    "train_step",
    "validate",
]
