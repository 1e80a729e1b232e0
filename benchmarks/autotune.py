"""What `steps_per_call="auto"` picks on each benchmark workload, and what it gains.

For each CPU case of `run.py` (its models, data and sizes, `--quick` sizes by default): one
train with `steps_per_call="auto"` (its choice and the two per-step times it measured) against
one with `steps_per_call=1`, steps/s of training side by side.

    python benchmarks/autotune.py [--cases mlp32,mlp1024,cnn,gpt] [--full]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import run as bench  # noqa: E402  (benchmarks/run.py: the cases, models and data)

import jaxnitro as jn  # noqa: E402


def train(case, data, steps_per_call, root: Path) -> tuple[float, str]:
    lines: list[str] = []
    loader = jn.DataLoader(data, case["batch"], drop_last=True)
    n = jn.Nitro(
        bench.experiment_for(case),
        data={"train": loader},
        run_dir=root / f"{case['name']}-{steps_per_call}",
        progress=False,
        steps_per_call=steps_per_call,
        precision=case.get("precision"),
    )
    r = jn.train(n)
    for row in jn.read_jsonl(Path(n.run_dir) / "metrics.jsonl"):
        if "steps_per_call_auto" in row:
            single, fused = row["single_step_s"], row["fused_step_s"]
            lines.append(
                f"{row['steps_per_call_auto']} (1: {single * 1e3:.2f} ms/step, "
                f"{row['tried']}: {fused * 1e3:.2f} ms/step)"
                if single and fused
                else str(row["steps_per_call_auto"])
            )
    return r.steps_per_second, lines[0] if lines else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="mlp32,mlp1024,cnn,gpt")
    ap.add_argument("--full", action="store_true", help="run.py's full sizes (default: quick)")
    args = ap.parse_args()
    wanted = args.cases.split(",")
    print("| case | auto picks (measured per step) | steps/s auto | steps/s 1 | auto × 1 |")
    print("|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as d:
        for case in bench.cases("cpu", quick=not args.full):
            if case["name"] not in wanted:
                continue
            data = bench.make_data(case)
            auto, choice = train(case, data, "auto", Path(d))
            one, _ = train(case, data, 1, Path(d))
            print(f"| {case['name']} | {choice} | {auto:,.0f} | {one:,.0f} | {auto / one:.2f}× |")


if __name__ == "__main__":
    main()
