"""`jn.export_model`: write a run's model as a bundle that serves without its code.

The order: the wire inputs (`export_inputs`, else forward's fields) → the weights as a flat
dict → the program (`export_preprocess → forward → export_postprocess` in inference mode,
Device values frozen), exported for every platform and refused if it calls back into Python
or uses an unstable custom call → the files, into a staging directory → the servable check
(a fresh process, without the model's code, must reproduce `jn.predict`) → the files moved
into place. A failed export leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from jaxnitro._src.core.errors import BundleError, ExportError, did_you_mean, warn_user
from jaxnitro._src.export import compat
from jaxnitro._src.export.format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    NAME,
    PLATFORMS,
    PROGRAM,
    WEIGHTS,
)
from jaxnitro._src.export.manifest import file_entry, read_manifest, write_manifest
from jaxnitro._src.export.program import (
    export_program,
    output_specs,
    serialize,
    serving_function,
    wire_inputs,
)
from jaxnitro._src.export.provenance import provenance
from jaxnitro._src.export.servable import check_servable
from jaxnitro._src.export.weights import flatten_weights
from jaxnitro._src.programs.stale import check_stale
from jaxnitro._src.steps import ema, population

if TYPE_CHECKING:
    from jaxnitro._src.run.nitro import Nitro

_EXPORT_HOOKS = ("export_inputs", "export_preprocess", "export_postprocess")


def export_model(
    n: Nitro,
    dir: str | os.PathLike,
    *,
    name: str | None = None,
    platforms: Sequence[str] = ("cpu", "cuda"),
    allow_custom_calls: Sequence[str] = (),
    weights: str | None = None,
) -> Path:
    """Write the run's model as a bundle: manifest.json, weights.safetensors, model.jaxexport.

    The program is `forward` in inference mode (BatchNorm running statistics, no dropout)
    with the Device values of now, wrapped by the optional hooks `export_preprocess(self,
    **wire)` and `export_postprocess(self, outputs)`; its inputs are `export_inputs(self)`
    (default: the fields forward takes, as the first train batch has them), each with a
    symbolic batch dimension. Before returning, the bundle is loaded in a fresh process that
    cannot import the model's code and compared with `jn.predict` on a sample batch.

    Args:
        n: the run (`jn.Nitro`), trained or not: its current weights are exported.
        dir: the bundle directory: created, or written into (an earlier bundle's files are
            replaced, other files are left alone).
        name: the model name (default: the experiment class name, lowercased).
        platforms: the platforms to lower for (any of cpu, cuda, rocm, tpu; this machine
            need not have them).
        allow_custom_calls: custom-call targets to export although jax.export gives them no
            compatibility guarantee (the bundle then needs this exact jaxlib).
        weights: with `Nitro(ema=...)`, "ema" (the averaged weights) or "raw" (the trained
            ones); None: those validation uses.

    Returns:
        The bundle directory.

    Raises:
        ExportError: the destination holds something else than a bundle, the program
            calls back into Python or an unstable custom call, or the fresh process does
            not reproduce `jn.predict`.
        ConfigError: `n` is a population (export `jn.member(n, i)`), or `weights` is not
            available.

    Example:
        >>> path = jn.export_model(n, "bundles/mnist")
        >>> jn.load_bundle(path)(x_test[:3]).shape
        (3, 10)
    """
    root = Path(dir)
    where = root.absolute()
    _check_exportable(n, weights, where)  # before anything is traced: fail fast
    platforms = _platforms(platforms)
    name = _name(name, n.spec.cls)
    check_stale(n.spec, n.programs)
    # progress: lowered for the platforms, then written and (on one of them) run once here
    steps = 2 + (compat.platform() in platforms)
    with n.display.bar(f"exporting {name}", steps, lines=True) as advance:
        with n.programs.on_compile("export", name):
            manifest, files, wire = _build(n, name, platforms, _names(allow_custom_calls), weights)
        advance(1, f"lowered for {', '.join(platforms)}")
        _write_staged(n, where, manifest, files, wire, platforms, weights, advance)
    return root


def _write_staged(
    n: Nitro,
    where: Path,
    manifest: dict,
    files: dict,
    wire,
    platforms,
    weights: str | None,
    advance: Callable[..., None],
) -> None:
    """Write and check the bundle in a staging directory beside ``where``, then move it
    into place; a failure (Ctrl-C included) leaves nothing behind."""
    staging = where.parent / f".{where.name}.tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    try:
        _write_checked(n, staging, manifest, files, wire, platforms, weights, advance)
        _publish(staging, where)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _names(names: str | Sequence[str]) -> tuple[str, ...]:
    """One name or several, as a tuple (a bare string is one name, not its letters)."""
    return (names,) if isinstance(names, str) else tuple(names)


def _check_exportable(n: Nitro, weights: str | None, where: Path) -> None:
    """Raise before anything is written for what cannot be exported (a population, a weights
    choice not available, a destination not writable); warn for untrained weights."""
    population.refuse(n, "jn.export_model")
    ema.pick(n, weights)  # a bad or unavailable choice fails before anything is written
    if n.step == 0 and n.spec.weights_path is None:
        warn_user(
            f"export_model: {n.spec.cls.__name__} has taken no optimizer step, so the bundle "
            f"holds its initial weights. Train first (jn.train(n)), or load trained weights "
            f"with jn.Nitro(exp, checkpoint='runs/...').",
        )
    _check_destination(where)


def _write_checked(
    n: Nitro,
    staging: Path,
    manifest: dict,
    files: dict,
    wire,
    platforms,
    weights: str | None,
    advance: Callable[..., None],
) -> None:
    """The bundle's files in `staging`, then the servable check (where this platform is one
    of the bundle's) recorded in its manifest."""
    for fname, data in files.items():
        (staging / fname).write_bytes(data)
    write_manifest(staging, manifest)
    advance(1, f"wrote {sum(len(d) for d in files.values()):,} bytes")
    here = compat.platform()
    manifest["check"] = None
    if here in platforms:
        manifest["check"] = check_servable(n, staging, wire, here, weights)
        advance(1, f"ran once on {here}")
    else:
        warn_user(
            f"export_model: this machine runs {here}, not one of {list(platforms)}, so the "
            f"bundle was not run here (no servable check). Load it on a {platforms[0]} "
            f"machine to verify it.",
        )
    write_manifest(staging, manifest)


def _build(
    n: Nitro,
    name: str,
    platforms: tuple[str, ...],
    allow: tuple[str, ...],
    which: str | None = None,
):
    """(manifest without files' check, {file name: bytes}, wire input specs)."""
    import safetensors.numpy

    wire = wire_inputs(n)
    weights = flatten_weights(*ema.pick(n, which))
    order: list[str] = []
    fn = serving_function(n, weights, order)
    exported = export_program(
        fn, weights.specs(), wire, platforms=platforms, allow_custom_calls=allow
    )
    outputs = output_specs(exported, order)
    arrays = {k: np.asarray(v, order="C") for k, v in weights.arrays.items()}
    files = {
        PROGRAM: serialize(exported),
        WEIGHTS: safetensors.numpy.save(arrays, metadata={"format": FORMAT}),
    }
    cls = n.spec.cls
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "name": name,
        "inputs": [ts_.entry(k) for k, ts_ in wire.items()],
        "outputs": [ts_.entry(k) for k, ts_ in outputs.items()],
        "platforms": list(exported.platforms),
        "hooks": [h for h in _EXPORT_HOOKS if callable(getattr(cls, h, None))],
        "allowed_custom_calls": list(allow),
        "weights": {
            "count": len(arrays),
            "bytes": int(sum(a.nbytes for a in arrays.values())),
            "prng_keys": {k: str(v) for k, v in weights.prng.items()},
        },
        "provenance": provenance(n, exported, ema.which(n, which)),
        "files": {k: file_entry(v) for k, v in files.items()},
    }
    return manifest, files, wire


def _platforms(platforms) -> tuple[str, ...]:
    items = (platforms,) if isinstance(platforms, str) else tuple(platforms)
    for p in items:
        if p not in PLATFORMS:
            hint = " Did you mean 'cuda'?" if p == "gpu" else did_you_mean(str(p), PLATFORMS)
            raise ExportError(
                f"platforms: {p!r} is not a platform jax.export lowers for; use any of "
                f"{list(PLATFORMS)}, e.g. platforms=('cpu', 'cuda').{hint}"
            )
    if not items:
        raise ExportError("platforms is empty; pass e.g. platforms=('cpu', 'cuda').")
    return tuple(dict.fromkeys(items))


def _name(name: str | None, cls) -> str:
    name = cls.__name__.lower() if name is None else name
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ExportError(
            f"name={name!r} cannot name a served model (it goes into URLs such as "
            f"/v2/models/<name>); use letters, digits, '_', '.', '-', e.g. name='mnist-mlp'."
        )
    return name


def _check_destination(root: Path) -> None:
    """A bundle goes into a directory (new or not); an existing manifest.json must be a
    bundle's, since it is replaced (a checkpoint directory has one of its own)."""
    if root.is_symlink() or (root.exists() and not root.is_dir()):
        raise ExportError(f"{root} exists and is not a directory; choose another bundle path.")
    if (root / MANIFEST).exists() and not _is_bundle(root):
        raise ExportError(
            f"{root} has a {MANIFEST} that is not a jaxnitro bundle's (a checkpoint "
            f"directory?), so it is not replaced. Choose another directory for the bundle."
        )


def _publish(staging: Path, root: Path) -> None:
    """Move the checked bundle into place: the whole directory when ``root`` is new, else
    its three files (the manifest last), leaving anything else in ``root`` alone."""
    _check_destination(root)  # again: time passed since the export started
    if not root.exists():
        staging.rename(root)
        return
    for fname in (PROGRAM, WEIGHTS, MANIFEST):
        os.replace(staging / fname, root / fname)
    staging.rmdir()


def _is_bundle(root: Path) -> bool:
    try:
        return read_manifest(root).get("format") == FORMAT
    except BundleError:
        return False
