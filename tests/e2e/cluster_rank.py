"""One process of the cluster tests: `python cluster_rank.py OUT RUN_DIR [EPOCHS]` under a
real or faked cluster (SLURM, Open MPI, Kubeflow Trainer v2, a JAXJob) or `jaxnitro launch`.

It calls `jn.distributed.initialize()` with no arguments, trains a tiny model on its rows
of every batch with `resume="auto"` (a requeued job continues), and writes
OUT/rank<i>.json: the layout's source, the final step and parameters, how it ended. With
$CLUSTER_RANK_STEP_SECONDS each step is that much slower (time for a signal to arrive
mid-run), and OUT/progress<i> holds the last step taken.
"""

import json
import os
import sys
import time
import warnings

import jaxnitro as jn

layout = jn.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import TinyMLP, make_data  # noqa: E402

warnings.simplefilter("ignore")
out, run_dir = sys.argv[1], sys.argv[2]
epochs = int(sys.argv[3]) if len(sys.argv) > 3 else 1
delay = float(os.environ.get("CLUSTER_RANK_STEP_SECONDS", "0"))
rank = jax.process_index()


@jn.experiment
class Rows:
    max_epochs: int = epochs

    def build_model(self, rng):
        return jn.split_model(TinyMLP(8, rngs=nnx.Rngs(rng)))

    def build_data(self, dist):
        x, y = make_data(128)
        rows = slice(dist.data_index, None, dist.data_count)
        per = 32 // dist.data_count
        return {"train": jn.DataLoader({"x": x[rows], "y": y[rows]}, per, drop_last=True)}

    def learning_rate(self, group):
        return 1e-2

    def forward(self, model, params, state, *, x):
        return jn.apply(model, params, state, x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy(logits, jax.nn.one_hot(y, 4)).mean()


def report(**info):
    params = [np.asarray(a).tolist() for a in jax.tree.leaves(n.params)]
    info.update(rank=rank, source=layout.source, processes=jax.process_count(), step=n.step)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({**info, "params": params}, f)


def at_step(record):
    with open(os.path.join(out, f"progress{rank}"), "w") as f:
        f.write(str(record.step))
    time.sleep(delay)


n = jn.Nitro(Rows(), run_dir=run_dir, progress=False, resume="auto")
jn.every(1, at_step, nitro=n)
try:
    result = jn.train(n)
except jn.Preempted as p:
    report(ended="preempted", checkpoint=str(p.checkpoint))
    raise
report(ended=result.stop_reason)
