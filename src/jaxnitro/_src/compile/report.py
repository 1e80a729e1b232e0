"""Compile reports: what each compiled program cost, and the blow-ups worth a warning.

Every program jaxnitro compiles gets a `CompileRecord`: trace, lower and compile seconds, the
op counts before and after XLA's optimizations, the size of the StableHLO text, the bytes of
constants baked into it, the FLOP estimate and the memory analysis. `record` also flags the
three ways a program quietly gets expensive:

- **baked constants**: an array captured by closure (a dataset, a lookup table) becomes a
  literal in the program. The program text grows with it, every compile re-hashes it, and
  changing the array needs a recompile. It should be an input.
- **an unrolled Python loop**: `for _ in range(n)` inside a traced hook emits its body `n`
  times, so compile time grows with `n`. Detected as the same op sequence repeated many times
  in a row in the StableHLO (SSA names and constants ignored), more times than the program has
  inputs, so a per-parameter `tree_map` (one copy per leaf) is never mistaken for a loop; and,
  as a backstop, as a program much larger than its inputs explain.
- **a slow compile**: whatever the cause, the persistent compilation cache saves it next run.

Counting works on the program text, so it needs no private JAX API and works on any backend.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from jaxnitro._src.compile.memory import ProgramMemory
from jaxnitro._src.core.html_table import html_table
from jaxnitro._src.core.units import format_bytes

if TYPE_CHECKING:
    import jax

__all__ = ["CompileRecord", "Flag", "Thresholds", "flops", "format_table", "record"]


@dataclasses.dataclass(frozen=True)
class Flag:
    """A warning about one program, in the user's terms.

    Attributes:
      kind: ``"baked_constants"``, ``"op_count"`` or ``"slow_compile"``.
      message: what was found, the hook to look at, and the fix.
    """

    kind: str
    message: str


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """When `record` raises a flag.

    Attributes:
      constant_bytes: baked constants above this many bytes (all constants together).
      repeats: an op sequence repeated this many times in a row counts as an unrolled loop
        (only if it also repeats more often than the program has inputs; see the module doc).
        A 200-step loop repeats 200 times; real models repeat a layer at most a few dozen.
      max_period: the longest loop body, in StableHLO ops, the repeat search looks for.
      op_count: backstop: programs with more StableHLO ops than this ...
      ops_per_input: ... and more than this many ops per input leaf are flagged as well.
      compile_seconds: compiles slower than this are flagged.
    """

    constant_bytes: int = 1 << 20
    repeats: int = 32
    max_period: int = 256
    op_count: int = 5000
    ops_per_input: int = 200
    compile_seconds: float = 60.0


@dataclasses.dataclass(frozen=True)
class CompileRecord:
    """What compiling one program cost. Sizes in bytes, times in seconds.

    Attributes:
      kind: the program kind (``"train"``, ``"eval"``, ``"predict"``, ...).
      label: a longer description (e.g. the batch shapes it was compiled for).
      trace_seconds: Python tracing time, when the caller measured it separately.
      lower_seconds: time of ``jit(...).lower(...)`` (includes tracing if not measured apart).
      compile_seconds: time of ``lowered.compile()``, XLA's part.
      hlo_ops: instructions in the optimized HLO (``compiled.as_text()``).
      stablehlo_ops: operations in the lowered StableHLO (``lowered.as_text()``).
      text_bytes: size of the StableHLO text.
      constant_bytes: bytes of non-splat constants baked into the StableHLO.
      flops: XLA's FLOP estimate, when the backend gives one.
      memory: ``memory_analysis()`` as ``arguments, outputs, aliased, temporaries, code,
        estimate`` (estimate = arguments + outputs - aliased + temporaries + code), or None.
      flags: the warnings raised for this program.
      loaded: JAX loaded the executable from its persistent compilation cache (then
        `compile_seconds` is the load's time, not XLA's).
    """

    kind: str
    label: str
    trace_seconds: float | None
    lower_seconds: float
    compile_seconds: float
    hlo_ops: int
    stablehlo_ops: int
    text_bytes: int
    constant_bytes: int
    flops: float | None
    memory: dict | None
    flags: tuple[Flag, ...]
    loaded: bool = False


def record(
    kind: str,
    label: str,
    lowered: jax.stages.Lowered,
    compiled: jax.stages.Compiled,
    *,
    lower_seconds: float,
    compile_seconds: float,
    trace_seconds: float | None = None,
    hooks: Sequence[str] = ("forward", "loss"),
    thresholds: Thresholds = Thresholds(),
    loaded: bool = False,
) -> CompileRecord:
    """Measure a lowered and compiled program and flag compile blow-ups.

    Args:
      kind: the program kind, used in messages (``program 'train' ...``).
      label: a longer description for the table.
      lowered: the ``jax.stages.Lowered`` the program came from.
      compiled: ``lowered.compile()``.
      lower_seconds, compile_seconds, trace_seconds: timings the caller measured.
      hooks: the user hooks traced into this program, named in messages as where to look.
      thresholds: when to flag.
      loaded: whether the executable came from the persistent cache (no slow-compile flag).

    Example:
      >>> lowered = jax.jit(step).lower(params, batch)
      >>> rec = record("train", "batch (32, 784)", lowered, lowered.compile(),
      ...              lower_seconds=0.2, compile_seconds=1.3)
      >>> [f.message for f in rec.flags]
    """
    text = lowered.as_text()
    ops = _stablehlo_ops(text)
    constant_bytes = _constant_bytes(text)
    where = "/".join(f"{h}()" for h in hooks) or "the traced hooks"
    flags = [
        _constants_flag(kind, constant_bytes, where, thresholds),
        _loop_flag(kind, ops, _n_inputs(text), where, thresholds),
        None if loaded else _slow_compile_flag(kind, compile_seconds, len(ops), where, thresholds),
    ]
    return CompileRecord(
        kind=kind,
        label=label,
        trace_seconds=trace_seconds,
        lower_seconds=lower_seconds,
        compile_seconds=compile_seconds,
        hlo_ops=_hlo_ops(compiled),
        stablehlo_ops=len(ops),
        text_bytes=len(text.encode()),
        constant_bytes=constant_bytes,
        flops=flops(compiled),
        memory=_memory(kind, compiled),
        flags=tuple(f for f in flags if f is not None),
        loaded=loaded,
    )


def _memory(kind: str, compiled: jax.stages.Compiled) -> dict | None:
    """The program's memory analysis as a dict without its name, or None if unavailable."""
    program_memory = ProgramMemory.of(kind, compiled)
    if program_memory is None:
        return None
    memory = dataclasses.asdict(program_memory)
    del memory["name"]
    return memory


def _constants_flag(kind: str, constant_bytes: int, where: str, t: Thresholds) -> Flag | None:
    if constant_bytes <= t.constant_bytes:
        return None
    return Flag(
        "baked_constants",
        (
            f"program '{kind}' bakes {format_bytes(constant_bytes)} of constants into the "
            f"program: an array captured by closure in {where} (usually a dataset or a "
            f"lookup table). Pass it as a jn.Device field or a batch field instead."
        ),
    )


def _slow_compile_flag(
    kind: str, compile_seconds: float, n_ops: int, where: str, t: Thresholds
) -> Flag | None:
    if compile_seconds <= t.compile_seconds:
        return None
    return Flag(
        "slow_compile",
        (
            f"program '{kind}' took {compile_seconds:.0f} s to compile. The persistent "
            f"compilation cache (on unless JAXNITRO_COMPILATION_CACHE=0 or "
            f"jn.setup_devices(compilation_cache=False)) lets later runs load it instead. If "
            f"the op count ({n_ops:,}) is "
            f"large, look for Python loops in {where} and use jax.lax.scan or "
            f"jax.lax.fori_loop."
        ),
    )


class CompileReport(list):
    """`jn.compile_report(n)`: a list of `CompileRecord`s, shown as a table in a notebook."""

    def __str__(self) -> str:
        return format_table(self)

    def _repr_html_(self) -> str:
        header, rows = _table_rows(self)
        flags = "".join(f"<p>! {f.message}</p>" for r in self for f in r.flags)
        return html_table(header, rows, caption="programs compiled") + flags


def _table_rows(records: Sequence[CompileRecord]) -> tuple[tuple[str, ...], list[tuple]]:
    header = (
        "program",
        "label",
        "lower s",
        "compile s",
        "HLO ops",
        "StableHLO ops",
        "text",
        "constants",
        "GFLOP",
        "memory",
    )
    rows = []
    for r in records:
        rows.append(
            (
                r.kind,
                r.label,
                f"{r.lower_seconds:.2f}",
                f"{r.compile_seconds:.2f}" + (" (loaded)" if r.loaded else ""),
                f"{r.hlo_ops:,}",
                f"{r.stablehlo_ops:,}",
                format_bytes(r.text_bytes),
                format_bytes(r.constant_bytes),
                "-" if r.flops is None else f"{r.flops / 1e9:.3g}",
                "-" if r.memory is None else format_bytes(r.memory["estimate"]),
            )
        )
    return header, rows


# Columns a narrow terminal loses first (`format_table(width=...)`), least telling first.
_NARROW_DROPS = ("StableHLO ops", "constants", "text", "lower s", "HLO ops", "GFLOP", "label")


def format_table(records: Iterable[CompileRecord], *, width: int | None = None) -> str:
    """A plain-text table of compile records, then their flags, for end-of-run printing.

    With `width` (a terminal's columns), columns are left out, least telling first, until
    every line fits, and a last line names them: a table the terminal wraps is unreadable.

    Example:
      >>> lowered = jax.jit(step).lower(params, batch)
      >>> rec = record("train", "batch (32, 784)", lowered, lowered.compile(),
      ...              lower_seconds=0.2, compile_seconds=1.3)
      >>> print(format_table([rec]))
    """
    records = list(records)
    header, body = _table_rows(records)
    rows: list[tuple] = [header, *body]
    keep = list(range(len(header)))
    left_out: list[str] = []
    for name in _NARROW_DROPS:
        if width is None or _table_width(rows, keep) <= width:
            break
        keep.remove(header.index(name))
        left_out.append(name)
    rows = [tuple(row[i] for i in keep) for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(keep))]
    first = 2 - sum(header.index(name) < 2 for name in left_out)  # the left-aligned ones
    lines = [
        "  ".join(
            c.ljust(w) if i < first else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if left_out:
        lines.append(f"(left out to fit: {', '.join(left_out)}; jn.compile_report(n) has them)")
    lines += [f"! {f.message}" for r in records for f in r.flags]
    return "\n".join(lines)


def _table_width(rows: Sequence[tuple], keep: Sequence[int]) -> int:
    return sum(max(len(row[i]) for row in rows) for i in keep) + 2 * (len(keep) - 1)


# --- program text ------------------------------------------------------------------------

# An operation line: optional results (`%0 =`, `%0:3 =`, `%a, %b =`), then `dialect.op`.
_OP = re.compile(r'\s*(?:%[\w#:.$-]+(?:\s*,\s*%[\w#:.$-]+)*\s*=\s*)?"?([a-z_]\w*\.[\w.]+)')
_NOT_OPS = ("builtin.module", "func.func")  # containers, not computation
_SSA = re.compile(r"%[\w#.$-]+(?::\d+)?")
_SYMBOL_SUFFIX = re.compile(r"(@[\w.$-]+?)_\d+\b")  # @closed_call_3 -> @closed_call


def _stablehlo_ops(text: str) -> list[str]:
    """One entry per op of a StableHLO module: the line with SSA names and symbol suffixes
    normalized away, or "" for a constant.

    Normalizing makes two copies of an unrolled loop body identical. Constants count as ops
    but are blanked for the repeat search, because JAX places and numbers them unpredictably
    (and an unrolled loop's index is one).
    """
    out = []
    for line in text.splitlines():
        m = _OP.match(line)
        if m is None or m.group(1) in _NOT_OPS:
            continue
        if m.group(1) == "stablehlo.constant":
            out.append("")  # counted as an op, skipped by the repeat search
            continue
        out.append(_SYMBOL_SUFFIX.sub(r"\1", _SSA.sub("%", line.strip())))
    return out


def _n_inputs(text: str) -> int:
    """Number of arguments (flattened input leaves) of the module's `main`."""
    m = re.search(r"func\.func public @main\((.*)", text)
    return len(re.findall(r"%arg\d+\s*:", m.group(1))) if m else 0


def _longest_repeat(lines: Sequence[str], max_period: int) -> tuple[int, int]:
    """(repeats, period): the most times one block of `period` ops follows itself in a row.

    For each period p, positions where op i equals op i+p form runs; a run of length r means
    the block repeats (r + p) // p times. Vectorized over interned line ids so a 100k-op
    program takes milliseconds.
    """
    body = [line for line in lines if line]  # constants out
    ids: dict[str, int] = {}
    seq = np.fromiter(
        (ids.setdefault(line, len(ids)) for line in body), dtype=np.int64, count=len(body)
    )
    best = (1, 0)
    for p in range(1, min(max_period, len(seq) // 2) + 1):
        same = np.concatenate(([False], seq[p:] == seq[:-p], [False]))
        edges = np.flatnonzero(same[1:] != same[:-1])  # run starts and ends, alternating
        if not len(edges):
            continue
        run = int((edges[1::2] - edges[::2]).max())
        repeats = (run + p) // p
        if repeats > best[0]:
            best = (repeats, p)
    return best


def _loop_flag(kind: str, ops: list[str], n_inputs: int, where: str, t: Thresholds) -> Flag | None:
    repeats, period = _longest_repeat(ops, t.max_period)
    fix = "use jax.lax.scan or jax.lax.fori_loop (nnx.scan for a stack of identical layers)"
    # A tree_map over parameters emits one copy per leaf, so it can repeat at most n_inputs
    # times; more repeats than inputs can only come from Python control flow.
    if repeats >= t.repeats and repeats > n_inputs:
        return Flag(
            "op_count",
            (
                f"program '{kind}' has {len(ops):,} ops and repeats the same {period}-op sequence "
                f"{repeats} times in a row: the op count grows with a Python loop in {where}, and "
                f"so does compile time. To trace the loop body once, {fix}."
            ),
        )
    if len(ops) > t.op_count and len(ops) > t.ops_per_input * max(n_inputs, 1):
        return Flag(
            "op_count",
            (
                f"program '{kind}' has {len(ops):,} ops for {n_inputs} inputs "
                f"({len(ops) // max(n_inputs, 1):,} per input): it is likely unrolled by a Python "
                f"loop in {where}, and compile time grows with it. To trace a loop body once, "
                f"{fix}."
            ),
        )
    return None


# `%cst = stablehlo.constant dense<...> : tensor<4x8xf32>`; also dense_resource<blob>.
_CONSTANT = re.compile(r"stablehlo\.constant\s+(dense(?:_resource)?)<")
_TENSOR = re.compile(r":\s*tensor<([^>]*)>\s*$")


def _constant_bytes(text: str) -> int:
    """Bytes of the non-splat constants in a StableHLO module.

    A splat (one value broadcast, `dense<0.0> : tensor<1024x1024xf32>`) costs nothing in the
    program, so only constants that store every element count: shape x itemsize each.
    """
    total = 0
    for line in text.splitlines():
        m = _CONSTANT.search(line)
        if m is None:
            continue
        t = _TENSOR.search(line[-200:])  # the type ends the line; the literal may be huge
        nbytes = _tensor_bytes(t.group(1)) if t else 0
        if not nbytes:
            continue
        literal = line[m.end() : m.end() + 3]
        if m.group(1) == "dense_resource" or literal.startswith("["):
            total += nbytes
        elif literal.startswith('"0x'):
            hex_digits = line.find('"', m.end() + 1) - (m.end() + 3)
            if hex_digits // 2 >= nbytes:  # a splat prints as a single element's bytes
                total += nbytes
    return total


def _tensor_bytes(spec: str) -> int:
    """Bytes of `tensor<4x8xf32>`'s contents from its spec ("4x8xf32"); 0 if dynamic."""
    *dims, dtype = spec.split(",")[0].strip().split("x")
    if not all(d.isdigit() for d in dims):
        return 0
    bits = [int(b) for b in re.findall(r"\d+", dtype)]
    if not bits:
        return 0
    itemsize = max(1, bits[0] // 8) * (2 if dtype.startswith("complex") else 1)  # i1 -> 1 byte
    return math.prod(int(d) for d in dims) * itemsize


def _hlo_ops(compiled: jax.stages.Compiled) -> int:
    """Instructions in the optimized HLO text."""
    try:
        text = compiled.as_text() or ""
    except Exception:  # some backends cannot print their executable
        return 0
    return sum(1 for line in text.splitlines() if re.match(r"\s*(ROOT\s+)?%?[\w.\-]+\s*=\s", line))


def flops(stage: jax.stages.Compiled | jax.stages.Lowered) -> float | None:
    """XLA's FLOP estimate of a compiled or lowered program (None: not known).
    `cost_analysis()` is a dict in jax 0.10, a list of dicts in older versions, and None or
    an error where the backend has no cost model."""
    try:
        cost = stage.cost_analysis()
    except Exception:
        return None
    if isinstance(cost, dict):
        cost = [cost]
    flops = [c["flops"] for c in cost or () if isinstance(c, dict) and "flops" in c]
    total = float(sum(flops))
    return total if flops and total >= 0 else None  # XLA reports -1 for "unknown"
