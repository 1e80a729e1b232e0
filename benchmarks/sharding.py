"""DP against FSDP on 8 fake CPU devices: bytes per device, step time, the memory plan.

A GPT-style model (benchmarks/gpt.py's code; 2 layers, d=768, a 8192-token vocabulary: 20M
parameters, its large matrices over the 4 MiB FSDP threshold) trains a few steps with
`sharding="dp"` and with `sharding="fsdp"` on 8 fake CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`, set in a child process before JAX
starts). Reported per device: parameter and optimizer-state bytes, the train step's time, and
the memory plan's figure for those arguments against the compiled program's
`memory_analysis()`.

    python benchmarks/sharding.py [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent


def child(steps: int) -> None:
    sys.path.insert(0, str(HERE))
    import jax
    from gpt import GPTLM, GPTConfig

    import jaxnitro as jn
    from jaxnitro._src.dist.sharding import device_bytes

    cfg = GPTConfig(vocab=8192, seq=64, layers=2, d=768, heads=12)
    rows = {}
    for how in ("dp", "fsdp"):
        with tempfile.TemporaryDirectory() as d:
            exp = GPTLM(config=cfg, batch=16, samples=16 * steps)
            n = jn.Nitro(exp, run_dir=d, progress=False, sharding=how, logger=False, n_devices=8)
            trees = jax.tree.leaves((n.params, n.opt_state))
            per_device = sum(device_bytes(x) for x in trees)
            total = sum(x.size * x.dtype.itemsize for x in trees)
            mem = jn.memory_plan(n)
            train = next(p for p in mem.programs if p.name.startswith("train"))
            plan_trees = mem.params_bytes + mem.opt_state_bytes + mem.model_state_bytes
            result = jn.train(n)
            rows[how] = {
                "params_opt_bytes_total": total,
                "params_opt_bytes_per_device": per_device,
                "steps_per_s": result.steps_per_second,
                "plan_args_per_device": plan_trees + mem.batch_bytes,
                "compiled_args_per_device": train.arguments,
            }
    print(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.steps)
        return
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAXNITRO_NO_PLOT": "1",
    }
    out = subprocess.run(
        [sys.executable, __file__, "--child", "--steps", str(args.steps)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = json.loads(out.strip().splitlines()[-1])
    dp = rows["dp"]
    mib = 2**20
    print("8 fake CPU devices; per device unless said")
    print("| sharding | params + opt (total) | params + opt per device | × dp | steps/s | × dp |")
    print("|---|---:|---:|---:|---:|---:|")
    for how, r in rows.items():
        print(
            f"| {how} | {r['params_opt_bytes_total'] / mib:.1f} MiB "
            f"| {r['params_opt_bytes_per_device'] / mib:.1f} MiB "
            f"| {r['params_opt_bytes_per_device'] / dp['params_opt_bytes_per_device']:.2f}× "
            f"| {r['steps_per_s']:.2f} | {r['steps_per_s'] / dp['steps_per_s']:.2f}× |"
        )
    print("\n| sharding | plan: arguments per device | memory_analysis | plan / compiled |")
    print("|---|---:|---:|---:|")
    for how, r in rows.items():
        ratio = r["plan_args_per_device"] / r["compiled_args_per_device"]
        print(
            f"| {how} | {r['plan_args_per_device'] / mib:.1f} MiB "
            f"| {r['compiled_args_per_device'] / mib:.1f} MiB | {ratio:.3f} |"
        )


if __name__ == "__main__":
    main()
