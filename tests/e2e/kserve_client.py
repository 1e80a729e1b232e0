"""KServe's own Python clients against a server: `python kserve_client.py REST_URL GRPC_ADDR
MODEL` infers the JSON rows on stdin over REST and gRPC V2 and prints both outputs as JSON.

A process of its own: KServe's generated protobuf module and tritonclient's (or jaxnitro's)
define the same `inference.*` messages, which one process's protobuf pool refuses twice.
"""

import asyncio
import json
import sys

import kserve
import numpy as np


async def main(rest: str, grpc: str, model: str, rows: list) -> dict:
    x = np.asarray(rows, np.float32)
    request = kserve.InferRequest(
        model_name=model,
        infer_inputs=[kserve.InferInput("x", list(x.shape), "FP32", data=x.ravel().tolist())],
    )
    rest_client = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2"))
    grpc_client = kserve.InferenceGRPCClient(grpc)
    try:
        ready = [await rest_client.is_server_ready(rest), await grpc_client.is_server_ready()]
        by_rest = await rest_client.infer(rest, request, model_name=model)
        by_grpc = await grpc_client.infer(request)
    finally:
        await rest_client.close()
        await grpc_client.close()
    return {
        "ready": ready,
        "rest": by_rest.outputs[0].as_numpy().tolist(),
        "grpc": by_grpc.outputs[0].as_numpy().tolist(),
    }


if __name__ == "__main__":
    rest, grpc, model = sys.argv[1:4]
    print(json.dumps(asyncio.run(main(rest, grpc, model, json.load(sys.stdin)))))
