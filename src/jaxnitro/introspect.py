"""Looking at a run without training it: programs, why they compiled, memory, groups.

`jn.compile(n)` compiles every program the run will use; `jn.compile_report(n)` lists what
each cost; `jn.explain(n)` says why each recompile happened; `jn.memory_plan(n)` adds up the
bytes before step 1; `jn.inspect(n)` prints all of it with the binding report and the
parameter groups.
"""

from __future__ import annotations

import dataclasses

from . import programs
from .compile import memory, report
from .experiment import fields
from .nitro import Nitro


def compile(n: Nitro) -> dict:  # noqa: A001 - the public name
    """Compile (or fetch from the cache) every program the run will use; no training."""
    programs.check_stale(n)
    return programs.planned(n)


def compile_report(n: Nitro) -> list[report.CompileRecord]:
    """One record per program this Nitro compiled: seconds, op counts, constants, memory."""
    return [p.record for p in n.program_set.compiled if p.record is not None]


def explain(n: Nitro) -> list[dict]:
    """Why each program this Nitro compiled differs from the closest one compiled before."""
    return [
        {"kind": p.kind, "label": p.label, "reasons": list(p.reasons)}
        for p in n.program_set.compiled
        if p.reasons
    ]


def memory_plan(n: Nitro, *, prefetch_depth: int = 2) -> memory.MemoryPlan:
    """Where the bytes go, from the compiled programs' memory analysis, against capacity."""
    progs = programs.planned(n, train="train" in n.splits)
    first = n.batch_info["train"]["first"] if "train" in n.splits else None
    fields_ = n.batch_info["train"]["fields"] if first is not None else ()
    unit = n.accum * n.steps_per_call
    batch_bytes = sum(first[f].nbytes for f in fields_) * unit if first is not None else 0
    capacity, source = memory.device_capacity(n.mesh.devices.flat[0], n.memory_budget)
    c = n.carry
    return memory.plan(
        {name: p.compiled for name, p in progs.items()},
        params=c.params,
        opt_state=c.opt_state,
        model_state=c.model_state,
        batch_bytes=batch_bytes,
        batches_in_flight=prefetch_depth + 1,
        checkpoint_staging_bytes=memory.tree_bytes((c.params, c.opt_state, c.model_state)),
        capacity=capacity,
        capacity_source=source,
    )


def check_memory(n: Nitro) -> memory.MemoryPlan:
    """The plan, raising MemoryPlanError (with the table and what to change) if it won't fit."""
    plan = memory_plan(n)
    bs = n.batch_info["train"]["batch_size"] if "train" in n.batch_info else 0
    memory.check(plan, batch_size=bs, n_devices=n.n_devices)
    return plan


@dataclasses.dataclass
class Inspection:
    binding: str
    groups: str
    compile_report: str
    memory: str

    def __str__(self) -> str:
        return "\n\n".join([self.binding, self.groups, self.compile_report, self.memory])


def inspect(n: Nitro, *, show: bool = True) -> Inspection:
    """Print the binding report, parameter groups, compile report and memory plan."""
    plan = memory_plan(n)
    result = Inspection(
        binding=_binding(n),
        groups=_groups(n),
        compile_report="programs\n"
        + "\n".join(f"  {note}" for note in programs.plan_notes(n, train="train" in n.splits))
        + "\n"
        + report.format_table(p.record for p in n.program_set.used.values() if p.record),
        memory=plan.table(),
    )
    if show:
        n.display.line(str(result)) if n.display.mode != "off" else print(result)
    return result


def _binding(n: Nitro) -> str:
    rows = [f"{'field':<16} {'marker':<11} value"]
    for f in fields(n.experiment):
        rows.append(f"{f.name:<16} {f.marker:<11} {getattr(n.experiment, f.name)!r:.40}")
    rows.append("")
    for hook, route in n.routes.items():
        names = "**batch" if route.takes_all else ", ".join(route.required + route.optional)
        rows.append(f"{hook}() receives: {names or '(no batch fields)'}")
    for split, info in n.batch_info.items():
        host_only = sorted(set(info["keys"]) - set(info["fields"]))
        rows.append(
            f"split {split!r}: batch {info['batch_size']}, to device {list(info['fields'])}"
            + (f", host only {host_only}" if host_only else "")
        )
    return "binding\n" + "\n".join(rows)


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
    if n.schedules.fns:
        extra.append("schedules: " + ", ".join(sorted(n.schedules.fns)))
    extra.append(
        f"accum {n.accum}, steps_per_call {n.steps_per_call}, precision {n.precision}, "
        f"{n.total_steps} optimizer steps planned"
    )
    return "parameter groups\n" + "\n".join(rows + extra)


def peak_memory(n: Nitro) -> int | None:
    """Peak bytes in use on the first device of the mesh, where the backend reports it."""
    try:
        stats = n.mesh.devices.flat[0].memory_stats()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


__all__ = ["compile", "compile_report", "explain", "inspect", "memory_plan", "peak_memory"]
