"""The tutorial: MNIST with the optimization features a real run uses.

    python examples/mnist_full.py [--epochs N] [--mnist path/to/mnist.npz]

On top of the quick start: two parameter groups (the output head learns at a higher rate),
decoupled weight decay with biases excluded, gradient clipping, a warmup + cosine schedule,
gradient accumulation over 2 micro-batches (effective batch 64), and Top-K checkpointing on
validation accuracy. Its plan: exactly 2 compiled programs (the fused train step with the
accumulation loop inside it, and the eval step).
"""

import argparse
from typing import Any

import jax
import optax
from flax import nnx

import jaxnitro as jn

jn.setup_devices(backend="cpu")


class MLP(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(784, width, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.head = nnx.Linear(width, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(self.drop(jax.nn.relu(self.hidden(x))))


@jn.experiment
class MnistTutorial:
    width: jn.GraphConst[int] = 256  # structural: in the compile key
    smoothing: jn.Device[float] = 0.05  # a traced input
    max_epochs: int = 8  # Host
    lr: float = 2e-3  # Host: read by learning_rate(), which runs on the driver
    mnist_path: str | None = None

    def build_model(self, rng: jax.Array) -> tuple[Any, Any, Any]:
        return jn.split_model(MLP(self.width, rngs=nnx.Rngs(rng)))

    def build_data(self, dist: jn.Dist) -> dict[str, jn.DataLoader]:
        x, y = jn.datasets.mnist(self.mnist_path)
        n_val = len(x) // 10
        tr, va = slice(0, len(x) - n_val), slice(len(x) - n_val, None)
        return {
            "train": jn.DataLoader(
                {"img": x[tr], "label": y[tr]}, batch_size=32, shuffle=True, drop_last=True
            ),
            "val": jn.DataLoader({"img": x[va], "label": y[va]}, batch_size=100),
        }

    # -- optimization -----------------------------------------------------------------
    def param_group(self, path: str, leaf: jax.Array) -> str:
        return "head" if path.startswith("head") else "body"

    def optimizer(self, group: str) -> Any:
        return optax.adam  # a factory: jaxnitro injects the rate so schedules never recompile

    def learning_rate(self, group: str) -> float:
        return self.lr * (3.0 if group == "head" else 1.0)

    def weight_decay(self, group: str) -> float:
        return 1e-4

    def no_decay(self, path: str, leaf: jax.Array) -> bool:
        return leaf.ndim <= 1  # biases

    def gradient_clip_norm(self) -> float:
        return 1.0

    def schedules(self) -> dict[str, Any]:
        return {"opt.learning_rate": jn.schedules.warmup_cosine(warmup=0.05)}

    # -- the model ----------------------------------------------------------------------
    def forward(self, model: Any, params: Any, state: Any, *, img: jax.Array) -> tuple[Any, Any]:
        return jn.apply(model, params, state, img)

    def loss(self, logits: jax.Array, *, label: jax.Array) -> jax.Array:
        targets = optax.smooth_labels(jax.nn.one_hot(label, 10), self.smoothing)
        return optax.softmax_cross_entropy(logits, targets).mean()

    def metrics(self, logits: jax.Array, *, label: jax.Array) -> dict[str, Any]:
        return {"acc": ((logits.argmax(-1) == label).sum(), label.shape[0])}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--epochs", type=int, default=MnistTutorial.max_epochs)
    parser.add_argument("--mnist", default=None)
    args = parser.parse_args()

    exp = MnistTutorial(max_epochs=args.epochs, mnist_path=args.mnist)
    n = jn.Nitro(exp, accum=2, checkpointer=jn.TopKCheckpointer(k=2, metric="acc", mode="max"))
    jn.inspect(n)  # binding, parameter groups, the 2 compiled programs, the memory plan
    result = jn.train(n)
    print(f"programs in the process cache: {jn.cache_stats()['entries']} (the plan: 2)")
