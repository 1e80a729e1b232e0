"""Serving benchmark: one bundle behind `jaxnitro serve` against a hand-written server.

    python benchmarks/serve.py [--quick] [--seconds 3] [--repeats 3] [--out FILE.json]

The same exported bundle (an MLP 784→128→10, trained one epoch on random data) is served by

  * hand: the minimal server a careful user writes, Starlette + uvicorn with one POST route
    that reads ``{"x": [[...]]}``, calls ``jax.jit`` of the bundle's program (the same
    weights and computation) on the event loop, and answers ``{"y": [[...]]}``; no
    validation, no batching, no padding (only batch 1 is compiled, and only batch 1 is sent).
    **The reference for every "× hand" ratio.**
  * jaxnitro serve, the KServe V2 JSON request a plain client sends;
  * jaxnitro serve, the binary tensor request tritonclient.http sends by default;
  * jaxnitro serve --max-batch-size 32 (no added delay), JSON.

Each server is its own process and all run at once (an idle one costs nothing), so the cells
of one concurrency level are measured back to back, not minutes apart. The load generator is
one process of client threads, each with its own keep-alive connection, sending one-row
requests for a fixed time after a short warm-up; latency is measured per request at the
client. Reported: requests/s and p50/p99 latency at concurrency 1, 8 and 32, with ratios
to the hand server in the same run (req/s: above 1 is faster; latency: below 1 is faster).
Every cell runs ``--repeats`` times, interleaved; the table shows medians, and each ratio
is the median of the ratios within a repeat.
The client shares the machine's cores with the servers, so absolute figures are low on a
small machine; the ratios are the result.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))  # jaxnitro from this checkout, installed or not

FEATURES = 784
CONCURRENCY = (1, 8, 32)


# -- the model ------------------------------------------------------------------------------
def make_bundle(root: Path) -> Path:
    import jax
    import optax
    from flax import nnx

    import jaxnitro as jn

    class MLP(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs):
            self.hidden = nnx.Linear(FEATURES, 128, rngs=rngs)
            self.out = nnx.Linear(128, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.relu(self.hidden(x)))

    @jn.experiment
    class ServeMLP:
        max_epochs: int = 1

        def build_model(self, rng):
            return jn.split_model(MLP(rngs=nnx.Rngs(rng)))

        def build_data(self, dist):
            rng = np.random.default_rng(0)
            x = rng.normal(size=(512, FEATURES)).astype(np.float32)
            y = rng.integers(0, 10, 512).astype(np.int32)
            return {"train": jn.DataLoader({"x": x, "y": y}, batch_size=32, drop_last=True)}

        def forward(self, model, params, state, *, x):
            return jn.apply(model, params, state, x)

        def loss(self, logits, *, y):
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    n = jn.Nitro(ServeMLP(), run_dir=root / "run", progress=False)
    jn.train(n)
    return jn.export_model(n, root / "bundle", name="mlp", platforms=("cpu",))


# -- the hand-written server (run in its own process: `serve.py --hand DIR PORT`) -----------
def hand_server(bundle: Path, port: int) -> None:
    import jax
    import safetensors.numpy
    import uvicorn
    from jax import export
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    exported = export.deserialize(bytearray((bundle / "model.jaxexport").read_bytes()))
    weights = jax.device_put(safetensors.numpy.load_file(bundle / "weights.safetensors"))
    predict = jax.jit(exported.call)
    predict(weights, {"x": np.zeros((1, FEATURES), np.float32)})  # compile batch 1

    async def infer(request: Request) -> JSONResponse:
        x = np.asarray((await request.json())["x"], np.float32)
        y = predict(weights, {"x": x})["output"]
        return JSONResponse({"y": np.asarray(y).tolist()})

    app = Starlette(routes=[Route("/predict", infer, methods=["POST"])])
    print("ready", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# -- starting servers -------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    def __init__(self, cmd: list[str], ready: str, port_pattern: str | None, port: int = 0):
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 180
        while not any(ready in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{cmd} did not start:\n{''.join(self.lines)}")
            time.sleep(0.05)
        if port_pattern:
            port = int(re.search(port_pattern, "".join(self.lines)).group(1))
        self.port = port

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# -- the requests -----------------------------------------------------------------------------
def requests_for(kind: str, x: np.ndarray) -> tuple[str, bytes, dict[str, str]]:
    if kind == "hand":
        return "/predict", json.dumps({"x": x.tolist()}).encode(), {}
    if kind == "binary":
        header = json.dumps(
            {
                "inputs": [
                    {
                        "name": "x",
                        "shape": list(x.shape),
                        "datatype": "FP32",
                        "parameters": {"binary_data_size": x.nbytes},
                    }
                ],
                "parameters": {"binary_data_output": True},
            }
        ).encode()
        return (
            "/v2/models/mlp/infer",
            header + x.tobytes(),
            {"Inference-Header-Content-Length": str(len(header))},
        )
    doc = {
        "inputs": [
            {"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }
    return "/v2/models/mlp/infer", json.dumps(doc).encode(), {}


def load(port: int, request: tuple, concurrency: int, seconds: float, warmup: float) -> dict:
    """Closed-loop load: ``concurrency`` threads, each sending one request at a time."""
    path, body, headers = request
    start = time.perf_counter()
    measure_from = start + warmup
    stop_at = measure_from + seconds
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    errors = [0] * concurrency

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        while True:
            t0 = time.perf_counter()
            if t0 >= stop_at:
                break
            conn.request("POST", path, body=body, headers=headers)
            r = conn.getresponse()
            r.read()
            t1 = time.perf_counter()
            if r.status != 200:
                errors[i] += 1
            elif t0 >= measure_from:
                latencies[i].append(t1 - t0)
        conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lat = np.concatenate([np.asarray(v) for v in latencies]) * 1e3
    return {
        "requests": int(lat.size),
        "errors": int(sum(errors)),
        "rps": float(lat.size / seconds),
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
    }


ROWS = {
    "hand": "hand: Starlette + jax.jit, JSON (reference)",
    "json": "jaxnitro serve, V2 JSON",
    "binary": "jaxnitro serve, V2 binary tensors",
    "batched": "jaxnitro serve --max-batch-size 32, V2 JSON",
}


def summarize(runs: dict) -> dict:
    """Per cell: the median over repeats of each figure, and of each ratio to the hand
    server measured in the same repeat (back to back, so drift cancels)."""
    out: dict = {}
    for c, cells in runs.items():
        out[c] = {}
        ref = cells["hand"]
        for key, reps in cells.items():
            cell: dict = {}
            for m in ("rps", "p50_ms", "p99_ms"):
                cell[m] = float(np.median([r[m] for r in reps]))
                pairs = zip(reps, ref, strict=True)
                cell[f"{m}_x_hand"] = float(np.median([r[m] / h[m] for r, h in pairs]))
            cell["errors"] = int(sum(r["errors"] for r in reps))
            out[c][key] = cell
    return out


def table(results: dict) -> str:
    lines = [
        "| concurrency | server | req/s | × hand | p50 ms | × hand | p99 ms | × hand |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c, cells in results.items():
        for key, cell in cells.items():
            lines.append(
                f"| {c} | {ROWS[key]} | {cell['rps']:.0f} | {cell['rps_x_hand']:.2f} | "
                f"{cell['p50_ms']:.2f} | {cell['p50_ms_x_hand']:.2f} | "
                f"{cell['p99_ms']:.2f} | {cell['p99_ms_x_hand']:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measured time per cell")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats per cell")
    parser.add_argument("--quick", action="store_true", help="1 s per cell, one repeat")
    parser.add_argument("--out", default="runs/bench/serve.json")
    parser.add_argument("--hand", nargs=2, metavar=("BUNDLE", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hand:
        hand_server(Path(args.hand[0]), int(args.hand[1]))
        return
    seconds = 1.0 if args.quick else args.seconds
    repeats = 1 if args.quick else args.repeats
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        bundle = make_bundle(Path(tmp))
        py = sys.executable
        serve = [py, "-m", "jaxnitro.serve", str(bundle), "--port", "0"]
        pattern = r"REST:\s+http://127\.0\.0\.1:(\d+)/v2"
        hand_port = free_port()
        servers = {
            "hand": Process(
                [py, __file__, "--hand", str(bundle), str(hand_port)], "ready", None, hand_port
            ),
            "json": Process(serve, "ready:", pattern),
            "batched": Process([*serve, "--max-batch-size", "32"], "ready:", pattern),
        }
        servers["binary"] = servers["json"]
        try:
            x = np.random.default_rng(1).normal(size=(1, FEATURES)).astype(np.float32)
            runs: dict = {c: {key: [] for key in ROWS} for c in CONCURRENCY}
            for repeat in range(repeats):
                for c in CONCURRENCY:
                    for key in ROWS:
                        kind = {"hand": "hand", "binary": "binary"}.get(key, "json")
                        cell = load(servers[key].port, requests_for(kind, x), c, seconds, 0.5)
                        runs[c][key].append(cell)
                        print(
                            f"repeat {repeat + 1} c={c:<3d} {ROWS[key]:48s} "
                            f"{cell['rps']:8.0f} req/s  p50 {cell['p50_ms']:.2f} ms  "
                            f"p99 {cell['p99_ms']:.2f} ms",
                            flush=True,
                        )
        finally:
            for s in {id(s): s for s in servers.values()}.values():
                s.stop()
    results = summarize(runs)
    import jax

    import jaxnitro

    report = {
        "when": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "seconds_per_cell": seconds,
        "work": f"MLP {FEATURES}→128→10, one row per request, FP32",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "jaxnitro": getattr(jaxnitro, "__version__", "0.1.0"),
        },
        "repeats": repeats,
        "runs": {str(c): cells for c, cells in runs.items()},
        "results": {str(c): cells for c, cells in results.items()},
        "wall_s": time.perf_counter() - began,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    md = table(results)
    out.with_suffix(".md").write_text(md + "\n")
    print()
    print(md)
    print(f"\nwrote {out} and {out.with_suffix('.md')} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
