"""`jaxnitro serve` for operators: Triton's model configuration, statistics and model
repository extensions (tritonclient's own calls over HTTP and gRPC), a model repository
with its control modes and version policies, version swaps that fail no request, and
metrics through prometheus_client.

The quick tests run the app in-process on a fake bundle; the slow ones export two real
versions of a small model and start ``python -m jaxnitro._src.serve --model-repository`` in a
subprocess on free ports.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from conftest import Tiny, nitro
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient
from test_serve import FakeBundle, Server

import jaxnitro as jn
from jaxnitro._src.core.errors import ConfigError
from jaxnitro._src.serve import build_app
from jaxnitro._src.serve.repository import parse_policy, select


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """``{(name, sorted labels): value}`` read by prometheus_client's own parser."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# -- in-process: config, statistics, metrics -------------------------------------------------------
FAKE_INPUT = {
    "inputs": [
        {"name": "a", "datatype": "FP32", "shape": [2, 3], "data": [1, 2, 3, 4, 5, 6]},
        {"name": "b", "datatype": "INT32", "shape": [2], "data": [1, 2]},
    ]
}


def test_config_statistics_and_metrics_count_what_was_sent():
    with TestClient(build_app([FakeBundle()], max_batch_size=4, max_batch_delay_ms=2)) as c:
        config = c.get("/v2/models/fake/config").json()
        assert config["name"] == "fake" and config["platform"] == "jax"
        assert config["max_batch_size"] == 4
        assert config["input"] == [
            {"name": "a", "data_type": "TYPE_FP32", "dims": [3]},
            {"name": "b", "data_type": "TYPE_INT32", "dims": []},
        ]
        assert config["output"][0] == {"name": "total", "data_type": "TYPE_FP32", "dims": []}
        assert config["dynamic_batching"] == {
            "preferred_batch_size": [1, 2, 4],
            "max_queue_delay_microseconds": 2000,
        }
        assert config["version_policy"] == {"latest": {"num_versions": 1}}
        assert c.get("/v2/models/fake/versions/1/config").status_code == 200
        assert c.get("/v2/models/fake/versions/9/config").status_code == 404
        assert c.get("/v2/models/nope/config").status_code == 404

        for _ in range(5):
            assert (
                c.post("/v2/models/fake/infer", content=json.dumps(FAKE_INPUT)).status_code == 200
            )
        bad = {"inputs": FAKE_INPUT["inputs"][:1]}
        for _ in range(2):
            assert c.post("/v2/models/fake/infer", content=json.dumps(bad)).status_code == 400

        (stats,) = c.get("/v2/models/fake/stats").json()["model_stats"]
        assert c.get("/v2/models/stats").json()["model_stats"] == [stats]
        assert c.get("/v2/models/fake/versions/1/stats").json()["model_stats"] == [stats]
        assert stats["name"] == "fake" and stats["version"] == "1"
        assert stats["inference_count"] == 10  # rows
        inference = stats["inference_stats"]
        assert inference["success"]["count"] == 5 and inference["fail"]["count"] == 2
        assert inference["queue"]["count"] == inference["compute_infer"]["count"] == 5
        assert stats["execution_count"] == sum(
            b["compute_infer"]["count"] for b in stats["batch_stats"]
        )
        assert {b["batch_size"] for b in stats["batch_stats"]} <= {2, 4}
        assert stats["last_inference"] > 1.6e12  # ms since the epoch
        assert all(v["ns"] > 0 for k, v in inference.items() if v["count"])

        samples = _samples(c.get("/metrics").text)
        labels = (("model", "fake"), ("version", "1"))
        assert samples[("nv_inference_request_success", labels)] == 5
        assert samples[("nv_inference_request_failure", labels)] == 2
        assert samples[("nv_inference_count", labels)] == 10
        assert samples[("nv_inference_exec_count", labels)] == stats["execution_count"]
        for name in ("request", "queue", "compute_infer"):
            assert samples[(f"nv_inference_{name}_duration_us", labels)] > 0
        ok = (("code", "200"), ("endpoint", "infer"), ("model", "fake"), ("protocol", "http"))
        assert samples[("jaxnitro_requests_total", ok)] == 5

        index = c.post("/v2/repository/index").json()
        assert index == [{"name": "fake", "version": "1", "state": "READY"}]
        r = c.post("/v2/repository/models/fake/unload", content="{}")
        assert r.status_code == 400 and "--model-repository" in r.json()["error"]


def test_two_servers_in_one_process_keep_their_own_metrics():
    with TestClient(build_app([FakeBundle()])) as one, TestClient(build_app([FakeBundle()])) as two:
        for _ in range(3):
            one.post("/v2/models/fake/infer", content=json.dumps(FAKE_INPUT))
        labels = (("model", "fake"), ("version", "1"))
        assert _samples(one.get("/metrics").text)[("nv_inference_request_success", labels)] == 3
        assert _samples(two.get("/metrics").text)[("nv_inference_request_success", labels)] == 0


def test_version_policies_parse_and_select():
    assert parse_policy("latest:2", where="x") == {"latest": {"num_versions": 2}}
    assert parse_policy("all", where="x") == {"all": {}}
    assert parse_policy("specific:3,1", where="x") == {"specific": {"versions": [1, 3]}}
    assert parse_policy({"latest": {}}, where="x") == {"latest": {"num_versions": 1}}
    for bad in ("latest:0", "newest", "specific:a", {"all": {}, "latest": {}}, {"latest": 3}):
        with pytest.raises(ConfigError, match=r"version policy .* \{\"latest\""):
            parse_policy(bad, where="policy.json")
    assert select([1, 2, 3], {"latest": {"num_versions": 2}}) == [2, 3]
    assert select([3, 1], {"all": {}}) == [1, 3]
    assert select([1, 2, 3], {"specific": {"versions": [1, 5]}}) == [1]


# -- a real repository, in a subprocess ------------------------------------------------------------
@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Two exported versions of Tiny with different weights, and their outputs on X."""
    root = tmp_path_factory.mktemp("versions")
    out = {}
    for version, seed in ((1, 0), (2, 1)):
        n = nitro(Tiny(), seed=seed, run_dir=root / f"run{version}")
        with warnings.catch_warnings():  # untrained on purpose: the seeds tell them apart
            warnings.simplefilter("ignore", UserWarning)
            jn.export_model(n, root / str(version), name="tiny", platforms=("cpu",))
        bundle = jn.load_bundle(root / str(version), max_batch_size=4)
        out[version] = (root / str(version), np.asarray(bundle(x=X)))
    assert not np.allclose(out[1][1], out[2][1], atol=1e-3)
    return out


X = np.random.default_rng(0).normal(size=(2, 8)).astype(np.float32)


def _place(src: Path, dest: Path) -> None:
    """Copy a bundle into the repository at once: a poll never sees half a version."""
    staging = dest.parent / f".staging-{dest.name}"
    shutil.copytree(src, staging)
    os.rename(staging, dest)


def _remove(path: Path) -> None:
    gone = path.parent / f".gone-{path.name}"
    os.rename(path, gone)
    shutil.rmtree(gone)


class RepoServer(Server):
    """`Server`, on a model repository instead of bundle directories."""

    def __init__(self, repo: Path, *args: str):
        super().__init__([], "--model-repository", str(repo), "--max-batch-size", "4", *args)

    def index(self) -> list[dict]:
        return json.loads(self.request("POST", "/v2/repository/index")[2])

    def wait_index(self, predicate, what: str, timeout: float = 120) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            index = self.index()
            if predicate({(e["name"], e["version"]): e for e in index}):
                return index
            assert time.monotonic() < deadline, f"{what}: {index}\n{self.output[-3000:]}"
            assert self.proc.poll() is None, self.output
            time.sleep(0.1)


def _infer(conn: http.client.HTTPConnection, path="/v2/models/tiny/infer", pause: float = 0):
    """One JSON request; with ``pause``, its body follows its headers that much later, so
    the server holds the version it picked while the body is on its way."""
    body = json.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 8], "data": X.ravel().tolist()}]}
    ).encode()
    conn.putrequest("POST", path)
    conn.putheader("Content-Length", str(len(body)))
    conn.endheaders()
    if pause:
        time.sleep(pause)  # the client's behaviour under test, not a wait for the server
    conn.send(body)
    r = conn.getresponse()
    doc = json.loads(r.read())
    if r.status != 200:
        return r.status, doc, None
    out = doc["outputs"][0]
    return r.status, doc, np.asarray(out["data"], np.float32).reshape(out["shape"])


@pytest.mark.slow
def test_tritonclient_config_statistics_repository_load_unload(versions, tmp_path):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    repo = tmp_path / "repo"
    for version in (1, 2):
        _place(versions[version][0], repo / "tiny" / str(version))
    (repo / "tiny" / "policy.json").write_text(json.dumps({"all": {}}))
    _place(versions[1][0], repo / "other" / "1")
    s = RepoServer(repo, "--model-control-mode", "explicit", "--load-model", "tiny")
    try:
        s._wait_for(r"(ready:)")  # the start-up lines: endpoints, models, versions, states
        for line in ("model repository", "control mode explicit", "loading: tiny", "gRPC:"):
            assert line in s.output, s.output
        assert "serving tiny version 2" in s.output and "not serving other: not loaded" in s.output
        h = httpclient.InferenceServerClient(s.rest)
        g = grpcclient.InferenceServerClient(s.grpc)
        for client in (h, g):
            assert client.is_model_ready("tiny", "1") and client.is_model_ready("tiny", "2")
            assert not client.is_model_ready("other")
        config = h.get_model_config("tiny")
        assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [8]}]
        assert config["max_batch_size"] == 4 and config["version_policy"] == {"all": {}}
        assert config["dynamic_batching"]["preferred_batch_size"] == [1, 2, 4]
        gconfig = g.get_model_config("tiny", "2", as_json=True)["config"]
        assert gconfig["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": ["8"]}]
        assert gconfig["max_batch_size"] == 4 and "all" in gconfig["version_policy"]

        # requests: 3 on version 1 over HTTP, 2 on the newest over gRPC, 1 failure each way
        inp = httpclient.InferInput("x", [2, 8], "FP32")
        inp.set_data_from_numpy(X)
        for _ in range(3):
            got = h.infer("tiny", [inp], model_version="1").as_numpy("output")
            np.testing.assert_allclose(got, versions[1][1], rtol=1e-5, atol=1e-5)
        ginp = grpcclient.InferInput("x", [2, 8], "FP32")
        ginp.set_data_from_numpy(X)
        for _ in range(2):
            got = g.infer("tiny", [ginp]).as_numpy("output")
            np.testing.assert_allclose(got, versions[2][1], rtol=1e-5, atol=1e-5)
        wrong = httpclient.InferInput("x", [2, 8], "FP64")
        wrong.set_data_from_numpy(X.astype(np.float64))
        with pytest.raises(InferenceServerException, match="FP64"):
            h.infer("tiny", [wrong], model_version="1")
        gwrong = grpcclient.InferInput("x", [2, 8], "FP64")
        gwrong.set_data_from_numpy(X.astype(np.float64))
        with pytest.raises(InferenceServerException, match="FP64"):
            g.infer("tiny", [gwrong], model_version="2")

        stats = {e["version"]: e for e in h.get_inference_statistics("tiny")["model_stats"]}
        assert stats["1"]["inference_stats"]["success"]["count"] == 3
        assert stats["1"]["inference_stats"]["fail"]["count"] == 1
        assert stats["1"]["inference_count"] == 6
        assert stats["2"]["inference_stats"]["success"]["count"] == 2
        gstats = g.get_inference_statistics("tiny", "2", as_json=True)["model_stats"]
        assert len(gstats) == 1 and gstats[0]["inference_stats"]["fail"]["count"] == "1"
        assert gstats[0]["inference_count"] == "4"

        # /metrics on the REST port and on --metrics-port (0 here: the line names it)
        metrics_url = re.findall(r"metrics: http://([\d.]+:\d+)/metrics", s.output)
        assert len(metrics_url) == 2 and metrics_url[0] == s.rest, s.output
        with urllib.request.urlopen(f"http://{metrics_url[1]}/metrics", timeout=30) as r:
            own_port = _samples(r.read().decode())
        samples = _samples(s.request("GET", "/metrics")[2].decode())
        success = ("nv_inference_request_success", (("model", "tiny"), ("version", "1")))
        assert own_port[success] == samples[success] == 3

        index = {(e["name"], e.get("version", "")): e for e in h.get_model_repository_index()}
        assert index[("tiny", "1")]["state"] == index[("tiny", "2")]["state"] == "READY"
        assert index[("other", "")]["state"] == "UNAVAILABLE"
        gindex = g.get_model_repository_index(as_json=True)["models"]
        assert {(e["name"], e.get("state")) for e in gindex} >= {("tiny", "READY")}

        g.load_model("other")
        assert h.is_model_ready("other") and g.is_model_ready("other", "1")
        loaded = _samples(s.request("GET", "/metrics")[2].decode())
        assert loaded[("nv_inference_count", (("model", "other"), ("version", "1")))] == 0
        h.unload_model("tiny")
        assert not h.is_model_ready("tiny") and not g.is_model_ready("tiny", "2")
        with pytest.raises(InferenceServerException, match="unknown model 'tiny'"):
            h.infer("tiny", [inp])
        h.load_model("tiny")
        assert h.is_model_ready("tiny", "1") and h.is_model_ready("tiny", "2")
        with pytest.raises(InferenceServerException, match="no model 'nope'.*'other', 'tiny'"):
            h.load_model("nope")
        with pytest.raises(InferenceServerException, match="no version '7'"):
            g.get_model_config("tiny", "7")
        h.close()
        g.close()
    finally:
        s.stop()
    assert s.proc.returncode == 0, s.output


@pytest.mark.slow
def test_swap_under_load_fails_no_request_and_a_broken_version_serves_on(versions, tmp_path):
    """32 clients without a version while version 2 is added (poll mode; the default policy,
    latest 1, then drains and unloads version 1) and version 1's directory removed: every
    request succeeds, and each answer is exactly one version's; a quarter of the clients
    send their bodies 0.2 s after their headers, so requests hold version 1 while it goes.
    Then a broken version 3 is dropped in: the index says why, and version 2 keeps serving."""
    repo = tmp_path / "repo"
    _place(versions[1][0], repo / "tiny" / "1")
    s = RepoServer(repo, "--model-control-mode", "poll", "--repository-poll-secs", "0.2")
    out1, out2 = versions[1][1], versions[2][1]
    answers: dict[str, int] = {"1": 0, "2": 0}
    failures: list = []
    stop = threading.Event()
    lock = threading.Lock()

    def client(pause: float) -> None:
        conn = http.client.HTTPConnection(s.rest, timeout=60)
        while not stop.is_set():
            status, doc, got = _infer(conn, pause=pause)
            if status != 200:
                failures.append((status, doc))
                continue
            one, two = (np.allclose(got, o, rtol=1e-5, atol=1e-5) for o in (out1, out2))
            version = doc["model_version"]
            if one == two or (one and version != "1") or (two and version != "2"):
                failures.append(("mismatch", version, got))
            with lock:
                answers[version] = answers.get(version, 0) + 1
        conn.close()

    def swap(futures) -> None:
        deadline = time.monotonic() + 60
        while answers["1"] < 64:
            assert time.monotonic() < deadline and not failures, failures[:3]
            time.sleep(0.05)
        _place(versions[2][0], repo / "tiny" / "2")
        s.wait_index(
            lambda i: (
                i.get(("tiny", "2"), {}).get("state") == "READY"
                and i.get(("tiny", "1"), {}).get("state") == "UNAVAILABLE"
            ),
            "v2 in, v1 drained and unloaded",
        )
        _remove(repo / "tiny" / "1")
        s.wait_index(lambda i: ("tiny", "1") not in i, "v1 gone from the index")
        seen = answers["2"]
        while answers["2"] < seen + 64:
            assert time.monotonic() < deadline + 120 and not failures, failures[:3]
            time.sleep(0.05)
        stop.set()
        for f in futures:
            f.result()

    try:
        s.wait_index(lambda i: i.get(("tiny", "1"), {}).get("state") == "READY", "v1 ready")
        with ThreadPoolExecutor(32) as pool:
            # a quarter send their bodies late: they hold version 1 while it is swapped out
            futures = [pool.submit(client, 0.2 if i % 4 == 0 else 0.0) for i in range(32)]
            try:
                swap(futures)
            finally:
                stop.set()  # the clients stop, also when an assertion fails
        assert not failures, failures[:5]
        assert answers["1"] >= 64 and answers["2"] >= 64, answers

        # a broken version dropped in while serving: reported, and nothing stops
        broken = repo / "tiny" / ".staging-3"
        broken.mkdir()
        (broken / "manifest.json").write_text("{not json")
        os.rename(broken, repo / "tiny" / "3")
        index = s.wait_index(
            lambda i: i.get(("tiny", "3"), {}).get("state") == "UNAVAILABLE", "v3 reported"
        )
        entry = next(e for e in index if e["version"] == "3")
        assert entry["reason"], entry
        conn = http.client.HTTPConnection(s.rest, timeout=60)
        for _ in range(5):
            status, doc, got = _infer(conn)
            assert status == 200 and doc["model_version"] == "2", doc
            np.testing.assert_allclose(got, out2, rtol=1e-5, atol=1e-5)
        status, doc, _ = _infer(conn, "/v2/models/tiny/versions/1/infer")
        assert status == 404 and "no version '1'" in doc["error"], doc
        conn.close()
        assert "model tiny version 3: failed to load" in s.output
    finally:
        stop.set()
        s.stop()
    assert s.proc.returncode == 0, s.output


@pytest.mark.slow
def test_default_grpc_port_taken_names_the_port_and_the_flags(versions, tmp_path):
    repo = tmp_path / "repo"
    _place(versions[1][0], repo / "tiny" / "1")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "jaxnitro._src.serve", "--model-repository", str(repo)]
        cmd += ["--port", "0", "--metrics-port", "0", "--grpc-port", str(port)]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"port {port}" in r.stderr and "--grpc-port" in r.stderr and "--no-grpc" in r.stderr


@pytest.mark.slow
def test_none_mode_loads_what_the_policy_serves_and_refuses_load_calls(versions, tmp_path):
    repo = tmp_path / "repo"
    for version in (1, 2):
        _place(versions[version][0], repo / "tiny" / str(version))
    (repo / "junk").mkdir()  # a model without versions: listed, not loaded
    (repo / "tiny" / "notes").mkdir()  # not a version: skipped
    app = build_app(model_repository=repo, version_policy="latest:2", max_batch_size=2)
    with TestClient(app) as c:
        assert c.get("/v2/health/ready").status_code == 200
        index = c.post("/v2/repository/index", content=json.dumps({"ready": True})).json()
        assert [(e["name"], e["version"]) for e in index] == [("tiny", "1"), ("tiny", "2")]
        assert c.post("/v2/repository/index").json()[0] == {
            "name": "junk",
            "version": "",
            "state": "UNAVAILABLE",
            "reason": "not loaded",
        }
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 8]}]}
        body["inputs"][0]["data"] = X.ravel().tolist()
        for path, version in (("/v2/models/tiny", "2"), ("/v2/models/tiny/versions/1", "1")):
            doc = c.post(path + "/infer", content=json.dumps(body)).json()
            assert doc["model_version"] == version
            got = np.asarray(doc["outputs"][0]["data"], np.float32).reshape(2, 4)
            np.testing.assert_allclose(got, versions[int(version)][1], rtol=1e-5, atol=1e-5)
        config = c.get("/v2/models/tiny/versions/1/config").json()
        assert config["version_policy"] == {"latest": {"num_versions": 2}}
        assert config["dynamic_batching"]["preferred_batch_size"] == [1, 2]
        r = c.post("/v2/repository/models/tiny/unload")
        assert r.status_code == 400 and "--model-control-mode explicit" in r.json()["error"]
    with pytest.raises(ConfigError, match="not both"):
        build_app([versions[1][0]], model_repository=repo)
    with pytest.raises(ConfigError, match=r"--load-model 'tni': no such model .*'tiny'"):
        build_app(model_repository=repo, model_control_mode="explicit", load_model=["tni"])
