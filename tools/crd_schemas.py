"""Turn CustomResourceDefinitions into the JSON schemas tests/unit/test_manifests.py validates the
manifests against: `python tools/crd_schemas.py SOURCE CRD.yaml [...]`.

For each served version of each CRD it writes `tests/fixtures/k8s-schemas/<group>_<kind>_
<version>.json.gz`: the CRD's `openAPIV3Schema` without its descriptions (most of the bytes),
with `$comment` naming SOURCE (repository, tag, commit, path), and `apiVersion`/`kind`
pinned. Nothing else is changed; the test adds Kubernetes' strict field validation (an
unknown field is an error) when it loads the schema.

The CRDs come from the projects' release tags (see tests/fixtures/k8s-schemas/README.md).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

import yaml

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "k8s-schemas"


def _strip(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def convert(crd: dict, source: str) -> dict[str, dict]:
    """{file name: schema} for every served version of `crd`."""
    spec, out = crd["spec"], {}
    group, kind = spec["group"], spec["names"]["kind"]
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        schema = _strip(version["schema"]["openAPIV3Schema"])
        props = schema.setdefault("properties", {})
        props["apiVersion"] = {"type": "string", "enum": [f"{group}/{version['name']}"]}
        props["kind"] = {"type": "string", "enum": [kind]}
        schema["$comment"] = f"{kind} {group}/{version['name']} from {source}"
        out[f"{group}_{kind}_{version['name']}.json"] = schema
    return out


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    source, paths = argv[0], argv[1:]
    OUT.mkdir(parents=True, exist_ok=True)
    for path in paths:
        for doc in yaml.safe_load_all(Path(path).read_text()):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            for name, schema in convert(doc, f"{source} {Path(path).name}").items():
                text = json.dumps(schema, sort_keys=True, separators=(",", ":")) + "\n"
                # gzip (mtime 0: the same bytes each time): InferenceService's is 640 kB
                (OUT / f"{name}.gz").write_bytes(gzip.compress(text.encode(), mtime=0))
                print(f"wrote {OUT / name}.gz")


if __name__ == "__main__":
    main(sys.argv[1:])
