"""What weight averaging (`Nitro(ema=0.999)`) costs in training steps/s.

For the mlp1024 and GPT cases of `run.py` (its models, data and sizes; `--quick` sizes by
default, the GPU profile with `--profile gpu`): one warm-up train of each setting (compiles),
then `--repeats` trains with EMA off and on, interleaved in one process (a fresh handle each;
the programs come from the process-wide cache), so drift on a shared machine hits both alike.
Prints one JSON line per case: the median steps/s of each, their ratio on/off, and the
median of each alternation's own on/off ratio (`paired_median`, robust to drift), and the
ratio of the median process CPU seconds per step (`cpu_s_per_step_on_over_off`: the work
itself, which other processes on a loaded machine slow down far less than the wall clock).

    python benchmarks/ema.py [--cases mlp1024,gpt] [--profile cpu|gpu] [--full] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import run as bench  # noqa: E402  (benchmarks/run.py: the cases, models and data)

import jaxnitro as jn  # noqa: E402


def train(case: dict, data: dict, ema: float | None, run_dir: Path) -> tuple[float, float, Any]:
    """(steps/s, process CPU seconds per step, the handle) of one short run."""
    loader = jn.DataLoader(data, case["batch"], drop_last=True)
    n = jn.Nitro(
        bench.experiment_for(case),
        data={"train": loader},
        run_dir=run_dir,
        progress=False,
        logger=False,
        checkpointer=False,
        precision=case.get("precision"),
        ema=ema,
    )
    cpu = time.process_time()
    rate = jn.train(n).steps_per_second
    return rate, (time.process_time() - cpu) / n.step, n


def program(n) -> dict:
    """What XLA made of the train program: optimized HLO instructions, FLOPs, and the
    memory estimate (arguments + outputs - aliased + temporaries), independent of load."""
    (r,) = [r for r in jn.compile_report(n) if r.kind == "train"]
    return {"hlo_ops": r.hlo_ops, "flops": r.flops, "memory": (r.memory or {}).get("estimate")}


def measure(case: dict, repeats: int, root: Path) -> dict:
    data = bench.make_data(case)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    settings = {"off": None, "on": 0.999}
    programs = {}
    for name, ema in settings.items():  # compile both first
        programs[name] = program(train(case, data, ema, root / f"{case['name']}-{name}-warm")[2])
    for i in range(repeats):
        for name, ema in settings.items():
            rate, cpu_s, _ = train(case, data, ema, root / f"{case['name']}-{name}-{i}")
            rates[name].append(rate)
            cpu[name].append(cpu_s)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    # each alternation's own ratio: drift between alternations cancels out of it
    paired = [b / a for a, b in zip(rates["off"], rates["on"], strict=True)]
    return {
        "case": case["name"],
        "steps_per_s_off": off,
        "steps_per_s_on": on,
        "on_over_off": on / off,
        "paired_median": statistics.median(paired),
        "cpu_s_per_step_on_over_off": statistics.median(cpu["on"]) / statistics.median(cpu["off"]),
        "program_off": programs["off"],
        "program_on": programs["on"],
        "rates": rates,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="mlp1024,gpt")
    p.add_argument("--profile", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--full", action="store_true", help="run.py's full sizes (default: quick)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    wanted = args.cases.split(",")
    cases = [c for c in bench.cases(args.profile, quick=not args.full) if c["name"] in wanted]
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            print(json.dumps(measure(case, args.repeats, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
