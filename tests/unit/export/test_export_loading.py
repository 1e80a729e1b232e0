"""Crafted bundles that load_bundle refuses, each with a message that says what is wrong."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
from conftest import Tiny, nitro

import jaxnitro as jn
from jaxnitro._src.core.errors import BundleError

pytestmark = pytest.mark.filterwarnings("ignore:export_model.*no optimizer step")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("loading")
    return jn.export_model(nitro(Tiny(), run_dir=root / "run"), root / "bundle", platforms=("cpu",))


@pytest.fixture
def bundle(exported, tmp_path):
    return Path(shutil.copytree(exported, tmp_path / "bundle"))


def _edit(root: Path, edit) -> None:
    path = root / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.slow
def test_the_copy_loads(bundle):
    assert jn.load_bundle(bundle)(np.zeros((2, 8), np.float32)).shape == (2, 4)


# -- item: manifest.json as a link out of the bundle ---------------------------------------------
@pytest.mark.slow
def test_a_manifest_linked_from_outside_the_bundle_is_refused(bundle, tmp_path):
    outside = tmp_path / "elsewhere.json"
    shutil.move(bundle / "manifest.json", outside)
    (bundle / "manifest.json").symlink_to(outside)
    with pytest.raises(
        BundleError, match=r"manifest\.json is a link to .*elsewhere\.json, outside"
    ):
        jn.load_bundle(bundle)


def test_a_manifest_linked_inside_the_bundle_still_loads(bundle):
    shutil.move(bundle / "manifest.json", bundle / "real.json")
    (bundle / "manifest.json").symlink_to("real.json")
    assert jn.load_bundle(bundle).name == "tiny"


# -- item: deep nesting ------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [100_000, 900, 40])
def test_a_deeply_nested_manifest_is_a_bundle_error(bundle, depth):
    """100 000 levels break json itself; 900 parse, but a copy of the manifest would not."""
    path = bundle / "manifest.json"
    text = path.read_text().rstrip()
    path.write_text(text[:-1] + ', "extra": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(BundleError, match=r"manifest\.json is not readable JSON .*nested"):
        jn.load_bundle(bundle)


# -- item: files that are not files; names that are not names ----------------------------------
def test_a_directory_entry_says_it_is_a_directory(bundle):
    _edit(bundle, lambda m: m["files"].update({".": {"sha256": "0" * 64}}))
    with pytest.raises(BundleError, match=r"lists '\.', which is a directory, not a regular"):
        jn.load_bundle(bundle)


def test_a_fifo_entry_says_it_is_a_fifo_and_is_never_opened(bundle):
    os.mkfifo(bundle / "pipe")  # opening it to read would block: the check must not
    _edit(bundle, lambda m: m["files"].update({"pipe": {"sha256": "0" * 64}}))
    with pytest.raises(BundleError, match=r"lists 'pipe', which is a FIFO \(named pipe\)"):
        jn.load_bundle(bundle)


def test_a_socket_entry_says_it_is_a_socket(bundle):
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(bundle / "sock"))
        _edit(bundle, lambda m: m["files"].update({"sock": {"sha256": "0" * 64}}))
        with pytest.raises(BundleError, match=r"lists 'sock', which is a socket"):
            jn.load_bundle(bundle)
    finally:
        sock.close()


def test_a_missing_file_is_still_called_missing(bundle):
    _edit(bundle, lambda m: m["files"].update({"gone.bin": {"sha256": "0" * 64}}))
    with pytest.raises(BundleError, match=r"gone\.bin is listed in the manifest but missing"):
        jn.load_bundle(bundle)


@pytest.mark.parametrize("name", [{"a": 1}, 7, None, "", "two words", "../up", True])
def test_a_name_that_cannot_name_a_served_model_is_refused(bundle, name):
    _edit(bundle, lambda m: m.update(name=name))
    with pytest.raises(BundleError, match=r"names the model .*cannot name a served model"):
        jn.load_bundle(bundle)


def test_a_manifest_that_is_a_fifo_says_so_and_is_never_opened(bundle):
    (bundle / "manifest.json").unlink()
    os.mkfifo(bundle / "manifest.json")
    with pytest.raises(BundleError, match=r"manifest\.json is a FIFO \(named pipe\), not a"):
        jn.load_bundle(bundle)
