"""Throughput and model FLOP utilization from what the compiler already knows.

A train program's FLOPs come from XLA's cost analysis (the compile report's `flops`); the
samples per step from the train split's batch size and `accum`; tokens from a batch field
named `tokens` (or the experiment's `tokens_per_sample`). The device's peak comes from
`Nitro(peak_tflops=...)` or the table below of known accelerators; on a device the table does
not know (a CPU) there is no `mfu`: none is invented.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from jaxnitro._src.core.types import Experiment
    from jaxnitro._src.data.splits import SplitSpec

# Dense (no sparsity) peak TFLOP/s per chip, by the matmul input dtype a run uses ("bf16":
# precision="bf16"; "f32": float32 matmuls at JAX's default precision, which on NVIDIA
# Ampere/Hopper runs them as TF32 and on a TPU as bf16 passes). Keys are matched against
# `jax.Device.device_kind`, longest first.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # NVIDIA H100 SXM5 datasheet (nvidia.com/en-us/data-center/h100): BF16 1,979 with
    # sparsity = 989 dense; TF32 989 with sparsity = 494 dense.
    "H100 80GB HBM3": {"bf16": 989.0, "f32": 494.0},
    "H100 SXM": {"bf16": 989.0, "f32": 494.0},
    # same datasheet, H100 PCIe: BF16 1,513 sparse = 756 dense; TF32 756 sparse = 378 dense.
    "H100 PCIe": {"bf16": 756.0, "f32": 378.0},
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): the H100 SXM's compute.
    "H200": {"bf16": 989.0, "f32": 494.0},
    # NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100): BF16 312, TF32 156 dense.
    "A100": {"bf16": 312.0, "f32": 156.0},
    # Google Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v4, v5e, v5p,
    # v6e): bf16 peak per chip; f32 matmuls run as bf16 passes at the default precision.
    "TPU v4": {"bf16": 275.0, "f32": 275.0},
    "TPU v5 lite": {"bf16": 197.0, "f32": 197.0},  # v5e
    "TPU v5e": {"bf16": 197.0, "f32": 197.0},
    "TPU v5p": {"bf16": 459.0, "f32": 459.0},
    "TPU v5": {"bf16": 459.0, "f32": 459.0},  # v5p reports "TPU v5"
    "TPU v6 lite": {"bf16": 918.0, "f32": 918.0},  # v6e (Trillium)
    "TPU v6e": {"bf16": 918.0, "f32": 918.0},
}


def peak_tflops(device_kind: str, precision: str, given: float | None = None) -> float | None:
    """The device's peak TFLOP/s for the run's precision: `given` (Nitro(peak_tflops=...))
    wins; else the table's entry for `device_kind`; else None (a CPU, an unknown chip).

    Example:
        >>> peak_tflops("NVIDIA H100 80GB HBM3", "bf16")
        989.0
    """
    if given is not None:
        return float(given)
    dtype = "bf16" if precision in ("bf16", "bfloat16") else "f32"
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key.lower() in device_kind.lower():
            return PEAK_TFLOPS[key][dtype]
    return None


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What one optimizer step carries, and the peak it is measured against.

    Attributes:
        samples: samples per optimizer step (batch size × accum).
        tokens: tokens per optimizer step (None: the run has no token count).
        flops: FLOPs per optimizer step per device (None: the backend gives no estimate).
        peak: the device's peak TFLOP/s (None: unknown, so no `mfu`).
    """

    samples: int
    tokens: int | None
    flops: float | None
    peak: float | None

    def rates(self, steps: int, seconds: float) -> dict[str, float]:
        """`samples_per_s`, `tokens_per_s`, `tflops_per_s` (per device) and `mfu` for
        `steps` optimizer steps in `seconds`; the keys that cannot be known are absent."""
        if steps <= 0 or seconds <= 0:
            return {}
        out = {"samples_per_s": self.samples * steps / seconds}
        if self.tokens is not None:
            out["tokens_per_s"] = self.tokens * steps / seconds
        if self.flops is not None:
            tflops = self.flops * steps / seconds / 1e12
            out["tflops_per_s"] = tflops
            if self.peak:
                out["mfu"] = tflops / self.peak
        return out


def step_flops(program_flops: float | None, accum: int) -> float | None:
    """FLOPs per optimizer step from a train program's cost analysis. XLA counts a loop's
    body once (not times its trip count), so a fused call's scan over `steps_per_call`
    steps counts one step, and accum's scan over micro-batches one micro-batch: a step is
    the program's count × `accum` (its optimizer update counted `accum` times, a small
    excess)."""
    if program_flops is None or not math.isfinite(program_flops) or program_flops <= 0:
        return None
    return program_flops * accum


class ThroughputSpec(Protocol):
    """What the throughput reads of a run's spec (a `RunSpec` is one)."""

    @property
    def experiment(self) -> Experiment: ...
    @property
    def split_specs(self) -> Mapping[str, SplitSpec]: ...
    @property
    def accum(self) -> int: ...
    @property
    def mesh(self) -> Mesh: ...
    @property
    def precision(self) -> str: ...


def tokens_per_sample(spec: ThroughputSpec) -> int | None:
    """Tokens per sample: the experiment's `tokens_per_sample`, else the per-example size of
    a batch field named `tokens` (None: neither)."""
    declared = getattr(spec.experiment, "tokens_per_sample", None)
    if isinstance(declared, int) and not isinstance(declared, bool) and declared > 0:
        return declared
    info = spec.split_specs.get("train")
    if info is None or "tokens" not in info.specs:
        return None
    shape, _ = info.specs["tokens"]  # (per-example shape, dtype)
    return math.prod(shape)


def for_run(
    spec: ThroughputSpec, program_flops: float | None, given_peak: float | None
) -> Throughput:
    """The run's `Throughput` from its spec, its train program's FLOPs and the peak option."""
    info = spec.split_specs["train"]
    samples = info.batch_size * spec.accum
    per_sample = tokens_per_sample(spec)
    kind = str(spec.mesh.devices.flat[0].device_kind)
    return Throughput(
        samples=samples,
        tokens=None if per_sample is None else per_sample * samples,
        flops=step_flops(program_flops, spec.accum),
        peak=peak_tflops(kind, spec.precision, given_peak),
    )
