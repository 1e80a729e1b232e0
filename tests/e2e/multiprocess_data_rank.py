"""One rank of the two-process data test: `jaxnitro launch --nproc 2 ... multiprocess_data_rank.py
OUT RUN_DIR`. Each process trains on its grain shard of a counting source and writes
OUT/rank<i>.json with the record indices it read."""

import json
import os
import sys
import warnings

import jaxnitro as jn

jn.distributed.initialize()

import grain  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import TinyMLP, make_data  # noqa: E402

warnings.simplefilter("ignore")
out, run_dir = sys.argv[1], sys.argv[2]
N, PER_PROCESS = 256, 16


class Counting(grain.sources.RandomAccessDataSource):
    """Records i -> (x_i, y_i), remembering which were read."""

    def __init__(self):
        self.x, self.y = make_data(N)
        self.read: list[int] = []

    def __len__(self):
        return N

    def __getitem__(self, i):
        self.read.append(int(i))
        return {"x": self.x[i], "y": self.y[i]}

    def __repr__(self):
        return f"Counting({N})"


source = Counting()


@jn.experiment
class Sharded:
    max_epochs: int = 1

    def build_model(self, rng):
        return jn.split_model(TinyMLP(16, rngs=nnx.Rngs(rng)))

    def build_data(self, dist):
        sampler = grain.samplers.IndexSampler(
            N, shard_options=jn.shard_options(dist), shuffle=True, num_epochs=1, seed=0
        )
        loader = grain.DataLoader(
            data_source=source,
            sampler=sampler,
            operations=[grain.transforms.Batch(PER_PROCESS, drop_remainder=True)],
            worker_count=0,
        )
        return {"train": loader}

    def forward(self, model, params, state, *, x):
        return jn.apply(model, params, state, x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


n = jn.Nitro(Sharded(), run_dir=run_dir, progress=False)
jn.train(n)
with open(os.path.join(out, f"rank{jax.process_index()}.json"), "w") as f:
    json.dump({"read": sorted(set(source.read)), "reads": len(source.read), "step": n.step}, f)
