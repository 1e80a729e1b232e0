"""Out of device memory in the middle of a run: a report in place of XLA's message.

When a program fails to allocate (`RESOURCE_EXHAUSTED`, "Out of memory"), the run raises
`OutOfMemoryError` (the original error chained) saying which phase and program failed, the
memory plan's figures for that program against the device's limit, the largest arrays alive
grouped by what they are, and the fixes that fit.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import jax

from jaxnitro._src.core.errors import JaxnitroError
from jaxnitro._src.core.units import format_bytes

if TYPE_CHECKING:
    from jaxnitro._src.compile.memory import MemoryPlan, ProgramMemory
    from jaxnitro._src.run.nitro import Nitro

_SIGNS = ("RESOURCE_EXHAUSTED", "out of memory", "failed to allocate", "allocation failure")
_SHOWN = 8  # largest live arrays listed


class OutOfMemoryError(JaxnitroError, MemoryError):
    """A program ran out of device memory mid-run (see `train/oom.py`)."""


def is_oom(error: BaseException) -> bool:
    """Whether `error` is an allocation failure of the runtime (not a Python MemoryError of
    the host, nor a plan refusal, which has its own report)."""
    if isinstance(error, JaxnitroError):
        return False
    text = str(error).lower()
    return any(sign.lower() in text for sign in _SIGNS)


@contextlib.contextmanager
def reported(n: Nitro, plan: MemoryPlan | None) -> Iterator[None]:
    """Inside: an allocation failure becomes an `OutOfMemoryError`, the original chained."""
    try:
        yield
    except Exception as e:
        if not is_oom(e):
            raise
        raise report(n, plan, e) from e


def at_steps(error: BaseException, steps: tuple[int, int]) -> None:
    """Mark `error` with the optimizer steps (first, last) of the train call that failed:
    with calls in flight, the error surfaces at a later dispatch or read-back, and the
    handle's step is then the last dispatched, not the one that failed."""
    with contextlib.suppress(AttributeError, TypeError):  # an exception without a __dict__
        error._jaxnitro_steps = steps  # type: ignore[attr-defined]


def _where(n: Nitro, error: BaseException) -> str:
    """`step 3`, or `steps 1-4` for a fused call (`steps_per_call`), of the failed call."""
    first, last = getattr(error, "_jaxnitro_steps", (n.step, n.step))
    return f"step {first}" if first == last else f"steps {first}-{last} (one call)"


def report(n: Nitro, plan: MemoryPlan | None, error: BaseException) -> OutOfMemoryError:
    """The `OutOfMemoryError` for `error`, raised by the caller `from error`."""
    phase = n.services.phases.current
    prog = _program(plan, phase)
    lines = [
        f"out of device memory while {phase.lower()} (epoch {n.epoch + 1}, {_where(n, error)})"
        + (f", in program '{prog.name}'" if prog is not None else "")
        + f": {_first_line(error)}"
    ]
    if plan is not None and prog is not None:
        lines += [
            f"the memory plan for it: arguments {format_bytes(prog.arguments)}, outputs "
            f"{format_bytes(prog.outputs - prog.aliased)} (not donated), temporaries "
            f"{format_bytes(prog.temporaries)}, kept: params {format_bytes(plan.params_bytes)}, "
            f"optimizer state {format_bytes(plan.opt_state_bytes)}, batches kept on the device "
            f"{format_bytes(plan.kept_batches_bytes)}; limit {format_bytes(plan.capacity)} "
            f"({plan.capacity_source})"
        ]
    groups = live_arrays(n)
    if groups:
        lines.append("largest arrays alive:")
        lines += [f"  {line}" for line in groups]
    lines.append("fixes that fit: " + "; ".join(_fixes(n)))
    return OutOfMemoryError("\n".join(lines))


def live_arrays(n: Nitro) -> list[str]:
    """The largest live arrays, by what they are: each group's total, then its arrays."""
    kinds = _kinds(n)
    by_kind: dict[str, list[Any]] = collections.defaultdict(list)
    for arr in _live():
        by_kind[kinds.get(id(arr), "user arrays / batches in flight")].append(arr)
    out = []
    ranked = sorted(by_kind.items(), key=lambda kv: -sum(_nbytes(a) for a in kv[1]))
    for kind, arrays in ranked:
        arrays.sort(key=_nbytes, reverse=True)
        total = sum(_nbytes(a) for a in arrays)
        out.append(f"{kind}: {format_bytes(total)} in {len(arrays)} array(s)")
        out += [f"  {format_bytes(_nbytes(a))}  {a.dtype}{list(a.shape)}" for a in arrays[:_SHOWN]]
    return out


def _kinds(n: Nitro) -> dict[int, str]:
    """id(array) -> what it is, for the arrays the run holds."""
    ts = n.train_state
    trees: list[tuple[str, Any]] = [
        ("parameters", ts.params),
        ("optimizer state", ts.opt_state),
        ("model state", ts.state),
        ("EMA weights", ts.ema),
        ("batches kept on the device", n.spec.resident),
    ]
    kinds: dict[int, str] = {}
    for name, tree in trees:
        for leaf in jax.tree.leaves(tree):
            kinds.setdefault(id(leaf), name)
    return kinds


def _live() -> Iterable[Any]:
    try:
        return jax.live_arrays()
    except Exception:  # noqa: BLE001 - a backend without the list: no table, still the report
        return ()


def _nbytes(arr: Any) -> int:
    try:
        return int(arr.nbytes)
    except Exception:  # noqa: BLE001 - a deleted or donated buffer
        return 0


def _program(plan: MemoryPlan | None, phase: str) -> ProgramMemory | None:
    if plan is None or not plan.programs:
        return None
    want = "val" if phase.lower().startswith("validat") else "train"
    named = [p for p in plan.programs if p.name.startswith(want)]
    return max(named or plan.programs, key=lambda p: p.estimate)


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0][:200] if str(error).strip() else repr(error)


def _fixes(n: Nitro) -> list[str]:
    spec, fixes = n.spec, []
    batch = spec.split_specs["train"].batch_size if "train" in spec.split_specs else None
    if batch and batch > 1:
        fixes.append(f"a smaller batch (now {batch}) with accum={spec.accum * 2} to keep its size")
    if spec.remat is None:
        fixes.append("remat=['Block'] (the model's repeated block class) to recompute activations")
    if getattr(spec.sharding, "fsdp", False) is False and spec.mesh.size > 1:
        fixes.append('sharding="fsdp" to split parameters and optimizer state over the devices')
    if spec.resident is not None or spec.device_batches is not None:
        fixes.append("data_on_device=False to keep the train arrays on the host")
    if spec.precision != "bf16":
        fixes.append('precision="bf16" to halve activations')
    if spec.steps_per_call > 1:
        fixes.append(f"steps_per_call=1 (now {spec.steps_per_call}): one step's batches at a time")
    return fixes
