#!/usr/bin/env bash
# Regenerate grpc_service_pb2.py (+ .pyi type stubs) and grpc_service_pb2_grpc.py from
# grpc_service.proto.
#
#   src/jaxnitro/_src/serve/proto/generate.sh            # uses python3 from PATH (or $PYTHON)
#
# Needs grpcio-tools. Generate with the OLDEST grpcio-tools the `serve` extra allows (1.76,
# protobuf gencode 6.31): generated code refuses a protobuf runtime older than the one it
# was generated with, and a grpcio older than the grpcio-tools.
#
# After protoc, each file gets a header that keeps ruff (lint and format) and mypy out of
# generated code, and grpc_service_pb2.py one edit: the messages live in the protocol's
# package `inference`, which tritonclient.grpc also registers, and two different files with
# the same symbols in protobuf's default descriptor pool fail to import ("duplicate symbol
# 'inference.ServerLiveRequest'"), so the module builds its messages in a private pool. The
# wire format (field numbers, /inference.GRPCInferenceService/<Method> paths) is unchanged.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
src="$(cd "$here/../../.." && pwd)"          # the directory that holds jaxnitro/
python="${PYTHON:-python3}"

cd "$src"
"$python" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
    jaxnitro/_src/serve/proto/grpc_service.proto

pb2="$here/grpc_service_pb2.py"
grpc="$here/grpc_service_pb2_grpc.py"
"$python" - "$pb2" "$grpc" "${pb2}i" <<'PY'
import sys
pb2, grpc, stubs = sys.argv[1:]
header = "# ruff: noqa\n# mypy: ignore-errors\n# fmt: off\n"
text = open(pb2).read()
old = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
assert old in text, "protoc output changed: update generate.sh"
text = text.replace(
    old,
    "# jaxnitro: a private pool, so that tritonclient.grpc's `inference` messages can be\n"
    "# imported in the same process (see generate.sh).\n"
    "_POOL = _descriptor_pool.DescriptorPool()\n"
    "DESCRIPTOR = _POOL.AddSerializedFile(",
)
open(pb2, "w").write(header + text)
for path in (grpc, stubs):
    text = open(path).read()
    open(path, "w").write(header + text)
PY
echo "wrote $pb2, ${pb2}i and $grpc"
