"""The `Runtime` a server runs, built from the arguments of `serve` and `build_app`: every
value checked first (each error names the fix), then the bundles loaded, or a model
repository attached that loads its models when the server starts."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxnitro._src.core.errors import ConfigError, check_int
from jaxnitro._src.export import load_bundle
from jaxnitro._src.serve.modelconfig import check_io, parse_policy
from jaxnitro._src.serve.registry import (
    DEFAULT_BUCKET_CAP,
    Registry,
    Servable,
    ServedModel,
    load_models,
)
from jaxnitro._src.serve.repository import MODEL_LOAD_TIMEOUT_S, Repository
from jaxnitro._src.serve.runtime import Runtime

#: Seconds between rescans of a model repository in ``poll`` mode.
REPOSITORY_POLL_SECS = 15.0

Sources = Sequence[str | os.PathLike | Servable] | str | os.PathLike


def check_seconds(name: str, seconds: Any) -> None:
    """Raise `ConfigError` unless ``seconds`` is a finite number > 0."""
    if isinstance(seconds, bool) or not (
        isinstance(seconds, (int, float)) and 0 < seconds < math.inf
    ):
        raise ConfigError(f"{name} must be a number of seconds > 0, got {seconds!r}; e.g. 10.")


def build_runtime(
    dirs: Sources,
    *,
    max_batch_size: int | None,
    max_batch_delay_ms: float,
    max_body_bytes: int,
    max_queue_size: int,
    max_inflight_bytes: int | None,
    body_timeout: float,
    log_requests: bool,
    model_repository: str | os.PathLike | None = None,
    model_control_mode: str = "none",
    repository_poll_secs: float = REPOSITORY_POLL_SECS,
    load_model: Sequence[str] = (),
    version_policy: str | dict | None = None,
    model_load_timeout: float = MODEL_LOAD_TIMEOUT_S,
) -> Runtime:
    """The runtime serving ``dirs`` (loaded now) or ``model_repository`` (loaded at start)."""
    _check_limits(
        max_batch_size=max_batch_size,
        max_batch_delay_ms=max_batch_delay_ms,
        max_body_bytes=max_body_bytes,
        body_timeout=body_timeout,
        max_queue_size=max_queue_size,
        max_inflight_bytes=max_inflight_bytes,
        model_load_timeout=model_load_timeout,
    )
    _check_sources(dirs, model_repository, load_model, model_control_mode, version_policy)
    models = []  # a repository loads its models when the server starts
    if model_repository is None:
        models = load_models(
            dirs,
            bucket_cap=max_batch_size,
            max_tensor_bytes=max_body_bytes,
            max_batch_delay_ms=float(max_batch_delay_ms),
        )
    runtime = Runtime(
        Registry(models),
        max_batch_size=max_batch_size,
        max_batch_delay_ms=float(max_batch_delay_ms),
        max_body_bytes=max_body_bytes,
        max_queue_size=max_queue_size,
        max_inflight_bytes=max_inflight_bytes,
        body_timeout=float(body_timeout),
        log_requests=log_requests,
    )
    if model_repository is not None:
        _attach_repository(
            runtime,
            Path(model_repository),
            mode=model_control_mode,
            poll_secs=repository_poll_secs,
            load_model=load_model,
            version_policy=version_policy,
            load_timeout=model_load_timeout,
        )
    return runtime


def _check_limits(
    *,
    max_batch_size: int | None,
    max_batch_delay_ms: float,
    max_body_bytes: int,
    body_timeout: float,
    max_queue_size: int,
    max_inflight_bytes: int | None,
    model_load_timeout: float,
) -> None:
    """Raise `ConfigError` naming the first limit out of range, and a value that fits."""
    if max_batch_size is not None:
        check_int("max_batch_size", max_batch_size, fix="pass e.g. 32, or None for no batching")
    if isinstance(max_batch_delay_ms, bool) or not (
        isinstance(max_batch_delay_ms, (int, float)) and 0 <= max_batch_delay_ms < math.inf
    ):
        raise ConfigError(
            f"max_batch_delay_ms must be a number of milliseconds >= 0, got "
            f"{max_batch_delay_ms!r}; e.g. 2.0."
        )
    check_int("max_body_bytes", max_body_bytes, fix="pass e.g. 64 << 20 (64 MiB)")
    check_seconds("body_timeout", body_timeout)
    check_int("max_queue_size", max_queue_size, fix="pass e.g. 1024")
    if max_inflight_bytes is not None:
        check_int("max_inflight_bytes", max_inflight_bytes, fix="pass e.g. 256 << 20 (256 MiB)")
        if max_inflight_bytes < max_body_bytes:
            raise ConfigError(
                f"max_inflight_bytes ({max_inflight_bytes}) is smaller than max_body_bytes "
                f"({max_body_bytes}), so the largest request could never be answered; raise "
                f"it to at least {max_body_bytes}, or leave it out (4 x max_body_bytes)."
            )
    check_seconds("model_load_timeout", model_load_timeout)


def _check_sources(
    dirs: Sources,
    model_repository: str | os.PathLike | None,
    load_model: Sequence[str],
    mode: str,
    version_policy: str | dict | None,
) -> None:
    """Raise `ConfigError` for a repository's options without a repository, or for bundle
    directories and a repository both."""
    if model_repository is None:
        if load_model or mode != "none" or version_policy is not None:
            raise ConfigError(
                "load_model, model_control_mode and version_policy apply to a model "
                "repository; add model_repository=DIR (--model-repository DIR)."
            )
    elif isinstance(dirs, (str, os.PathLike)) or dirs:
        raise ConfigError(
            "serve takes bundle directories or a model repository, not both; put the bundles "
            "in the repository as <model>/<version>/, or serve them without one."
        )


def _attach_repository(
    runtime: Runtime,
    root: Path,
    *,
    mode: str,
    poll_secs: float,
    load_model: Sequence[str],
    version_policy: str | dict | None,
    load_timeout: float,
) -> None:
    """Give ``runtime`` the repository at ``root``; it loads its models when started."""
    if isinstance(poll_secs, bool) or not (
        isinstance(poll_secs, (int, float)) and 0 < poll_secs < math.inf
    ):
        raise ConfigError(
            f"repository_poll_secs must be a number of seconds > 0, got {poll_secs!r}; e.g. 15."
        )
    make_model = functools.partial(
        _make_model,
        max_batch_size=runtime.max_batch_size,
        max_batch_delay_ms=runtime.max_batch_delay_ms,
        max_body_bytes=runtime.max_body_bytes,
    )
    policy = None
    if version_policy is not None:
        policy = parse_policy(version_policy, where="--version-policy")
    runtime.repository = Repository(
        root,
        runtime=runtime,
        make_model=make_model,
        mode=mode,
        poll_secs=float(poll_secs),
        load=tuple(load_model),
        policy=policy,
        load_timeout=float(load_timeout),
    )
    runtime.starting = True


def _make_model(
    name: str,
    version: str,
    path: Path,
    settings: dict,
    *,
    max_batch_size: int | None,
    max_batch_delay_ms: float,
    max_body_bytes: int,
) -> ServedModel:
    """One version of a repository's model: its config.pbtxt (or a load request's config)
    over the server's flags. Runs in a worker thread (it loads the bundle)."""
    cap = settings.get("max_batch_size") or max_batch_size or DEFAULT_BUCKET_CAP
    batching = settings.get("batching", max_batch_size is not None)
    if "max_batch_size" in settings and "batching" not in settings:
        batching = False  # Triton: without dynamic_batching, each request alone
    model = ServedModel(
        load_bundle(path, max_batch_size=cap),
        name=name,
        version=version,
        bucket_cap=cap,
        max_tensor_bytes=max_body_bytes,
        batching=batching,
        max_batch_delay_ms=settings.get("max_batch_delay_ms", float(max_batch_delay_ms)),
        version_policy=settings["version_policy"],
    )
    model.configured = bool({"max_batch_size", "batching"} & set(settings))
    model.settings = settings
    where = f"model {name!r} version {version}"
    odd = sorted(set(settings.get("preferred", ())) - set(model.bucket_sizes()))
    if odd:
        raise ConfigError(
            f"{where}: preferred_batch_size {odd} is not among the batch sizes this "
            f"server compiles ({model.bucket_sizes()}: powers of two up to "
            f"max_batch_size); leave it out or use those."
        )
    if "io" in settings:
        check_io(model.config(), settings["io"], where=where)
    return model
