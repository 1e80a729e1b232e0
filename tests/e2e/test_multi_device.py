"""Data parallelism on fake CPU devices: the same run on 4 devices matches 1 device."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from helpers.paths import TESTS

SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import jax, numpy as np
    from conftest import Tiny, host_copy, nitro
    import jaxnitro as jn

    assert len(jax.devices()) == 4
    runs = {{}}
    for n_dev in (1, 4):
        n = nitro(Tiny(max_epochs=2), run_dir={tmp!r} + f"/d{{n_dev}}", n_devices=n_dev)
        r = jn.train(n)
        runs[n_dev] = (host_copy(n.params), r.history[-1]["acc"], n.mesh.size)
        if n_dev == 4:
            kernel = n.params["hidden"]["kernel"][...]
            assert len(kernel.sharding.device_set) == 4  # replicated over the data mesh
    diff = max(float(np.abs(a - b).max()) for a, b in
               zip(jax.tree.leaves(runs[1][0]), jax.tree.leaves(runs[4][0])))
    print("DIFF", diff, "ACC", runs[1][1], runs[4][1])
    n = nitro(Tiny(max_epochs=1), run_dir={tmp!r} + "/acc", n_devices=4, accum=2, steps_per_call=2)
    jn.train(n)
    print("STEPS", n.step)
    try:
        nitro(Tiny(), run_dir={tmp!r} + "/bad", n_devices=8)
    except jn.ConfigError as e:
        print("ERR", e)
""")


@pytest.mark.multi_device
def test_four_fake_devices_match_one(tmp_path):
    script = tmp_path / "md.py"
    script.write_text(SCRIPT.format(tests=str(TESTS), tmp=str(tmp_path)))
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    diff = float(out.stdout.split("DIFF")[1].split()[0])
    assert diff < 1e-5  # the data-parallel mean gradient equals the single-device one
    assert "STEPS 4" in out.stdout
    assert "n_devices=8 but only 4 device(s)" in out.stdout
