"""The XLA options jaxnitro compiles with by default, per backend and batch size, where XLA's
own measured slower for the programs it compiles.

On a CPU, XLA hands dot products (and what it fuses with them) to YNNPACK fusions by default.
For the small batches a CPU trains, XLA's own emitters run them faster; from about a thousand
rows YNNPACK catches up. Measured on a 2-core VM (jaxlib 0.10.2), each program compiled both
ways in one process and run alternately (`benchmarks/compile_options_ab.py`, RESULTS.md): a
hand-written `jax.jit` step of the MNIST MLP 1.07-1.09x the steps/s at batch 32, 1.05-1.06x
at 256, 0.99-1.00x at 1024; the bench CNN at batch 64 1.08-1.12x; a tiny GPT at batch 8
1.00-1.01x; jaxnitro's MLP run 1.08-1.11x at 32 and 0.91-0.97x at 1024. So a CPU program
whose batch has at most `SMALL_ROWS` rows is compiled with YNNPACK fusion off, where this
jaxlib knows the option (`cpu_known` asks it once a process; another jaxlib compiles with
XLA's own defaults). Other backends get none.

Such a program also runs its Eigen calls (dots, convolutions) on the calling thread where its
FLOP estimate is under 1e6 (`ONE_THREAD`, jaxnitro's own option, made XLA's
`xla_cpu_multi_thread_eigen: False` per program by `resolve` at its compile): for a program
that small, handing work to Eigen's threads costs more than it saves. Measured the same way
on the idle VM (`benchmarks/compile_options_ab.py --one-thread`, and the same A/B by hand):
the 2-32-2 MLP step of `train_step_cost.py` (3e4 FLOPs) 1.03-1.05x in four runs; the MNIST
MLP at batch 32 (1.5e7) 1.01-1.02x idle but 0.99-1.00x on the VM slowed by its neighbours,
the MLP at batch 256 (1.1e8) 0.98-1.00x and a tiny GPT (4.5e9) 0.97-0.99x: so only programs
far below those keep one thread. (On the slowed VM the 2-32-2 step gave 0.96-1.03x.)

A run's programs take these (by its train batch size) unless `Nitro(compile_options=...)` is
given: that dict is used as it is (`compile_options={}` for XLA's own defaults). `jn.train_step`
(by its batch) and a bundle's served programs (by their padded batch size) take them too.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxnitro._src.compile import report

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["CPU", "ONE_THREAD", "defaults", "refused", "resolve"]

#: jaxnitro's own option (not XLA's; `resolve` replaces it): a program whose FLOP estimate is
#: under its value runs its Eigen calls (dots, convolutions) on the calling thread.
ONE_THREAD = "jaxnitro_one_thread_below_flops"
#: What a CPU program of a small batch is compiled with (where this jaxlib knows the options).
CPU: dict[str, Any] = {"xla_cpu_experimental_ynn_fusion_type": "", ONE_THREAD: 1e6}
#: The most rows a batch may have for `CPU` to apply.
SMALL_ROWS = 512
_SENTINEL = "jaxnitro_no_such_option"
# the XLA option `ONE_THREAD` sets
_ONE_THREAD_XLA = {"xla_cpu_multi_thread_eigen": False}


def defaults(platform: str, rows: int | None) -> dict[str, Any]:
    """The options a program for `platform` ("cpu", "gpu", ...) whose batch has `rows` rows
    (None: not known, taken as small) is compiled with when the run gives none.

    Example:
        >>> defaults("gpu", 32)
        {}
    """
    small = rows is None or rows <= SMALL_ROWS
    return dict(CPU) if platform == "cpu" and small and cpu_known() else {}


def resolve(options: Mapping[str, Any], lowered: Any) -> dict[str, Any]:
    """The XLA options to compile `lowered` (a `jax.stages.Lowered`) with: `options` less
    jaxnitro's own, `ONE_THREAD` replaced by what it gives this program.

    Example:
        >>> lowered = jax.jit(lambda x: x * 2).lower(np.ones(4, np.float32))
        >>> resolve({ONE_THREAD: 1e6}, lowered)
        {'xla_cpu_multi_thread_eigen': False}
        >>> resolve({ONE_THREAD: 1.0}, lowered)  # 4 FLOPs: not under 1
        {}
    """
    out = dict(options)
    below = out.pop(ONE_THREAD, None)
    if below is not None:
        flops = report.flops(lowered)
        if flops is not None and flops < float(below):
            out.update(_ONE_THREAD_XLA)
    return out


@functools.cache
def cpu_known() -> bool:
    """Whether this jaxlib's CPU compiler knows the XLA options of `CPU` (and of
    `ONE_THREAD`). Asked without compiling (`_said`, ~5 ms, once a process)."""
    xla = {k: v for k, v in {**CPU, **_ONE_THREAD_XLA}.items() if k != ONE_THREAD}
    said = _said(xla)
    return said is not None and _all_taken(said, xla)


_refusals: dict[tuple, str | None] = {}


def refused(options: Mapping[str, Any]) -> str | None:
    """What this jaxlib's compiler says against `options` on the default backend (an option
    name it does not know, a value it cannot take), jaxnitro's own left out; None where it
    takes them or cannot tell. Asked once per set of options, on a program of one scalar.

    Example:
        >>> refused({"xla_backend_optimization_level": 2}) is None
        True
        >>> refused({"xla_no_such_flag": True})
        "No such compile option: 'xla_no_such_flag'"
    """
    xla = {k: v for k, v in options.items() if k != ONE_THREAD}
    if not xla:
        return None
    key = (jax.default_backend(), tuple(sorted((k, repr(v)) for k, v in xla.items())))
    if key not in _refusals:
        _refusals[key] = _ask(xla)
    return _refusals[key]


def _ask(xla: dict[str, Any]) -> str | None:
    said = _said(xla)
    return None if said is None or _all_taken(said, xla) else said


def _said(xla: dict[str, Any]) -> str | None:
    """What the compiler says to `xla` with an option it cannot know after them, on a
    program of one scalar: the first line of its error (it names the first option it does
    not know, or a value it cannot take); None where it accepted even that one (then it
    cannot tell)."""
    try:
        lowered = jax.jit(lambda x: x).lower(np.float32(0))
        lowered.compile(compiler_options={**xla, _SENTINEL: ""})
    except Exception as e:  # noqa: BLE001 - the compiler's own words are the answer
        said = str(e).splitlines()[0] if str(e) else type(e).__name__
        return said.split("INVALID_ARGUMENT: ", 1)[-1]
    return None


def _all_taken(said: str, xla: dict[str, Any]) -> bool:
    """`_said` named the sentinel and none of `xla`: it took every one of them."""
    return _SENTINEL in said and not any(k in said for k in xla)
