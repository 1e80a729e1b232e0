"""jaxnitro: declare the experiment, compile once, train without boilerplate."""

from jaxnitro import datasets, distributed, schedules
from jaxnitro._src.checkpoint.store import TopKCheckpointer, load_checkpoint, read_manifest
from jaxnitro._src.compile.cache import cache_reset, cache_stats
from jaxnitro._src.core.errors import (
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
from jaxnitro._src.core.version import __version__ as __version__
from jaxnitro._src.data.grain_source import shard_options
from jaxnitro._src.data.loader import DataLoader
from jaxnitro._src.dist.devices import setup_devices
from jaxnitro._src.dist.sharding import Sharding
from jaxnitro._src.experiment.markers import Device, GraphConst, Host, experiment, fields
from jaxnitro._src.experiment.models import apply, split_model
from jaxnitro._src.export import Bundle, TensorSpec, export_model, load_bundle
from jaxnitro._src.observe.events import Preempted, StepRecord, every, on_phase
from jaxnitro._src.observe.loggers import (
    CSVLogger,
    JSONLogger,
    Logger,
    MLflowLogger,
    TensorBoardLogger,
    WandbLogger,
    read_jsonl,
)
from jaxnitro._src.observe.plot import plot
from jaxnitro._src.run.early_stop import EarlyStopping
from jaxnitro._src.run.history import History
from jaxnitro._src.run.live import device_value, history, request_stop, set_device
from jaxnitro._src.run.nitro import Dist, Nitro, member
from jaxnitro._src.run.rates import learning_rates, set_lr
from jaxnitro._src.steps.custom import group_grad, optimizer_step
from jaxnitro._src.steps.state import TrainState, train_step
from jaxnitro._src.train.background import RunHandle, runs, start
from jaxnitro._src.train.driver import TrainResult, train
from jaxnitro._src.train.evaluation import evaluate, validate
from jaxnitro._src.train.introspect import compile, compile_report, explain, inspect, memory_plan
from jaxnitro._src.train.lr_find import LRFindResult, lr_find
from jaxnitro._src.train.prediction import predict
from jaxnitro._src.train.render import render

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
    "RunHandle",
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
    "learning_rates",
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
    "runs",
    "set_device",
    "set_lr",
    "setup_devices",
    "shard_options",
    "split_model",
    "start",
    "train",
    "train_step",
    "validate",
]
