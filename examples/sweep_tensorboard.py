"""A sweep over label smoothing, watched in TensorBoard: one compile for the whole grid.

    python examples/sweep_tensorboard.py [--epochs N]
    tensorboard --logdir runs/sweep              # every point's curves, side by side

`smoothing` is a Device field of the quick start's `MnistMLP`: a traced input, so every point
after the first reuses the first point's programs (the table's `compiled` column says so).
Each point is its own run dir with its JSONL log, TensorBoard events, checkpoints and
curves; `runs/sweep/curves.png` overlays them. The same grid from the shell:

    jaxnitro sweep examples/mnist.py:MnistMLP --smoothing 0.0,0.05,0.1,0.2 --max-epochs 3
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the quick start's experiment, reused

from mnist import MnistMLP  # noqa: E402

import jaxnitro as jn  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--smoothing", default="0.0,0.05,0.1,0.2")
    args = parser.parse_args()

    rows: list[tuple[float, float | None, int]] = []
    dirs: list[Path] = []
    for value in [float(v) for v in args.smoothing.split(",")]:
        run_dir = Path("runs/sweep") / f"smoothing={value}"
        n = jn.Nitro(
            MnistMLP(smoothing=value, max_epochs=args.epochs),
            run_dir=run_dir,
            logger=[jn.JSONLogger(), jn.TensorBoardLogger()],  # needs jaxnitro[tensorboard]
            checkpointer=jn.TopKCheckpointer(metric="acc", mode="max"),
            progress=False,
        )
        result = jn.train(n)
        rows.append((value, result.best_metric, result.programs_compiled))
        dirs.append(run_dir)

    print(f"{'smoothing':>9}  {'best acc':>8}  compiled")
    for value, acc, compiled in sorted(rows, key=lambda r: -(r[1] or 0.0)):
        print(f"{value:>9.2f}  {acc:>8.4f}  {compiled:>8}")
    print("curves:", jn.plot(dirs, metrics="loss,acc", out="runs/sweep/curves.png"))
    print("TensorBoard: tensorboard --logdir runs/sweep")
