"""Serving benchmark: one bundle behind `jaxnitro serve` against a hand-written server.

    python benchmarks/serve.py [--quick] [--models small,wide] [--seconds 3] [--repeats 3]
                               [--soak 10000] [--server-src DIR] [--out FILE.json]

Two models, each exported as a bundle (trained one epoch on random data):

  * small: MLP 784→128→10; a one-row call costs ~0.05 ms, far less than the HTTP request
    around it, so the request path is the whole cost and batching has little to save;
  * wide: MLP 784→1024→1024→10; a one-row call costs ~1 ms on a 2-core CPU, about as much as
    the request, and a 32-row call ~7 ms: the case dynamic batching is for.

Each is served by

  * hand: the minimal server a careful user writes, Starlette + uvicorn with one POST route
    that reads ``{"x": [[...]]}``, calls ``jax.jit`` of the bundle's program (the same
    weights and computation) on the event loop, and answers ``{"y": [[...]]}``; no
    validation, no batching, no padding (only batch 1 is compiled, and only batch 1 is sent).
    **The reference for every "× hand" ratio.**
  * jaxnitro serve, the KServe V2 JSON request a plain client sends;
  * jaxnitro serve, the binary tensor request tritonclient.http sends by default;
  * jaxnitro serve --max-batch-size 32 (no added delay), JSON and binary.

Each server is its own process and all run at once (an idle one costs nothing), so the cells
of one concurrency level are measured back to back, not minutes apart. The load generator is
one process of client threads, each with its own keep-alive connection, sending one-row
requests for a fixed time after a short warm-up; latency is measured per request at the
client. Reported: requests/s and p50/p99 latency at concurrency 1, 8 and 32, with ratios
to the hand server in the same run (req/s: above 1 is faster; latency: below 1 is faster).
Every cell runs ``--repeats`` times, interleaved; the table shows medians and, under
"range", the lowest and highest of the per-repeat ratios; each ratio is the median of the
ratios within a repeat.

Then the soak (``--soak N``, 0 to skip): N requests from 32 concurrent clients against the
batched server of the first model, of 1 to 8 rows (some over the batch size of 32: split),
JSON and binary alternating, every answer compared with the bundle's own output; reported:
errors, wrong answers, the calls they were merged into, and the server's resident memory
before and after.

The client shares the machine's cores with the servers, so absolute figures are low on a
small machine; the ratios are the result. ``--server-src DIR`` runs the jaxnitro servers
from another checkout's ``src`` (e.g. a commit before a change), for before/after tables.
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


# -- the models -----------------------------------------------------------------------------
#: name -> hidden widths of the MLP 784→...→10
MODELS = {"small": (128,), "wide": (1024, 1024)}


def describe(model: str) -> str:
    return "MLP " + "→".join(map(str, (FEATURES, *MODELS[model], 10)))


def make_bundle(root: Path, model: str = "small") -> Path:
    import jax
    import optax
    from flax import nnx

    import jaxnitro as jn

    widths = MODELS[model]

    class MLP(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs):
            sizes = (FEATURES, *widths)
            self.hidden = nnx.List(
                [nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes, sizes[1:], strict=False)]
            )
            self.out = nnx.Linear(widths[-1], 10, rngs=rngs)

        def __call__(self, x):
            for layer in self.hidden:
                x = jax.nn.relu(layer(x))
            return self.out(x)

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

    n = jn.Nitro(ServeMLP(), run_dir=root / f"run-{model}", progress=False)
    jn.train(n)
    return jn.export_model(n, root / f"bundle-{model}", name="mlp", platforms=("cpu",))


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
    def __init__(
        self,
        cmd: list[str],
        ready: str,
        port_pattern: str | None,
        port: int = 0,
        src: str | None = None,
    ):
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        if src:
            env["PYTHONPATH"] = src
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

    def rss_mib(self) -> float:
        """The process's resident memory now (Linux)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

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


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system) used so far by process ``pid`` (Linux), or by this one."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load(
    port: int,
    request: tuple,
    concurrency: int,
    seconds: float,
    warmup: float,
    pid: int | None = None,
) -> dict:
    """Closed-loop load: ``concurrency`` threads, each sending one request at a time. With
    ``pid``, also the server's and this client's CPU time per request while measuring."""
    path, body, headers = request
    start = time.perf_counter()
    measure_from = start + warmup
    stop_at = measure_from + seconds
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    errors = [0] * concurrency
    cpu: dict[str, float] = {}

    def sample(when: str, at: float) -> None:
        time.sleep(max(0.0, at - time.perf_counter()))
        cpu[f"server_{when}"] = cpu_seconds(pid) if pid else 0.0
        cpu[f"client_{when}"] = cpu_seconds()

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
    sample("start", measure_from)
    sample("stop", stop_at)  # before the last requests drain: the window is the measured one
    for t in threads:
        t.join()
    lat = np.concatenate([np.asarray(v) for v in latencies]) * 1e3
    per = 1e6 / max(1, lat.size)
    return {
        "requests": int(lat.size),
        "errors": int(sum(errors)),
        "rps": float(lat.size / seconds),
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "server_cpu_us": (cpu["server_stop"] - cpu["server_start"]) * per,
        "client_cpu_us": (cpu["client_stop"] - cpu["client_start"]) * per,
    }


ROWS = {
    "hand": "hand: Starlette + jax.jit, JSON (reference)",
    "json": "jaxnitro serve, V2 JSON",
    "binary": "jaxnitro serve, V2 binary tensors",
    "batched": "jaxnitro serve --max-batch-size 32, V2 JSON",
    "batched_binary": "jaxnitro serve --max-batch-size 32, V2 binary",
}
KIND = {"hand": "hand", "json": "json", "binary": "binary", "batched": "json"}
KIND["batched_binary"] = "binary"


def summarize(runs: dict) -> dict:
    """Per cell: the median over repeats of each figure, and of each ratio to the hand
    server measured in the same repeat (back to back, so drift cancels), with the lowest
    and highest of those ratios."""
    out: dict = {}
    for c, cells in runs.items():
        out[c] = {}
        ref = cells["hand"]
        for key, reps in cells.items():
            cell: dict = {}
            for m in ("rps", "p50_ms", "p99_ms"):
                cell[m] = float(np.median([r[m] for r in reps]))
                ratios = [r[m] / h[m] for r, h in zip(reps, ref, strict=True)]
                cell[f"{m}_x_hand"] = float(np.median(ratios))
                cell[f"{m}_x_hand_range"] = [float(min(ratios)), float(max(ratios))]
            for m in ("server_cpu_us", "client_cpu_us"):
                cell[m] = float(np.median([r[m] for r in reps]))
            cell["errors"] = int(sum(r["errors"] for r in reps))
            out[c][key] = cell
    return out


def table(results: dict) -> str:
    lines = [
        "| concurrency | server | req/s | × hand (range) | p50 ms | × hand (range) | p99 ms "
        "| × hand | server CPU µs/req | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ratio(cell: dict, m: str) -> str:
        low, high = cell[f"{m}_x_hand_range"]
        return f"{cell[f'{m}_x_hand']:.2f} ({low:.2f}–{high:.2f})"

    for c, cells in results.items():
        for key, cell in cells.items():
            lines.append(
                f"| {c} | {ROWS[key]} | {cell['rps']:.0f} | {ratio(cell, 'rps')} | "
                f"{cell['p50_ms']:.2f} | {ratio(cell, 'p50_ms')} | "
                f"{cell['p99_ms']:.2f} | {cell['p99_ms_x_hand']:.2f} | "
                f"{cell['server_cpu_us']:.0f} | {cell['errors']} |"
            )
    return "\n".join(lines)


def _no_extra_ports(src: str | None) -> list[str]:
    """The flags that leave gRPC and the metrics port off, where the server has them (on
    by default since the model repository; an older checkout has neither the flags nor
    the ports), so both servers listen on their REST port only."""
    env = {**os.environ, **({"PYTHONPATH": src} if src else {})}
    cmd = [sys.executable, "-m", "jaxnitro._src.serve", "--help"]
    text = subprocess.run(cmd, capture_output=True, text=True, env=env).stdout
    return ["--no-grpc", "--no-metrics-port"] if "--no-grpc" in text else []


def start_servers(bundle: Path, src: str | None) -> dict[str, Process]:
    py = sys.executable
    serve = [py, "-m", "jaxnitro._src.serve", str(bundle), "--port", "0", *_no_extra_ports(src)]
    pattern = r"REST:\s+http://127\.0\.0\.1:(\d+)/v2"
    hand_port = free_port()
    servers = {
        "hand": Process(
            [py, __file__, "--hand", str(bundle), str(hand_port)], "ready", None, hand_port
        ),
        "json": Process(serve, "ready:", pattern, src=src),
        "batched": Process([*serve, "--max-batch-size", "32"], "ready:", pattern, src=src),
    }
    servers["binary"] = servers["json"]
    servers["batched_binary"] = servers["batched"]
    return servers


def stop_servers(servers: dict[str, Process]) -> None:
    for s in {id(s): s for s in servers.values()}.values():
        s.stop()


def measure(servers: dict[str, Process], seconds: float, repeats: int, label: str) -> dict:
    x = np.random.default_rng(1).normal(size=(1, FEATURES)).astype(np.float32)
    runs: dict = {c: {key: [] for key in ROWS} for c in CONCURRENCY}
    for repeat in range(repeats):
        for c in CONCURRENCY:
            for key in ROWS:
                server = servers[key]
                request = requests_for(KIND[key], x)
                cell = load(server.port, request, c, seconds, 0.5, pid=server.proc.pid)
                runs[c][key].append(cell)
                print(
                    f"{label} repeat {repeat + 1} c={c:<3d} {ROWS[key]:48s} "
                    f"{cell['rps']:8.0f} req/s  p50 {cell['p50_ms']:.2f} ms  "
                    f"p99 {cell['p99_ms']:.2f} ms  server CPU {cell['server_cpu_us']:.0f} µs/req  "
                    f"client CPU {cell['client_cpu_us']:.0f} µs/req",
                    flush=True,
                )
    return runs


# -- the soak: many requests, every answer checked --------------------------------------------
def soak(server: Process, bundle: Path, n: int, concurrency: int = 32) -> dict:
    """``n`` requests of 1-8 rows (every 50th: 40, over the batch size) from ``concurrency``
    clients, JSON and binary alternating, each answer compared with the bundle's own."""
    import jaxnitro as jn

    rng = np.random.default_rng(7)
    rows = [40 if i % 50 == 0 else int(rng.integers(1, 9)) for i in range(n)]
    starts = np.concatenate([[0], np.cumsum(rows)[:-1]])
    pool = rng.normal(size=(int(sum(rows)), FEATURES)).astype(np.float32)
    expected = jn.load_bundle(bundle)(x=pool)
    next_job = iter(range(n))
    lock = threading.Lock()
    counts = {"errors": 0, "wrong": 0, "answered": 0}

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        while True:
            with lock:
                i = next(next_job, None)
            if i is None:
                break
            lo, hi = int(starts[i]), int(starts[i] + rows[i])
            kind = "binary" if i % 2 else "json"
            path, body, headers = requests_for(kind, pool[lo:hi])
            try:
                conn.request("POST", path, body=body, headers=headers)
                r = conn.getresponse()
                data = r.read()
                ok = r.status == 200
                got = _output(data, r.getheader("Inference-Header-Content-Length")) if ok else None
            except (OSError, http.client.HTTPException):
                ok, got = False, None
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            with lock:
                if not ok:
                    counts["errors"] += 1
                elif got is None or not np.allclose(got, expected[lo:hi], atol=1e-5, rtol=1e-5):
                    counts["wrong"] += 1
                else:
                    counts["answered"] += 1
        conn.close()

    before_metrics = _metrics(server.port)
    rss_before = server.rss_mib()
    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    rss_after = server.rss_mib()
    after_metrics = _metrics(server.port)
    calls = 'jaxnitro_batch_rows_count{model="mlp"}'
    return {
        "requests": n,
        "rows": int(sum(rows)),
        "concurrency": concurrency,
        **counts,
        "seconds": wall,
        "rps": n / wall,
        "model_calls": int(after_metrics.get(calls, 0) - before_metrics.get(calls, 0)),
        "server_errors_counted": int(
            sum(v for k, v in after_metrics.items() if k.startswith("jaxnitro_request_errors"))
            - sum(v for k, v in before_metrics.items() if k.startswith("jaxnitro_request_errors"))
        ),
        "rss_mib_before": rss_before,
        "rss_mib_after": rss_after,
    }


def _output(data: bytes, header_length: str | None) -> np.ndarray | None:
    if header_length is None:
        out = json.loads(data)["outputs"][0]
        return np.reshape(out["data"], out["shape"])
    header = json.loads(data[: int(header_length)])
    out = header["outputs"][0]
    return np.frombuffer(data[int(header_length) :], np.float32).reshape(out["shape"])


def _metrics(port: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measured time per cell")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats per cell")
    parser.add_argument("--quick", action="store_true", help="1 s per cell, one repeat")
    parser.add_argument("--models", default="small,wide", help="comma-separated: small, wide")
    parser.add_argument("--soak", type=int, default=10_000, help="soak requests (0: none)")
    parser.add_argument("--server-src", default=None, help="run jaxnitro serve from this src")
    parser.add_argument("--out", default="runs/bench/serve.json")
    parser.add_argument("--hand", nargs=2, metavar=("BUNDLE", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hand:
        hand_server(Path(args.hand[0]), int(args.hand[1]))
        return
    seconds = 1.0 if args.quick else args.seconds
    repeats = 1 if args.quick else args.repeats
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if unknown := [m for m in models if m not in MODELS]:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    began = time.perf_counter()
    runs: dict = {}
    soaked: dict | None = None
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            bundle = make_bundle(Path(tmp), model)
            servers = start_servers(bundle, args.server_src)
            try:
                runs[model] = measure(servers, seconds, repeats, model)
                if args.soak and soaked is None:
                    soaked = {"model": model, **soak(servers["batched"], bundle, args.soak)}
                    print(f"soak: {soaked}", flush=True)
            finally:
                stop_servers(servers)
    results = {m: summarize(r) for m, r in runs.items()}
    import jax

    import jaxnitro

    report = {
        "when": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "seconds_per_cell": seconds,
        "work": {m: f"{describe(m)}, one row per request, FP32" for m in models},
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average": os.getloadavg(),
        },
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "jaxnitro": getattr(jaxnitro, "__version__", "0.1.0"),
        },
        "server_src": args.server_src,
        "repeats": repeats,
        "runs": {m: {str(c): cells for c, cells in r.items()} for m, r in runs.items()},
        "results": {m: {str(c): cells for c, cells in r.items()} for m, r in results.items()},
        "soak": soaked,
        "wall_s": time.perf_counter() - began,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    md = "\n\n".join(f"{describe(m)}:\n\n{table(r)}" for m, r in results.items())
    if soaked:
        md += "\n\n" + soak_line(soaked)
    out.with_suffix(".md").write_text(md + "\n")
    print()
    print(md)
    print(f"\nwrote {out} and {out.with_suffix('.md')} ({report['wall_s']:.0f} s)")


def soak_line(s: dict) -> str:
    return (
        f"Soak ({describe(s['model'])}, --max-batch-size 32): {s['requests']} requests "
        f"({s['rows']} rows) from {s['concurrency']} clients in {s['seconds']:.1f} s "
        f"({s['rps']:.0f} req/s): {s['errors']} errors, {s['wrong']} wrong answers, "
        f"{s['answered']} correct; {s['model_calls']} model calls; server memory "
        f"{s['rss_mib_before']:.0f} → {s['rss_mib_after']:.0f} MiB."
    )


if __name__ == "__main__":
    main()
