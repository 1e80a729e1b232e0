"""What `steps_per_call="auto"` picks on each benchmark workload, and what it gains.

For each CPU case of `run.py` (its models, data and sizes, `--quick` sizes by default): one
train with `steps_per_call="auto"` (its choice and the per-step times it measured) against one
with `steps_per_call=1`, each in a fresh process (so each compiles what it needs), interleaved
`--repeats` times: steps/s of training, and end to end (the handle built, compiled, trained).

    python benchmarks/autotune.py [--cases mlp32,mlp1024,cnn,gpt] [--full] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import run as bench  # noqa: E402  (benchmarks/run.py: the cases, models and data)

import jaxnitro as jn  # noqa: E402


def train(case, data, steps_per_call, root: Path) -> tuple[float, str, float]:
    lines: list[str] = []
    t0 = time.perf_counter()
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
    e2e = time.perf_counter() - t0
    for row in jn.read_jsonl(Path(n.run_dir) / "metrics.jsonl"):
        if "steps_per_call_auto" in row:
            single, fused = row["single_step_s"], row["fused_step_s"]
            lines.append(
                f"{row['steps_per_call_auto']} (1: {single * 1e3:.2f} ms/step, "
                f"{row['candidate']}: {fused * 1e3:.2f} ms/step)"
                if single and fused
                else f"{row['steps_per_call_auto']} (1: {single * 1e3:.2f} ms/step; "
                f"{row['candidate']} not tried)"
                if single
                else str(row["steps_per_call_auto"])
            )
    return r.steps_per_second, lines[0] if lines else "", e2e


def one(case_name: str, setting: str, full: bool) -> dict:
    """One train in this (fresh) process."""
    (case,) = [c for c in bench.cases("cpu", quick=not full) if c["name"] == case_name]
    data = bench.make_data(case)
    with tempfile.TemporaryDirectory() as d:
        rate, choice, e2e = train(case, data, setting if setting == "auto" else 1, Path(d))
    return {"steps_per_s": rate, "choice": choice, "e2e_s": e2e}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="mlp32,mlp1024,cnn,gpt")
    ap.add_argument("--full", action="store_true", help="run.py's full sizes (default: quick)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--one", nargs=2, metavar=("CASE", "SETTING"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, args.full)))
        return
    print(
        "| case | auto picks (measured per step) | steps/s auto × 1 | end to end s, auto "
        "| end to end s, 1 |"
    )
    print("|---|---|---:|---:|---:|")
    for name in args.cases.split(","):
        runs: dict[str, list] = {"auto": [], "1": []}
        for _ in range(args.repeats):
            for setting in runs:
                cmd = [sys.executable, __file__, "--one", name, setting]
                out = subprocess.run(
                    cmd + (["--full"] if args.full else []), capture_output=True, text=True
                )
                if out.returncode:
                    sys.exit(out.stderr)
                runs[setting].append(json.loads(out.stdout.strip().splitlines()[-1]))
        ratios = [
            a["steps_per_s"] / b["steps_per_s"]
            for a, b in zip(runs["auto"], runs["1"], strict=True)
        ]
        e2e = {k: statistics.median(r["e2e_s"] for r in v) for k, v in runs.items()}
        print(
            f"| {name} | {runs['auto'][0]['choice']} | "
            + "–".join(f"{x:.2f}×" for x in sorted(ratios))
            + f" | {e2e['auto']:.2f} | {e2e['1']:.2f} |"
        )


if __name__ == "__main__":
    main()
