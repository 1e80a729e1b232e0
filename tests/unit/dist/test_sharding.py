"""Sharding: the FSDP rule, user rules, and runs on 8 fake CPU devices that match one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers.paths import TESTS
from jax.sharding import PartitionSpec as P

import jaxnitro as jn
from jaxnitro._src.dist.sharding import param_specs, resolve, spec_for

MIB = 2**20


# ---------------------------------------------------------------- the rules, without devices
def test_the_fsdp_rule_replicates_small_arrays_and_splits_the_largest_divisible_dim():
    assert spec_for((1024, 4096), 16 * MIB, 8, 4 * MIB) == P(None, "data")
    assert spec_for((4096, 1024), 16 * MIB, 8, 4 * MIB) == P("data")
    assert spec_for((1000, 4096), 16 * MIB, 8, 4 * MIB) == P(None, "data")
    assert spec_for((1001, 4095), 16 * MIB, 8, 4 * MIB) == P()  # nothing divides: whole
    assert spec_for((256, 256), 256 * 1024, 8, 4 * MIB) == P()  # small: replicated
    assert spec_for((4096, 4096), 64 * MIB, 1, 4 * MIB) == P()  # one device


def test_user_rules_come_first_and_two_matching_rules_are_named():
    params = {
        "emb": {"table": np.zeros((16, 8), np.float32)},
        "mlp": {"kernel": np.zeros((8, 16), np.float32)},
        "out": {"kernel": np.zeros((8, 4), np.float32)},
    }
    axes = {"data": 2, "model": 2}
    # Every parameter is contested: the FSDP rule splits each (min_shard_bytes=0), and Flax
    # annotations name a spec for two of them. Order: user rule, annotation, FSDP.
    s = jn.Sharding(
        mesh=axes, fsdp=True, min_shard_bytes=0, rules=[(r"^mlp/kernel$", P(None, "model"))]
    )
    annotated = {
        "emb": {"table": None},
        "mlp": {"kernel": P("model")},
        "out": {"kernel": P("model")},
    }
    specs = param_specs(params, s, axes, annotated)
    assert specs["mlp"]["kernel"] == P(None, "model")  # the rule, over annotation and FSDP
    assert specs["out"]["kernel"] == P("model")  # the annotation, over FSDP's P("data")
    assert specs["emb"]["table"] == P("data")  # FSDP alone
    plain = jn.Sharding(mesh=axes, rules=[(r"^mlp/kernel$", P(None, "model"))])
    specs = param_specs(params, plain, axes)
    assert specs["mlp"]["kernel"] == P(None, "model") and specs["out"]["kernel"] == P()
    both = jn.Sharding(rules=[(r"kernel", P()), (r"mlp/", P("data"))])
    with pytest.raises(jn.ConfigError, match=r"matches two sharding rules, 'kernel' and 'mlp/'"):
        param_specs(params, both, {"data": 2})


def test_a_rule_that_does_not_fit_the_mesh_says_why():
    params = {"w": np.zeros((6, 4), np.float32)}
    with pytest.raises(jn.ConfigError, match=r"does not divide by the 4 devices"):
        param_specs(params, jn.Sharding(rules=[("w", P("data"))]), {"data": 4})
    with pytest.raises(jn.ConfigError, match=r"names mesh axis 'model'"):
        param_specs(params, jn.Sharding(rules=[("w", P(None, "model"))]), {"data": 2})


def test_bad_sharding_settings_name_the_fix(run_dir):
    with pytest.raises(jn.ConfigError, match=r"use 'dp'.*'fsdp'.*jn.Sharding"):
        resolve("zero3")
    with pytest.raises(jn.ConfigError, match=r"a 'data' axis"):
        jn.Sharding(mesh={"model": 2})
    with pytest.raises(jn.ConfigError, match=r"PartitionSpec"):
        jn.Sharding(rules=[("w", ("data",))])


# ---------------------------------------------------------------- 8 fake devices
SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    sys.path.insert(0, {tests!r})
    warnings.simplefilter("ignore")
    import jax, numpy as np
    from jax.sharding import PartitionSpec as P
    from conftest import Tiny, host_copy, nitro
    import jaxnitro as jn

    assert len(jax.devices()) == 8
    tmp = {tmp!r}
    out = {{}}

    def diff(a, b):
        return max(float(np.abs(x - y).max()) for x, y in
                   zip(jax.tree.leaves(host_copy(a)), jax.tree.leaves(host_copy(b))))

    def run(name, **kw):
        n = nitro(Tiny(max_epochs=2, val_batch=40), run_dir=tmp + "/" + name, **kw)
        jn.train(n)
        return n

    one = run("one", n_devices=1)
    dp = run("dp", n_devices=8)
    fsdp_all = jn.Sharding(fsdp=True, min_shard_bytes=0)
    fsdp = run("fsdp", n_devices=8, sharding=fsdp_all)
    kernel = fsdp.params["hidden"]["kernel"][...]
    out["fsdp_kernel_shard"] = list(kernel.sharding.shard_shape(kernel.shape))
    out["fsdp_kernel_spec"] = str(kernel.sharding.spec)
    mu = [x for x in jax.tree.leaves(fsdp.opt_state) if getattr(x, "shape", None) == (8, 16)]
    out["fsdp_moments_sharded"] = all(not x.is_fully_replicated for x in mu) and len(mu) >= 2
    out["dp_vs_one"] = diff(dp.params, one.params)
    out["fsdp_vs_one"] = diff(fsdp.params, one.params)
    out["plan_dp"] = jn.memory_plan(dp).params_bytes
    out["plan_fsdp"] = jn.memory_plan(fsdp).params_bytes
    out["inspect"] = str(jn.inspect(fsdp, show=False).sharding)

    rules = [(r"^hidden/kernel$", P(None, "model")), (r"^out/kernel$", P("model"))]
    two_d = jn.Sharding(mesh={{"data": 4, "model": 2}}, rules=rules)
    m = run("2d", sharding=two_d)
    out["2d_vs_one"] = diff(m.params, one.params)
    out["2d_spec"] = str(m.params["hidden"]["kernel"][...].sharding.spec)

    # A checkpoint written on 8 devices under FSDP resumes on 4 devices, data parallel.
    kw = dict(val_batch=40)
    half = nitro(Tiny(max_epochs=1, **kw), run_dir=tmp + "/moved", n_devices=8, sharding=fsdp_all)
    jn.train(half)
    moved = nitro(Tiny(max_epochs=2, **kw), run_dir=tmp + "/moved", n_devices=4, resume="auto")
    out["moved_start"] = [moved.step, half.step, str(moved.spec.resume_path)]
    out["half_checkpoint"] = str(half.checkpointer.latest())
    jn.train(moved)
    out["moved_vs_fsdp"] = diff(moved.params, fsdp.params)
    out["moved_devices"] = len(moved.params["hidden"]["kernel"][...].sharding.device_set)
    print("OUT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharding")
    script = tmp / "sh.py"
    script.write_text(SCRIPT.format(tests=str(TESTS), tmp=str(tmp)))
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("OUT", 1)[1])


@pytest.mark.multi_device
def test_dp_and_fsdp_on_eight_devices_end_equal_to_one_device(eight):
    assert eight["dp_vs_one"] < 1e-5
    assert eight["fsdp_vs_one"] < 1e-5


@pytest.mark.multi_device
def test_fsdp_splits_the_weights_and_their_optimizer_state(eight):
    assert eight["fsdp_kernel_shard"] == [8, 2]  # (8, 16) split along its largest dim
    assert "data" in eight["fsdp_kernel_spec"]
    assert eight["fsdp_moments_sharded"]
    assert eight["plan_fsdp"] < eight["plan_dp"]  # the plan counts bytes per device
    assert "per device" in eight["inspect"] and "'data'" in eight["inspect"]


@pytest.mark.multi_device
def test_a_two_dimensional_mesh_with_rules_trains_like_one_device(eight):
    assert eight["2d_vs_one"] < 1e-5
    assert "model" in eight["2d_spec"]


@pytest.mark.multi_device
def test_a_checkpoint_from_eight_fsdp_devices_resumes_on_four(eight):
    # The moved handle starts where the 8-device run stopped (one epoch: 8 steps), from its
    # checkpoint; retraining from scratch would land on the same weights, so this is the test.
    start, saved, resumed_from = eight["moved_start"]
    assert start == saved == 8
    assert resumed_from == eight["half_checkpoint"] != "None"
    assert eight["moved_devices"] == 4
    assert eight["moved_vs_fsdp"] < 1e-5
