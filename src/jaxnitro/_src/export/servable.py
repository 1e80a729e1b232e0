"""The servable check: a written bundle, loaded in a fresh process that cannot import the
model's code, must reproduce `jn.predict` on a sample batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jaxnitro._src.core.errors import ExportError
from jaxnitro._src.experiment import models
from jaxnitro._src.export.format import TensorSpec
from jaxnitro._src.export.program import _hook, _named_outputs
from jaxnitro._src.train.prediction import predict

if TYPE_CHECKING:
    from jaxnitro._src.run.nitro import Nitro

#: Rows of the sample batch: odd, so the bundle's padding to a bucket is exercised.
SAMPLE_ROWS = 3
TIMEOUT_S = 600

# Runs with `python -I` (no cwd, no PYTHONPATH, no user site on sys.path) and refuses to
# import the experiment's module: the bundle alone must be enough.
_SCRIPT = r"""
import importlib.abc, json, sys
blocked = set(json.loads(sys.argv[4]))
class _NoModelCode(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in blocked or name.split(".")[0] in blocked:
            raise ImportError(f"{name} is the model's code; a bundle must run without it")
sys.meta_path.insert(0, _NoModelCode())
sys.path.append(sys.argv[5])
import numpy as np, safetensors.numpy as stn
from jaxnitro._src.export.bundle import load_bundle
bundle = load_bundle(sys.argv[1])
out = bundle(**stn.load_file(sys.argv[2]))
out = out if isinstance(out, dict) else {next(iter(bundle.outputs)): out}
stn.save_file({k: np.asarray(v, order="C") for k, v in out.items()}, sys.argv[3])
"""


def sample_inputs(n: Nitro, wire: dict[str, TensorSpec]) -> dict[str, np.ndarray]:
    """Rows of the first train batch when the wire inputs are batch fields, else random
    values of each input's dtype and shape (seeded by the run's seed)."""
    first = n.spec.split_specs["train"].first
    real = {}
    for name, ts in wire.items():
        arr = np.asarray(first[name]) if name in first else None
        if arr is None or arr.shape[1:] != ts.shape or arr.dtype.kind != ts.dtype.kind:
            break
        real[name] = arr[:SAMPLE_ROWS].astype(ts.dtype)
    else:
        return real
    rng = np.random.default_rng(n.spec.seed)
    out = {}
    for name, ts in wire.items():
        shape = (SAMPLE_ROWS, *ts.shape)
        if ts.dtype.kind == "b":
            out[name] = rng.random(shape) < 0.5
        elif ts.dtype == np.uint8:
            out[name] = rng.integers(0, 256, shape).astype(np.uint8)
        elif ts.dtype.kind in "iu":  # small values: valid as indices and as counts
            out[name] = rng.integers(0, 2, shape).astype(ts.dtype)
        else:
            out[name] = rng.standard_normal(shape).astype(ts.dtype)
    return out


def reference_outputs(
    n: Nitro, sample: dict[str, np.ndarray], weights: str | None = None
) -> dict[str, np.ndarray]:
    """What the bundle must return: export_preprocess → `jn.predict` → export_postprocess."""
    spec, device = n.spec, dict(n.device.values)
    cls = spec.cls
    batch = sample
    with models.mode(train=False):
        if callable(getattr(cls, "export_preprocess", None)):
            pre = jax.jit(lambda d, w: _hook(spec, d, "export_preprocess", **w))
            batch = jax.device_get(pre(device, sample))
        outputs = predict(n, {k: np.asarray(v) for k, v in dict(batch).items()}, weights=weights)
        where = f"{cls.__name__}.forward"
        if callable(getattr(cls, "export_postprocess", None)):
            post = jax.jit(lambda d, o: _hook(spec, d, "export_postprocess", o))
            outputs = jax.device_get(post(device, outputs))
            where = f"{cls.__name__}.export_postprocess"
    return {k: np.asarray(v) for k, v in _named_outputs(outputs, where).items()}


def _blocked(cls) -> list[str]:
    module = cls.__module__
    if module == "__main__":
        return []
    top = module.split(".")[0]
    return [module] if top == "jaxnitro" else [module, top]


def run_fresh(root: Path, sample: dict[str, np.ndarray], cls, platform: str) -> dict:
    """The bundle's outputs on ``sample``, computed in a new Python process."""
    import safetensors.numpy

    with tempfile.TemporaryDirectory(prefix="jaxnitro-check-") as tmp:
        inp, out = Path(tmp) / "inputs.safetensors", Path(tmp) / "outputs.safetensors"
        safetensors.numpy.save_file({k: np.asarray(v, order="C") for k, v in sample.items()}, inp)
        # The directory that holds the `jaxnitro` package (this module is jaxnitro/_src/export/...).
        package_root = str(Path(__file__).resolve().parents[2])
        args = [str(root), str(inp), str(out), json.dumps(_blocked(cls)), package_root]
        env = {**os.environ, "JAX_PLATFORMS": platform}
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-c", _SCRIPT, *args],
                cwd=tmp,
                env=env,
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as e:
            raise ExportError(
                f"servable check: loading and running the bundle in a fresh process took more "
                f"than {TIMEOUT_S} s; the bundle was not written."
            ) from e
        if proc.returncode != 0:
            raise ExportError(
                f"servable check: the bundle failed in a fresh process (without the model's "
                f"code), so it was not written. The process said:\n{proc.stderr[-3000:]}\n"
                f"If it names the model's module, the program still needs Python code at run "
                f"time; make forward and the export hooks depend only on their arguments."
            )
        return dict(safetensors.numpy.load_file(out))


def tolerance(dtype: np.dtype) -> float:
    return max(1e-5, 8 * float(jnp.finfo(dtype).eps))


def compare(expected: dict, got: dict) -> dict[str, float]:
    """Max abs difference per output; ExportError when one is outside tolerance."""
    diffs = {}
    for name, want in expected.items():
        have = got.get(name)
        if have is None or have.shape != want.shape or have.dtype != want.dtype:
            what = "missing" if have is None else f"{have.dtype}{list(have.shape)}"
            raise ExportError(
                f"servable check: output {name!r} is {want.dtype}{list(want.shape)} from "
                f"jn.predict but {what} from the bundle; the bundle was not written."
            )
        if want.dtype.kind in "fcV":
            a, b = want.astype(np.float64), have.astype(np.float64)
            diff = float(np.nanmax(np.abs(a - b))) if a.size else 0.0
            tol = tolerance(want.dtype)
            ok = np.allclose(b, a, rtol=tol, atol=tol, equal_nan=True)
        else:
            diff = float(np.abs(want.astype(np.int64) - have.astype(np.int64)).max(initial=0))
            tol, ok = 0.0, bool(np.array_equal(want, have))
        if not ok:
            raise ExportError(
                f"servable check: output {name!r} of the bundle, run in a fresh process, "
                f"differs from jn.predict by up to {diff:.3g} (tolerance {tol:g}) on a sample "
                f"of {len(want)} rows; the bundle was not written. The program must depend only "
                f"on the weights, the GraphConst and Device values and its inputs: look for "
                f"global arrays or random draws read inside forward or the export hooks."
            )
        diffs[name] = diff
    return diffs


def check_servable(
    n: Nitro, root: Path, wire: dict[str, TensorSpec], platform: str, weights: str | None = None
) -> dict:
    """Run the check (against `jn.predict` with the exported `weights`); the manifest's
    record of it."""
    sample = sample_inputs(n, wire)
    expected = reference_outputs(n, sample, weights)
    got = run_fresh(root, sample, n.spec.cls, platform)
    diffs = compare(expected, got)
    rows = len(next(iter(sample.values())))
    return {"platform": platform, "rows": rows, "max_abs_diff": diffs}
