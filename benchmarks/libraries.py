"""The behaviours that decided whether jaxnitro adopts three libraries (docs/libraries.md).

1. orbax's `CheckpointManager` against `checkpoint/`: one byte of a saved array flipped on
   disk, then restored; and the time of a save and a restore of the same tree.
2. grain's worker pool against `data/workers.py`: a per-sample transform defined as a
   closure (as in a notebook), with 2 workers; the time to the first batch and to the end of
   an epoch.
3. uvicorn's `limit_concurrency` against `serve/connections.py`: idle connections that
   never send a request, then a real client.

    python benchmarks/libraries.py [--only orbax,grain,uvicorn]

Each prints one JSON line per finding. Timings are of this machine, both ways in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import tempfile
import time
from pathlib import Path

import numpy as np


def say(**row) -> None:
    print(json.dumps(row), flush=True)


def _flip_a_byte(root: Path) -> Path:
    """Flip one byte in the middle of the largest file under `root` (an array's data)."""
    target = max((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    return target


def check_orbax(mib: int = 64) -> None:
    import orbax.checkpoint as ocp

    import jaxnitro as jn

    tree = {"w": np.random.default_rng(0).standard_normal(mib << 18).astype(np.float32)}
    with tempfile.TemporaryDirectory() as tmp:
        # orbax: a manager keeping the best 2 by a metric, saving synchronously
        options = ocp.CheckpointManagerOptions(
            max_to_keep=2, best_fn=lambda m: m["acc"], enable_async_checkpointing=False
        )
        with ocp.CheckpointManager(Path(tmp) / "orbax", options=options) as mgr:
            t0 = time.perf_counter()
            mgr.save(1, args=ocp.args.StandardSave(tree), metrics={"acc": 0.5})
            mgr.wait_until_finished()
            save_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            back = mgr.restore(1, args=ocp.args.StandardRestore(tree))
            restore_s = time.perf_counter() - t0
            assert np.array_equal(back["w"], tree["w"])
            flipped = _flip_a_byte(Path(tmp) / "orbax" / "1")
            try:
                back = mgr.restore(1, args=ocp.args.StandardRestore(tree))
                outcome = (
                    "restored, equal"
                    if np.array_equal(back["w"], tree["w"])
                    else (f"restored silently, {int((back['w'] != tree['w']).sum())} values differ")
                )
            except Exception as e:  # noqa: BLE001 - what orbax raises is the finding
                outcome = f"raised {type(e).__name__}: {str(e)[:120]}"
            say(
                library="orbax.CheckpointManager",
                mib=mib,
                save_s=round(save_s, 3),
                restore_s=round(restore_s, 3),
                flipped=str(flipped.relative_to(tmp)),
                corrupted_restore=outcome,
                latest_step_after_corruption=mgr.latest_step(),
            )
        # jaxnitro: the Top-K store, a foreground save
        ck = jn.TopKCheckpointer(2, metric="acc", mode="max", dir=Path(tmp) / "jn")
        t0 = time.perf_counter()
        path = ck.save(epoch=1, step=1, metrics={"acc": 0.5}, trees={"params": tree}, meta={})
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        back, _ = jn.load_checkpoint(path, {"params": tree})
        restore_s = time.perf_counter() - t0
        assert np.array_equal(back["params"]["w"], tree["w"])
        flipped = _flip_a_byte(path)
        try:
            jn.load_checkpoint(path, {"params": tree})
            outcome = "restored"
        except jn.CheckpointError as e:
            outcome = f"raised CheckpointError: {str(e)[:120]}"
        say(
            library="jaxnitro TopKCheckpointer",
            mib=mib,
            save_s=round(save_s, 3),
            restore_s=round(restore_s, 3),
            flipped=str(flipped.relative_to(tmp)),
            corrupted_restore=outcome,
        )


def check_grain(samples: int = 20_000, batch: int = 100) -> None:
    import grain.python as gp

    import jaxnitro as jn

    x = np.random.default_rng(0).integers(0, 255, (samples, 28, 28), dtype=np.uint8)
    scale = 1 / 255  # a closure variable, as a notebook's transform has

    def transform(example, rng):
        img = example["x"].astype(np.float32) * scale
        return {"x": img[:, ::-1] if rng.random() < 0.5 else img}

    loader = jn.DataLoader({"x": x}, batch, transform=transform, workers=2, seed=0)
    t0 = time.perf_counter()
    it = iter(loader)
    next(it)
    first_s = time.perf_counter() - t0
    for _ in it:
        pass
    epoch_s = time.perf_counter() - t0
    loader.close()
    say(
        library="jaxnitro DataLoader workers=2",
        first_batch_s=round(first_s, 3),
        epoch_s=round(epoch_s, 3),
        samples=samples,
    )

    class Flip(gp.RandomMapTransform):
        def random_map(self, element, rng):
            img = element.astype(np.float32) * scale
            return img[:, ::-1] if rng.random() < 0.5 else img

    from absl import flags

    flags.FLAGS.mark_as_parsed()  # grain's workers read absl flags (outside absl.app.run too)
    sampler = gp.IndexSampler(
        samples, shard_options=gp.NoSharding(), shuffle=False, num_epochs=1, seed=0
    )
    t0 = time.perf_counter()
    try:
        dl = gp.DataLoader(
            data_source=x, sampler=sampler, worker_count=2, operations=[Flip(), gp.Batch(batch)]
        )
        it = iter(dl)
        next(it)
        first_s = time.perf_counter() - t0
        for _ in it:
            pass
        say(
            library="grain DataLoader worker_count=2",
            first_batch_s=round(first_s, 3),
            epoch_s=round(time.perf_counter() - t0, 3),
            samples=samples,
        )
    except Exception as e:  # noqa: BLE001 - what grain raises is the finding
        say(
            library="grain DataLoader worker_count=2",
            after_s=round(time.perf_counter() - t0, 3),
            outcome=f"raised {type(e).__name__}: {str(e)[:200]}",
        )


async def _uvicorn_case(protocol, limit: int | None, idle: int, wait_s: float) -> dict:
    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, http=protocol, limit_concurrency=limit, log_level="error", lifespan="off"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(idle)]
    await asyncio.sleep(wait_s)
    open_now = len(server.server_state.connections)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await writer.drain()
    status = (await asyncio.wait_for(reader.readline(), 5)).decode().strip()
    for _, w in [*held, (reader, writer)]:
        w.close()
    server.should_exit = True
    await task
    return {"idle_connections_open_after_s": [open_now, wait_s], "a_real_request_got": status}


def check_uvicorn(idle: int = 20, wait_s: float = 7.0) -> None:
    from jaxnitro._src.serve.connections import ConnectionLimits, protocol_class

    row = asyncio.run(_uvicorn_case("httptools", limit=idle, idle=idle, wait_s=wait_s))
    say(library=f"uvicorn limit_concurrency={idle}", idle=idle, **row)
    guarded = protocol_class(ConnectionLimits(header_timeout=2.0, max_connections=idle))
    row = asyncio.run(_uvicorn_case(guarded, limit=None, idle=idle, wait_s=wait_s))
    say(library=f"jaxnitro max_connections={idle}, header_timeout=2", idle=idle, **row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="orbax,grain,uvicorn")
    args = parser.parse_args()
    checks = {"orbax": check_orbax, "grain": check_grain, "uvicorn": check_uvicorn}
    for name in args.only.split(","):
        checks[name]()


if __name__ == "__main__":
    main()
