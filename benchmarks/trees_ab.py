"""Two trees of the package, measured by the same benchmarks in alternating processes.

    python benchmarks/trees_ab.py --before REV [--runs 3] [--repeats 5] [--batches 32]

`stop54_ab.py` and `host_ab.py` load a few old modules beside the new ones in one process;
a change of a program's calling convention (what a train call takes and returns) spans too
many modules for that. This checks out `--before` into a temporary worktree and runs, for
each of `--runs` rounds, in alternating order, each tree's `host.py` (the hand loop, jaxnitro
and Keras 3 `fit`, interleaved within the process) and `train_step_cost.py` (`jn.train_step`
against a hand step). Each process measures its own ratios against the references it runs
beside, so the machine's drift between processes moves both sides' ratios alike.

Reported per tree and round: jaxnitro × the hand loop and × Keras at each batch size (the
medians of `host.py`'s interleaved repeats), and `jn.train_step` × the hand step; then the
median over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def run(tree: Path, script: str, *args: str) -> str:
    """`benchmarks/<script>` of `tree`, its package on the path; its standard output."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    cmd = [sys.executable, str(tree / "benchmarks" / script), *args]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{script} in {tree} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def one_round(tree: Path, repeats: int, batches: str, workdir: Path) -> dict[str, float]:
    """The figures of one process each of `host.py` and `train_step_cost.py` on `tree`."""
    out = workdir / "host.json"
    flags = ["--repeats", str(repeats), "--batches", batches, "--item-epochs", "1"]
    run(tree, "host.py", *flags, "--json", str(out))
    got: dict[str, float] = {}
    for r in json.loads(out.read_text()):
        got[f"x hand, batch {r['batch']}"] = r["ratio"]
        if r["keras_ratio"] is not None:
            got[f"x Keras, batch {r['batch']}"] = r["keras_ratio"]
    cost = run(tree, "train_step_cost.py", "--repeats", str(repeats))
    got["train_step x hand"] = json.loads(cost.strip().splitlines()[-1])["x_hand"]
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the revision to compare this tree with")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", default="32")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="jaxnitro-trees-") as tmp:
        before = Path(tmp) / "before"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(before), args.before],
            check=True,
        )
        try:
            trees = {"before": before, "after": ROOT}
            got: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
            for r in range(args.runs):
                for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
                    got[name].append(one_round(trees[name], args.repeats, args.batches, Path(tmp)))
                    print(name, json.dumps({k: round(v, 3) for k, v in got[name][-1].items()}))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)])
    print(f"\nbefore = {args.before}, {args.runs} rounds (medians; per round in brackets)\n")
    print("| figure | before | after |")
    print("|---|---:|---:|")
    for key in got["after"][0]:
        cells = []
        for name in ("before", "after"):
            values = [g[key] for g in got[name] if key in g]
            spread = ", ".join(f"{v:.2f}" for v in values)
            cells.append(f"{statistics.median(values):.3f}× ({spread})")
        print(f"| {key} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
