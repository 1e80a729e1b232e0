"""What checking cached programs against a trace of the current code costs on a cache hit.

Compile discipline III (docs/recompilation.md) traces and lowers each program once per
entry-point call and compares its text with the cached program's. This measures, with every
program already cached (no compile in any timed part):

- `quickstart_train_ms`: a whole `jn.train` of a new handle of the quick start's MLP
  (2 steps, no validation, logger or checkpoint): start-up dominates it;
- `gpt12_train_ms`: the same for a 12-layer GPT (`benchmarks/gpt.py`'s tiny width, 1 step);
- `predict_loop_ms`: 100 `jn.predict` calls on a live handle of the MLP (a batch of 32);

each the median of `--repeats`, in CPU time of the process (all its threads: on a shared
machine, wall time measures the neighbours). Run it on two trees, interleaved, to compare:

    PYTHONPATH=src python benchmarks/recheck.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jaxnitro as jn  # noqa: E402


def _mlp():
    """The quick start's MLP on 64 random rows (startup.py's experiment)."""
    from startup import _experiment

    return _experiment()()


def _gpt():
    import gpt

    cfg = gpt.GPTConfig.tiny(layers=12)
    return gpt.GPTLM(config=cfg, batch=2, samples=2)


def _train_ms(exp, tmp: Path, repeats: int) -> float:
    runs = iter(range(10**6))

    def handle():
        return jn.Nitro(
            exp,
            run_dir=tmp / f"r{next(runs)}",
            progress="off",
            logger=False,
            checkpointer=False,
        )

    jn.train(handle())  # compiles the train program once: every later handle hits it
    misses = jn.cache_stats()["misses"]
    times = []
    for _ in range(repeats):
        n = handle()
        t0 = time.process_time()
        jn.train(n)
        times.append(time.process_time() - t0)
    assert jn.cache_stats()["misses"] == misses, "a timed run compiled"
    return 1e3 * statistics.median(times)


def _predict_ms(exp, tmp: Path, repeats: int) -> float:
    n = jn.Nitro(exp, run_dir=tmp / "p", progress="off", logger=False, checkpointer=False)
    x = {"img": np.random.default_rng(1).normal(size=(32, 784)).astype(np.float32)}
    jn.predict(n, x)  # compiles the predict program
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(100):
            jn.predict(n, x)
        times.append(time.process_time() - t0)
    return 1e3 * statistics.median(times)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-gpt", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        out = {
            "jaxnitro": jn.__file__,
            "quickstart_train_ms": round(_train_ms(_mlp(), tmp / "q", args.repeats), 1),
            "predict_loop_ms": round(_predict_ms(_mlp(), tmp, args.repeats), 1),
        }
        if not args.skip_gpt:
            out["gpt12_train_ms"] = round(_train_ms(_gpt(), tmp / "g", args.repeats), 1)
    out["repeats"] = args.repeats
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
