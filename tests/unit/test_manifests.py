"""The cluster manifests (`examples/k8s/`, `examples/kubeflow/`, `deploy/kserve/`,
`deploy/k8s/`): valid against the real schemas (the projects' CRDs at a release, Kubernetes'
own for core kinds; tests/fixtures/k8s-schemas/README.md), strict about unknown fields, and
true to the conventions KServe and jaxnitro serve rely on."""

from __future__ import annotations

import copy
import gzip
import json
from typing import Any

import jsonschema
import pytest
import yaml
from helpers.dockerfile import command
from helpers.paths import ROOT, TESTS

SCHEMAS = TESTS / "fixtures" / "k8s-schemas"
DIRS = ["examples/k8s", "examples/kubeflow", "deploy/kserve", "deploy/k8s"]
KUBERNETES = "1.33.0"  # the oldest release the manifests must apply to


def _docs() -> list[tuple[str, dict]]:
    out = []
    for d in DIRS:
        files = sorted((ROOT / d).glob("*.yaml"))
        assert files, f"no manifests in {d}"
        for f in files:
            for i, doc in enumerate(yaml.safe_load_all(f.read_text())):
                if doc:
                    out.append((f"{d}/{f.name}#{i}", doc))
    return out


DOCS = _docs()


def _strict(schema: Any) -> Any:
    """`schema` with unknown fields rejected wherever the API server would drop them."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            if not out.get("x-kubernetes-preserve-unknown-fields"):
                out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _crd_schemas() -> dict[tuple[str, str], dict]:
    found = {}
    for path in SCHEMAS.glob("*.json.gz"):
        schema = json.loads(gzip.decompress(path.read_bytes()))
        api, kind = schema["properties"]["apiVersion"]["enum"][0], schema["properties"]["kind"]
        found[(api, kind["enum"][0])] = _strict(schema)
    return found


CRDS = _crd_schemas()


def _validate(doc: dict) -> None:
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRDS:
        jsonschema.validate(doc, CRDS[key], cls=jsonschema.Draft7Validator)
        return
    import kubernetes_validate

    kubernetes_validate.validate(doc, KUBERNETES, strict=True)


@pytest.mark.slow
@pytest.mark.parametrize("where,doc", DOCS, ids=[w for w, _ in DOCS])
def test_each_manifest_is_valid_against_its_schema(where, doc):
    _validate(doc)


def test_the_kinds_the_issue_asks_for_are_there():
    kinds = {(w.split("#")[0].rsplit("/", 1)[0], d["kind"]) for w, d in DOCS}
    for want in [
        ("examples/k8s", "JobSet"),
        ("examples/k8s", "Job"),
        ("examples/k8s", "Service"),
        ("examples/k8s", "Role"),
        ("examples/kubeflow", "TrainJob"),
        ("deploy/kserve", "ClusterServingRuntime"),
        ("deploy/kserve", "InferenceService"),
        ("deploy/k8s", "Deployment"),
        ("deploy/k8s", "Service"),
        ("deploy/k8s", "HorizontalPodAutoscaler"),
        ("deploy/k8s", "ScaledObject"),
    ]:
        assert want in kinds, want


def test_the_validation_catches_what_the_api_server_refuses():
    runtime = next(d for _, d in DOCS if d["kind"] == "ClusterServingRuntime")
    bad = copy.deepcopy(runtime)
    bad["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/v2/health/ready"
    with pytest.raises(jsonschema.ValidationError, match="paht"):
        _validate(bad)
    bad = copy.deepcopy(runtime)
    bad["spec"]["supportedModelFormats"][0]["autoSelect"] = "yes"
    with pytest.raises(jsonschema.ValidationError):
        _validate(bad)
    import kubernetes_validate

    job = copy.deepcopy(next(d for _, d in DOCS if d["kind"] == "Job"))
    job["spec"]["completionMode"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(job)
    deployment = copy.deepcopy(next(d for _, d in DOCS if d["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(deployment)


# -- conventions ---------------------------------------------------------------------------
def _one(kind: str, where: str) -> dict:
    found = [d for w, d in DOCS if d["kind"] == kind and w.startswith(where)]
    assert len(found) == 1, (kind, where, len(found))
    return found[0]


def _probes_and_ports(container: dict, ports: dict[str, int]) -> None:
    def port(probe: str) -> int:
        got = container[probe]["httpGet"]["port"]
        return ports.get(got, got) if isinstance(got, str) else got

    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert container["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    startup = container["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 300  # warm-up compiles
    assert port("readinessProbe") == port("livenessProbe") == port("startupProbe") == 8080


def test_the_kserve_runtime_follows_kserves_conventions():
    runtime = _one("ClusterServingRuntime", "deploy/kserve")
    spec = runtime["spec"]
    assert [f["name"] for f in spec["supportedModelFormats"]] == ["jaxnitro"]
    assert spec["protocolVersions"] == ["v2", "grpc-v2"]
    assert spec["annotations"] == {
        "prometheus.kserve.io/port": "8080",
        "prometheus.kserve.io/path": "/metrics",
    }
    [container] = spec["containers"]
    assert container["name"] == "kserve-container"
    assert container["securityContext"]["runAsUser"] == 1000
    _probes_and_ports(container, {})
    # Its args follow the image's ENTRYPOINT and agree with it.
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    assert args == {"model-repository": "/mnt/models", "http-port": "8080", "grpc-port": "9000"}
    image = command()
    for flag, value in args.items():
        assert image[image.index(f"--{flag}") + 1] == value


def test_the_inference_services_plain_keda_and_grpc():
    services = {w.split("#")[0]: d for w, d in DOCS if d["kind"] == "InferenceService"}
    for where, isvc in services.items():
        model = isvc["spec"]["predictor"]["model"]
        assert model["modelFormat"]["name"] == "jaxnitro", where
        assert model["storageUri"], where
    keda = [
        d
        for d in services.values()
        if d["metadata"].get("annotations", {}).get("serving.kserve.io/autoscalerClass") == "keda"
    ]
    assert len(keda) == 1
    [metric] = keda[0]["spec"]["predictor"]["autoScaling"]["metrics"]
    query = metric["external"]["metric"]["query"]
    assert "delta(nv_inference_queue_duration_us" in query
    assert "(1 + delta(nv_inference_request_success" in query
    grpc = [
        d
        for d in services.values()
        if d["spec"]["predictor"]["model"].get("protocolVersion") == "grpc-v2"
    ]
    assert len(grpc) == 1
    assert grpc[0]["spec"]["predictor"]["model"]["ports"] == [
        {"name": "h2c", "containerPort": 9000, "protocol": "TCP"}
    ]


def test_the_plain_kubernetes_deployment_matches_the_image():
    deployment = _one("Deployment", "deploy/k8s")
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8080, "grpc": 9000}
    _probes_and_ports(container, ports)
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/mnt/models", "/var/cache/jaxnitro"} <= mounts
    assert pod["securityContext"]["runAsUser"] == 1000
    service = _one("Service", "deploy/k8s")
    assert {p["port"] for p in service["spec"]["ports"]} == {8080, 9000}
    scaled = _one("ScaledObject", "deploy/k8s")
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert "nv_inference_queue_duration_us" in scaled["spec"]["triggers"][0]["metadata"]["query"]
    hpa = _one("HorizontalPodAutoscaler", "deploy/k8s")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]


def test_training_manifests_mount_the_run_dir_and_give_jax_k8s_its_rbac():
    for where in ("examples/k8s/jobset.yaml", "examples/k8s/indexed-job.yaml"):
        docs = {d["kind"]: d for w, d in DOCS if w.startswith(where)}
        granted = {
            (r, v)
            for rule in docs["Role"]["rules"]
            for r in rule["resources"]
            for v in rule["verbs"]
        }
        assert {("pods", "get"), ("jobs", "get"), ("pods", "list")} <= granted, where
        binding = docs["RoleBinding"]
        assert binding["roleRef"]["name"] == docs["Role"]["metadata"]["name"]
        sa = docs["ServiceAccount"]["metadata"]["name"]
        assert binding["subjects"][0]["name"] == sa
        text = json.dumps(docs)
        assert f'"serviceAccountName": "{sa}"' in text and '"mountPath": "/runs"' in text
    job = _one("Job", "examples/k8s")
    assert job["spec"]["completionMode"] == "Indexed"
    service = _one("Service", "examples/k8s")
    assert service["spec"]["clusterIP"] == "None"  # headless
    assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]
    trainjob = _one("TrainJob", "examples/kubeflow")
    assert trainjob["spec"]["runtimeRef"]["name"] == "jax-distributed"
    assert '"mountPath": "/runs"' in json.dumps(trainjob)
