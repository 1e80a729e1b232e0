"""Looking at a run without training it: programs, why they compiled, memory, groups.

It only looks: planning and the memory check live in `programs/plan.py`. `jn.compile(n)`
compiles every program the run will use; `jn.compile_report(n)` lists what
each cost; `jn.explain(n)` says why each recompile happened; `jn.memory_plan(n)` adds up the
bytes before step 1; `jn.inspect(n)` prints all of it with the binding report and the
parameter groups.
"""

from __future__ import annotations

import dataclasses
import html
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxnitro._src.compile import memory, report
from jaxnitro._src.core.units import format_bytes
from jaxnitro._src.experiment.markers import fields
from jaxnitro._src.observe import timing
from jaxnitro._src.observe.display import in_notebook
from jaxnitro._src.observe.runs import run_rows
from jaxnitro._src.programs import plan
from jaxnitro._src.programs.stale import check_stale

if TYPE_CHECKING:
    from jaxnitro._src.run.nitro import Nitro


def compile(n: Nitro) -> dict:  # noqa: A001 - the public name
    """Compile (or fetch from the cache) every program the run will use; no training.

    Args:
        n: the run (`jn.Nitro`).

    Returns:
        The programs planned for the run, by kind (``"train"``, ``"eval"``, ...).

    Raises:
        MemoryPlanError: the programs would not fit in the device's memory (the message holds
            the table and what to change).

    Example:
        >>> sorted(jn.compile(n))
        ['eval', 'train']
    """
    check_stale(n.spec, n.programs)
    return plan.planned(n.spec, n.programs, n.train_state, n.device, epoch=n.epoch, step=n.step)


def compile_report(n: Nitro) -> report.CompileReport:
    """One record per program this Nitro compiled: seconds, op counts, constants, memory.

    Args:
        n: the run (`jn.Nitro`).

    Returns:
        A `CompileReport`: a list of records that prints as a table (HTML in a notebook).

    Example:
        >>> [r.kind for r in jn.compile_report(n)]
        ['train', 'eval']
    """
    return report.CompileReport(p.record for p in n.programs.compiled if p.record is not None)


def explain(n: Nitro) -> list[dict]:
    """Why each program this Nitro compiled differs from the closest one compiled before.

    Args:
        n: the run (`jn.Nitro`).

    Returns:
        One dict per recompiled program: ``kind``, ``label`` and ``reasons`` (sentences in
        the experiment's terms); programs compiled for the first time are left out.

    Example:
        >>> jn.explain(n)
        [{'kind': 'train', 'label': 'Mlp', 'reasons': ['GraphConst `width` changed 128 → 256']}]
    """
    return [
        {"kind": p.kind, "label": p.label, "reasons": list(p.reasons)}
        for p in n.programs.compiled
        if p.reasons
    ]


def memory_plan(n: Nitro, *, prefetch_depth: int = 2) -> memory.MemoryPlan:
    """Where the bytes go, from the compiled programs' memory analysis, against capacity.

    Args:
        n: the run (`jn.Nitro`); its programs are compiled if they are not yet.
        prefetch_depth: how many batches ahead the prefetch thread puts on the device (each
            is counted).

    Returns:
        A `MemoryPlan`: the bytes per part (weights, optimizer state, activations, batches,
        ...), the capacity and whether it fits; `.table()` formats it.

    Example:
        >>> print(jn.memory_plan(n).table())
    """
    return plan.memory_plan(
        n.spec,
        n.programs,
        n.train_state,
        n.device,
        epoch=n.epoch,
        step=n.step,
        prefetch_depth=prefetch_depth,
    )


@dataclasses.dataclass
class Inspection:
    """What `jn.inspect` reports, by section; `text()` is the whole report.

    A report `jn.inspect(n)` has printed already is not printed again: its `str()` is then a
    one-line note, so `print(jn.inspect(n))` shows the report once.
    """

    binding: str
    groups: str
    compile_report: str
    memory: str
    sharding: str = ""
    records: list = dataclasses.field(default_factory=list, repr=False)  # the report's rows
    notes: list = dataclasses.field(default_factory=list, repr=False)  # the programs planned
    time_split: str = ""  # where the last epoch's time went (observe/timing.py)
    _shown = False  # (unannotated: not a field) set by jn.inspect once it printed the text

    def text(self) -> str:
        """The whole report: binding, groups, sharding, programs, memory."""
        parts = [self.binding, self.groups, self.sharding, self.compile_report, self.memory]
        parts.append(self.time_split)
        return "\n\n".join(p for p in parts if p)

    def _repr_html_(self) -> str | None:
        """A notebook's view: each part a block, the compile report's programs a table
        (None once `jn.inspect` showed it: the cell's value is then the one-line note)."""
        if self._shown:
            return None
        parts = [
            ("binding", self.binding),
            ("groups", self.groups),
            ("sharding", self.sharding),
            ("programs", self.compile_report),
            ("memory", self.memory),
        ]
        out = []
        for name, part in parts:
            if not part:
                continue
            title, _, body = part.partition("\n")
            if name == "programs":  # the notes as text, the compiled programs as a table
                body = "\n".join(self.notes)
            block = f"<pre>{html.escape(body)}</pre>" if body else ""
            if name == "programs" and self.records:
                block += report.CompileReport(self.records)._repr_html_()
            out.append(
                f"<details open><summary><b>{html.escape(title)}</b></summary>{block}</details>"
            )
        return "".join(out)

    def __str__(self) -> str:
        if self._shown:
            return "(the inspection report is printed above; .text() returns it)"
        return self.text()

    def __repr__(self) -> str:
        return str(self)


def inspect(n: Nitro, *, show: bool = True) -> Inspection:
    """Print the binding report, parameter groups, compile report and memory plan.

    Shows it once: printed, or in a notebook displayed as HTML; the returned report, shown
    again (`print(jn.inspect(n))`, or as a cell's value), is only a one-line note;
    `show=False` returns it unshown, its `str()` the whole text and HTML in a notebook.

    Args:
        n: the run (`jn.Nitro`); its programs are compiled if they are not yet.
        show: print (or display) the report now.

    Returns:
        An `Inspection`, one attribute per section (``binding``, ``groups``,
        ``compile_report``, ``memory``, ``sharding``); `.text()` is the whole report.

    Example:
        >>> report = jn.inspect(n, show=False)
        >>> print(report.memory)
    """
    mem = memory_plan(n)
    notes = [f"  {note}" for note in plan.notes(n.spec, train="train" in n.spec.splits)]
    records = [p.record for p in n.programs.used.values() if p.record]
    result = Inspection(
        binding=_binding(n),
        groups=_groups(n),
        compile_report="programs\n" + "\n".join(notes) + "\n" + report.format_table(records),
        memory=mem.table(),
        sharding=_sharding(n),
        records=records,
        notes=notes,
        time_split=_time_split(n),
    )
    if show:
        if in_notebook():  # the HTML view, once: the cell's value is then a one-line note
            from IPython.display import display  # the kernel loaded IPython already

            display(result)
        else:
            text = result.text()
            n.display.line(text) if n.display.mode != "off" else print(text)
        result._shown = True
    return result


def _time_split(n: Nitro) -> str:
    """The last epoch's time split from the run's log ('' before a train)."""
    log = Path(n.run_dir) / "metrics.jsonl"
    split = timing.last_split(run_rows(log)) if log.is_file() else None
    return "" if split is None else f"time (last epoch): {timing.format_split(split)}"


def _binding(n: Nitro) -> str:
    rows = [f"{'field':<16} {'marker':<11} value"]
    for f in fields(n.experiment):
        rows.append(f"{f.name:<16} {f.marker:<11} {getattr(n.experiment, f.name)!r:.40}")
    rows.append("")
    for hook, route in n.spec.routes.items():
        names = "**batch" if route.takes_all else ", ".join(route.required + route.optional)
        rows.append(f"{hook}() receives: {names or '(no batch fields)'}")
    for split, info in n.spec.split_specs.items():
        host_only = sorted(set(info.keys) - set(info.fields))
        rows.append(
            f"split {split!r}: batch {info.batch_size}, to device {list(info.fields)}"
            + (f", host only {host_only}" if host_only else "")
            + f"; from {data_source(n.spec.splits[split])}"
            + _resident(n.spec, split)
        )
    return "binding\n" + "\n".join(rows)


def _resident(spec: Any, split: str) -> str:
    if split != "train":
        return ""
    if spec.device_batches is not None:
        size = format_bytes(spec.device_batches.nbytes)
        return f"; on the device ({size}), in order: each batch put there once, taken as it is"
    if spec.resident is None:
        return ""
    size = sum(a.nbytes for a in spec.resident.values())
    return f"; on the device ({format_bytes(size)}), each batch gathered in the train program"


def data_source(src: Any) -> str:
    """Where a split's batches come from, and how many worker processes read them."""
    from jaxnitro._src.data import grain_source

    if grain_source.kind(src) is not None:
        return grain_source.describe(src)
    describe = getattr(src, "describe", None)
    if callable(describe):
        return str(describe())
    return f"{type(src).__name__} (iterated in-process)"


def _groups(n: Nitro) -> str:
    opt = n.optimizer
    rows = [f"{'group':<12} {'rule':<24} {'rate':>10} {'decay':>8} {'params':>12}"]
    for g, spec in sorted(opt.groups.items()):
        rule = (
            getattr(spec.factory, "__name__", None)
            or getattr(getattr(spec.factory, "func", None), "__name__", None)
            or "transform"
        )
        rows.append(
            f"{g:<12} {rule:<24} {spec.rate:>10.3g} {spec.weight_decay:>8.3g} {spec.count:>12,}"
        )
    extra = [f"clip global norm {opt.clip:g}" if opt.clip else "no clipping"]
    run = n.spec
    if run.schedules.fns:
        extra.append("schedules: " + ", ".join(sorted(run.schedules.fns)))
    extra.append(
        f"accum {run.accum}, steps_per_call {run.steps_per_call}, precision {run.precision}, "
        f"{run.total_steps} optimizer steps planned"
    )
    return "parameter groups\n" + "\n".join(rows + extra)


def _sharding(n: Nitro) -> str:
    """Each parameter's spec and bytes per device, on this run's mesh."""
    from jaxnitro._src.dist.sharding import describe

    spec = n.spec
    mesh = dict(zip(spec.mesh.axis_names, spec.mesh.devices.shape, strict=True))
    how = spec.sharding.describe() if spec.sharding is not None else "dp"
    rows = describe(n.params)
    width = max([len(r[0]) for r in rows] + [9])
    lines = [
        f"sharding {how} on mesh {mesh}",
        f"{'parameter':<{width}} {'shape':<16} {'spec':<24} {'total':>10} {'per device':>10}",
    ]
    for name, shape, pspec, total, per in rows:
        lines.append(
            f"{name:<{width}} {str(shape):<16} {pspec or 'replicated':<24} "
            f"{format_bytes(total):>10} {format_bytes(per):>10}"
        )
    total = sum(r[3] for r in rows)
    per = sum(r[4] for r in rows)
    lines.append(
        f"{'total':<{width}} {'':<16} {'':<24} {format_bytes(total):>10} {format_bytes(per):>10}"
    )
    return "\n".join(lines)


def peak_memory(n: Nitro) -> int | None:
    """Peak bytes in use on the first device of the mesh, where the backend reports it."""
    try:
        stats = n.mesh.devices.flat[0].memory_stats()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


__all__ = ["compile", "compile_report", "explain", "inspect", "memory_plan", "peak_memory"]
