"""A GAN on a ring of 8 Gaussians, written as a custom train step (two models, two optimizers).

    python examples/gan.py [--epochs N]   # 30 by default: all 8 modes; after 5 not yet

`train_step` replaces the built-in step (one loss, one optimizer): it is handed the whole
parameter tree, the optimizer states (one per group, from `optimizers`), the model state and a
per-step key, and returns them updated with a dict of metrics. `jn.group_grad` differentiates
one group's parameters (the other held constant) and `jn.optimizer_step` applies that group's
optimizer. Validation, checkpoints, resume, schedules and logging are the framework's.

On 2 CPU cores it trains in well under a minute and covers all 8 modes (MMD to the data about
0.004-0.008; two independent samples of the data are about 0.002 apart).
"""

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxnitro as jn

jn.setup_devices(backend="cpu")

MODES, RADIUS, SPREAD = 8, 2.0, 0.05
CENTRES = np.stack(
    [RADIUS * np.cos(2 * np.pi * np.arange(MODES) / MODES),
     RADIUS * np.sin(2 * np.pi * np.arange(MODES) / MODES)], axis=1
).astype(np.float32)  # fmt: skip


def ring(n: int, seed: int) -> np.ndarray:
    """n points from the mixture: a random centre plus Gaussian noise."""
    rng = np.random.default_rng(seed)
    return CENTRES[rng.integers(0, MODES, n)] + SPREAD * rng.standard_normal((n, 2), np.float32)


class MLP(nnx.Module):
    def __init__(self, d_in: int, width: int, d_out: int, *, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(d_in, width, rngs=rngs)
        self.l2 = nnx.Linear(width, width, rngs=rngs)
        self.l3 = nnx.Linear(width, d_out, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l3(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))


class GAN(nnx.Module):
    def __init__(self, latent: int, width: int, *, rngs: nnx.Rngs) -> None:
        self.generator = MLP(latent, width, 2, rngs=rngs)
        self.discriminator = MLP(2, width, 1, rngs=rngs)


def bce(logits: jax.Array, target: float) -> jax.Array:
    """Binary cross-entropy on logits (optax's sigmoid_binary_cross_entropy, written out)."""
    return -(
        target * jax.nn.log_sigmoid(logits) + (1 - target) * jax.nn.log_sigmoid(-logits)
    ).mean()


def mmd(a: jax.Array, b: jax.Array, scale: float = 0.5) -> jax.Array:
    """Squared maximum mean discrepancy with a Gaussian kernel (0 for equal distributions)."""

    def k(x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.exp(-((x[:, None] - y[None]) ** 2).sum(-1) / (2 * scale**2))

    return k(a, a).mean() + k(b, b).mean() - 2 * k(a, b).mean()


@jn.experiment
class RingGAN:
    latent: jn.GraphConst[int] = 2
    width: jn.GraphConst[int] = 128
    lr: float = 5e-4  # 1e-3 drops modes for some seeds; 5e-4 covered all 8 for seeds 0-2, 7, 42
    max_epochs: int = 30

    def build_model(self, rng: jax.Array) -> tuple[Any, Any, Any]:
        return jn.split_model(GAN(self.latent, self.width, rngs=nnx.Rngs(rng)))

    def build_data(self, dist: jn.Dist) -> dict[str, jn.DataLoader]:
        z = np.random.default_rng(1).standard_normal((2000, self.latent), np.float32)
        return {
            "train": jn.DataLoader({"x": ring(25_600, 0)}, batch_size=256, shuffle=True),
            "val": jn.DataLoader({"z": z, "x": ring(2000, 2)}, batch_size=2000),
        }

    def optimizers(self) -> dict[str, Any]:  # one per top-level module of the model
        return {
            "generator": optax.adam(self.lr, b1=0.5),
            "discriminator": optax.adam(self.lr, b1=0.5),
        }

    def train_step(
        self, model: Any, params: Any, opt_state: Any, state: Any, rng: jax.Array, *, x: jax.Array
    ) -> tuple[Any, Any, Any, dict[str, jax.Array]]:
        z = jax.random.normal(rng, (x.shape[0], self.latent))

        def disc_loss(p: Any) -> jax.Array:
            fake, _ = jn.apply(model, p, state, z, method="generator")
            real_logits, _ = jn.apply(model, p, state, x, method="discriminator")
            fake_logits, _ = jn.apply(model, p, state, fake, method="discriminator")
            return bce(real_logits, 1.0) + bce(fake_logits, 0.0)

        def gen_loss(p: Any) -> jax.Array:  # the non-saturating loss
            fake, _ = jn.apply(model, p, state, z, method="generator")
            logits, _ = jn.apply(model, p, state, fake, method="discriminator")
            return bce(logits, 1.0)

        d_loss, grads = jn.group_grad(disc_loss, params, "discriminator")
        params, opt_state = jn.optimizer_step("discriminator", params, opt_state, grads)
        g_loss, grads = jn.group_grad(gen_loss, params, "generator")
        params, opt_state = jn.optimizer_step("generator", params, opt_state, grads)
        return params, opt_state, state, {"d_loss": d_loss, "g_loss": g_loss}

    def forward(
        self, model: Any, params: Any, state: Any, *, z: jax.Array
    ) -> tuple[Any, Any]:  # validation, predict, export: generate
        return jn.apply(model, params, state, z, method="generator")

    def metrics(self, fake: jax.Array, *, x: jax.Array) -> dict[str, Any]:
        dist = jnp.linalg.norm(fake[:, None] - CENTRES[None], axis=-1)
        near = dist.min(1) < 4 * SPREAD  # a sample "hits" a mode within 4 sigma
        hits = jnp.zeros(MODES).at[dist.argmin(1)].add(near)
        covered = (hits >= 0.02 * fake.shape[0]).sum()  # modes holding >= 2% of the samples
        return {"mmd": (mmd(fake, x), 1), "modes": (covered, 1), "quality": (near.sum(), len(x))}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--epochs", type=int, default=RingGAN.max_epochs, help="default %(default)s"
    )
    args = parser.parse_args()
    n = jn.Nitro(
        RingGAN(max_epochs=args.epochs),
        steps_per_call=20,
        checkpointer=jn.TopKCheckpointer(metric="mmd", mode="min"),
    )
    best = jn.train(n).history.best
    if best is None:
        raise SystemExit("no epoch reported a finite mmd")
    print(f"best epoch {best['epoch']}: mmd {best['mmd']:.4f}, modes covered "
          f"{int(best['modes'])}/8, samples near a mode {best['quality']:.0%}")  # fmt: skip
