"""The PyTorch side of the benchmarks: the same models, an eager loop and a Lightning `fit`.

Only `run.py` imports this, and only when torch is installed. Each model mirrors its JAX twin in
`run.py` / `gpt.py` (same layers, widths and initial scale; RAdam 1e-3, cross-entropy). The eager
loop keeps the batches on the device, as a careful PyTorch user would; Lightning's `fit` is timed
end to end (Trainer construction, setup, one epoch over a DataLoader), as in
`shared/bench/anchor_bench.py`.
"""

from __future__ import annotations

import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# -- models ---------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    """NCHW twin of run.py's CNN (which is NHWC): three 3x3 convs, then a linear head."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.c3 = nn.Conv2d(32, 32, 3, stride=2, padding=1)
        self.head = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x):
        x = F.relu(self.c3(F.relu(self.c2(F.relu(self.c1(x))))))
        return self.head(x.flatten(1))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        heads = lambda a: a.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Twin of gpt.GPT: learned positions, pre-LN blocks, head tied to the embedding."""

    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.d)
        self.pos = nn.Parameter(torch.randn(cfg.seq, cfg.d) * 0.02)
        self.blocks = nn.ModuleList([Block(cfg.d, cfg.heads) for _ in range(cfg.layers)])
        self.ln_f = nn.LayerNorm(cfg.d)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.embed.weight.T


def build(kind: str, gpt_config=None) -> nn.Module:
    return {"mlp": MLP, "cnn": CNN}[kind]() if kind != "gpt" else GPT(gpt_config)


def tensors(kind: str, data: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The benchmark's arrays as torch tensors (CNN images moved to NCHW once, untimed)."""
    if kind == "gpt":
        return torch.from_numpy(data["tokens"].astype(np.int64)), None
    x = data["x"]
    if kind == "cnn":
        x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    return torch.from_numpy(x), torch.from_numpy(data["y"].astype(np.int64))


def loss_of(kind: str, model, x, y, bf16: bool):
    with torch.autocast(device_type=device(), dtype=torch.bfloat16, enabled=bf16):
        if kind == "gpt":
            logits = model(x[:, :-1])
            return F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        return F.cross_entropy(model(x), y)


# -- the two ways ---------------------------------------------------------------------------
def eager(
    kind: str,
    data,
    *,
    batch: int,
    steps: int,
    gpt_config=None,
    bf16: bool = False,
    warmup: int = 10,
) -> dict:
    """A plain PyTorch loop, batches already on the device; returns steps/s over `steps`.

    On a CPU it first picks PyTorch's faster thread count for this work (1 or all cores,
    timed over a few steps) and keeps it for Lightning too: on some machines (the 2-core VM
    of RESULTS.md) OpenMP's two-thread synchronization makes a small model 10x slower.
    """
    dev = device()
    t0 = time.perf_counter()
    model = build(kind, gpt_config).to(dev)
    opt = torch.optim.RAdam(model.parameters(), 1e-3)
    x, y = tensors(kind, data)
    x = x[: steps * batch].to(dev)
    y = y[: steps * batch].to(dev) if y is not None else None

    def run(n):
        for i in range(n):
            sl = slice((i % steps) * batch, (i % steps + 1) * batch)
            opt.zero_grad(set_to_none=True)
            loss = loss_of(kind, model, x[sl], None if y is None else y[sl], bf16)
            loss.backward()
            opt.step()
        sync()
        return loss.detach()

    run(1)
    ttfs = time.perf_counter() - t0
    if dev == "cpu":
        torch.set_num_threads(_faster_threads(run))
    run(warmup)
    t0 = time.perf_counter()
    loss = run(steps)
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else None
    return {
        "steps_per_s": steps / dt,
        "seconds": dt,
        "ttfs_s": ttfs,
        "final_loss": float(loss),
        "peak_bytes": peak,
        "device": dev,
        "threads": torch.get_num_threads(),
    }


def _faster_threads(run) -> int:
    """1 or all cores, whichever runs `run(1)` faster (best of two alternating 0.25 s trials)."""
    rates: dict[int, float] = {}
    for threads in [1, torch.get_num_threads()] * 2:
        torch.set_num_threads(threads)
        run(1)
        done, t0 = 0, time.perf_counter()
        while done < 3 or time.perf_counter() - t0 < 0.25:
            run(1)
            done += 1
        rates[threads] = max(rates.get(threads, 0.0), done / (time.perf_counter() - t0))
    return max(rates, key=rates.get)


def lightning_fit(
    kind: str,
    data,
    *,
    batch: int,
    steps: int,
    gpt_config=None,
    bf16: bool = False,
    defaults: bool = False,
) -> dict:
    """One epoch of `Trainer.fit`, timed end to end (Trainer, setup, DataLoader, steps).

    Stripped (the default): no logger, checkpointing, progress bar or model summary, the
    fairest reference. `defaults=True`: the Trainer as users run it, with its default logger,
    checkpoint, progress bar and model summary (writing into a temporary directory)."""
    try:
        import lightning as L
    except ImportError:
        import pytorch_lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build(kind, gpt_config)

        def training_step(self, b, i):
            x, *y = b
            if kind == "gpt":
                logits = self.model(x[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
            else:
                loss = F.cross_entropy(self.model(x), y[0])
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.RAdam(self.parameters(), 1e-3)

    x, y = tensors(kind, data)
    ds = torch.utils.data.TensorDataset(*([x] if y is None else [x, y]))
    dl = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=False, drop_last=True)
    dev = device()
    stripped = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        trainer = L.Trainer(
            max_epochs=1,
            limit_train_batches=steps,
            accelerator="gpu" if dev == "cuda" else "cpu",
            devices=1,
            precision="bf16-mixed" if bf16 else "32-true",
            default_root_dir=root,
            **({} if defaults else stripped),
        )
        trainer.fit(Module(), dl)
        sync()
        dt = time.perf_counter() - t0
    return {
        "steps_per_s": steps / dt,
        "seconds": dt,
        "e2e_s": dt,
        "device": dev,
        "note": "one epoch incl. Trainer setup" + (", Trainer defaults" if defaults else ""),
    }
