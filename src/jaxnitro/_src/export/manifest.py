"""Reading a bundle's files safely: the manifest, the sha256 of every file it lists, and
nothing outside the bundle directory. JSON, safetensors and flatbuffers only: no pickle."""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path
from typing import Any

from jaxnitro._src.core.errors import BundleError
from jaxnitro._src.core.jsonable import parse_json
from jaxnitro._src.export.format import FORMAT, FORMAT_VERSION, MANIFEST, NAME, PROGRAM, WEIGHTS


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_entry(data: bytes) -> dict:
    """The manifest's record of one file."""
    return {"sha256": sha256(data), "bytes": len(data)}


#: How deep a manifest may nest: the real one nests 5 levels; a deeper one is not ours.
MAX_DEPTH = 32


def read_manifest(root: Path) -> dict:
    """The parsed ``manifest.json`` of a bundle directory, format and version checked."""
    path = root / MANIFEST
    kind = _kind(path)
    if root.is_dir() and kind is not None:
        raise BundleError(
            f"{path} is {kind}, not a regular file; a bundle's manifest is a JSON file. Point "
            f"load_bundle at the directory jn.export_model(n, dir) wrote."
        )
    if not root.is_dir() or not path.is_file():
        raise BundleError(
            f"no bundle at {root}: {MANIFEST} is missing. Point load_bundle at the directory "
            f"jn.export_model(n, dir) wrote."
        )
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise BundleError(
            f"{path} is a link to {resolved}, outside the bundle directory; a bundle only "
            f"reads its own files, so it is refused. Replace the link with the manifest "
            f"itself (copy the bundle with symlinks resolved), or export again."
        )
    try:
        manifest = parse_json(resolved.read_text(encoding="utf-8"), max_depth=MAX_DEPTH)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise BundleError(
            f"{path} is not readable JSON ({e}); the bundle is damaged: export it again."
        ) from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(
            f"{path} is not a jaxnitro bundle manifest (format {_get(manifest, 'format')!r}, "
            f"expected {FORMAT!r}); point load_bundle at a directory jn.export_model wrote."
        )
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version > FORMAT_VERSION:
        raise BundleError(
            f"{path} has bundle format version {version!r}; this jaxnitro reads up to "
            f"{FORMAT_VERSION}. Upgrade jaxnitro (pip install -U jaxnitro) to load it."
        )
    name = manifest.get("name")
    if "name" in manifest and not (isinstance(name, str) and NAME.fullmatch(name)):
        raise BundleError(
            f"{path} names the model {name!r:.80}, which cannot name a served model (it goes "
            f"into URLs such as /v2/models/<name>): a name is a string of letters, digits, "
            f"'_', '.', '-'. Set \"name\" to one (e.g. \"mnist-mlp\"), or export again with "
            f"jn.export_model(n, dir, name=...)."
        )
    return manifest


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else None


def _inside(root: Path, name: Any) -> Path:
    """The path of a listed file, refusing anything that is not a plain file in ``root``."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise BundleError(f"{root / MANIFEST} lists a file named {name!r}; refusing the bundle.")
    rel = Path(name)
    resolved = (root / rel).resolve()
    if rel.is_absolute() or ".." in rel.parts or not resolved.is_relative_to(root.resolve()):
        raise BundleError(
            f"{root / MANIFEST} lists {name!r}, a path outside the bundle directory; a bundle "
            f"only reads its own files, so it is refused. Re-export the bundle, or remove the "
            f"entry if the manifest was edited by hand."
        )
    return root / rel


def read_files(root: Path, manifest: dict) -> dict[str, bytes]:
    """The bytes of every file the manifest lists, each checked against its sha256."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise BundleError(
            f"{root / MANIFEST} has no 'files' table of sha256 checksums; the bundle cannot be "
            f"verified. Export it again with jn.export_model."
        )
    for required in (PROGRAM, WEIGHTS):
        if required not in files:
            raise BundleError(
                f"{root / MANIFEST} does not list {required}; the bundle is incomplete. "
                f"Export it again with jn.export_model."
            )
    out = {}
    for name, entry in files.items():
        path = _inside(root, name)
        expected = _get(entry, "sha256")
        if not path.is_file():
            raise _not_a_file(root, name, path)
        data = path.read_bytes()
        if not isinstance(expected, str) or sha256(data) != expected:
            raise BundleError(
                f"{path}: sha256 {sha256(data)[:16]}... does not match the manifest's "
                f"{str(expected)[:16]}...: the file was changed or damaged after export. Restore "
                f"it from the original bundle or export again; it is not loaded."
            )
        out[name] = data
    return out


def _kind(path: Path) -> str | None:
    """What ``path`` is when it exists but is not a regular file (following links), else
    None: a directory, a FIFO (never opened: reading one blocks), a socket, a device."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    for test, what in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return what
    return "another kind of file"


def _not_a_file(root: Path, name: str, path: Path) -> BundleError:
    """The error for a listed file that is not a regular file: what it is instead."""
    kind = _kind(path)
    if kind is None:
        return BundleError(f"{path} is listed in the manifest but missing; export it again.")
    return BundleError(
        f"{root / MANIFEST} lists {name!r}, which is {kind}, not a regular file; a bundle "
        f"lists only its own files. Remove the entry if the manifest was edited by hand, or "
        f"export again."
    )


def write_manifest(root: Path, manifest: dict) -> None:
    text = json.dumps(manifest, indent=2, allow_nan=False) + "\n"
    (root / MANIFEST).write_text(text, encoding="utf-8")
