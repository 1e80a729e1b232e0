"""Export bundles: jn.export_model writes one, jn.load_bundle runs it without the model's code."""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from conftest import Tiny, make_data, nitro
from flax import nnx
from helpers.paths import TESTS

import jaxnitro as jn
from jaxnitro._src.core.errors import BundleError, BundleInputError, ExportError, HookError
from jaxnitro._src.experiment.hooks import check_hooks
from jaxnitro._src.export import compat

# Most tests export an untrained handle on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:export_model.*no optimizer step")

SRC = Path(jn.__file__).resolve().parent


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Tiny trained one epoch and exported once (default platforms: cpu and cuda)."""
    root = tmp_path_factory.mktemp("export")
    n = nitro(Tiny(max_epochs=1), run_dir=root / "run")
    jn.train(n)
    return n, jn.export_model(n, root / "bundle")


@pytest.fixture
def bundle_copy(trained, tmp_path):
    """A private copy of the exported bundle, free to damage."""
    return Path(shutil.copytree(trained[1], tmp_path / "bundle"))


def _edit_manifest(root: Path, edit) -> None:
    path = root / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


# -- the round trip ----------------------------------------------------------------------------
_FRESH = r"""
import sys
import numpy as np, safetensors.numpy as stn
import jaxnitro as jn
bundle = jn.load_bundle(sys.argv[1])
x = stn.load_file(sys.argv[2])["x"]
stn.save_file({f"b{k}": bundle(x[:k]) for k in (1, 3, 5)}, sys.argv[3])
assert "conftest" not in sys.modules and sys.argv[4] not in sys.path, sys.path
"""


@pytest.mark.slow
def test_bundle_in_a_fresh_process_matches_predict(trained, tmp_path):
    n, path = trained
    x, _ = make_data(5, seed=7)
    safetensors.numpy.save_file({"x": x}, tmp_path / "x.st")
    proc = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            _FRESH,
            str(path),
            str(tmp_path / "x.st"),
            str(tmp_path / "o.st"),
            str(TESTS),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = safetensors.numpy.load_file(tmp_path / "o.st")
    for k in (1, 3, 5):
        np.testing.assert_allclose(got[f"b{k}"], jn.predict(n, {"x": x[:k]}), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_manifest_describes_the_bundle(trained):
    n, path = trained
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["name"] == "tiny" and manifest["format_version"] == 1
    assert manifest["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 8]}]
    assert manifest["outputs"] == [{"name": "output", "dtype": "float32", "shape": ["batch", 4]}]
    assert manifest["platforms"] == ["cpu", "cuda"]
    prov = manifest["provenance"]
    assert prov["jax"] == jax.__version__ and prov["jaxlib"] == compat.versions()["jaxlib"]
    assert prov["calling_convention_version"] >= 9 and prov["serialization_version"] >= 1
    assert prov["experiment"] == "conftest.Tiny" and prov["seed"] == 42
    assert prov["graph_consts"] == {"width": 16, "dropout": 0.0}
    assert prov["device_values"] == {"smoothing": 0.0}
    assert prov["checkpoint"]["step"] == n.step and "val_loss" in prov["checkpoint"]["metrics"]
    assert Path(prov["checkpoint"]["path"]).is_dir()
    assert "created" in prov and "git" in prov
    assert manifest["check"]["max_abs_diff"]["output"] <= 1e-5
    for name, entry in manifest["files"].items():
        assert hashlib.sha256((path / name).read_bytes()).hexdigest() == entry["sha256"]
    weights = safetensors.numpy.load_file(path / "weights.safetensors")
    assert {"params/hidden/kernel", "params/out/bias"} <= set(weights)
    assert any(k.startswith("state/") for k in weights)  # the NNX Rngs travel as key data


@pytest.mark.slow
def test_any_batch_size_runs_in_a_bounded_set_of_programs(trained):
    n, path = trained
    bundle = jn.load_bundle(path, max_batch_size=16)
    x, _ = make_data(40, seed=3)
    for size in (1, 2, 3, 5, 7, 9, 16, 40):
        out = bundle(x[:size])
        assert isinstance(out, np.ndarray) and out.shape == (size, 4)
        np.testing.assert_allclose(out, jn.predict(n, {"x": x[:size]}), atol=1e-5, rtol=1e-5)
    assert set(bundle.compiled_batch_sizes) <= {1, 2, 4, 8, 16}
    np.testing.assert_array_equal(bundle(x=x[:3]), bundle(x[:3]))  # by name or by position
    assert list(bundle.inputs) == ["x"] and bundle.inputs["x"] == jn.TensorSpec("float32", (8,))
    assert list(bundle.outputs) == ["output"] and bundle.name == "tiny"
    assert bundle.manifest["name"] == "tiny" and bundle.platforms == ("cpu", "cuda")


@pytest.mark.slow
def test_bundle_calls_from_many_threads_compile_each_size_once(trained):
    from concurrent.futures import ThreadPoolExecutor

    n, path = trained
    bundle = jn.load_bundle(path, max_batch_size=8)
    x, _ = make_data(8, seed=4)
    expected = {k: jn.predict(n, {"x": x[:k]}) for k in range(1, 9)}
    compiles = []
    listener = lambda name, *a, **k: compiles.append(name)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda k: bundle(x[:k]), [*range(1, 9)] * 3))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    for k, out in zip([*range(1, 9)] * 3, outs, strict=True):
        np.testing.assert_allclose(out, expected[k], atol=1e-5, rtol=1e-5)
    assert bundle.compiled_batch_sizes == (1, 2, 4, 8)
    assert compiles.count("/jax/core/compile/backend_compile_duration") == 4


# -- inputs are validated --------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded(trained):
    return jn.load_bundle(trained[1])


def test_float64_is_refused_not_cast(loaded):
    x = np.zeros((2, 8), np.float64)
    with pytest.raises(BundleInputError, match=r"input 'x': expected dtype float32, got float64"):
        loaded(x)
    with pytest.raises(BundleInputError, match=r"astype\(np\.float32\)"):
        loaded(x=x)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (
            np.zeros((2, 9), np.float32),
            r"input 'x': expected shape float32\[batch, 8\].*got \[2, 9\]",
        ),
        (np.zeros((8,), np.float32), r"got \[8\]\. Add the batch dimension: x\[None\]"),
        (np.zeros((0, 8), np.float32), r"input 'x': the batch is empty"),
    ],
)
def test_wrong_shapes_name_the_input_and_both_shapes(loaded, value, match):
    with pytest.raises(BundleInputError, match=match):
        loaded(value)


def test_wrong_names_and_counts(loaded):
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(BundleInputError, match=r"unknown input\(s\) \['xx'\].*Did you mean 'x'"):
        loaded(xx=x)
    with pytest.raises(BundleInputError, match=r"takes 1 input\(s\) \['x'\], got 2"):
        loaded(x, x)
    with pytest.raises(BundleInputError, match=r"missing input\(s\) \['x'\]"):
        loaded()
    with pytest.raises(BundleInputError, match="either by position or by name"):
        loaded(x, x=x)
    assert loaded([[0.0] * 8]).shape == (1, 4)  # a list carries no precision: converted


# -- the bundle is verified on load ------------------------------------------------------------
def test_tampered_weights_are_named(bundle_copy):
    path = bundle_copy / "weights.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"weights\.safetensors: sha256 .* does not match"):
        jn.load_bundle(bundle_copy)


def test_tampered_program_is_named(bundle_copy):
    with (bundle_copy / "model.jaxexport").open("ab") as f:
        f.write(b"\0")
    with pytest.raises(BundleError, match=r"model\.jaxexport: sha256"):
        jn.load_bundle(bundle_copy)


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "sub/../../x"])
def test_manifest_listing_files_outside_the_bundle_is_refused(bundle_copy, name):
    _edit_manifest(bundle_copy, lambda m: m["files"].update({name: {"sha256": "0" * 64}}))
    with pytest.raises(BundleError, match="outside the bundle directory"):
        jn.load_bundle(bundle_copy)


def test_manifest_without_the_program_is_refused(bundle_copy):
    _edit_manifest(bundle_copy, lambda m: m["files"].pop("model.jaxexport"))
    with pytest.raises(BundleError, match=r"does not list model\.jaxexport"):
        jn.load_bundle(bundle_copy)


def test_manifest_inputs_must_match_the_program(bundle_copy):
    _edit_manifest(bundle_copy, lambda m: m["inputs"][0].update({"shape": ["batch", 9]}))
    with pytest.raises(BundleError, match=r"do not match model\.jaxexport.*input 'x'"):
        jn.load_bundle(bundle_copy)


@pytest.mark.parametrize("version", ["0.4.30", "99.0.0"])
def test_jaxlib_outside_the_compatibility_window_is_refused(bundle_copy, version):
    _edit_manifest(bundle_copy, lambda m: m["provenance"].update({"jaxlib": version}))
    with pytest.raises(BundleError, match=rf"jaxlib {version}.*allow_incompatible_jaxlib=True"):
        jn.load_bundle(bundle_copy)
    assert jn.load_bundle(bundle_copy, allow_incompatible_jaxlib=True)(
        np.zeros((1, 8), np.float32)
    ).shape == (1, 4)


def test_compatibility_window_rules():
    here = {"jaxlib": "0.10.2", "calling_convention_versions": [9, 10], "serialization_version": 11}
    ok = {"jaxlib": "0.10.2", "calling_convention_version": 10, "serialization_version": 11}
    assert compat.window_problem(ok, here) is None
    assert compat.window_problem({**ok, "jaxlib": "0.9.0"}, here) is None  # one minor newer
    assert "older" in compat.window_problem({**ok, "jaxlib": "0.10.3"}, here)
    assert "6-month" in compat.window_problem({**ok, "jaxlib": "0.8.1"}, here)
    assert "calling convention 8" in compat.window_problem(
        {**ok, "calling_convention_version": 8}, here
    )
    assert "schema version 12" in compat.window_problem({**ok, "serialization_version": 12}, here)


def test_not_a_bundle(tmp_path):
    with pytest.raises(BundleError, match="no bundle at"):
        jn.load_bundle(tmp_path)
    (tmp_path / "manifest.json").write_text('{"rows": []}')
    with pytest.raises(BundleError, match="not a jaxnitro bundle manifest"):
        jn.load_bundle(tmp_path)


# -- what export refuses -------------------------------------------------------------------------
@jn.experiment
class Prints(Tiny):
    def forward(self, model, params, state, *, x):
        jax.debug.print("sum {}", x.sum())
        return jn.apply(model, params, state, x)


@jn.experiment
class Callback(Tiny):
    def forward(self, model, params, state, *, x):
        x = jax.pure_callback(np.tanh, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return jn.apply(model, params, state, x)


@pytest.mark.parametrize(
    ("cls", "call"), [(Prints, "jax.debug.print"), (Callback, "jax.pure_callback")]
)
def test_host_callbacks_are_refused_naming_the_call(cls, call, run_dir):
    n = nitro(cls(), run_dir=run_dir)
    with pytest.raises(ExportError, match=rf"{call}.*test_export\.py.*Remove the call"):
        jn.export_model(n, run_dir / "bundle")
    assert not (run_dir / "bundle").exists()


@jn.experiment
class CustomCall(Tiny):
    def forward(self, model, params, state, *, x):
        out, state = jn.apply(model, params, state, x)
        spec = jax.ShapeDtypeStruct(out.shape, out.dtype)
        return jax.ffi.ffi_call("jn_test_unstable_op", spec)(out), state


def test_unstable_custom_calls_are_refused_with_the_way_out(run_dir):
    n = nitro(CustomCall(), run_dir=run_dir)
    with pytest.raises(ExportError, match=r"'jn_test_unstable_op'.*allow_custom_calls"):
        jn.export_model(n, run_dir / "bundle")


@jn.experiment
class BatchMean(Tiny):
    def export_postprocess(self, outputs):
        return {"mean": outputs.mean(0)}


def test_outputs_need_the_batch_dimension_first(run_dir):
    with pytest.raises(ExportError, match=r"output 'mean' has shape \(4\).*batch dimension"):
        jn.export_model(nitro(BatchMean(), run_dir=run_dir), run_dir / "bundle")


def test_bad_arguments_fail_before_tracing(run_dir, tmp_path):
    n = nitro(Tiny(), run_dir=run_dir)
    with pytest.raises(ExportError, match="Did you mean 'cuda'"):
        jn.export_model(n, tmp_path / "b", platforms=("cpu", "gpu"))
    with pytest.raises(ExportError, match="cannot name a served model"):
        jn.export_model(n, tmp_path / "b", name="a model/v1")
    checkpoints = tmp_path / "checkpoints"  # a checkpoint directory's manifest.json
    checkpoints.mkdir()
    (checkpoints / "manifest.json").write_text('{"rows": []}')
    before = (checkpoints / "manifest.json").read_bytes()
    with pytest.raises(ExportError, match="not a jaxnitro bundle's .a checkpoint directory"):
        jn.export_model(n, checkpoints)
    assert (checkpoints / "manifest.json").read_bytes() == before


def test_cuda_only_export_from_cpu_is_written_but_not_run_here(run_dir):
    n = nitro(Tiny(), run_dir=run_dir)
    seen = []
    jn.on_phase(lambda phase, step, epoch, info: seen.append((phase, info.get("program"))), nitro=n)
    with pytest.warns(UserWarning, match="no servable check"):
        path = jn.export_model(n, run_dir / "bundle", platforms="cuda")
    assert ("Compiling", "export") in seen
    assert json.loads((path / "manifest.json").read_text())["platforms"] == ["cuda"]
    with pytest.raises(BundleError, match=r"exported for \['cuda'\]; this process runs on cpu"):
        jn.load_bundle(path)


@jn.experiment
class DriftsPerTrace(Tiny):
    def forward(self, model, params, state, *, x):
        _TRACES.append(1)  # a value read at trace time that the next trace sees changed
        out, state = jn.apply(model, params, state, x)
        return out * len(_TRACES), state


_TRACES: list[int] = []


@pytest.mark.slow
def test_servable_check_fails_the_export_when_outputs_differ(run_dir):
    n = nitro(DriftsPerTrace(), run_dir=run_dir)
    with pytest.raises(ExportError, match=r"output 'output' .* differs from jn\.predict"):
        jn.export_model(n, run_dir / "bundle")
    assert not (run_dir / "bundle").exists() and not list(run_dir.glob(".bundle.tmp-*"))


# -- models and hooks ------------------------------------------------------------------------------
class NormDropMLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jax.nn.relu(self.norm(self.hidden(x)))))


@jn.experiment
class NormDrop(Tiny):
    def build_model(self, rng):
        return jn.split_model(NormDropMLP(rngs=nnx.Rngs(rng)))


@pytest.mark.slow
def test_batchnorm_and_dropout_export_in_inference_mode(run_dir):
    n = nitro(NormDrop(max_epochs=1), run_dir=run_dir)
    jn.train(n)
    bundle = jn.load_bundle(jn.export_model(n, run_dir / "bundle"))
    x, _ = make_data(5, seed=11)
    out = bundle(x)
    np.testing.assert_array_equal(out, bundle(x))  # no dropout
    np.testing.assert_allclose(out, jn.predict(n, {"x": x}), atol=1e-5, rtol=1e-5)
    # running statistics, not the batch's: one row alone gives the same output
    np.testing.assert_allclose(bundle(x[:1]), out[:1], atol=1e-5, rtol=1e-5)
    weights = safetensors.numpy.load_file(run_dir / "bundle" / "weights.safetensors")
    assert {"state/norm/mean", "state/norm/var"} <= set(weights)


@jn.experiment
class Wire(Tiny):
    scale: jn.Device[float] = 2.0

    def export_inputs(self):
        return {"img": jn.TensorSpec("uint8", (8,))}

    def export_preprocess(self, *, img):
        return {"x": img.astype(jnp.float32) / 255.0 * self.scale}

    def export_postprocess(self, logits):
        return {"probs": jax.nn.softmax(logits, -1), "label": logits.argmax(-1)}


@pytest.mark.slow
def test_preprocess_and_postprocess_hooks(run_dir):
    n = nitro(Wire(max_epochs=1), run_dir=run_dir)
    jn.train(n)
    jn.set_device(n, scale=3.0)
    (run_dir / "bundle").mkdir()
    (run_dir / "bundle" / "README.md").write_text("kept")
    path = jn.export_model(n, run_dir / "bundle", name="wire-v1")
    assert (path / "README.md").read_text() == "kept"  # files beside the bundle stay
    jn.set_device(n, scale=1.0)  # the bundle keeps the value it was exported with
    bundle = jn.load_bundle(path)
    assert bundle.name == "wire-v1" and list(bundle.outputs) == ["probs", "label"]
    assert bundle.inputs["img"].dtype == np.uint8
    img = np.random.default_rng(0).integers(0, 256, (5, 8)).astype(np.uint8)
    out = bundle(img=img)
    assert set(out) == {"probs", "label"} and out["label"].dtype == np.int32
    jn.set_device(n, scale=3.0)
    logits = jn.predict(n, {"x": img.astype(np.float32) / 255.0 * 3.0})
    np.testing.assert_allclose(out["probs"], jax.nn.softmax(logits, -1), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(out["label"], logits.argmax(-1))
    manifest = bundle.manifest
    assert manifest["provenance"]["device_values"]["scale"] == 3.0
    assert manifest["hooks"] == ["export_inputs", "export_preprocess", "export_postprocess"]
    with pytest.raises(BundleInputError, match="expected dtype uint8, got float32"):
        bundle(img=img.astype(np.float32))


def test_export_hooks_are_known_hooks():
    check_hooks(Wire)  # no misspelled-hook error for the three export hooks

    class Typo(Tiny):
        def export_preproces(self, **wire):
            return wire

    with pytest.raises(HookError, match="export_preproces looks like a misspelled hook"):
        check_hooks(Typo)


def test_tensor_spec():
    spec = jn.TensorSpec(np.float32, [28, 28])
    assert spec == jn.TensorSpec("float32", (28, 28)) and spec.shape == (28, 28)
    assert repr(jn.TensorSpec("bfloat16", ())) == "TensorSpec(dtype='bfloat16', shape=())"
    with pytest.raises(TypeError, match="per example"):
        jn.TensorSpec("float32", 8)
    with pytest.raises(TypeError, match="not a dtype"):
        jn.TensorSpec("floot32", (8,))


def test_export_code_never_uses_pickle(trained, monkeypatch):
    unsafe = re.compile(
        r"import (cloud)?pickle|pickle\.(loads?|Unpickler)|allow_pickle|np\.load\(|marshal\."
    )
    for path in sorted((SRC / "export").glob("*.py")):
        assert not unsafe.search(path.read_text()), path.name

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used while loading or running a bundle")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    jn.load_bundle(trained[1])(np.zeros((2, 8), np.float32))


@jn.experiment
class WrongWire(Tiny):
    def export_inputs(self):
        return {"pixels": jn.TensorSpec("float32", (8,))}


def test_export_inputs_must_feed_forward(run_dir):
    with pytest.raises(ExportError, match=r"declares inputs \['pixels'\], but forward reads"):
        jn.export_model(nitro(WrongWire(), run_dir=run_dir), run_dir / "bundle")


def test_git_provenance(tmp_path):
    from jaxnitro._src.export.provenance import git_state

    assert git_state(tmp_path) is None  # not inside a work tree
    repo = tmp_path / "repo"
    (repo / "runs" / "tiny").mkdir(parents=True)
    (repo / "train.py").write_text("print(1)\n")

    def git(*args):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=repo,
            check=True,
            capture_output=True,
        )

    git("init", "-q")
    git("add", "train.py")
    git("commit", "-qm", "first")
    state = git_state(repo / "runs" / "tiny")
    assert len(state["commit"]) == 40 and state["dirty"] is False  # untracked runs/ not dirty
    (repo / "train.py").write_text("print(2)\n")
    assert git_state(repo / "runs" / "tiny")["dirty"] is True


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["linen", "equinox", "plain"])
def test_every_model_adapter_exports(kind, run_dir):
    from test_adapters_driver import AnyNet  # the same nets the adapter tests train

    n = nitro(AnyNet(kind=kind, max_epochs=1), run_dir=run_dir)
    jn.train(n)
    bundle = jn.load_bundle(jn.export_model(n, run_dir / "bundle"))
    x, _ = make_data(5, seed=2)
    np.testing.assert_allclose(bundle(x), jn.predict(n, {"x": x}), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(bundle(x[:1]), bundle(x)[:1], atol=1e-5, rtol=1e-5)
