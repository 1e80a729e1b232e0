"""Reading a bundle's files safely: the manifest, the sha256 of every file it lists, and
nothing outside the bundle directory. JSON, safetensors and flatbuffers only: no pickle."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..errors import BundleError
from .format import FORMAT, FORMAT_VERSION, MANIFEST, PROGRAM, WEIGHTS


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_entry(data: bytes) -> dict:
    """The manifest's record of one file."""
    return {"sha256": sha256(data), "bytes": len(data)}


def read_manifest(root: Path) -> dict:
    """The parsed ``manifest.json`` of a bundle directory, format and version checked."""
    path = root / MANIFEST
    if not root.is_dir() or not path.is_file():
        raise BundleError(
            f"no bundle at {root}: {MANIFEST} is missing. Point load_bundle at the directory "
            f"jn.export_model(n, dir) wrote."
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
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
            raise BundleError(f"{path} is listed in the manifest but missing; export it again.")
        data = path.read_bytes()
        if not isinstance(expected, str) or sha256(data) != expected:
            raise BundleError(
                f"{path}: sha256 {sha256(data)[:16]}... does not match the manifest's "
                f"{str(expected)[:16]}...: the file was changed or damaged after export. Restore "
                f"it from the original bundle or export again; it is not loaded."
            )
        out[name] = data
    return out


def write_manifest(root: Path, manifest: dict) -> None:
    text = json.dumps(manifest, indent=2, allow_nan=False) + "\n"
    (root / MANIFEST).write_text(text, encoding="utf-8")
