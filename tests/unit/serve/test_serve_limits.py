"""`jaxnitro serve` against hostile clients: connections that never finish their headers,
oversized headers, a connection flood under a low open-files limit, a JSON body that would
decode to many times its bytes, too many bytes in flight, a client that never reads its
response when SIGTERM comes, and booleans mixed with numbers.

The quick tests run the codec, the tensors and the byte budget in-process; the slow ones
start ``python -m jaxnitro._src.serve`` (test_serve's `Server`) and use raw sockets.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
import tracemalloc
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import Tiny, nitro
from test_serve import INFER, Server, _json_infer, _raw, _x

import jaxnitro as jn
from jaxnitro._src.core.errors import ConfigError
from jaxnitro._src.serve import codec, command, connections, server, tensors
from jaxnitro._src.serve.body import InflightBytes
from jaxnitro._src.serve.errors import InvalidRequest, PayloadTooLarge, Unavailable

F32 = np.dtype(np.float32)


# -- quick ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "data,dtype",
    [
        ([True, 0.5], np.float32),
        ([[0.5, 1.5], [False, 2.0]], np.float32),
        ([True, 1], np.int32),
        ([1, 2, True], np.uint8),
    ],
)
def test_booleans_mixed_with_numbers_are_refused_like_all_booleans(data, dtype):
    dtype = np.dtype(dtype)
    shape = np.shape(data)
    with pytest.raises(InvalidRequest, match="true/false mixed with numbers"):
        tensors.from_list("x", data, dtype, shape, limit=1 << 20)
    # as a request: the whole path, small body and large (JSON left as text) alike
    count = int(np.prod(shape))
    flat = json.dumps(np.ravel(np.asarray(data, dtype=object)).tolist())
    for repeat in (1, (codec.DEFER_JSON_BYTES // len(flat)) + 1):
        values = ",".join([flat[1:-1]] * repeat)
        entry = f'{{"name":"x","datatype":"FP32","shape":[{count * repeat}],"data":[{values}]}}'
        body = f'{{"inputs":[{entry}]}}'.encode()
        (t,) = codec.parse_request(body, None).inputs
        assert isinstance(t.data, tensors.JsonArray) == (len(body) >= codec.DEFER_JSON_BYTES)
        with pytest.raises(InvalidRequest, match="true/false mixed with numbers"):
            tensors.from_list("x", t.data, dtype, t.shape, limit=64 << 20, may_hold_bools=True)
    # numbers alone still pass, and all-booleans keep their own message
    ok = tensors.from_list("x", [0.5, 1], F32, (2,), limit=1 << 20, may_hold_bools=False)
    np.testing.assert_array_equal(ok, [0.5, 1.0])
    with pytest.raises(InvalidRequest, match="must be numbers, got true/false values"):
        tensors.from_list("x", [True, False], F32, (2,), limit=1 << 20)


def _big_json(values: bytes, count: int, shape: list[int]) -> bytes:
    data = b",".join([values] * count)
    head = b'{"id":"big","inputs":[{"name":"x","datatype":"FP32","shape":%s,"data":[' % (
        json.dumps(shape).encode()
    )
    return head + data + b']}],"parameters":{"binary_data_output":true}}'


@pytest.mark.slow
def test_a_large_json_body_is_checked_before_its_values_are_parsed():
    rows = (8 << 20) // 8 // 4  # 8 MiB of "1.5," text
    over = _big_json(b"1.5", rows * 8, [rows * 2, 8])  # declares twice as many values
    limit = rows * 8 * 4 + 1  # the data itself would fit, the declared shape does not
    mismatch = _big_json(b"1.5", rows * 8, [1, 8])
    tracemalloc.start()
    try:
        (t,) = codec.parse_request(over, None).inputs
        with pytest.raises(PayloadTooLarge, match=r"values take \d+ bytes, over the limit"):
            tensors.from_list("x", t.data, F32, t.shape, limit=limit)
        (t,) = codec.parse_request(mismatch, None).inputs
        with pytest.raises(InvalidRequest, match=rf"holds {rows * 8} values, .* has 8"):
            tensors.from_list("x", t.data, F32, t.shape, limit=limit)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # parsed, each value would be a Python float (32 bytes for 4 of text): 8x the body
    assert peak < len(over), peak
    # an accepted large body decodes as the small-body path does
    x = np.random.default_rng(0).normal(size=(rows // 4, 8)).astype(np.float32)
    doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape)}]}
    doc["inputs"][0]["data"] = x.tolist()
    body = json.dumps(doc).encode()
    assert len(body) >= codec.DEFER_JSON_BYTES
    (t,) = codec.parse_request(body, None).inputs
    assert isinstance(t.data, tensors.JsonArray)
    got = tensors.from_list("x", t.data, F32, t.shape, limit=64 << 20)
    np.testing.assert_array_equal(got, x)
    # a string or an object among the values of a large body: refused, not parsed
    strings = _big_json(b'"a"', 300_000, [300_000])
    with pytest.raises(InvalidRequest, match="holds something other than numbers"):
        codec.parse_request(strings, None)
    escaped = _big_json(b"1.5", 300_000, [300_000]).replace(b'"data"', b'"d\\u0061ta"')
    with pytest.raises(InvalidRequest, match=r"outside its inputs' 'data' arrays is \d+ bytes"):
        codec.parse_request(escaped, None)
    broken = _big_json(b"1.5", 300_000, [300_000])[:-3]
    with pytest.raises(InvalidRequest, match="failed to parse the request JSON"):
        codec.parse_request(broken, None)


def test_inflight_bytes_are_bounded_across_requests():
    budget = InflightBytes(100)
    first, second = budget.share(), budget.share()
    first.take(60)
    first.take(20)
    with pytest.raises(Unavailable, match=r"answering 80 bytes .* limit of 100 .*--max-inflight"):
        second.take(30)
    second.take(20)
    first.release()
    assert budget.used == 20
    second.take(80)
    second.release()
    assert budget.used == 0


def test_limit_options_are_checked_and_the_cli_defaults_agree(tmp_path):
    assert command.HEADER_TIMEOUT_S == connections.HEADER_TIMEOUT_S
    assert command.MAX_CONNECTIONS == connections.MAX_CONNECTIONS
    assert command.DRAIN_TIMEOUT_S == server.DRAIN_TIMEOUT_S
    assert command.EXIT_CUT == server.EXIT_CUT
    assert command.REPOSITORY_POLL_SECS == server.REPOSITORY_POLL_SECS
    bad = [
        ({"header_timeout": 0}, "header_timeout must be a number of seconds > 0, got 0"),
        ({"drain_timeout": float("inf")}, "drain_timeout must be a number of seconds > 0"),
        ({"max_connections": 0}, "max_connections"),
        (
            {"max_inflight_bytes": 1000, "max_body_bytes": 2000},
            r"max_inflight_bytes \(1000\) is smaller than max_body_bytes \(2000\)",
        ),
    ]
    for options, match in bad:
        with pytest.raises(ConfigError, match=match):
            server.serve([tmp_path], **options)


# -- the real thing, in a subprocess ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A Tiny bundle (input x FP32[-1, 8], output FP32[-1, 4])."""
    root = tmp_path_factory.mktemp("serve-limits")
    n = nitro(Tiny(max_epochs=1), run_dir=root / "run")
    with warnings.catch_warnings():  # untrained weights serve as well as trained ones
        warnings.filterwarnings("ignore", "export_model: Tiny has taken no optimizer step")
        return jn.export_model(n, root / "tiny", platforms=("cpu",))


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _connect(address: str, timeout: float = 30.0) -> socket.socket:
    sock = socket.create_connection(_host_port(address), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (the socket's timeout fails the test)."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _good_request(address: str) -> int:
    conn = http.client.HTTPConnection(address, timeout=30)
    try:
        conn.request("POST", INFER, body=_json_infer())
        r = conn.getresponse()
        r.read()
        return r.status
    except OSError:
        return -1
    finally:
        conn.close()


@pytest.mark.slow
def test_connections_without_headers_are_closed_and_big_headers_refused(tiny):
    s = Server([tiny], "--header-timeout", "1.5", "--max-connections", "64")
    try:
        base = _open_fds(s.proc.pid)
        started = time.monotonic()
        partial = [_connect(s.rest) for _ in range(10)]
        for sock in partial:
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
        silent = [_connect(s.rest) for _ in range(5)]
        # good clients are served meanwhile, on connections of their own
        with ThreadPoolExecutor(4) as ex:
            assert list(ex.map(_good_request, [s.rest] * 8)) == [200] * 8
        for sock in partial:
            answer = _read_until_closed(sock)
            assert answer.startswith(b"HTTP/1.1 408 "), answer
            assert b"did not arrive within 1.5 s" in answer and b"--header-timeout" in answer
        for sock in silent:
            assert _read_until_closed(sock) == b""  # nothing asked, nothing answered
        assert time.monotonic() - started >= 1.4
        # a request line and headers over 64 KiB: 431 once they pass it, not 150 MB later
        big = _connect(s.rest)
        big.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent = 0
        try:
            while sent < 1 << 20:
                big.sendall(b"a" * 16384)
                sent += 16384
        except OSError:
            pass  # the server closed it: the answer is read below
        answer = _read_until_closed(big)
        assert answer.startswith(b"HTTP/1.1 431 "), answer
        assert f"exceed {connections.MAX_HEADER_BYTES} bytes".encode() in answer
        for sock in [*partial, *silent, big]:
            sock.close()
        deadline = time.monotonic() + 30
        while _open_fds(s.proc.pid) > base + 2:
            assert time.monotonic() < deadline, (_open_fds(s.proc.pid), base)
            time.sleep(0.05)
        assert _good_request(s.rest) == 200
    finally:
        s.stop()


@pytest.mark.slow
def test_a_connection_flood_under_a_low_open_files_limit_does_not_shut_clients_out(
    tiny, monkeypatch
):
    # 300 connections that never send their headers, against `ulimit -n 256`
    monkeypatch.setattr(subprocess, "Popen", _popen_with_nofile(256))
    s = Server([tiny], "--header-timeout", "3")
    monkeypatch.undo()
    flood: list[socket.socket] = []
    try:
        assert "max connections:" in s.output and "ulimit -n" in s.output, s.output
        cap = int(s.output.split("max connections: ")[1].split(",")[0])
        assert 0 < cap < 256 - 64
        for _ in range(300):
            sock = _connect(s.rest)
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            flood.append(sock)
        # good clients: answered at once (503 while the flood holds every slot), then served
        served = 0
        deadline = time.monotonic() + 60
        while served < 10:
            assert time.monotonic() < deadline, (served, s.output[-2000:])
            status = _good_request(s.rest)
            assert status in (200, 503, -1), status
            served += status == 200
            if status != 200:
                time.sleep(0.1)
        # every flood connection got an answer: 503 beyond the cap (a reset when too many
        # were refused at once to linger), 408 after the header timeout within it
        answers = {"503": 0, "408": 0, "reset": 0}
        refusal = b""
        for sock in flood:
            try:
                answer = _read_until_closed(sock)
            except ConnectionResetError:
                answers["reset"] += 1
                continue
            code = answer[9:12].decode()
            assert code in ("503", "408"), answer
            answers[code] += 1
            refusal = answer if code == "503" else refusal
        assert answers["408"] <= cap and answers["503"] + answers["reset"] >= 300 - cap, answers
        assert answers["503"] >= 1
        assert b"its limit (jaxnitro serve --max-connections)" in refusal, refusal
        # the server's descriptors come back
        deadline = time.monotonic() + 30
        while _open_fds(s.proc.pid) > 256 - cap:
            assert time.monotonic() < deadline, _open_fds(s.proc.pid)
            time.sleep(0.1)
        assert _good_request(s.rest) == 200
    finally:
        for sock in flood:
            sock.close()
        s.stop()


def _popen_with_nofile(limit: int):
    """subprocess.Popen, then `ulimit -n limit` on the child before it has imported much
    (prlimit: a preexec_fn would fork this multithreaded process)."""
    real = subprocess.Popen

    def popen(*args, **kwargs):
        proc = real(*args, **kwargs)
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (limit, limit))
        return proc

    return popen


def _peak_and_reset(pid: int) -> tuple[int, int]:
    """(VmHWM, VmRSS) of a process in bytes; resets its VmHWM to its VmRSS."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                fields[key] = int(value.split()[0]) * 1024
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    return fields["VmHWM"], fields["VmRSS"]


@pytest.mark.slow
def test_a_refused_63_mib_json_body_costs_under_3x_its_size(tiny):
    s = Server([tiny])  # the default --max-body-bytes: 64 MiB
    try:
        count = (63 << 20) // 4  # "1.5," per value
        over = _big_json(b"1.5", count, [count // 4, 8])  # twice the values it holds
        mismatch = _big_json(b"1.5", count, [2, 8])
        for body, status, match in [
            (over, 413, "values take .* bytes, over the limit"),
            (mismatch, 400, "'data' holds .* values, but the declared shape"),
        ]:
            assert 60 << 20 < len(body) < 64 << 20
            _peak_and_reset(s.proc.pid)
            _, before = _peak_and_reset(s.proc.pid)
            got, _, data = s.request("POST", INFER, body)
            assert got == status and re.search(match, json.loads(data)["error"]), data[:300]
            peak, _ = _peak_and_reset(s.proc.pid)
            assert peak - before < 3 * len(body), (peak - before) / len(body)
        assert s.status("GET", "/v2/health/live") == 200
    finally:
        s.stop()


@pytest.mark.slow
def test_bytes_in_flight_beyond_the_limit_get_503(tiny):
    s = Server([tiny], "--max-body-bytes", "2000000", "--max-inflight-bytes", "2500000")
    try:
        # a request that declares 2 MB and sends them slowly holds its 2 MB meanwhile
        slow = _connect(s.rest)
        body, headers = _raw(np.zeros((62_000, 8), np.float32))
        head = f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        slow.sendall(head.encode() + body[:1000])
        deadline = time.monotonic() + 30
        while True:  # until the server has taken the slow request's share
            got, _, data = s.request("POST", INFER, *_raw(_x(40_000)))
            if got == 503:
                break
            assert got == 200 and time.monotonic() < deadline, data[:300]
            time.sleep(0.05)
        error = json.loads(data)["error"]
        assert "--max-inflight-bytes" in error and "2500000" in error, error
        assert s.request("POST", INFER, _json_infer())[0] == 200  # small ones fit
        slow.sendall(body[1000:])
        assert _read_until_closed_or_response(slow).startswith(b"HTTP/1.1 200 ")
        slow.close()
        assert s.request("POST", INFER, *_raw(_x(40_000)))[0] == 200
    finally:
        s.stop()


def _read_until_closed_or_response(sock: socket.socket) -> bytes:
    sock.settimeout(30)
    return sock.recv(65536)


@pytest.mark.slow
def test_sigterm_cuts_a_client_that_never_reads_its_response(tiny):
    s = Server([tiny], "--drain-timeout", "2")
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(30)
        sock.connect(_host_port(s.rest))
        body, headers = _raw(np.ones((200_000, 8), np.float32))  # a ~16 MB JSON answer
        head = f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        sock.sendall(head.encode() + body)
        ok = 'jaxnitro_requests_total{code="200",endpoint="infer",model="tiny",protocol="http"}'
        deadline = time.monotonic() + 60
        while s.metrics().get(ok, 0) < 1:  # answered; the response waits for the client
            assert time.monotonic() < deadline, s.output
            time.sleep(0.05)
        started = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(30) == server.EXIT_CUT, s.output
        assert time.monotonic() - started < 15
        s._reader.join(5)
        assert "cut 1 request(s) still unanswered after the drain timeout of 2 s" in s.output
        sock.close()
    finally:
        s.stop()


@pytest.mark.slow
def test_sigterm_with_nothing_left_still_exits_0(tiny):
    s = Server([tiny], "--drain-timeout", "2")
    idle = _connect(s.rest)  # a kept-alive connection between requests is no request
    idle.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
    assert idle.recv(65536).startswith(b"HTTP/1.1 400 ")
    s.proc.send_signal(signal.SIGTERM)
    try:
        assert s.proc.wait(30) == 0, s.output
        s._reader.join(5)
        assert "stopped" in s.output and "cut" not in s.output
    finally:
        idle.close()
        s.stop()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.slow
def test_sigterm_cuts_rest_and_grpc_requests_still_running_at_the_drain_timeout(tiny):
    import tritonclient.grpc as grpcclient

    # requests wait 20 s in the batcher for others to join: far past the 1 s drain timeout
    s = Server(
        [tiny], "--max-batch-size", "64", "--max-batch-delay-ms", "20000", "--drain-timeout", "1"
    )
    x = _x(3, seed=9)

    def rest_call(_):
        return s.status("POST", INFER, _json_infer(x))

    def grpc_call(_):
        g = grpcclient.InferenceServerClient(s.grpc)
        try:
            inp = grpcclient.InferInput("x", [3, 8], "FP32")
            inp.set_data_from_numpy(x)
            g.infer("tiny", [inp], client_timeout=60)
            return "answered"
        except Exception as e:
            return type(e).__name__
        finally:
            g.close()

    try:
        with ThreadPoolExecutor(4) as ex:
            futures = [ex.submit(rest_call, i) for i in range(2)]
            futures += [ex.submit(grpc_call, i) for i in range(2)]
            deadline = time.monotonic() + 60
            while s.metrics().get('jaxnitro_queue_depth{model="tiny"}', 0) < 4:
                assert time.monotonic() < deadline, s.output
                time.sleep(0.05)
            started = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            assert s.proc.wait(30) == server.EXIT_CUT, s.output
            assert time.monotonic() - started < 15
            results = [f.result(timeout=30) for f in futures]
        assert results[:2] == [-1, -1] and "answered" not in results[2:], results
        s._reader.join(5)
        assert "cut 4 request(s) still unanswered after the drain timeout of 1 s" in s.output
    finally:
        s.stop()
