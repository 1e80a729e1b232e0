"""One rank of the multi-process tests: `jaxnitro launch --nproc 2 ... multiprocess_rank.py
OUT RUN_DIR MODE` (or a plain `python` run: one process). Each rank writes OUT/rank<i>.json
with its final step, parameters and how it ended.

MODE: "train"; "resume" (resume="auto"); "sigterm" (rank 1 sends itself SIGTERM after step
3); "die" (rank 1 SIGKILLs itself after step 3); "ragged" (rank 1's train batches are
shorter than rank 0's); "stop" (rank 0 calls jn.request_stop after step 3); "fsdp",
"fsdp-sigterm", "fsdp-resume": as "train", "sigterm", "resume" with FSDP (both kernels split
over the 4 devices); "model": a {"data": 1, "model": 4} mesh over both processes, which feed
the same rows (dist.data_count is 1).
"""

import json
import os
import signal
import sys
import time
import warnings

import jaxnitro as jn

if "JAXNITRO_NUM_PROCESSES" in os.environ:
    jn.distributed.initialize()
    jn.distributed.initialize()  # again, the same: nothing to do
    try:
        jn.distributed.initialize(num_processes=3)
        raise AssertionError("a second initialize with other arguments must fail")
    except jn.ConfigError as e:
        assert "already called with other arguments" in str(e), e

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import TinyMLP, make_data  # noqa: E402

warnings.simplefilter("ignore")
out, run_dir, mode = sys.argv[1], sys.argv[2], sys.argv[3]
fsdp = mode.startswith("fsdp")
rank = jax.process_index()


@jn.experiment
class Strided:
    max_epochs: int = 3
    sharding: str = "dp"

    def build_model(self, rng):
        return jn.split_model(TinyMLP(16, rngs=nnx.Rngs(rng)))

    def build_data(self, dist):
        # Process p takes rows p, p + P, ...: global batch b holds the rows of one process's
        # batch b [32b, 32b + 32), so the mean loss is that of one process.
        x, y = make_data(256 + 64)
        rows = slice(dist.data_index, None, dist.data_count)  # (process_index, _count on dp)
        tx, ty, vx, vy = x[:256][rows], y[:256][rows], x[256:][rows], y[256:][rows]
        if mode == "ragged" and dist.process_index == 1:
            tx, ty = tx[:-8], ty[:-8]
        per = 32 // dist.data_count
        return {
            "train": jn.DataLoader({"x": tx, "y": ty}, per, drop_last=True),
            "val": jn.DataLoader({"x": vx, "y": vy}, per),
        }

    def learning_rate(self, group):
        return 1e-2

    def forward(self, model, params, state, *, x):
        return jn.apply(model, params, state, x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy(logits, jax.nn.one_hot(y, 4)).mean()

    def metrics(self, logits, *, y):
        return {"acc": ((logits.argmax(-1) == y).sum(), y.shape[0])}


# "model": a model axis over all 4 devices, so across both processes: they feed the same rows.
MODEL_PARALLEL = jn.Sharding(
    mesh={"data": 1, "model": 4},
    rules=[(r"hidden/kernel", P(None, "model")), (r"out/kernel", P("model", None))],
)


def report(**info):
    from jax.experimental import multihost_utils

    params = [  # an FSDP shard lives on one process: gathered whole
        np.asarray(
            a if a.is_fully_replicated else multihost_utils.process_allgather(a, tiled=True)
        ).tolist()
        for a in jax.tree.leaves(n.params)
    ]
    specs = [str(a.sharding.spec) for a in jax.tree.leaves(n.params)]
    info.update(rank=rank, step=n.step, params=params, devices=jax.device_count(), specs=specs)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(info, f)


def at_step(record):
    if rank == 0 and record.step == 3 and mode == "stop":
        jn.request_stop(n)
    if rank == 1 and record.step == 3 and mode in ("sigterm", "die", "fsdp-sigterm"):
        os.kill(os.getpid(), signal.SIGKILL if mode == "die" else signal.SIGTERM)
    if record.step >= 3 and mode in ("sigterm", "fsdp-sigterm", "stop"):
        # JAX's notice of the SIGTERM (or of rank 0's request) reaches the other process
        # through the coordination service; on a loaded machine the 21 steps left could all
        # run before it arrives (the run then completes, exit 0). Slowed, the run outlasts
        # the notice.
        time.sleep(0.1)


try:
    n = jn.Nitro(
        Strided(),
        run_dir=run_dir,
        progress=False,
        n_devices=jax.device_count(),
        resume="auto" if mode.endswith("resume") else False,
        sharding=jn.Sharding(fsdp=True, min_shard_bytes=64)
        if fsdp
        else MODEL_PARALLEL
        if mode == "model"
        else "dp",
    )
except jn.JaxnitroError as e:
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "error": f"{type(e).__name__}: {e}"}, f)
    raise
jn.every(1, at_step, nitro=n)
try:
    result = jn.train(n)
except jn.Preempted as p:
    report(ended="preempted", checkpoint=str(p.checkpoint))
    raise
except jn.JaxnitroError as e:
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "error": f"{type(e).__name__}: {e}"}, f)
    raise
report(ended=result.stop_reason, checkpoint=str(result.best_checkpoint))
