"""What a cached handle pays before its first step: the fingerprints at each entry point.

Every entry point (`jn.train`, `validate`, `predict`, ...) re-fingerprints the traced code to
find edits (`check_stale`), and each program request builds its key from the same
fingerprints. None of it runs per step. This measures, on the quick start's experiment with
every program already cached:

- `fingerprints_ms`: one `hook_prints` of the run (what `check_stale` computes);
- `key_ms`: one train-program key (what a program request computes);
- `train_start_ms`: a whole `jn.train` of a new handle whose program is cached, for a run of
  two train steps, no validation, no logger and no checkpoint: start-up dominates it;

each the median of `--repeats`. Run it on two trees to compare (e.g. before and after a
change to what is fingerprinted):

    PYTHONPATH=src python benchmarks/startup.py --repeats 30
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

import jaxnitro as jn  # noqa: E402

try:
    from jaxnitro._src.programs import traced as programs
except ImportError:  # a tree from before the layers (to compare with)
    try:
        from jaxnitro._src.compile import programs  # type: ignore[no-redef]
    except ImportError:  # a tree from before the internals moved under _src
        from jaxnitro.compile import programs  # type: ignore[no-redef]


def _experiment():
    import mnist  # examples/mnist.py: the quick start's MLP

    @jn.experiment
    class Startup(mnist.MnistMLP):
        n_rows: int = 64

        def build_data(self, dist):
            rng = np.random.default_rng(0)
            x = rng.normal(size=(self.n_rows, 784)).astype(np.float32)
            y = rng.integers(0, 10, size=self.n_rows).astype(np.int32)
            loader = jn.DataLoader({"img": x, "label": y}, batch_size=32, drop_last=True)
            return {"train": loader}

    return Startup


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    cls = _experiment()
    with tempfile.TemporaryDirectory() as tmp:
        runs = iter(range(10**6))

        def handle():
            return jn.Nitro(
                cls(max_epochs=1),
                run_dir=Path(tmp) / f"r{next(runs)}",
                progress="off",
                logger=False,
                checkpointer=False,
            )

        jn.train(handle())  # compiles the train program once: every later handle hits it
        n = handle()
        jn.train(n)
        spec = n.spec
        fingerprints = _median_ms(lambda: programs.hook_prints(spec), args.repeats)

        # older trees fingerprint the hooks only (no traced_code)
        traced_code = getattr(programs, "traced_code", programs.traced_functions)
        train_hooks = programs._kind_hooks(spec, "train")

        def key():
            return programs.explain.hook_parts(traced_code(spec, train_hooks))

        key_ms = _median_ms(key, args.repeats)
        handles = [handle() for _ in range(args.repeats)]
        starts = []
        for h in handles:
            t0 = time.perf_counter()
            jn.train(h)
            starts.append(time.perf_counter() - t0)
        assert jn.cache_stats()["misses"] == 1, jn.cache_stats()
    out = {
        "jaxnitro": jn.__file__,
        "fingerprints_ms": round(fingerprints, 3),
        "key_ms": round(key_ms, 3),
        "train_start_ms": round(1e3 * statistics.median(starts), 2),
        "repeats": args.repeats,
    }
    print(json.dumps(out, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
