"""The public surface, as users import it: `jn.` names, the three public modules, the CLI.

The lists below are literal on purpose: a change to the surface (a name added, removed or
renamed) must be a change to this file too, so that moving code around inside the package
cannot change what users see by accident.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types
from pathlib import Path

import click
import pytest

import jaxnitro as jn
from jaxnitro._src.cli import cli

SRC = Path(jn.__file__).resolve().parent.parent

ALL = [
    "Bundle",
    "BundleError",
    "BundleInputError",
    "CSVLogger",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DataLoader",
    "Device",
    "Dist",
    "EarlyStopping",
    "ExportError",
    "GraphConst",
    "History",
    "HookError",
    "Host",
    "HostFieldError",
    "JSONLogger",
    "JaxnitroError",
    "LRFindResult",
    "Logger",
    "MLflowLogger",
    "MemoryPlanError",
    "MetricsError",
    "Nitro",
    "NonFiniteLossError",
    "Preempted",
    "RoutingError",
    "RunHandle",
    "RunLockedError",
    "Sharding",
    "StepRecord",
    "TensorBoardLogger",
    "TensorSpec",
    "TopKCheckpointer",
    "TrainResult",
    "TrainState",
    "WandbLogger",
    "apply",
    "cache_reset",
    "cache_stats",
    "compile",
    "compile_report",
    "datasets",
    "device_value",
    "distributed",
    "evaluate",
    "every",
    "experiment",
    "explain",
    "export_model",
    "fields",
    "group_grad",
    "history",
    "inspect",
    "learning_rates",
    "load_bundle",
    "load_checkpoint",
    "lr_find",
    "member",
    "memory_plan",
    "on_phase",
    "optimizer_step",
    "plot",
    "predict",
    "read_jsonl",
    "read_manifest",
    "render",
    "request_stop",
    "runs",
    "schedules",
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

PUBLIC_MODULES = {"datasets", "distributed", "schedules"}

# Each public module's `__all__` (None: it has none) and the names users reach in it.
MODULE_ALL = {
    "schedules": ["constant", "linear", "one_cycle", "step_decay", "warmup_cosine"],
    "datasets": None,
    "distributed": [
        "DistributedError",
        "barrier",
        "broadcast",
        "check_same",
        "initialize",
        "is_initialized",
        "process_count",
        "process_index",
    ],
}
MODULE_NAMES = {
    "schedules": ["constant", "linear", "one_cycle", "step_decay", "warmup_cosine"],
    "datasets": ["mnist"],
    "distributed": [
        "DistributedError",
        "ENV_COORDINATOR",
        "ENV_LOCAL_DEVICE_IDS",
        "ENV_NUM_PROCESSES",
        "ENV_PROCESS_ID",
        "Layout",  # the resolved process layout and its source (issue 44)
        "SOURCES",
        "barrier",
        "broadcast",
        "check_same",
        "decided_by_process_zero",
        "gather",
        "initialize",
        "is_initialized",
        "process_count",
        "process_index",
        "resolve_args",
        "resolve_layout",
        "timeout_ms",
    ],
}

COMMANDS = [
    "cache",  # added with the persistent compilation cache (warm starts)
    "env",  # the resolved process layout, nothing started (issue 44)
    "evaluate",
    "export",
    "inspect",
    "launch",
    "mcp",  # an MCP server driving runs (issue 29; the mcp SDK is the [mcp] extra)
    "plot",
    "predict",
    "runs",
    "serve",
    "sweep",
    "train",
    "validate",
]


def test_the_jn_names_are_what_they_were():
    assert sorted(jn.__all__) == ALL
    assert len(jn.__all__) == len(ALL)  # no name listed twice
    for name in ALL:
        value = getattr(jn, name)
        # `jn.compile`, `jn.experiment`, `jn.plot`, ... are functions even where a module of
        # the package has the same name; only the three public modules are modules.
        assert isinstance(value, types.ModuleType) == (name in PUBLIC_MODULES), name


def test_the_public_modules_import_as_before():
    for name in sorted(PUBLIC_MODULES):
        module = importlib.import_module(f"jaxnitro.{name}")
        assert getattr(jn, name) is module
        assert getattr(module, "__all__", None) == MODULE_ALL[name]
        missing = [n for n in MODULE_NAMES[name] if not hasattr(module, n)]
        assert not missing, f"jaxnitro.{name} lost {missing}"
    import jaxnitro.schedules as schedules
    from jaxnitro.distributed import DistributedError, resolve_args

    assert float(schedules.warmup_cosine(warmup=0.1)(100)(10)) == 1.0
    assert issubclass(DistributedError, jn.JaxnitroError)
    assert callable(resolve_args)


def test_the_cli_commands_are_what_they_were():
    assert sorted(cli.commands) == COMMANDS
    groups = {name for name, c in cli.commands.items() if isinstance(c, click.Group)}
    assert groups == {"cache"}  # `jaxnitro cache info|clear`; every other command is a leaf
    assert sorted(cli.commands["cache"].commands) == ["clear", "info"]


@pytest.mark.slow
def test_python_m_jaxnitro_lists_the_commands():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "COLUMNS": "200"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-m", "jaxnitro", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    listed = [line.split()[0] for line in out.split("Commands:", 1)[1].splitlines() if line.strip()]
    assert listed == COMMANDS
