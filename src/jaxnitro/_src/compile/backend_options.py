"""The XLA options jaxnitro compiles with by default, per backend, where XLA's own measured
slower for the programs it compiles.

On a CPU, XLA hands dot products (and what it fuses with them) to YNNPACK fusions by default.
For the small steps a CPU trains (an MLP or a small CNN, batch 32-1024), XLA's own emitters run
them faster: a hand-written `jax.jit` step of the MNIST MLP 1.07-1.10x the steps/s, the CNN of
`benchmarks/run.py` 1.09x, a tiny GPT the same (2-core VM, jaxlib 0.10.2;
`benchmarks/RESULTS.md`). So a CPU program is compiled with YNNPACK fusion off, where this
jaxlib knows the option (`cpu_defaults` asks it once a process; another jaxlib compiles with
XLA's own defaults). Other backends get none.

A run's programs take these unless `Nitro(compile_options=...)` is given: that dict is used as
it is (`compile_options={}` for XLA's own defaults). `jn.train_step` takes them too, so a
step of `jn.train` and of `jn.train_step` compute alike.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

__all__ = ["CPU", "defaults"]

#: What a CPU program is compiled with (where this jaxlib knows the option).
CPU: dict[str, Any] = {"xla_cpu_experimental_ynn_fusion_type": ""}
_SENTINEL = "jaxnitro_no_such_option"


def defaults(platform: str) -> dict[str, Any]:
    """The options a program for `platform` ("cpu", "gpu", ...) is compiled with when the
    run gives none.

    Example:
        >>> defaults("gpu")
        {}
    """
    return dict(CPU) if platform == "cpu" and cpu_known() else {}


@functools.cache
def cpu_known() -> bool:
    """Whether this jaxlib's CPU compiler knows the options of `CPU`. Asked without
    compiling: the options go with one it cannot know, and the error names the first
    unknown (~5 ms, once a process)."""
    options = {**CPU, _SENTINEL: ""}
    try:
        lowered = jax.jit(lambda x: x).lower(np.float32(0))
        lowered.compile(compiler_options=options)
    except Exception as e:  # noqa: BLE001 - what the compiler says, or any failure: not known
        return _SENTINEL in str(e) and not any(k in str(e) for k in CPU)
    return False  # (accepted the sentinel: the answer cannot be trusted)
