"""The bad-input suite: every mistake a user can make gets a jaxnitro error that names the
problem and the fix, raised where the mistake is made, never a JAX-internal traceback.

Each test asserts the error type and key substrings of the message (the problem, then the
fix). `docs/errors.md` lists every case.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import Tiny, leaves_equal, make_data, nitro
from helpers.paths import TESTS

import jaxnitro as jn
from jaxnitro._src.checkpoint.runlock import LOCK_NAME as RUN_LOCK
from jaxnitro._src.checkpoint.runlock import RunLockedError
from jaxnitro._src.core.errors import ConfigArgumentError, JaxnitroError
from jaxnitro._src.run.early_stop import EarlyStopping

SRC = Path(jn.__file__).resolve().parent


def check(excinfo, *patterns: str) -> str:
    """Every pattern is in the message; the error is jaxnitro's own (not a JAX internal)."""
    err = excinfo.value
    msg = str(err)
    for p in patterns:
        assert re.search(p, msg, re.S), f"{p!r} not in message:\n{msg}"
    if not isinstance(err, JaxnitroError):  # a builtin (TypeError...) must come from jaxnitro
        raiser = Path(str(excinfo.traceback[-1].path)).resolve()
        assert SRC in raiser.parents, f"{type(err).__name__} raised in {raiser}: {msg}"
    assert "jax._src" not in msg and "Traceback" not in msg, msg
    return msg


def batches(n_batches=8, bs=32, seed=0, **extra):
    """A list of dict batches (a re-iterable split), Tiny's fields x/y."""
    x, y = make_data(n_batches * bs, seed)
    out = [{"x": x[i * bs : (i + 1) * bs], "y": y[i * bs : (i + 1) * bs]} for i in range(n_batches)]
    for b in out:
        b.update(extra)
    return out


# ----------------------------------------------------------------------- experiment fields
def test_wrong_field_type():
    with pytest.raises(jn.ConfigError) as e:
        Tiny(width="wide")
    check(e, r"field 'width' is declared int but got 'wide' \(str\)", r"pass an integer")


def test_unhashable_graphconst():
    @jn.experiment
    class Layers(Tiny):
        sizes: jn.GraphConst[object] = (16, 16)

    with pytest.raises(jn.ConfigError) as e:
        Layers(sizes=[16, 16])
    check(e, r"GraphConst field 'sizes' holds an unhashable list", r"use a tuple instead of a list")


def test_graphconst_hashing_by_identity():
    class Opaque:  # default __hash__/__eq__: identity
        pass

    @jn.experiment
    class WithObj(Tiny):
        thing: jn.GraphConst[object] = None

    with pytest.raises(jn.ConfigError) as e:
        WithObj(thing=Opaque())
    check(e, r"'thing' holds a Opaque that hashes by identity", r"@dataclass\(frozen=True\)")


def test_graphconst_driver_field():
    with pytest.raises(jn.ConfigError) as e:

        @jn.experiment
        class Bad:
            max_epochs: jn.GraphConst[int] = 3

    check(e, r"Bad\.max_epochs is a driver setting and cannot be GraphConst", r"Remove the marker")


def test_bare_marker_without_type():
    with pytest.raises(jn.ConfigError) as e:

        @jn.experiment
        class Bad:
            width: jn.GraphConst = 3

    check(e, r"bare jn\.GraphConst needs a type", r"jn\.GraphConst\[float\]")


def test_device_field_given_a_string():
    with pytest.raises(jn.ConfigError) as e:
        Tiny(smoothing="a lot")
    check(e, r"field 'smoothing' is declared float but got 'a lot'")


def test_unknown_experiment_kwarg():
    with pytest.raises(ConfigArgumentError) as e:
        Tiny(widht=32)
    check(e, r"Tiny has no field 'widht'", r"Did you mean 'width'\?")
    assert isinstance(e.value, TypeError)  # also what Python users expect


def test_positional_args():
    with pytest.raises(ConfigArgumentError) as e:
        Tiny(32)
    check(e, r"Tiny takes keyword arguments only", r"Tiny\(width=\.\.\.\)", r"got 1 positional")


def test_unknown_preset():
    @jn.experiment
    class WithPresets(Tiny):
        @classmethod
        def presets(cls):
            return {"small": {"width": 8}}

    with pytest.raises(jn.ConfigError) as e:
        WithPresets.from_preset("smal")
    check(e, r"no preset 'smal'", r"presets: \['small'\]", r"Did you mean 'small'\?")


# ---------------------------------------------------------------------------------- hooks
@pytest.mark.slow
def test_host_field_read_in_traced_code(run_dir):
    @jn.experiment
    class ReadsHost(Tiny):
        def metrics(self, logits, *, y):
            return {"acc": ((logits.argmax(-1) == y).sum() * self.n_train, y.shape[0])}

    with pytest.raises(jn.HostFieldError) as e:
        nitro(ReadsHost(), run_dir=run_dir)  # metric names are traced at setup
    check(
        e,
        r"metrics\(\) read Host field 'n_train' of ReadsHost inside traced code",
        r"jn\.GraphConst\[int\]",
        r"jn\.Device\[int\]",
    )


def test_missing_hook(run_dir):
    @jn.experiment
    class NoLoss:
        def build_model(self, rng):
            return Tiny().build_model(rng)

        def build_data(self, dist):
            return Tiny().build_data(dist)

        def forward(self, model, params, state, *, x):
            return jn.apply(model, params, state, x)

    with pytest.raises(jn.HookError) as e:
        nitro(NoLoss(), run_dir=run_dir)
    check(e, r"NoLoss is missing required hook\(s\)", r"loss\(self, outputs, \*, <batch fields>\)")


def test_misspelled_hook(run_dir):
    @jn.experiment
    class Typo(Tiny):
        def metric(self, logits, *, y):
            return {}

    with pytest.raises(jn.HookError) as e:
        nitro(Typo(), run_dir=run_dir)
    check(
        e,
        r"Typo\.metric looks like a misspelled hook and would never be called",
        r"Did you mean 'metrics'\?",
        r"prefix it with '_' if it is a helper",
    )


def test_hook_with_wrong_signature(run_dir):
    @jn.experiment
    class PositionalLabel(Tiny):
        def loss(self, logits, y):  # batch fields are keyword-only
            return super().loss(logits, y=y)

    with pytest.raises(jn.HookError) as e:
        nitro(PositionalLabel(), run_dir=run_dir)
    check(
        e,
        r"PositionalLabel\.loss\(self, logits, y\) has the wrong signature",
        r"expected loss\(self, outputs, \*, <batch fields>\)",
        r"put them after a '\*'",
    )


def test_forward_with_too_few_parameters(run_dir):
    @jn.experiment
    class NoState(Tiny):
        def forward(self, model, params, *, x):
            return jn.apply(model, params, {}, x)

    with pytest.raises(jn.HookError) as e:
        nitro(NoState(), run_dir=run_dir)
    check(
        e,
        r"NoState\.forward.*has the wrong signature",
        r"forward\(self, model, params, state, \*, <batch fields>\)",
    )


@pytest.mark.slow
def test_batch_missing_a_routed_field(run_dir):
    @jn.experiment
    class WantsLabel(Tiny):
        def loss(self, logits, *, label):
            return super().loss(logits, y=label)

    with pytest.raises(jn.RoutingError) as e:
        nitro(WantsLabel(), run_dir=run_dir)
    check(
        e,
        r"loss\(\) needs batch field\(s\) \['label'\] but the 'train' batches have \['x', 'y'\]",
        r"Rename the keyword parameter or add the field to the data",
    )


@pytest.mark.slow
def test_build_model_returning_a_module(run_dir):
    @jn.experiment
    class RawModule(Tiny):
        def build_model(self, rng):
            from conftest import TinyMLP
            from flax import nnx

            return TinyMLP(16, rngs=nnx.Rngs(rng))

    with pytest.raises(jn.HookError) as e:
        nitro(RawModule(), run_dir=run_dir)
    check(
        e,
        r"RawModule\.build_model must return \(model, params, state\), got TinyMLP",
        r"return jn\.split_model\(module\)",
    )


def test_build_data_returning_a_list(run_dir):
    @jn.experiment
    class ListData(Tiny):
        def build_data(self, dist):
            return list(super().build_data(dist).values())

    with pytest.raises(jn.HookError) as e:
        nitro(ListData(), run_dir=run_dir)
    check(
        e,
        r"build_data must return a dict of splits",
        r"\{'train': loader, 'val': loader\}",
        r"got list",
    )


def test_forward_not_returning_a_pair(run_dir):
    @jn.experiment
    class LogitsOnly(Tiny):
        def forward(self, model, params, state, *, x):
            return jn.apply(model, params, state, x)[0]

    with pytest.raises(jn.HookError) as e:
        nitro(LogitsOnly(), run_dir=run_dir)
    check(
        e,
        r"LogitsOnly\.forward must return \(outputs, new_state\), got ArrayImpl|"
        r"LogitsOnly\.forward must return \(outputs, new_state\), got \w+",
        r"return jn\.apply\(model, params, state, x\)",
    )


def test_loss_returning_a_non_scalar(run_dir):
    @jn.experiment
    class PerExample(Tiny):
        def loss(self, logits, *, y):
            return optax.softmax_cross_entropy_with_integer_labels(logits, y)

    with pytest.raises(jn.HookError) as e:
        nitro(PerExample(), run_dir=run_dir)
    check(
        e,
        r"PerExample\.loss\(\) returned an array of shape \(20,\) on a batch of the 'val' "
        r"split \(20 rows\); it must return a scalar",
        r"return losses\.mean\(\)",
    )


def test_loss_returning_an_integer(run_dir):
    @jn.experiment
    class IntLoss(Tiny):
        def loss(self, logits, *, y):
            return (logits.argmax(-1) != y).sum()

    with pytest.raises(jn.HookError) as e:
        nitro(IntLoss(), run_dir=run_dir)
    check(
        e,
        r"loss\(\) must return a floating-point scalar, got dtype int32",
        r"integer loss has no gradient",
    )


def test_metrics_returning_a_bare_number(run_dir):
    @jn.experiment
    class BareMetrics(Tiny):
        def metrics(self, logits, *, y):
            return (logits.argmax(-1) == y).mean()

    with pytest.raises(jn.MetricsError) as e:
        nitro(BareMetrics(), run_dir=run_dir)
    check(
        e,
        r"metrics\(\) must return a dict name -> \(sum, count\), got an array of shape "
        r"\(\) \(float32\)",
        r"return \{'acc': \(\(logits\.argmax\(-1\) == label\)\.sum\(\), label\.shape\[0\]\)\}",
    )


def test_metric_value_neither_a_pair_nor_valid(run_dir):
    @jn.experiment
    class BareValue(Tiny):
        def metrics(self, logits, *, y):
            return {"acc": (logits.argmax(-1) == y).mean()}

    with pytest.raises(jn.MetricsError) as e:
        nitro(BareValue(), run_dir=run_dir)
    check(
        e,
        r"returned 'acc' as an array of shape \(\) \(float32\)",
        r"each metric is \(sum, count\)",
        r"\(total, None\) for a value that is summed and never divided",
    )


def test_metric_triple_is_refused(run_dir):
    @jn.experiment
    class Triple(Tiny):
        def metrics(self, logits, *, y):
            correct = (logits.argmax(-1) == y).sum()
            return {"acc": (correct, y.shape[0], "mean")}

    with pytest.raises(jn.MetricsError) as e:
        nitro(Triple(), run_dir=run_dir)
    check(e, r"'acc' as a 3-element tuple", r"each metric is \(sum, count\)")


def test_metric_name_that_is_not_a_string(run_dir):
    @jn.experiment
    class IntName(Tiny):
        def metrics(self, logits, *, y):
            return {0: ((logits.argmax(-1) == y).sum(), y.shape[0])}

    with pytest.raises(jn.MetricsError) as e:
        nitro(IntName(), run_dir=run_dir)
    check(e, r"returned a non-string metric name 0", r"name metrics with strings")


def test_metric_sum_that_is_not_numeric(run_dir):
    @jn.experiment
    class StringSum(Tiny):
        def metrics(self, logits, *, y):
            return {"acc": ("correct", y.shape[0])}

    with pytest.raises(jn.MetricsError) as e:
        nitro(StringSum(), run_dir=run_dir)
    check(
        e,
        r"returned a sum for 'acc' that is not numeric \('correct'\)",
        r"e\.g\. \(correct\.sum\(\), label\.shape\[0\]\)",
    )


def test_metric_count_that_is_not_a_scalar(run_dir):
    @jn.experiment
    class VectorCount(Tiny):
        def metrics(self, logits, *, y):
            return {"acc": ((logits.argmax(-1) == y).sum(), jnp.ones_like(y))}

    with pytest.raises(jn.MetricsError) as e:
        nitro(VectorCount(), run_dir=run_dir)
    check(e, r"a count of shape \(20,\) for 'acc'", r"a count is a scalar")


def test_train_metrics_not_a_scalar(run_dir):
    @jn.experiment
    class VectorTrainMetric(Tiny):
        def train_metrics(self, logits, *, y):
            return {"margin": logits.max(-1)}

    with pytest.raises(jn.HookError) as e:
        jn.train(nitro(VectorTrainMetric(), run_dir=run_dir, max_epochs=1))
    check(e, r"train_metrics 'margin' has shape \(32,\)", r"each train metric is a scalar")


def test_derive_returning_junk(run_dir):
    @jn.experiment
    class BadDerive(Tiny):
        def derive(self, data):
            return [("width", 8)]

    with pytest.raises(jn.HookError) as e:
        nitro(BadDerive(), run_dir=run_dir)
    check(e, r"derive must return a dict field -> value, got list")


def test_derive_setting_an_unknown_field(run_dir):
    @jn.experiment
    class UnknownDerive(Tiny):
        def derive(self, data):
            return {"widht": 8}

    with pytest.raises(jn.ConfigError) as e:
        nitro(UnknownDerive(), run_dir=run_dir)
    check(
        e,
        r"Tiny has no field 'widht'|UnknownDerive has no field 'widht'",
        r"Did you mean 'width'\?",
    )


def test_model_error_inside_forward_names_the_hook_and_shapes(run_dir):
    x, y = make_data(64)
    data = {"train": jn.DataLoader({"x": x[:, :5], "y": y}, 32, drop_last=True)}
    n = nitro(run_dir=run_dir, data=data, max_epochs=1)
    with pytest.raises(TypeError) as e:  # JAX's own error type is kept, with context added
        jn.train(n)
    notes = "\n".join(getattr(e.value, "__notes__", []))
    assert "forward" in notes and "(32, 5)" in notes, notes


def test_optimizer_hook_returning_junk(run_dir):
    @jn.experiment
    class JunkOptimizer(Tiny):
        def optimizer(self, group):
            return "adam"

    with pytest.raises(jn.ConfigError) as e:
        nitro(JunkOptimizer(), run_dir=run_dir)
    check(
        e,
        r"optimizer\('default'\) must return an optax factory such as optax\.adamw",
        r"got 'adam'",
    )


def test_optimizer_hook_returning_a_transformation_with_a_schedule(run_dir):
    @jn.experiment
    class FixedTx(Tiny):
        def optimizer(self, group):
            return optax.adam(1e-3)

    with pytest.raises(jn.ConfigError) as e:
        nitro(
            FixedTx(),
            run_dir=run_dir,
            schedules={"opt.learning_rate": jn.schedules.warmup_cosine()},
        )
    check(e, r"returned a ready optax transformation", r"Return the factory instead")


def test_learning_rate_hook_returning_none(run_dir):
    @jn.experiment
    class NoRate(Tiny):
        def learning_rate(self, group):
            pass  # forgot the return

    with pytest.raises(jn.ConfigError) as e:
        nitro(NoRate(), run_dir=run_dir)
    check(e, r"learning_rate\('default'\) returned None", r"return a float")


def test_learning_rate_zero_everywhere(run_dir):
    @jn.experiment
    class Frozen(Tiny):
        def learning_rate(self, group):
            return 0.0

    with pytest.raises(jn.ConfigError) as e:
        nitro(Frozen(), run_dir=run_dir)
    check(
        e,
        r"every parameter group has learning rate 0: nothing would train",
        r"Set a positive rate in learning_rate\(self, group\)",
    )


def test_negative_learning_rate(run_dir):
    @jn.experiment
    class Negative(Tiny):
        def learning_rate(self, group):
            return -1e-3

    with pytest.raises(jn.ConfigError) as e:
        nitro(Negative(), run_dir=run_dir)
    check(e, r"learning_rate\('default'\) returned -0\.001", r"return a finite rate >= 0")


def test_finalize_metrics_returning_junk(run_dir):
    @jn.experiment
    class BadFinalize(Tiny):
        def finalize_metrics(self, values, split):
            return values["acc"]

    with pytest.raises(JaxnitroError) as e:
        jn.validate(nitro(BadFinalize(), run_dir=run_dir))
    check(e, r"finalize_metrics must return a dict, got float")


# ----------------------------------------------------------------------------------- data
def test_fields_with_different_batch_sizes():
    x, y = make_data(64)
    with pytest.raises(jn.DataError) as e:
        jn.DataLoader({"x": x, "y": y[:60]}, 32)
    check(
        e,
        r"fields must share their leading \(sample\) dimension; got \{'x': 64, 'y': 60\}",
        r"Batch dimension comes first",
    )


def test_batch_fields_with_different_batch_sizes(run_dir):
    bad = batches()
    bad[0] = {"x": bad[0]["x"], "y": bad[0]["y"][:16]}
    with pytest.raises(jn.DataError) as e:
        nitro(run_dir=run_dir, data={"train": bad})
    check(
        e,
        r"the 'train' batch fields disagree on the batch size \(leading dimension\): "
        r"\{'x': 32, 'y': 16\}",
        r"slice all fields with the same indices",
    )


def test_empty_batch_dict(run_dir):
    with pytest.raises(jn.DataError) as e:
        nitro(run_dir=run_dir, data={"train": [{}, {}]})
    check(
        e,
        r"the 'train' split yielded an empty batch \(a dict with no fields\)",
        r"Yield dicts of arrays",
    )


@pytest.mark.slow
def test_batch_key_set_changing_mid_epoch(run_dir):
    bad = batches()
    bad[3] = {**bad[3], "w": np.ones(32, np.float32)}
    n = nitro(run_dir=run_dir, data={"train": bad}, max_epochs=1)
    with pytest.raises(jn.DataError) as e:
        jn.train(n)
    check(
        e,
        r"the 'train' batch fields changed mid-run: expected \['x', 'y'\], got \['w', 'x', 'y'\]",
        r"Every batch of a split must carry the same fields",
    )


def test_non_array_field():
    x, _ = make_data(64)
    with pytest.raises(jn.DataError) as e:
        jn.DataLoader({"x": x, "y": {"labels": 1}}, 32)
    check(e, r"batch field 'y' is a dict, not an array", r"convert it with np\.asarray, or drop it")


def test_non_array_field_in_a_batch(run_dir):
    bad = batches(extra="ignored")
    with pytest.raises(jn.DataError) as e:
        nitro(run_dir=run_dir, data={"train": bad})
    check(e, r"batch field 'extra' is a str, not an array", r"np\.asarray")


def test_object_dtype():
    x, _ = make_data(64)
    names = np.array(["cat", "dog"] * 32, dtype=object)
    with pytest.raises(jn.DataError) as e:
        jn.DataLoader({"x": x, "name": names}, 32)
    check(
        e,
        r"batch field 'name' has dtype object, which cannot go to a device",
        r"Encode it as numbers",
    )


def test_string_dtype():
    x, _ = make_data(64)
    with pytest.raises(jn.DataError) as e:
        jn.DataLoader({"x": x, "name": np.array(["cat", "dog"] * 32)}, 32)
    check(e, r"batch field 'name' has dtype <U3, which cannot go to a device")


def test_scalar_batch_field(run_dir):
    bad = batches()
    for b in bad:
        b["scale"] = np.float32(2.0)
    with pytest.raises(jn.DataError) as e:
        nitro(run_dir=run_dir, data={"train": bad})
    check(
        e,
        r"batch field 'scale' of split 'train' is a scalar",
        r"batch dimension first",
        r"np\.full\(batch_size, value\)",
        r"make it an experiment field",
    )


def test_scalar_dataloader_field():
    x, y = make_data(64)
    with pytest.raises(jn.DataError) as e:
        jn.DataLoader({"x": x, "y": y, "temperature": 0.5}, 32)
    check(
        e,
        r"DataLoader field 'temperature' is a scalar",
        r"np\.full\(n, value\)",
        r"make it an experiment field",
    )


def test_split_yielding_tuples(run_dir):
    x, y = make_data(64)
    with pytest.raises(jn.DataError) as e:
        nitro(run_dir=run_dir, data={"train": [(x[:32], y[:32]), (x[32:], y[32:])]})
    check(
        e,
        r"the 'train' split yielded a tuple",
        r"batches are dicts of arrays",
        r"Wrap your arrays in jn\.DataLoader",
    )


@pytest.fixture
def ragged_train(run_dir):
    x, y = make_data(250)
    return {"train": jn.DataLoader({"x": x, "y": y}, 32)}


def test_ragged_train_loader(run_dir, ragged_train):
    with pytest.raises(jn.DataError) as e:
        nitro(run_dir=run_dir, data=ragged_train)
    check(
        e,
        r"the 'train' split has 250 samples, which batch_size=32 does not divide",
        r"Pass drop_last=True to the train DataLoader",
    )


def test_short_batch_in_a_train_list(run_dir):
    bad = batches()
    bad[5] = {k: v[:20] for k, v in bad[5].items()}
    n = nitro(run_dir=run_dir, data={"train": bad}, max_epochs=1)
    with pytest.raises(jn.DataError) as e:
        jn.train(n)
    check(e, r"a train batch of epoch 1 has 20 samples, not 32", r"drop_last=True")


def test_accum_not_dividing_the_epoch(run_dir):
    with pytest.raises(jn.ConfigError) as e:
        nitro(run_dir=run_dir, accum=3)
    check(
        e, r"accum=3 does not divide the 8 train batches of an epoch", r"Use accum in \[1, 2, 4\]"
    )


def test_one_shot_iterator_split(run_dir):
    with pytest.raises(jn.DataError) as e:
        nitro(run_dir=run_dir, data={"train": iter(batches())})
    check(
        e,
        r"split 'train' is a one-shot iterator",
        r"empty after the first epoch",
        r"Pass a re-iterable \(a list of batches or a jn\.DataLoader\)",
    )


def test_generator_split(run_dir):
    with pytest.raises(jn.DataError) as e:
        nitro(run_dir=run_dir, data={"train": (b for b in batches())})
    check(e, r"split 'train' is a one-shot iterator \(generator\)")


def test_empty_dataloader():
    x, y = make_data(64)
    with pytest.raises(jn.DataError) as e:
        jn.DataLoader({"x": x[:0], "y": y[:0]}, 32)
    check(e, r"DataLoader got 0 samples", r"Check the loading or filtering")


def test_empty_split(run_dir):
    with pytest.raises(jn.DataError) as e:
        nitro(run_dir=run_dir, data={"train": batches(), "val": []})
    check(e, r"split 'val' is empty", r"Remove the split, or check what build_data loads")


def test_no_train_split(run_dir):
    with pytest.raises(jn.DataError) as e:
        nitro(run_dir=run_dir, data={"trian": batches()})
    check(
        e, r"splits \['trian'\] but no 'train' split, which is required", r"Did you mean 'trian'\?"
    )


def test_dataloader_bad_batch_size():
    x, y = make_data(64)
    with pytest.raises(jn.DataError) as e:
        jn.DataLoader({"x": x, "y": y}, 0)
    check(e, r"batch_size must be an int >= 1, got 0")


def test_dataloader_given_arrays_not_a_dict():
    x, y = make_data(64)
    with pytest.raises(jn.DataError) as e:
        jn.DataLoader((x, y), 32)
    check(
        e,
        r"DataLoader takes a non-empty dict of arrays \{field: array\}, got tuple",
        r"jn\.DataLoader\(\{'img': x, 'label': y\}, 32\)",
    )


def test_nan_loss_names_step_and_epoch(run_dir):
    x, y = make_data(256)
    x[3 * 32 + 5] = np.nan  # in the 4th batch: optimizer step 4
    data = {"train": jn.DataLoader({"x": x, "y": y}, 32, drop_last=True)}
    n = nitro(run_dir=run_dir, data=data, max_epochs=2)
    with pytest.raises(jn.NonFiniteLossError) as e:
        jn.train(n)
    check(
        e,
        r"the training loss is nan at step 4 \(epoch 1, batch 3\)",
        r"Lower the learning rate, check the data for NaN/inf, or add gradient clipping",
    )


# ----------------------------------------------------------------------- driver settings
def test_nitro_given_the_class(run_dir):
    with pytest.raises(jn.ConfigError) as e:
        jn.Nitro(Tiny, run_dir=run_dir)
    check(
        e,
        r"Nitro takes an experiment instance, got the class Tiny",
        r"pass an instance: jn\.Nitro\(MyExp\(\)\)",
    )


def test_nitro_given_a_plain_object(run_dir):
    class Plain:
        pass

    with pytest.raises(jn.ConfigError) as e:
        jn.Nitro(Plain(), run_dir=run_dir)
    check(e, r"got Plain", r"Decorate the class with @jn\.experiment")


def test_misspelled_nitro_keyword(run_dir):
    with pytest.raises(ConfigArgumentError) as e:
        nitro(run_dir=run_dir, checkpionter=jn.TopKCheckpointer())
    check(e, r"'checkpionter'", r"Did you mean 'checkpointer'\?")


def test_bad_precision(run_dir):
    with pytest.raises(jn.ConfigError) as e:
        nitro(run_dir=run_dir, precision="bfloat16")
    check(
        e, r"precision='bfloat16'", r"use 'f32' \(the default\) or 'bf16'", r"Did you mean 'bf16'\?"
    )


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"seed": "42"}, r"seed must be an int >= 0, got '42'"),
        ({"max_epochs": 0}, r"max_epochs must be an int >= 1, got 0"),
        ({"accum": 0}, r"accum must be an int >= 1, got 0"),
    ],
)
def test_bad_int_settings(run_dir, kw, pattern):
    with pytest.raises(jn.ConfigError) as e:
        nitro(run_dir=run_dir, **kw)
    check(e, pattern)


def test_checkpointer_of_the_wrong_type(run_dir):
    with pytest.raises(jn.ConfigError) as e:
        nitro(run_dir=run_dir, checkpointer="topk")
    check(e, r"checkpointer must be a jn\.TopKCheckpointer, got str")


def test_bad_topk_mode():
    with pytest.raises(jn.ConfigError) as e:
        jn.TopKCheckpointer(metric="acc", mode="maximize")
    check(
        e,
        r"checkpoint mode='maximize' is invalid",
        r"valid modes are 'min', 'max'",
        r"Did you mean 'max'\?",
    )


def test_bad_topk_k():
    with pytest.raises(jn.ConfigError) as e:
        jn.TopKCheckpointer(k=0)
    check(e, r"TopKCheckpointer k must be an int >= 1, got 0", r"how many checkpoints to keep")


def test_bad_early_stopping_mode():
    with pytest.raises(jn.ConfigError) as e:
        EarlyStopping(metric="acc", mode="maximize")
    check(e, r"EarlyStopping mode='maximize' is invalid", r"'min'.*'max'", r"Did you mean 'max'\?")


def test_monitored_metric_absent(run_dir):
    with pytest.raises(jn.ConfigError) as e:
        nitro(run_dir=run_dir, checkpointer=jn.TopKCheckpointer(metric="accuracy", mode="max"))
    check(
        e,
        r"the checkpointer monitors 'accuracy', which this run never produces",
        r"validation produces \['acc', 'val_loss'\]",
        r"Did you mean 'acc'\?",
    )


def test_early_stopping_metric_absent(run_dir):
    with pytest.raises(jn.ConfigError) as e:
        nitro(run_dir=run_dir, early_stop=EarlyStopping(metric="accuracy", mode="max"))
    check(
        e,
        r"early stopping monitors 'accuracy', which this run never produces",
        r"'acc'.*'val_loss'",
        r"Did you mean 'acc'\?",
    )


def test_early_stop_of_the_wrong_type(run_dir):
    with pytest.raises(jn.ConfigError) as e:
        nitro(run_dir=run_dir, early_stop=5)
    check(e, r"early_stop must be a jn\.EarlyStopping, got int")


def test_monitored_metric_without_a_val_split(run_dir):
    with pytest.raises(jn.ConfigError) as e:
        nitro(Tiny(n_val=0), run_dir=run_dir, checkpointer=jn.TopKCheckpointer(metric="acc"))
    check(e, r"monitors 'acc' but the data has no 'val' split", r"Add a 'val' split")


def test_unknown_schedule_key(run_dir):
    with pytest.raises(jn.ConfigError) as e:
        nitro(run_dir=run_dir, schedules={"opt.learning_rat": jn.schedules.warmup_cosine()})
    check(
        e,
        r"unknown schedule key 'opt\.learning_rat'",
        r"valid keys:",
        r"Did you mean 'opt\.learning_rate'\?",
    )


def test_schedule_key_without_a_prefix(run_dir):
    with pytest.raises(jn.ConfigError) as e:
        nitro(run_dir=run_dir, schedules={"learning_rate": jn.schedules.warmup_cosine()})
    check(e, r"schedule key 'learning_rate' must start with 'opt\.' or 'device\.'")


def test_schedule_of_a_graphconst_field(run_dir):
    with pytest.raises(jn.ConfigError) as e:
        nitro(run_dir=run_dir, schedules={"device.width": jn.schedules.constant(1.0)})
    check(e, r"schedule 'device\.width': 'width' is a GraphConst field; only jn\.Device")


def test_schedule_that_is_not_a_factory(run_dir):
    with pytest.raises(jn.ConfigError) as e:
        nitro(run_dir=run_dir, schedules={"opt.learning_rate": "cosine"})
    check(
        e,
        r"schedule 'opt\.learning_rate' must be a factory f\(total_steps\)",
        r"a number, or an optax schedule; got 'cosine'",
    )


def test_run_dir_that_is_a_file(tmp_path):
    path = tmp_path / "run"
    path.write_text("not a directory")
    with pytest.raises(jn.ConfigError) as e:
        nitro(run_dir=path)
    check(e, rf"run_dir {re.escape(str(path))} is a file", r"give a directory path")


def test_unwritable_run_dir(tmp_path):
    if os.geteuid() != 0:
        parent = tmp_path / "locked"
        parent.mkdir()
        parent.chmod(0o500)
    elif Path("/proc/self").is_dir():  # root writes anywhere, but nothing can be created in /proc
        parent = Path("/proc/jaxnitro-unwritable")
    else:
        pytest.skip("running as root without /proc: every directory is writable")
    try:
        with pytest.raises(jn.ConfigError) as e:
            nitro(run_dir=parent / "run")
        check(
            e, rf"cannot create run_dir {re.escape(str(parent / 'run'))}", r"Pick a writable path"
        )
    finally:
        if os.geteuid() != 0:
            parent.chmod(0o700)


def test_n_devices_larger_than_visible(run_dir):
    visible = len(jax.devices())
    with pytest.raises(jn.ConfigError) as e:
        nitro(run_dir=run_dir, n_devices=visible + 7)
    check(
        e,
        rf"n_devices={visible + 7} but only {visible} device\(s\) are visible",
        r"XLA_FLAGS=--xla_force_host_platform_device_count=",
    )


def test_n_devices_not_positive(run_dir):
    with pytest.raises(jn.ConfigError) as e:
        nitro(run_dir=run_dir, n_devices=0)
    check(e, r"n_devices must be an int >= 1, got 0")


@pytest.mark.multi_device
def test_batch_not_divisible_by_devices(tmp_path):
    """Needs 2 (fake) devices, so it runs in a subprocess."""
    script = tmp_path / "two_devices.py"
    script.write_text(
        textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(TESTS)!r})
        import jaxnitro as jn
        from conftest import Tiny, nitro
        out = {{}}
        try:
            nitro(Tiny(val_batch=25), run_dir={str(tmp_path / "run")!r}, n_devices=2)
        except Exception as e:
            out["odd"] = [type(e).__name__, isinstance(e, jn.JaxnitroError), str(e)]
        try:
            nitro(Tiny(), run_dir={str(tmp_path / "run3")!r}, n_devices=3)
        except Exception as e:
            out["three"] = [type(e).__name__, isinstance(e, jn.JaxnitroError), str(e)]
        print("RESULT" + json.dumps(out))
    """)
    )
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    kind, ours, msg = out["odd"]
    assert kind == "DataError" and ours, msg
    assert "the 'val' batch size 25 does not divide by the 2 devices" in msg
    assert "Use a batch size that is a multiple of 2" in msg
    kind, ours, msg = out["three"]
    assert kind == "ConfigError" and ours and "only 2 device(s) are visible" in msg


# ------------------------------------------------------------------------- entry points
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir)
    jn.train(n)
    return n, run_dir


def test_unknown_split_in_evaluate(trained):
    n, _ = trained
    with pytest.raises(jn.DataError) as e:
        jn.evaluate(n, split="vall")
    check(e, r"no split 'vall'; the data has \['train', 'val'\]", r"Did you mean 'val'\?")


def test_predict_given_a_bare_array(trained):
    n, _ = trained
    x, _ = make_data(4)
    with pytest.raises(jn.DataError) as e:
        jn.predict(n, x)
    check(
        e,
        r"predict takes a dict batch \(or a loader of them\), got a bare ndarray",
        r"forward\(\) expects the field\(s\) \['x'\]",
        r"jn\.predict\(n, \{'x': x\}\)",
    )


def test_predict_batch_missing_a_field(trained):
    n, _ = trained
    x, _ = make_data(4)
    with pytest.raises(jn.DataError) as e:
        jn.predict(n, {"inputs": x})
    check(e, r"predict: forward\(\) needs field\(s\) \['x'\]; the batch has \['inputs'\]")


def test_set_device_on_a_graphconst(trained):
    n, _ = trained
    with pytest.raises(jn.ConfigError) as e:
        jn.set_device(n, width=32)
    check(
        e,
        r"set_device cannot change GraphConst field 'width'",
        r"build a new Nitro \(one recompile\)",
        r"Only jn\.Device fields are live inputs",
    )


def test_set_device_on_a_host_field(trained):
    n, _ = trained
    with pytest.raises(jn.ConfigError) as e:
        jn.set_device(n, max_epochs=3)
    check(e, r"set_device cannot change Host field 'max_epochs'", r"dataclasses\.replace")


def test_set_device_unknown_field(trained):
    n, _ = trained
    with pytest.raises(jn.ConfigError) as e:
        jn.set_device(n, smoothnig=0.1)
    check(e, r"Tiny has no field 'smoothnig'", r"Did you mean 'smoothing'\?")


def test_set_device_changing_the_shape(trained):
    n, _ = trained
    with pytest.raises(jn.ConfigError) as e:
        jn.set_device(n, smoothing=np.zeros(3, np.float32))
    check(
        e,
        r"would change its shape/dtype from \(\)/float32 to \(3,\)/float32",
        r"Pass a value of the same shape and dtype",
    )


def test_device_value_of_a_non_device_field(trained):
    n, _ = trained
    with pytest.raises(jn.ConfigError) as e:
        jn.device_value(n, "width")
    check(e, r"'width' is not a Device field; Device fields: \['smoothing'\]")


# --------------------------------------------------------------------------- checkpoints
@pytest.mark.slow
def test_resume_with_changed_config(trained, tmp_path):
    _, run_dir = trained
    with pytest.raises(jn.CheckpointError) as e:
        nitro(Tiny(max_epochs=2, width=32), run_dir=run_dir, resume="auto")
    check(
        e,
        r"cannot resume from .*epoch-0001.*its GraphConst config differs",
        r"'width': \(\['int', 16\], \['int', 32\]\)|width",
        r"start a new run_dir",
    )


def test_resume_true_without_a_checkpoint(run_dir):
    with pytest.raises(jn.CheckpointError) as e:
        nitro(run_dir=run_dir, resume=True)
    check(e, r"resume=True but .*checkpoints holds no checkpoint", r"Use resume='auto'")


def test_resume_from_a_missing_path(run_dir, tmp_path):
    with pytest.raises(jn.CheckpointError) as e:
        nitro(run_dir=run_dir, resume=str(tmp_path / "nope"))
    check(e, r"resume='.*nope': no such checkpoint", r"resume='auto'")


def test_checkpoint_path_that_is_not_a_checkpoint(run_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(jn.CheckpointError) as e:
        nitro(run_dir=run_dir, checkpoint=tmp_path / "empty")
    check(
        e,
        r"empty is not a complete checkpoint \(no meta\.json\)",
        r"pass a path returned by TopKCheckpointer\.save\(\), latest\(\) or best\(\)",
    )


def _copy_newest(trained, tmp_path) -> Path:
    import shutil

    _, run_dir = trained
    ck = jn.TopKCheckpointer(dir=run_dir / "checkpoints")
    src = ck.latest()
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


def test_corrupted_checkpoint_data(trained, tmp_path, run_dir):
    ckpt = _copy_newest(trained, tmp_path)
    for data_file in [p for p in (ckpt / "arrays").rglob("*") if p.parent.name == "d"]:
        with open(data_file, "r+b") as fh:  # truncated by a full disk, say
            fh.truncate(data_file.stat().st_size // 2)
    with pytest.raises(jn.CheckpointError) as e:
        nitro(run_dir=run_dir, checkpoint=ckpt)
    check(e, rf"checkpoint {re.escape(str(ckpt))} is corrupted")


def test_corrupted_checkpoint_checksum(trained, tmp_path, run_dir):
    ckpt = _copy_newest(trained, tmp_path)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["trees"]["params"]["sha256"] = "0" * 64
    (ckpt / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(jn.CheckpointError) as e:
        nitro(run_dir=run_dir, checkpoint=ckpt)
    check(e, r"is corrupted \(checksum mismatch in tree 'params'\)")


def test_corrupted_checkpoint_meta_weights_only(trained, tmp_path, run_dir):
    ckpt = _copy_newest(trained, tmp_path)
    (ckpt / "meta.json").write_text('{"format_version": 1, "ep')
    with pytest.raises(jn.CheckpointError) as e:
        nitro(run_dir=run_dir, checkpoint=ckpt)
    check(e, r"is corrupted \(unreadable meta\.json")


def test_corrupted_checkpoint_meta_on_resume(trained, tmp_path, run_dir):
    ckpt = _copy_newest(trained, tmp_path)
    (ckpt / "meta.json").write_text('{"format_version": 1, "ep')
    with pytest.raises(jn.CheckpointError) as e:
        nitro(run_dir=run_dir, resume=str(ckpt))
    check(e, r"is corrupted \(unreadable meta\.json")


@pytest.mark.slow
def test_checkpoint_of_another_model(trained, tmp_path):
    ckpt = _copy_newest(trained, tmp_path)
    with pytest.raises(jn.CheckpointError) as e:
        nitro(Tiny(width=8), run_dir=tmp_path / "other", checkpoint=ckpt)
    check(
        e,
        r"tree 'params' does not match its template",
        r"template \(8, 8\) float32, checkpoint \(8, 16\) float32",
        r"Build the template from the same model/optimizer configuration",
    )


# --------------------------------------------------------------- surface checks (hardening)
@pytest.mark.parametrize("kind", ["list", "dict", "ndarray"])
def test_mutable_experiment_default(kind):
    default = {"list": [1, 2], "dict": {"a": 1}, "ndarray": np.zeros(3)}[kind]
    with pytest.raises(jn.ConfigError) as e:
        jn.experiment(type("Mutable", (), {"__annotations__": {"sizes": object}, "sizes": default}))
    check(e, r"Mutable.sizes has a mutable default", r"default_factory")


def test_empty_run_dir(run_dir):
    with pytest.raises(jn.ConfigError) as e:
        nitro(run_dir="")
    check(e, r"run_dir is empty", r"run_dir='runs/Tiny'")


def test_run_dir_not_a_path():
    with pytest.raises(jn.ConfigError) as e:
        nitro(run_dir=123)
    check(e, r"run_dir must be a path \(str or pathlib.Path\), got int 123")


def test_an_empty_logger_list(run_dir):
    with pytest.raises(jn.ConfigError) as e:
        nitro(run_dir=run_dir, logger=[])
    check(e, r"logger=\[\] lists no logger", r"logger=False")


def test_logger_without_the_protocol(run_dir):
    with pytest.raises(jn.ConfigError) as e:
        nitro(run_dir=run_dir, logger=object())
    check(e, r"lacks the jn.Logger method\(s\)", r"log_metrics")


@pytest.mark.parametrize(
    "text,expected",
    [("1GB", 10**9), ("512MiB", 512 * 2**20), ("1.5 GiB", int(1.5 * 2**30)), (4096, 4096)],
)
def test_memory_budget_sizes_are_parsed(run_dir, text, expected):
    assert nitro(run_dir=run_dir, memory_budget=text).spec.memory_budget == expected


@pytest.mark.parametrize("bad", ["lots", "1 parsec", -5, 0])
def test_memory_budget_refused(run_dir, bad):
    with pytest.raises(jn.ConfigError) as e:
        nitro(run_dir=run_dir, memory_budget=bad)
    check(e, r"memory_budget", r"'1GB'")


def test_progress_value(run_dir):
    with pytest.raises(jn.ConfigError) as e:
        jn.Nitro(Tiny(), run_dir=run_dir, progress="fancy")
    check(e, r"progress='fancy'", r"'rich', 'plain' or False/'off'")


def test_resume_value(run_dir):
    with pytest.raises(jn.ConfigError) as e:
        nitro(run_dir=run_dir, resume=3)
    check(e, r"resume=3", r"'auto'")


def test_preset_override_typo_names_the_override():
    @jn.experiment
    class WithPresets2(Tiny):
        @classmethod
        def presets(cls):
            return {"small": {"width": 8}}

    with pytest.raises(jn.ConfigError) as e:
        WithPresets2.from_preset("small", widht=4)
    check(
        e,
        r"from_preset\('small', \.\.\.\) got an override for unknown field 'widht'",
        r"Did you mean 'width'",
    )


def test_run_dir_in_use_by_another_handle(run_dir):

    other = jn.Nitro(Tiny(max_epochs=1), run_dir=run_dir, progress=False)
    other.services.lock.acquire("train", what="x")
    try:
        with pytest.raises(RunLockedError) as e:
            jn.train(nitro(Tiny(max_epochs=1), run_dir=run_dir))
        check(
            e,
            r"is in use by another handle in this process",
            r"another run_dir",
            r"wait for it to finish",
        )
    finally:
        other.services.lock.release()


def test_damaged_checkpoint_meta_field(run_dir):
    jn.train(nitro(Tiny(max_epochs=1), run_dir=run_dir))
    latest = jn.TopKCheckpointer(dir=run_dir / "checkpoints").latest()
    meta_path = latest / "meta.json"
    info = json.loads(meta_path.read_text())
    info["meta"]["batch_in_epoch"] = "x"
    info.pop("record_sha256", None)
    meta_path.write_text(json.dumps(info))
    with pytest.raises(jn.CheckpointError) as e:
        nitro(Tiny(max_epochs=2), run_dir=run_dir, resume=str(latest))
    check(e, r"batch_in_epoch")


@pytest.mark.parametrize("value", ["x", [1.0], [1.0, -1], [1.0, 2.5]])
def test_damaged_checkpoint_epoch_loss(run_dir, value):
    jn.train(nitro(Tiny(max_epochs=1), run_dir=run_dir))
    latest = jn.TopKCheckpointer(dir=run_dir / "checkpoints").latest()
    meta_path = latest / "meta.json"
    info = json.loads(meta_path.read_text())
    info["meta"]["epoch_loss"] = value
    info.pop("record_sha256", None)
    meta_path.write_text(json.dumps(info))
    with pytest.raises(jn.CheckpointError) as e:
        nitro(Tiny(max_epochs=2), run_dir=run_dir, resume=str(latest))
    check(e, r"'epoch_loss' must be \[sum, count\]", r"Resume from another checkpoint")


def test_predict_names_a_misnamed_field_and_a_wrong_width(run_dir):
    n = nitro(Tiny(max_epochs=1, n_val=0), run_dir=run_dir)
    with pytest.raises(
        jn.DataError,
        match=r"needs field\(s\) \['x'\]; the batch has \['xx'\]\. "
        r"Rename 'xx' to 'x'\.",
    ):
        jn.predict(n, {"xx": np.zeros((3, 8), np.float32)})
    with pytest.raises(jn.DataError, match=r"field 'x' has per-sample shape \(5,\)"):
        jn.predict(n, {"x": np.zeros((3, 5), np.float32)})


def test_new_user_mistakes_from_the_trial_are_named(run_dir, tmp_path):
    # An uncalled logger class is refused at setup (it used to disable all logging quietly).
    with pytest.raises(jn.ConfigError, match=r"logger=JSONLogger is the class; pass an instance"):
        nitro(Tiny(), run_dir=run_dir / "a", logger=jn.JSONLogger)
    with pytest.raises(jn.ConfigError, match=r"is the class"):
        nitro(Tiny(), run_dir=run_dir / "b", logger=[jn.JSONLogger(), jn.JSONLogger])
    # checkpoint= takes a run directory (its best checkpoint), as the CLI does.
    first = nitro(Tiny(max_epochs=1), run_dir=run_dir / "trained")
    jn.train(first)
    again = nitro(Tiny(max_epochs=1), run_dir=run_dir / "eval", checkpoint=run_dir / "trained")
    assert leaves_equal(again.params, first.params)
    with pytest.raises(jn.CheckpointError, match=r"does not exist; pass a checkpoint directory"):
        nitro(Tiny(), run_dir=run_dir / "c", checkpoint=tmp_path / "nope")


@pytest.mark.parametrize(("n_val", "split", "rows"), [(100, "val", 20), (0, "train", 32)])
def test_a_per_example_loss_names_its_split_hook_and_shape(run_dir, n_val, split, rows):
    @jn.experiment
    class PerExample(Tiny):
        def loss(self, logits, *, y):
            return optax.softmax_cross_entropy_with_integer_labels(logits, y)

    with pytest.raises(jn.HookError) as e:
        jn.train(nitro(PerExample(n_val=n_val), run_dir=run_dir))
    assert (
        f"PerExample.loss() returned an array of shape ({rows},) on a batch of the {split!r} "
        f"split ({rows} rows); it must return a scalar" in str(e.value)
    )


def dead_pid() -> int:
    """The pid of a process that has exited (it printed its pid, then ended)."""
    code = "import os; print(os.getpid())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(proc.stdout)


@pytest.mark.slow
def test_warnings_under_public_calls_point_at_the_callers_line(tmp_path):
    here = str(Path(__file__).resolve())
    x = np.random.default_rng(0).normal(size=(64, 8))  # float64
    y = np.zeros(64, np.int32)
    float64 = {"train": jn.DataLoader({"x": x, "y": y}, batch_size=32, drop_last=True)}
    table = {"opt.learning_rate": lambda total: lambda s: 1 - s / total}

    def boom(phase, step, epoch, info):
        raise RuntimeError("a broken monitor")

    caught = {}

    def record(name, call):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            result = call()
        assert got, f"{name}: no warning"
        caught[name] = {w.filename for w in got}
        return result

    # jn.Nitro called here (conftest's nitro() would be the caller's line)
    kw = dict(run_dir=tmp_path / "a", progress=False)
    n = record(
        "float64 data",
        lambda: jn.Nitro(Tiny(max_epochs=1), **kw, data=float64, schedules=table),
    )
    jn.on_phase(boom, nitro=n)
    record("a failing phase monitor", lambda: jn.train(n))
    n.max_epochs = 2
    record("schedules past their horizon", lambda: jn.train(n))
    record("trained already", lambda: jn.train(n))
    record(
        "a resume with another seed",
        lambda: jn.Nitro(Tiny(max_epochs=1), **kw, resume="auto", seed=7),
    )
    # through contextlib: jn.train's writing session takes over a dead writer's lock
    stale = tmp_path / "b"
    stale.mkdir()
    (stale / RUN_LOCK).write_text(json.dumps({"pid": dead_pid(), "host": "here"}))
    b = jn.Nitro(Tiny(max_epochs=1), run_dir=stale, progress=False)
    record("a dead writer's lock", lambda: jn.train(b))
    assert len(caught) == 6
    assert all(files == {here} for files in caught.values()), caught
