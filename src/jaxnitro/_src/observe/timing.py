"""Where an epoch's time goes, and the run's goodput.

The training thread's wall time in an epoch is split by what it was waiting on:

- `compile_s`: compiling train programs (a program first needed mid-epoch);
- `data_wait_s`: asking the feed for the next batch while the device sat idle (`data/waits.py`);
- `device_s`: the train programs running: the thread dispatching them, blocked reading their
  outputs back (a chunk at a time) or at the epoch's end, and asking for data while a step
  was still running (that ask ran in the device's shadow, so the device set the pace);
- `eval_s`: validation (mid-epoch ones and the epoch's);
- `checkpoint_stall_s`: training stopped for checkpoints (the copy to host memory of a
  background write, a whole foreground write);
- `host_s`: the rest, the driver's own Python between dispatches (logging the read-back steps,
  callbacks, bookkeeping), measured as the thread's time not in any of the above.

Their sum is the epoch's wall time (`wall_s`), each also as a fraction (`<name>_frac`). The
clock is read per dispatch and per read-back chunk, never by a device sync of its own.
"""

from __future__ import annotations

import dataclasses
import time

SPLIT = ("device_s", "host_s", "data_wait_s", "checkpoint_stall_s", "compile_s", "eval_s")


@dataclasses.dataclass
class EpochClock:
    """Seconds an epoch's training thread spent in each kind of wait (see the module)."""

    t0: float = dataclasses.field(default_factory=time.perf_counter)
    compile_s: float = 0.0
    dispatch_s: float = 0.0  # in the train calls (their dispatch; compiles apart)
    readback_s: float = 0.0  # blocked on step outputs (read-back chunks, the epoch's end)
    fetch_s: float = 0.0  # asking the feed for the next calls (data_wait_s is part of it)
    eval_s: float = 0.0
    checkpoint_stall_s: float = 0.0

    def restart(self) -> None:
        """The epoch's clock starts now (after batches staged on the device)."""
        self.t0 = time.perf_counter()

    def split(self, data_wait_s: float, now: float | None = None) -> dict[str, float]:
        """The split up to `now`, as `<name>_s` and `<name>_frac`, with `wall_s`."""
        wall = (time.perf_counter() if now is None else now) - self.t0
        data_wait = min(data_wait_s, self.fetch_s)
        parts = {
            "device_s": self.dispatch_s + self.readback_s + (self.fetch_s - data_wait),
            "data_wait_s": data_wait,
            "checkpoint_stall_s": self.checkpoint_stall_s,
            "compile_s": self.compile_s,
            "eval_s": self.eval_s,
        }
        parts["host_s"] = max(0.0, wall - sum(parts.values()))
        out = {k: parts[k] for k in SPLIT}
        out["wall_s"] = wall
        out.update({f"{k[:-2]}_frac": v / wall if wall > 0 else 0.0 for k, v in parts.items()})
        return out


@dataclasses.dataclass
class Goodput:
    """The run's wall time against the time its train programs produced kept steps."""

    t0: float = dataclasses.field(default_factory=time.perf_counter)
    totals: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(SPLIT, 0.0))
    hinted: bool = False  # the host-bound hint was shown (once a run)

    def add(self, split: dict[str, float]) -> None:
        for k in SPLIT:
            self.totals[k] += split.get(k, 0.0)

    def record(self, now: float | None = None) -> dict[str, float]:
        """`goodput` (device time of kept steps over the run's wall time), `wall_s`, the
        epochs' split summed, and `other_s`: the rest (setup, planning, the first
        compiles, the summary)."""
        wall = (time.perf_counter() if now is None else now) - self.t0
        out = {"goodput": self.totals["device_s"] / wall if wall > 0 else 0.0, "wall_s": wall}
        out.update(self.totals)
        out["other_s"] = max(0.0, wall - sum(self.totals.values()))
        return out


# The share of a step's time (the driver's Python and the device's) above which dispatch, not
# the device, sets the pace.
HOST_SHARE = 0.2


#: The fewest train calls an epoch needs to measure the cost of dispatch: a run stopped after a
#: step, or a short epoch, times its first read-backs and bookkeeping, not dispatch.
HINT_MIN_CALLS = 16


def host_bound_hint(
    split: dict[str, float], steps_per_call: int, *, steps: int, profiled: bool = False
) -> str | None:
    """A line when the driver's own Python took over `HOST_SHARE` of the train time (the
    device then waits for dispatch), naming `steps_per_call`; None otherwise, and None from
    an epoch that does not measure it: fewer than `HINT_MIN_CALLS` calls of its `steps`, or
    `profiled` (the profiler's start and stop ran on the driver's thread)."""
    if profiled or steps < HINT_MIN_CALLS * steps_per_call:
        return None
    host, device = split.get("host_s", 0.0), split.get("device_s", 0.0)
    if host + device <= 0 or host / (host + device) <= HOST_SHARE:
        return None
    more = max(8, 4 * steps_per_call)
    return (
        f"the driver's own Python took {host / (host + device):.0%} of the train time (host_s "
        f"{host:.2f}s against device_s {device:.2f}s): the steps are short enough that "
        f"dispatching them costs time. steps_per_call={more} (now {steps_per_call}), or "
        f"'auto', runs several steps per dispatch."
    )


_LABELS = {
    "device_s": "device",
    "host_s": "host",
    "data_wait_s": "data wait",
    "checkpoint_stall_s": "checkpoint",
    "compile_s": "compile",
    "eval_s": "eval",
}


def last_split(rows: list[dict]) -> dict[str, float] | None:
    """The last epoch line's split among a run's log rows (None: no epoch logged one)."""
    for row in reversed(rows):
        if row.get("type") == "metrics" and row.get("context") == "epoch" and "wall_s" in row:
            return {k: row[k] for k in (*SPLIT, "wall_s") if isinstance(row.get(k), int | float)}
    return None


def format_split(split: dict[str, float], *, short: bool = False) -> str:
    """'device 78% · data wait 17% · ...' of the wall time, largest first (`short`: the two
    largest, no total)."""
    wall = split.get("wall_s", 0.0)
    if wall <= 0:
        return "-"
    parts = sorted(((split.get(k, 0.0) / wall, k) for k in SPLIT), reverse=True)
    text = " · ".join(f"{_LABELS[k]} {frac:.0%}" for frac, k in parts[: 2 if short else None])
    return text if short else f"{text} of {wall:.2f}s"
