"""A checkpoint's record, `meta.json`: built at save time (`_new_record`), and on load read,
validated field by field and checked against its hash (`_read_meta`). Nothing read is trusted."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from jaxnitro._src.checkpoint.format import META
from jaxnitro._src.checkpoint.format import record_hash as _record_hash
from jaxnitro._src.checkpoint.messages import _short
from jaxnitro._src.core.errors import CheckpointError
from jaxnitro._src.core.jsonable import jsonable, parse_json

FORMAT_VERSION = 1


def _metric_value(name: str, value: Any) -> float | None:
    """A metric as a float; NaN/inf as None (JSON has none, and they cannot be ranked)."""
    try:
        number = float(value)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"metric {name!r}={value!r} is not a number; pass floats (or 0-d arrays)"
        ) from exc
    return jsonable(number)


def _bad_field(ckpt: Path, field: str, value: Any, want: str) -> CheckpointError:
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return CheckpointError(
        f"checkpoint {ckpt} is corrupted ({META} field {field!r} must be "
        f"{want}, got {shown}); use another checkpoint"
    )


def _is_int(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def validate_int(
    meta: dict,
    key: str,
    path: str | os.PathLike,
    *,
    minimum: int = 0,
    maximum: int | None = None,
    default: int | None = None,
) -> int:
    """``meta[key]`` as an int in [``minimum``, ``maximum``], else a CheckpointError naming
    the field and path.

    A missing (or null) value gives ``default`` when one is given. For the user meta of a
    checkpoint, e.g. ``validate_int(meta, "batch_in_epoch", path, default=0)``.

    Example:
        >>> validate_int({"batch_in_epoch": 7}, "batch_in_epoch", "ckpt", default=0)
        7
    """
    value: Any = meta.get(key) if isinstance(meta, dict) else None
    if value is None and default is not None:
        return default
    if not _is_int(value, minimum) or (maximum is not None and value > maximum):
        bound = f" and <= {maximum}" if maximum is not None else ""
        raise _bad_field(Path(path), key, value, f"an int >= {minimum}{bound}")
    return int(value)


def _check_record(ckpt: Path, info: dict) -> None:
    """Types and ranges of the fields jaxnitro itself uses, each error naming its field."""
    for key in ("epoch", "step"):
        validate_int(info, key, ckpt)
    metrics = info.get("metrics")
    if not isinstance(metrics, dict) or not all(
        isinstance(k, str)
        and (v is None or (isinstance(v, int | float) and not isinstance(v, bool)))
        for k, v in metrics.items()
    ):
        raise _bad_field(ckpt, "metrics", metrics, "a dict of str -> float or null")
    for key, kind in (("meta", dict), ("time", str)):
        if not isinstance(info.get(key), kind):
            raise _bad_field(ckpt, key, info.get(key), f"a {kind.__name__}")
    trees = info.get("trees")
    if not isinstance(trees, dict) or not all(isinstance(t, dict) for t in trees.values()):
        raise _bad_field(ckpt, "trees", trees, "a dict of tree specs")
    indices = set()
    for name, t in trees.items():
        index, leaves = t.get("index"), t.get("leaves")
        if not _is_int(index) or index in indices:
            raise _bad_field(ckpt, f"trees.{name}.index", index, "a distinct int >= 0")
        indices.add(index)
        if not isinstance(t.get("sha256"), str) or not isinstance(leaves, list):
            raise _bad_field(ckpt, f"trees.{name}", t, "{index, sha256: str, leaves: list}")
        for j, leaf in enumerate(leaves):
            if not _leaf_spec_ok(leaf):
                raise _bad_field(
                    ckpt,
                    f"trees.{name}.leaves[{j}]",
                    leaf,
                    "{path, keys, shape: [int >= 0], dtype: str, prng_impl}",
                )


def _leaf_spec_ok(leaf: Any) -> bool:
    """Whether a meta.json leaf spec has the fields and types `_check_record` requires."""
    return (
        isinstance(leaf, dict)
        and isinstance(leaf.get("path"), str)
        and isinstance(leaf.get("dtype"), str)
        and isinstance(leaf.get("prng_impl", 0), str | None)
        and isinstance(leaf.get("shape"), list)
        and all(_is_int(n) for n in leaf["shape"])
        and isinstance(leaf.get("keys"), list)
        and all(
            isinstance(e, list)
            and len(e) == 2
            and e[0] in ("i", "f", "a", "d")
            and isinstance(e[1], str | int)
            for e in leaf["keys"]
        )
    )


def _read_meta(ckpt: Path) -> dict:
    """meta.json of a checkpoint, validated (see _check_record) and checked against its hash."""
    try:
        info = parse_json((ckpt / META).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(
            f"{ckpt} is not a complete checkpoint (no {META}); pass a path "
            "returned by TopKCheckpointer.save(), latest() or best()"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint {ckpt} is corrupted (unreadable {META}: {_short(exc)}); use another "
            "checkpoint"
        ) from exc
    if not isinstance(info, dict):
        raise CheckpointError(
            f"checkpoint {ckpt} is corrupted ({META} is not a JSON object); use another checkpoint"
        )
    if info.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {ckpt} has format_version "
            f"{info.get('format_version')!r}; this jaxnitro reads {FORMAT_VERSION}. Load it "
            "with the jaxnitro version that wrote it"
        )
    _check_record(ckpt, info)
    # Checkpoints written before the record hash existed have none; any other is verified.
    if "record_sha256" in info:
        try:
            same = info.get("record_sha256") == _record_hash(info)
        except (TypeError, ValueError, RecursionError):
            same = False
        if not same:
            raise CheckpointError(
                f"checkpoint {ckpt} is corrupted ({META} does not match its "
                "record_sha256: it was edited or damaged); use another checkpoint"
            )
    return info


def _counters(epoch: Any, step: Any) -> tuple[int, int]:
    """(epoch, step) as ints >= 0: what _read_meta would refuse is refused at save time."""
    try:
        counters = int(epoch), int(step)
    except (TypeError, ValueError, OverflowError):
        counters = (-1, -1)
    if min(counters) < 0:
        raise CheckpointError(
            f"checkpoint epoch and step must be ints >= 0; pass the run's "
            f"counters, got epoch={epoch!r}, step={step!r}"
        )
    return counters


def _new_record(epoch: int, step: int, metrics: dict, meta: dict | None) -> dict:
    """The JSON record of a checkpoint (meta.json without its trees)."""
    record = {
        "format_version": FORMAT_VERSION,
        "epoch": epoch,
        "step": step,
        "metrics": {str(k): _metric_value(k, v) for k, v in metrics.items()},
        "time": datetime.now(UTC).isoformat(timespec="microseconds"),
        "meta": meta or {},
    }
    try:  # NaN/inf (a history row of a diverged step) as null, numpy values as numbers
        return jsonable(record)
    except RecursionError as exc:
        raise CheckpointError(
            "checkpoint meta contains itself (a cycle); pass plain JSON data (str/number/list/dict)"
        ) from exc
