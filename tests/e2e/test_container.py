"""The serving image (`Dockerfile`): its conventions (KServe's model repository, ports and
a non-root user), and its exact command, ENTRYPOINT + CMD, run as a real process on a
/mnt/models-style repository, answering KServe's own Python clients (REST and gRPC V2) and
tritonclient. Building the image needs a registry these machines cannot reach: everything
up to it is tested here."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import urllib.request
import warnings

import numpy as np
import pytest
from conftest import Tiny, nitro
from helpers.dockerfile import command, instructions
from helpers.paths import SRC, TESTS
from helpers.procs import until

import jaxnitro as jn
from jaxnitro._src.dist.launcher import free_port

KSERVE_CLIENT = str(TESTS / "e2e" / "kserve_client.py")


def _flag(cmd: list[str], name: str) -> str:
    """The value the last `name` in `cmd` gives (the one the server takes)."""
    at = max(i for i, x in enumerate(cmd) if x == name)
    return cmd[at + 1]


def test_the_image_follows_kserves_conventions():
    cmd = command()
    assert cmd[:2] == ["jaxnitro", "serve"]
    assert _flag(cmd, "--model-repository") == "/mnt/models"
    assert _flag(cmd, "--http-port") == "8080" and _flag(cmd, "--grpc-port") == "9000"
    assert _flag(cmd, "--host") == "0.0.0.0"  # reachable from outside the pod
    steps = instructions()
    assert ("USER", "1000") in steps
    assert any(w == "EXPOSE" and set(a.split()) == {"8080", "9000"} for w, a in steps)
    env = " ".join(a for w, a in steps if w == "ENV")
    assert "JAXNITRO_COMPILATION_CACHE=/var/cache/jaxnitro/" in env
    text = "\n".join(f"{w} {a}" for w, a in instructions(None))
    assert "ACCELERATOR" in text and "cuda12" in text  # the CUDA build argument


def test_later_flags_override_the_images_and_help_shows_both_port_names(tmp_path):
    from click.testing import CliRunner

    from jaxnitro._src.cli import cli

    got = CliRunner().invoke(cli, ["serve", "--help"])
    assert got.exit_code == 0 and "--port, --http-port" in got.output
    serve = cli.commands["serve"]
    later = ["--http-port", "8081", "--model-repository", str(tmp_path)]  # a pod's `args`
    ctx = serve.make_context("serve", [*command()[2:], *later])
    assert ctx.params["port"] == 8081 and ctx.params["grpc_port"] == 9000
    assert ctx.params["model_repository"] == tmp_path


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    """A /mnt/models-style repository, <model>/<version>/: what KServe's storage initializer
    downloads, and the expected output on X."""
    root = tmp_path_factory.mktemp("mnt")
    n = nitro(Tiny(), run_dir=root / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # untrained: fine for serving
        jn.export_model(n, root / "models" / "tiny" / "1", name="tiny", platforms=("cpu",))
    expected = np.asarray(jn.load_bundle(root / "models" / "tiny" / "1")(x=X))
    return root / "models", expected


X = np.random.default_rng(0).normal(size=(2, 8)).astype(np.float32)


@pytest.mark.slow
def test_the_containers_command_serves_kserve_and_triton_clients(repository, tmp_path):
    import tritonclient.grpc as tgrpc
    import tritonclient.http as thttp

    if importlib.util.find_spec("kserve") is None:  # (not imported here: see kserve_client.py)
        pytest.skip("KServe's Python SDK is not installed: pip install kserve")
    models, expected = repository
    http_port, grpc_port = free_port(), free_port()
    cache = tmp_path / "cache"  # the mounted /var/cache/jaxnitro
    # The image's command, then what a pod's `args` would add: later flags win.
    cmd = command() + ["--model-repository", str(models)]
    cmd += ["--http-port", str(http_port), "--grpc-port", str(grpc_port)]
    bin_dir = os.path.dirname(sys.executable)
    assert shutil.which(cmd[0], path=bin_dir), f"no {cmd[0]} console script in {bin_dir}"
    env = {
        **os.environ,
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
        "PYTHONPATH": str(SRC),
        "JAX_PLATFORMS": "cpu",
        "JAXNITRO_COMPILATION_CACHE": str(cache / "xla"),  # as the image's ENV, mounted here
    }
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    reader = threading.Thread(
        target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True
    )
    reader.start()
    rest = f"http://127.0.0.1:{http_port}"

    def ready() -> bool:
        assert proc.poll() is None, "".join(lines)
        try:
            with urllib.request.urlopen(f"{rest}/v2/health/ready", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        until(ready, 180)

        got = subprocess.run(
            [sys.executable, KSERVE_CLIENT, rest, f"127.0.0.1:{grpc_port}", "tiny"],
            input=json.dumps(X.tolist()),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert got.returncode == 0, got.stderr[-3000:]
        answers = json.loads(got.stdout)
        assert answers["ready"] == [True, True]
        for way in ("rest", "grpc"):
            np.testing.assert_allclose(np.asarray(answers[way]), expected, rtol=1e-5)

        h = thttp.InferenceServerClient(f"127.0.0.1:{http_port}")
        g = tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        for client, mod in ((h, thttp), (g, tgrpc)):
            inp = mod.InferInput("x", [2, 8], "FP32")
            inp.set_data_from_numpy(X)
            got = client.infer("tiny", [inp]).as_numpy("output")
            np.testing.assert_allclose(got, expected, rtol=1e-5)
        # The warm-up's compiled programs persisted where the image mounts its cache.
        assert (cache / "xla").is_dir() and any((cache / "xla").iterdir()), "no cache entries"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0, "".join(lines)[-3000:]
