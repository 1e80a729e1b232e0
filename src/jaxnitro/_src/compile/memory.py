"""The memory plan: will training fit on the device, checked before step 1.

An out-of-memory error an hour into a run (at the first validation, or at the first
checkpoint) costs the hour. XLA knows every program's memory needs once it is compiled, so
jaxnitro compiles every program ahead of time from the first batch's shapes, adds what lives
outside the programs (prefetched batches, checkpoint staging), and compares the sum with the
device's capacity. If it does not fit, `check` fails with a table of where the bytes go and
concrete changes that would make it fit.

The programs run one at a time and params and optimizer state are *arguments* of the train
program (donated, so its outputs alias them), so the total is the largest program's
estimate, not the sum over programs, and params are never counted twice.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxnitro._src.core.errors import ConfigError, MemoryPlanError
from jaxnitro._src.core.units import format_bytes

if TYPE_CHECKING:
    from typing import Any

    from jaxnitro._src.core.types import PyTree

__all__ = ["MemoryPlan", "ProgramMemory", "check", "device_capacity", "plan", "suggestions"]

_HOST = "available host RAM"


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """One compiled program's memory, from XLA's ``memory_analysis()`` (bytes, per device).

    ``estimate = arguments + outputs - aliased + temporaries + code``: donated inputs share
    their buffers with outputs. On an H200 this matched the measured peak within 560 bytes
    of 2.4 GB. (XLA's own ``peak_memory_in_bytes`` leaves out temporaries on CPU.)
    """

    name: str
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    code: int
    estimate: int

    @classmethod
    def of(cls, name: str, compiled: Any) -> ProgramMemory | None:
        """Read a compiled program's memory analysis; None where the backend has none."""
        try:
            m = compiled.memory_analysis()
        except Exception:  # unimplemented on some backends and plugins
            return None
        if m is None:
            return None
        parts = dict(
            arguments=m.argument_size_in_bytes,
            outputs=m.output_size_in_bytes,
            aliased=m.alias_size_in_bytes,
            temporaries=m.temp_size_in_bytes,
            code=m.generated_code_size_in_bytes,
        )
        parts = {k: int(v) for k, v in parts.items()}
        estimate = (
            parts["arguments"]
            + parts["outputs"]
            - parts["aliased"]
            + parts["temporaries"]
            + parts["code"]
        )
        return cls(name=name, **parts, estimate=estimate)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Where the bytes of a training run go, against what the device holds.

    Attributes:
      programs: every compiled program's memory.
      params_bytes, opt_state_bytes, model_state_bytes: sizes of those pytrees (they are
        part of the programs' arguments; listed for the table).
      batch_bytes: one batch on the device.
      batches_in_flight: batches held besides the one a program is consuming (prefetch).
      checkpoint_staging_bytes: host copy made while writing a checkpoint.
      kept_batches_bytes: an in-order train split's batches kept on the device, besides the
        one a program is consuming (`data/device_batches.py`).
      total: the largest program + batches in flight + kept batches + (on host memory)
        checkpoint staging.
      capacity, capacity_source: what the device holds and where that number came from.
      fits: ``total <= capacity``.
    """

    programs: tuple[ProgramMemory, ...]
    params_bytes: int
    opt_state_bytes: int
    model_state_bytes: int
    batch_bytes: int
    batches_in_flight: int
    checkpoint_staging_bytes: int
    total: int
    capacity: int
    capacity_source: str
    fits: bool
    members: int | None = None  # a population's member count (its trees carry a member axis)
    kept_batches_bytes: int = 0

    @property
    def largest_population(self) -> int | None:
        """For a population: about how many members would fit, everything scaling with the
        member count (conservative: a batch all members share does not)."""
        if not self.members:
            return None
        return max(int(self.capacity // (self.total / self.members)), 0)

    @property
    def largest(self) -> ProgramMemory:
        """The program that sets the total."""
        return max(self.programs, key=lambda p: p.estimate)

    @property
    def staging_counted(self) -> bool:
        """Checkpoint staging is host memory: it competes only with a host-RAM capacity."""
        return _HOST in self.capacity_source

    def table(self) -> str:
        """Where the bytes go, largest program first, in binary units."""
        p = self.largest
        in_trees = self.params_bytes + self.opt_state_bytes + self.model_state_bytes
        staging = "checkpoint staging (host)" + ("" if self.staging_counted else ", not counted")
        rows = [
            ("params", self.params_bytes),
            ("optimizer state", self.opt_state_bytes),
            ("model state", self.model_state_bytes),
            ("batch and other arguments", max(p.arguments - in_trees, 0)),
            ("outputs (not donated)", p.outputs - p.aliased),
            ("temporaries (activations, gradients)", p.temporaries),
            ("generated code", p.code),
            (
                f"batches in flight ({self.batches_in_flight} x {format_bytes(self.batch_bytes)})",
                self.batches_in_flight * self.batch_bytes,
            ),
            (staging, self.checkpoint_staging_bytes),
        ]
        if self.kept_batches_bytes:
            rows.insert(-1, ("train batches kept on the device", self.kept_batches_bytes))
        verdict = "fits" if self.fits else f"over by {format_bytes(self.total - self.capacity)}"
        width = max(len(name) for name, _ in rows) + 2
        lines = [f"where the bytes go (largest program: '{p.name}')"]
        lines += [f"  {name:<{width}}{format_bytes(n):>10}" for name, n in rows]
        lines += [
            f"  {'total':<{width}}{format_bytes(self.total):>10}",
            f"  {'capacity (' + self.capacity_source + ')':<{width}}"
            f"{format_bytes(self.capacity):>10}   {verdict}",
        ]
        if self.members:
            each = format_bytes(self.total // self.members)
            lines.append(
                f"population: {self.members} members, about {each} each; about "
                f"{self.largest_population} would fit"
            )
        others = [q for q in self.programs if q is not p]
        if others:
            lines.append(
                "other programs (run one at a time): "
                + ", ".join(f"'{q.name}' {format_bytes(q.estimate)}" for q in others)
            )
        return "\n".join(lines)


def device_capacity(device: Any = None, memory_budget: int | None = None) -> tuple[int, str]:
    """(bytes, source) a training run may use on `device` (default: the first device).

    `memory_budget` wins when given. Otherwise the device's ``bytes_limit`` (on GPU about 75%
    of its memory, JAX's default preallocation); CPU devices report no memory stats, and
    there the device memory *is* host RAM, so the RAM available now is the capacity.

    Example:
      >>> device_capacity(memory_budget=2**30)
      (1073741824, 'memory_budget')
    """
    if memory_budget is not None:
        return int(memory_budget), "memory_budget"
    device = device if device is not None else jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # some plugins do not implement it
        stats = None
    if stats and stats.get("bytes_limit"):
        name = type(device).__name__.removesuffix("Device").lower() or device.platform
        return int(stats["bytes_limit"]), f"bytes_limit of {name}:{device.id}"
    return _available_host_ram(), _HOST


def plan(
    compiled_programs: Mapping[str, object],
    *,
    params: PyTree,
    opt_state: PyTree,
    model_state: PyTree,
    batch_bytes: int,
    batches_in_flight: int,
    checkpoint_staging_bytes: int,
    capacity: int,
    capacity_source: str,
    members: int | None = None,
    kept_batches_bytes: int = 0,
) -> MemoryPlan:
    """Add up the memory of a run's compiled programs and buffers.

    Args:
      compiled_programs: name -> ``jax.stages.Compiled`` (e.g. ``{"train": ..., "eval": ...}``).
      params, opt_state, model_state: the pytrees (arrays or ``ShapeDtypeStruct``s).
      batch_bytes: bytes of one batch on the device.
      batches_in_flight: batches held besides the one being consumed (prefetch depth).
      checkpoint_staging_bytes: host bytes a checkpoint write stages.
      capacity, capacity_source: from `device_capacity`.
      kept_batches_bytes: train batches kept on the device besides the one in use.

    Example:
      >>> step = jax.jit(train_step, donate_argnums=0).lower(state, batch).compile()
      >>> p = plan({"train": step}, params=state.params, opt_state=state.opt_state,
      ...          model_state={}, batch_bytes=tree_bytes(batch), batches_in_flight=2,
      ...          checkpoint_staging_bytes=0, capacity=2**30, capacity_source="memory_budget")
      >>> print(p.table())
    """
    params_bytes, opt_bytes, state_bytes = map(tree_bytes, (params, opt_state, model_state))
    inputs = params_bytes + opt_bytes + state_bytes + batch_bytes
    programs = _program_memories(compiled_programs, inputs)
    if not programs:
        raise ConfigError(
            "there is no compiled program to plan: jn.memory_plan(n) needs a run with a "
            "'train' or 'val' split (and plan() a dict {name: lowered.compile()})"
        )
    total = max(p.estimate for p in programs) + batches_in_flight * batch_bytes
    total += kept_batches_bytes
    if _HOST in capacity_source:
        total += checkpoint_staging_bytes
    return MemoryPlan(
        programs=tuple(programs),
        params_bytes=params_bytes,
        opt_state_bytes=opt_bytes,
        model_state_bytes=state_bytes,
        batch_bytes=batch_bytes,
        batches_in_flight=batches_in_flight,
        checkpoint_staging_bytes=checkpoint_staging_bytes,
        total=total,
        capacity=capacity,
        capacity_source=capacity_source,
        fits=total <= capacity,
        members=members,
        kept_batches_bytes=kept_batches_bytes,
    )


def _program_memories(
    compiled_programs: Mapping[str, object], inputs_bytes: int
) -> list[ProgramMemory]:
    """Each program's memory analysis; where the backend has none, at least its inputs."""
    programs = []
    for name, compiled in compiled_programs.items():
        memory = ProgramMemory.of(name, compiled)
        if memory is None:  # no analysis on this backend: count at least what goes in
            memory = ProgramMemory(name, inputs_bytes, 0, 0, 0, 0, inputs_bytes)
        programs.append(memory)
    return programs


def suggestions(plan: MemoryPlan, *, batch_size: int, n_devices: int) -> list[str]:
    """Concrete changes that would make `plan` fit, each with the bytes it would save.

    The batch-size numbers assume temporaries and batch buffers grow linearly with the batch
    size, except a gradient-sized part of the temporaries (params bytes) that does not. The
    part of the temporaries that really is fixed is usually about that (measured on CPU:
    temporaries = 2104 B x batch + 4 kB for a 13 kB-param MLP), so the suggested batch errs
    on the safe side.

    Example:
      >>> for fix in suggestions(p, batch_size=256, n_devices=1):
      ...     print("-", fix)
    """
    if plan.fits:
        return []
    temp = plan.largest.temporaries
    out = []
    if plan.members and plan.members > 1:
        fit = plan.largest_population or 0
        out.append(
            f"population={fit} (from {plan.members}) should fit: each member takes about "
            f"{format_bytes(plan.total // plan.members)}"
            if fit >= 1
            else f"even one member of the population does not fit (about "
            f"{format_bytes(plan.total // plan.members)} each)"
        )
    out += _batch_suggestions(plan, batch_size=batch_size)
    out.append(
        f'precision="bf16" stores activations in bfloat16, roughly halving temporaries: '
        f"about {format_bytes(plan.total - temp // 2)} in total{_verdict(plan, temp // 2)}."
    )
    out.append(
        f"remat: jn.Nitro(..., remat=['Block'], remat_policy='dots_saveable') names the "
        f"block classes of the model whose activations are recomputed in the backward pass "
        f"instead of stored; saves up to the {format_bytes(temp)} of temporaries, for extra "
        f"compute."
    )
    if not plan.members:  # a population keeps its parameters replicated
        out.append(_fsdp_suggestion(plan, n_devices=n_devices))
    return out


def _batch_suggestions(plan: MemoryPlan, *, batch_size: int) -> list[str]:
    """A smaller batch_size (and the accum that keeps the effective batch) that should fit,
    or why a smaller batch alone cannot."""
    temp = plan.largest.temporaries
    grads = min(temp, plan.params_bytes)
    per_batch = temp - grads + plan.batch_bytes * (plan.batches_in_flight + 1)  # +1: argument
    fixed = max(plan.total - per_batch, 0)
    per_sample = per_batch / max(batch_size, 1)
    largest = math.floor((plan.capacity - fixed) / per_sample) if per_sample else 0
    if not 1 <= largest < batch_size:
        return [
            f"a smaller batch alone will not do: the parts that do not scale with it "
            f"(params, optimizer state, gradients, outputs, code, staging) take "
            f"{format_bytes(fixed)} of {format_bytes(plan.capacity)}."
        ]
    accum = next(
        k for k in range(2, batch_size + 1) if batch_size % k == 0 and batch_size // k <= largest
    )
    return [
        f"batch_size={largest} (from {batch_size}) should fit, about "
        f"{format_bytes(fixed + largest * per_sample)}; this assumes temporaries (mostly "
        f"activations) and batch buffers scale linearly with the batch size.",
        f"accum={accum} with batch_size={batch_size // accum} keeps the effective batch "
        f"of {batch_size}: {accum} micro-batches per optimizer step, in one program.",
    ]


def _fsdp_suggestion(plan: MemoryPlan, *, n_devices: int) -> str:
    sharded = plan.params_bytes + plan.opt_state_bytes
    if n_devices > 1:
        saved = sharded - sharded // n_devices
        return (
            f'FSDP (sharding="fsdp") splits the parameters and optimizer state over the '
            f"{n_devices} devices ((params + optimizer state) / {n_devices} on each): saves up to "
            f"{format_bytes(saved)}{_verdict(plan, saved)}."
        )
    return (
        f'FSDP (sharding="fsdp") over N devices keeps (params + optimizer state) / N on each '
        f"({format_bytes(sharded)} now); it needs more than this one device (n_devices=N)."
    )


def check(plan: MemoryPlan, *, batch_size: int, n_devices: int) -> None:
    """Raise `MemoryPlanError` with the table and the suggestions if `plan` does not fit.

    Example:
      >>> check(p, batch_size=256, n_devices=1)  # returns None when it fits
    """
    if plan.fits:
        return
    fixes = "\n".join(
        f"  - {s}" for s in suggestions(plan, batch_size=batch_size, n_devices=n_devices)
    )
    raise MemoryPlanError(
        f"training would run out of memory: it needs {format_bytes(plan.total)} but the "
        f"{plan.capacity_source} is {format_bytes(plan.capacity)}. Stopping before step 1 rather "
        f"than at an out-of-memory error hours in.\n\n{plan.table()}\n\nTo make it fit:\n"
        f"{fixes}\nIf the capacity is wrong (another process shares the device, or it may "
        f"use more), pass memory_budget=<bytes> to Nitro."
    )


def _verdict(plan: MemoryPlan, saved: int) -> str:
    return " (would fit)" if plan.total - saved <= plan.capacity else " (not enough alone)"


def tree_bytes(tree: PyTree) -> int:
    """Bytes on one device of a pytree of arrays or ``ShapeDtypeStruct``s (a sharded array
    counts its shard: the plan is per device).

    Example:
      >>> tree_bytes({"w": np.zeros((4, 8), np.float32), "b": jax.ShapeDtypeStruct((8,), "f4")})
      160
    """
    total = 0
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_replicated:
            shard = leaf.sharding.shard_shape(leaf.shape)
            total += math.prod(shard) * leaf.dtype.itemsize
            continue
        nbytes = getattr(leaf, "nbytes", None)
        if nbytes is None:
            if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
                nbytes = math.prod(leaf.shape) * leaf.dtype.itemsize  # also typed PRNG keys
            else:
                nbytes = np.asarray(leaf).nbytes
        total += int(nbytes)
    return total


def _available_host_ram() -> int:
    try:
        import psutil
    except ImportError:
        pass
    else:
        return int(psutil.virtual_memory().available)
    try:  # MemAvailable counts the page cache the kernel would give back; SC_AVPHYS_PAGES not
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
