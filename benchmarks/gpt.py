"""A GPT-style language model in Flax NNX, and the jaxnitro experiment that trains it.

    PYTHONPATH=src python benchmarks/gpt.py            # a tiny GPT, a few steps, on any machine
    PYTHONPATH=src python benchmarks/gpt.py --small    # GPT-2 small (124M): bf16 + cuDNN on a GPU

The model is GPT-2's: token and learned position embeddings, pre-LayerNorm blocks (causal
self-attention, then a 4x GELU MLP), a final LayerNorm and a head tied to the token embedding.
Attention is `jax.nn.dot_product_attention`; on a GPU, `attention="cudnn"` selects cuDNN's fused
(flash) kernel, which needs bf16 or fp16 inputs and about doubles GPT-2 small's throughput over
XLA's default. Train it with `precision="bf16"`: bf16 compute, f32 master weights and optimizer
state. `benchmarks/run.py` trains this same model code through jaxnitro and by hand.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxnitro as jn


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The model's shape. Frozen, so it hashes by content and can be a GraphConst."""

    vocab: int = 50304  # GPT-2's 50257 tokens, padded to a multiple of 128 for the matmuls
    seq: int = 1024
    layers: int = 12
    d: int = 768
    heads: int = 12
    attention: str | None = None  # dot_product_attention implementation: "cudnn", "xla", None

    @classmethod
    def gpt2_small(cls, **overrides) -> GPTConfig:
        """GPT-2 small: 124M parameters."""
        return cls(**overrides)

    @classmethod
    def tiny(cls, **overrides) -> GPTConfig:
        """A CPU-sized GPT (about 0.7M parameters) with the same structure."""
        return cls(**{"vocab": 2048, "seq": 128, "layers": 2, "d": 128, "heads": 4, **overrides})


_init = nnx.initializers.normal(0.02)


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: x + attention(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        d = cfg.d
        # GPT-2 scales the residual projections' init by 1/sqrt(2 * layers).
        out_init = nnx.initializers.normal(0.02 / (2 * cfg.layers) ** 0.5)
        self.heads, self.attention = cfg.heads, cfg.attention
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, kernel_init=_init, rngs=rngs)
        self.proj = nnx.Linear(d, d, kernel_init=out_init, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, kernel_init=_init, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, kernel_init=out_init, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        heads = lambda a: a.reshape(b, t, self.heads, d // self.heads)  # noqa: E731
        a = jax.nn.dot_product_attention(
            heads(q), heads(k), heads(v), is_causal=True, implementation=self.attention
        )
        x = x + self.proj(a.reshape(b, t, d))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class GPT(nnx.Module):
    """tokens (batch, seq) int32 -> logits (batch, seq, vocab)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.d, embedding_init=_init, rngs=rngs)
        self.pos = nnx.Param(_init(rngs.params(), (cfg.seq, cfg.d)))
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.ln_f = nnx.LayerNorm(cfg.d, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]].astype(self.embed.embedding.dtype)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.ln_f(x))  # the head shares the embedding matrix


def next_token_loss(logits, tokens):
    """Mean cross-entropy of predicting tokens[:, 1:] from logits of tokens[:, :-1]."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), tokens[:, 1:]
    ).mean()


def n_params(cfg: GPTConfig) -> int:
    """Parameter count (the tied head counted once)."""
    d, per_block = cfg.d, 12 * cfg.d * cfg.d + 13 * cfg.d
    return cfg.vocab * d + cfg.seq * d + cfg.layers * per_block + 2 * d


def train_flops_per_token(cfg: GPTConfig) -> float:
    """Forward + backward FLOPs per token: 6 N for the matmuls with the weights, plus causal
    attention's two (seq x seq) products, 12 * layers * seq * d halved for the causal mask."""
    return 6 * n_params(cfg) + 6 * cfg.layers * cfg.seq * cfg.d


def random_tokens(n: int, cfg: GPTConfig, seed: int = 0) -> np.ndarray:
    """(n, seq + 1) int32 tokens: each row is an input sequence and, shifted by one, its targets."""
    return np.random.default_rng(seed).integers(0, cfg.vocab, (n, cfg.seq + 1), dtype=np.int32)


@jn.experiment
class GPTLM:
    """Next-token prediction with a GPT."""

    config: jn.GraphConst[GPTConfig] = GPTConfig.tiny()
    batch: int = 8  # sequences per step
    samples: int = 256  # random sequences in the training split
    max_epochs: int = 1

    def build_model(self, rng):
        return jn.split_model(GPT(self.config, rngs=nnx.Rngs(rng)))

    def build_data(self, dist):
        tokens = random_tokens(self.samples, self.config)
        return {"train": jn.DataLoader({"tokens": tokens}, self.batch, drop_last=True)}

    def forward(self, model, params, state, *, tokens):
        return jn.apply(model, params, state, tokens[:, :-1])

    def loss(self, logits, *, tokens):
        return next_token_loss(logits, tokens)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="GPT-2 small (124M) instead of tiny")
    args = parser.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    if args.small:
        cfg = GPTConfig.gpt2_small(attention="cudnn" if on_gpu else None)
        exp = GPTLM(config=cfg, batch=16, samples=16 * 20)
    else:
        exp = GPTLM()
    n = jn.Nitro(exp, precision="bf16" if on_gpu else None, run_dir="runs/GPTLM")
    result = jn.train(n)
    tokens_per_s = result.steps_per_second * exp.batch * exp.config.seq
    print(f"{n_params(exp.config) / 1e6:.1f}M parameters · {tokens_per_s:,.0f} tokens/s")
