"""Options declared once (`jaxnitro._src.run.options`): as keywords, experiment fields, flags of
`jaxnitro train`, entries of a TOML config file, in `help(jn.Nitro)` and docs/options.md."""

from __future__ import annotations

import json
import os
import textwrap
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import Tiny
from helpers.cli import jaxnitro
from helpers.paths import ROOT

import jaxnitro as jn
from jaxnitro._src.cli import cli
from jaxnitro._src.run import config, options, settings

#: A good value per value option, other than its default (a new option needs one here).
GOOD = {
    "seed": 7,
    "run_dir": "runs/opt",
    "n_devices": 1,
    "accum": 2,
    "steps_per_call": 2,
    "max_epochs": 3,
    "precision": "bf16",
    "logger": "jsonl,csv",
    "early_stop": "val_loss:3",
    "reduce_lr_on_plateau": "val_loss:3:0.5",
    "resume": "auto",
    "checkpoint": "somewhere",
    "memory_budget": "2GiB",
    "progress": "plain",
    "on_nonfinite": "skip",
    "val_every": 5,
    "checkpoint_every": 6,
    "checkpoint_every_minutes": 1.5,
    "log_grad_norm": True,
    "log_every_n_steps": 10,
    "sharding": "fsdp",
    "remat": ["Block"],
    "remat_policy": "dots_saveable",
    "population": 2,
    "data_on_device": False,
    "show_curves": True,
    "ema": 0.99,
    "ema_warmup": False,
    "ema_every": 2,
    "ema_state": True,
    "ema_eval": "both",
    "weights": "ema",
    "peak_tflops": 312.0,
    "profile": "10:20",
}
#: Another good value (a flag's, where GOOD is the file's).
OTHER = {
    **GOOD,
    "seed": 8,
    "run_dir": "runs/other",
    "n_devices": 2,
    "accum": 3,
    "steps_per_call": "auto",
    "max_epochs": 4,
    "precision": "f32",
    "logger": "csv",
    "early_stop": "acc:2:max",
    "reduce_lr_on_plateau": "acc:2:0.1:max",
    "resume": "some/checkpoint",
    "checkpoint": "elsewhere",
    "memory_budget": "1GB",
    "progress": "rich",
    "on_nonfinite": "error",
    "val_every": 7,
    "checkpoint_every": 8,
    "checkpoint_every_minutes": 2.5,
    "log_grad_norm": False,
    "log_every_n_steps": 3,
    "sharding": "dp",
    "remat": ["Block", "Head"],
    "remat_policy": "full",
    "population": 3,
    "data_on_device": True,
    "show_curves": False,
    "ema": 0.9,
    "ema_warmup": True,
    "ema_every": 3,
    "ema_state": False,
    "ema_eval": False,
    "weights": "raw",
    "peak_tflops": 989.0,
    "profile": "3:5",
}
#: A value each option refuses, and a part of the message that says why.
BAD = {
    "seed": (-1, "seed must be an int >= 0"),
    "run_dir": (3, "run_dir must be a path"),
    "n_devices": (0, "n_devices must be an int >= 1"),
    "accum": (0, "accum must be an int >= 1"),
    "steps_per_call": ("fast", "steps_per_call='fast'"),
    "max_epochs": (0, "max_epochs must be an int >= 1"),
    "precision": ("f16", "precision='f16'"),
    "logger": ("cvs", "Did you mean 'csv'"),
    "early_stop": ("val_loss", "METRIC:PATIENCE"),
    "reduce_lr_on_plateau": ("val_loss:3", "METRIC:PATIENCE:FACTOR"),
    "resume": (3, "resume=3"),
    "checkpoint": (3, "checkpoint must be a path"),
    "memory_budget": ("2 parsecs", "is not a size"),
    "progress": ("fancy", "progress='fancy'"),
    "on_nonfinite": ("ignore", "on_nonfinite='ignore'"),
    "val_every": (0, "val_every must be an int >= 1"),
    "checkpoint_every": (0, "checkpoint_every must be an int >= 1"),
    "checkpoint_every_minutes": (-1, "checkpoint_every_minutes must be a number > 0"),
    "log_grad_norm": ("yes", "log_grad_norm='yes'"),
    "log_every_n_steps": (0, "log_every_n_steps must be an int >= 1"),
    "sharding": ("tp", "sharding='tp'"),
    "remat": ("Block", "remat='Block'"),
    "remat_policy": ("some", "remat_policy='some'"),
    "population": (0, "population=0"),
    "data_on_device": ("yes", "data_on_device='yes'"),
    "show_curves": ("yes", "show_curves='yes'"),
    "ema": (1.5, "ema=1.5"),
    "ema_warmup": ("yes", "ema_warmup='yes'"),
    "ema_every": (0, "ema_every=0"),
    "ema_state": ("yes", "ema_state='yes'"),
    "ema_eval": ("all", "ema_eval='all'"),
    "weights": ("avg", "weights='avg'"),
    "peak_tflops": (0, "peak_tflops must be a number of TFLOP/s > 0"),
    "profile": ("20:10", "profile='20:10'"),
}
VALUE = [o.name for o in options.OPTIONS if o.value]


def with_fields(values: dict, base=Tiny):
    """An experiment whose fields are named like options, with these values."""
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    ns = {"__annotations__": {k: type(v) for k, v in values.items()}, **values}
    return jn.experiment(type("Fielded", (base,), ns))


def test_every_value_option_has_test_values():
    assert set(GOOD) == set(OTHER) == set(BAD) == set(VALUE)


def test_help_and_signature_list_every_option_with_default_and_doc():
    doc = jn.Nitro.__doc__
    for o in options.OPTIONS:
        assert f"{o.name} ({o.type})" in doc and o.doc in doc
    assert "val_every (int) = None" in doc and "accum (int) = 1" in doc
    import inspect

    params = inspect.signature(jn.Nitro).parameters
    assert list(params)[1:] == list(options.NAMES)
    assert params["on_nonfinite"].default == "error"


def test_docs_options_md_is_up_to_date():
    """Regenerate with: python -m jaxnitro._src.run.options > docs/options.md"""
    assert (ROOT / "docs" / "options.md").read_text() == options.markdown()


@pytest.mark.parametrize("name", VALUE)
def test_a_value_option_from_a_field_keyword_wins_default_last(name):
    exp = with_fields({name: GOOD[name]})()
    field = options.resolve(exp, {})[name]
    assert (list(field) if isinstance(field, tuple) else field) == GOOD[name]  # field > default
    assert options.resolve(exp, {name: OTHER[name]})[name] == OTHER[name]  # keyword > field
    if not hasattr(Tiny, name):  # (Tiny has a max_epochs field)
        assert options.resolve(Tiny(), {})[name] == options.BY_NAME[name].default
    settings.settings(exp, {})  # the field's value passes the option's check


@pytest.mark.parametrize("name", VALUE)
def test_a_bad_value_as_keyword_or_field_is_a_config_error(name):
    value, why = BAD[name]
    with pytest.raises(jn.ConfigError, match=why.replace("(", r"\(")):
        settings.settings(Tiny(), {name: value})
    with pytest.raises(jn.ConfigError) as e:
        settings.settings(with_fields({name: value})(), {})
    assert f"experiment field Fielded.{name}={value!r}" in str(e.value)
    assert why in str(e.value)


def test_fields_set_step_cadences_in_a_real_handle(run_dir):
    """The README's rule for val_every and checkpoint_every (ignored as fields before)."""
    exp = with_fields({"val_every": 3, "checkpoint_every": 4})()
    n = jn.Nitro(exp, run_dir=run_dir, progress=False)
    assert (n.spec.val_every, n.spec.checkpoint_every) == (3, 4)
    n = jn.Nitro(exp, run_dir=run_dir, progress=False, val_every=5)
    assert n.spec.val_every == 5
    with pytest.raises(jn.ConfigError, match=r"Fielded\.val_every=0"):
        jn.Nitro(with_fields({"val_every": 0})(), run_dir=run_dir, progress=False)


def test_logger_and_early_stop_by_name():
    s = settings.settings(Tiny(), {"logger": "jsonl,csv", "early_stop": "acc:2"})
    assert [type(x).__name__ for x in s.logger] == ["JSONLogger", "CSVLogger"]
    es = s.early_stop
    assert (es.metric, es.patience, es.mode) == ("acc", 2, "max")
    assert settings.settings(Tiny(), {"early_stop": "val_loss:4"}).early_stop.mode == "min"


# -- the command line (in process: --print-config trains nothing) -----------------------------
EXPERIMENT = """
import jax
import numpy as np
import optax
from flax import nnx

import jaxnitro as jn


class TinyMLP(nnx.Module):
    def __init__(self, width, *, rngs):
        self.hidden = nnx.Linear(8, width, rngs=rngs)
        self.out = nnx.Linear(width, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


@jn.experiment
class Small:
    width: jn.GraphConst[int] = 16
    smoothing: jn.Device[float] = 0.0
    sizes: tuple = (1, 2)

    @classmethod
    def presets(cls):
        return {"wide": {"width": 32}}

    def build_model(self, rng):
        return jn.split_model(TinyMLP(self.width, rngs=nnx.Rngs(rng)))

    def build_data(self, dist):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(192, 8)).astype(np.float32)
        y = (x @ rng.normal(size=(8, 4))).argmax(-1).astype(np.int32)
        return {
            "train": jn.DataLoader({"x": x[:128], "y": y[:128]}, batch_size=32, shuffle=True),
            "val": jn.DataLoader({"x": x[128:], "y": y[128:]}, batch_size=32),
        }

    def learning_rate(self, group):
        return 1e-2

    def forward(self, model, params, state, *, x):
        return jn.apply(model, params, state, x)

    def loss(self, logits, *, y):
        targets = optax.smooth_labels(jax.nn.one_hot(y, 4), self.smoothing)
        return optax.softmax_cross_entropy(logits, targets).mean()

    def metrics(self, logits, *, y):
        return {"acc": ((logits.argmax(-1) == y).sum(), y.shape[0])}
"""


def _fielded_source(values: dict) -> str:
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    lines = [f"    {k}: {type(v).__name__} = {v!r}" for k, v in values.items()]
    return "\n\n@jn.experiment\nclass Fielded(Small):\n" + "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("options")
    field_values = {k: v for k, v in GOOD.items()}
    (d / "exp.py").write_text(textwrap.dedent(EXPERIMENT) + _fielded_source(field_values))
    return d


def _flag_args(values: dict) -> list[str]:
    args = []
    for name, value in values.items():
        o = options.BY_NAME[name]
        if o.is_bool:
            args.append(o.flag if value else f"--no-{o.flag[2:]}")
        else:
            args += [o.flag, ",".join(value) if isinstance(value, list) else str(value)]
    return args


def _print_config(work: Path, *args: str) -> tuple[int, str]:
    old = os.getcwd()
    os.chdir(work)
    try:
        r = CliRunner().invoke(cli, ["train", *args, "--print-config"], catch_exceptions=False)
    except SystemExit as e:  # pragma: no cover - click returns the code in the result
        return int(e.code or 0), ""
    finally:
        os.chdir(old)
    return r.exit_code, r.output


def _toml(work: Path, name: str, body: dict) -> Path:
    import tomli_w

    path = work / name
    path.write_text(tomli_w.dumps(body))
    return path


def _used(printed: dict) -> dict:
    """The option values a printed config gives the run: [options], and the fields named like
    an option that [options] leaves out (a field sets its option: written once)."""
    named = {k: v for k, v in printed["fields"].items() if k in options.NAMES}
    return {**named, **printed["options"]}


def test_every_value_option_as_flag_file_and_field_with_precedence(work):
    # default: no flag, no file, no field
    code, out = _print_config(work, "exp.py:Small")
    assert code == 0, out
    printed = tomllib.loads(out)
    assert printed["options"]["accum"] == 1 and printed["target"] == "exp.py:Small"
    # a flag each
    code, out = _print_config(work, "exp.py:Small", *_flag_args(OTHER))
    assert code == 0, out
    assert _used(tomllib.loads(out)) == {**_used(printed), **OTHER}
    # the file each, then flags win over it
    path = _toml(work, "all.toml", {"target": "exp.py:Small", "options": GOOD})
    code, out = _print_config(work, "--config", str(path))
    assert code == 0, out
    assert _used(tomllib.loads(out)) == {**_used(printed), **GOOD}
    code, out = _print_config(work, "--config", str(path), *_flag_args(OTHER))
    assert code == 0, out
    assert _used(tomllib.loads(out)) == {**_used(printed), **OTHER}
    # fields named like the options: a field sets it, the file wins over the field
    code, out = _print_config(work, "exp.py:Fielded")
    assert code == 0, out
    assert _used(tomllib.loads(out)) == {**_used(printed), **GOOD}
    path = _toml(work, "over.toml", {"target": "exp.py:Fielded", "options": OTHER})
    code, out = _print_config(work, "--config", str(path))
    assert code == 0, out
    assert _used(tomllib.loads(out)) == {**_used(printed), **OTHER}


@pytest.mark.parametrize("name", VALUE)
def test_a_bad_value_as_flag_or_in_a_file_exits_2(work, name):
    value, why = BAD[name]
    o = options.BY_NAME[name]
    if not o.is_bool:  # a bool flag has no value to get wrong; any text is a path
        text = "" if name in ("run_dir", "resume", "checkpoint", "remat") else str(value)
        code, out = _print_config(work, "exp.py:Small", o.flag, text)
        assert code == 2 and f"Invalid value for '{o.flag}'" in out, out
    path = _toml(work, f"bad-{name}.toml", {"target": "exp.py:Small", "options": {name: value}})
    code, out = _print_config(work, "--config", str(path))
    assert code == 2, out
    assert f"[options] {name} = {value!r}" in out and why in out.replace("\n", " ")


def test_config_unknown_keys_and_fields_exit_2_with_did_you_mean(work):
    cases = [
        ({"target": "exp.py:Small", "optons": {}}, "unknown key 'optons'", "'options'"),
        ({"target": "exp.py:Small", "options": {"val_evry": 2}}, "'val_evry'", "'val_every'"),
        ({"target": "exp.py:Small", "fields": {"widht": 2}}, "'widht' is no field", "'width'"),
        ({"target": "exp.py:Small", "options": {"schedules": {}}}, "schedules", "Python"),
    ]
    for i, (body, what, hint) in enumerate(cases):
        code, out = _print_config(work, "--config", str(_toml(work, f"u{i}.toml", body)))
        text = " ".join(out.split())
        assert code == 2 and what in text and hint in text, out
    (work / "broken.toml").write_text("target = \n")
    code, out = _print_config(work, "--config", "broken.toml")
    assert code == 2 and "not valid TOML" in out


def test_config_fields_preset_and_flags_over_the_file(work):
    body = {"target": "exp.py:Small", "preset": "wide", "fields": {"smoothing": 0.1, "sizes": [3]}}
    path = _toml(work, "fields.toml", body)
    code, out = _print_config(work, "--config", str(path), "--smoothing", "0.2")
    assert code == 0, out
    printed = tomllib.loads(out)
    assert printed["preset"] == "wide"
    assert printed["fields"] == {"width": 32, "smoothing": 0.2, "sizes": [3]}


# -- every run writes config.toml, and it repeats the run ------------------------------------
def _history(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keep = ("loss", "val_loss", "acc")
    return [
        {k: r[k] for k in ("context", "step", *keep) if k in r}
        for r in rows
        if r.get("type") == "metrics" and r.get("context") in ("train", "validate")
    ]


@pytest.mark.slow  # two runs in subprocesses
def test_config_toml_repeats_the_run_bit_for_bit(work):
    args = ["exp.py:Small", "--smoothing", "0.05", "--max-epochs", "2", "--val-every", "2"]
    args += ["--seed", "3", "--logger", "jsonl,csv", "--progress", "off", "--run-dir", "runs/a"]
    p = jaxnitro("train", *args, cwd=work)
    assert p.returncode == 0, p.stderr
    written = tomllib.loads((work / "runs/a/config.toml").read_text())
    assert written["target"] == "../../exp.py:Small" and written["fields"]["smoothing"] == 0.05
    assert written["options"]["val_every"] == 2 and written["options"]["logger"] == "jsonl,csv"
    assert written["jaxnitro_version"] == jn.__version__
    p = jaxnitro("train", "--config", "runs/a/config.toml", "--run-dir", "runs/b", cwd=work)
    assert p.returncode == 0, p.stderr
    first, again = _history(work / "runs/a"), _history(work / "runs/b")
    assert len(first) > 4 and first == again
    assert (work / "runs/b/metrics.csv").is_file()  # the logger came from the file too


@pytest.mark.slow
def test_a_python_run_writes_its_config(run_dir):
    exp = with_fields({"val_every": 3})()
    n = jn.Nitro(exp, run_dir=run_dir, progress=False, max_epochs=1, logger=jn.JSONLogger())
    jn.train(n)
    text = (run_dir / "config.toml").read_text()
    written = tomllib.loads(text)
    assert written["fields"]["val_every"] == 3 and "val_every" not in written["options"]
    assert written["options"]["max_epochs"] == 1  # the keyword over the field: both written
    assert written["fields"]["width"] == 16 and written["target"].endswith(":Fielded")
    assert "# not written (no TOML value): options.logger = a JSONLogger" in text
    assert config.read(run_dir / "config.toml")["options"]["seed"] == 42


def test_train_needs_a_target_or_a_config_with_one(work):
    code, out = _print_config(work)
    assert code == 2 and "give TARGET" in out and "--config FILE.toml" in out
    path = _toml(work, "no-target.toml", {"options": {"seed": 1}})
    code, out = _print_config(work, "--config", str(path))
    assert code == 2 and "give TARGET" in out
    code, out = _print_config(work, "exp.py:Small", "--config", str(path))
    assert code == 0 and tomllib.loads(out)["options"]["seed"] == 1


def test_sweep_takes_flags_and_a_config_file(work):
    old = os.getcwd()
    os.chdir(work)
    try:
        bad = _toml(work, "sweep-bad.toml", {"target": "exp.py:Small", "options": {"accum": 0}})
        r = CliRunner().invoke(cli, ["sweep", "--config", str(bad)])
        assert r.exit_code == 2 and "[options] accum = 0" in r.output, r.output
        r = CliRunner().invoke(cli, ["sweep", "exp.py:Small", "--val-every", "0"])
        assert r.exit_code == 2 and "Invalid value for '--val-every'" in r.output, r.output
    finally:
        os.chdir(old)


@pytest.mark.slow  # a two-point sweep in a subprocess
def test_a_sweep_starts_from_a_config_file(work):
    body = {
        "target": "exp.py:Small",
        "fields": {"width": 8},
        "options": {"max_epochs": 1, "run_dir": "runs/sweepcfg", "val_every": 2},
    }
    _toml(work, "sweep.toml", body)
    p = jaxnitro("sweep", "--config", "sweep.toml", "--smoothing", "0.0,0.1", "--json", cwd=work)
    assert p.returncode == 0, p.stderr
    runs = sorted((work / "runs/sweepcfg").glob("sweep-*"))
    assert [r.name for r in runs] == ["sweep-0-smoothing=0.0", "sweep-1-smoothing=0.1"]
    written = tomllib.loads((runs[1] / "config.toml").read_text())
    assert written["fields"] == {"width": 8, "smoothing": 0.1, "sizes": [1, 2]}
    assert written["options"]["max_epochs"] == 1 and written["options"]["val_every"] == 2


# -- one vocabulary for booleans (core/words.py) ---------------------------------------------
BOOL_OPTIONS = [o.name for o in options.OPTIONS if o.value and "bool" in o.type]


@pytest.mark.parametrize("name", BOOL_OPTIONS)
def test_every_bool_option_reads_the_one_vocabulary(name):
    from jaxnitro._src.cli.values import parse
    from jaxnitro._src.core.words import FALSE_WORDS, TRUE_WORDS

    o = options.BY_NAME[name]
    for words, meant in ((TRUE_WORDS, True), (FALSE_WORDS, False)):
        for word in (*words, *(w.upper() for w in words)):
            assert o.check(o.parse(word)) == meant, (name, word)
            assert parse(bool, word) is meant  # a bool field: the same words


def test_bool_words_as_flag_values_and_resume_words_are_not_paths(work):
    code, out = _print_config(
        work, "exp.py:Small", "--log-grad-norm", "y", "--ema-warmup=off", "--resume", "on"
    )
    assert code == 0, out
    printed = tomllib.loads(out)["options"]
    assert printed["log_grad_norm"] is True and printed["ema_warmup"] is False
    assert printed["resume"] is True  # not the checkpoint path 'on'
    for word, meant in (("1", True), ("0", False), ("auto", "auto"), ("./on", "./on")):
        assert options.BY_NAME["resume"].parse(word) == meant
    code, out = _print_config(work, "exp.py:Small", "--log-grad-norm=maybe")
    assert code == 2 and "true/yes/y/on/1" in out, out


def test_an_option_a_field_sets_is_written_once(work):
    code, out = _print_config(work, "exp.py:Fielded")
    assert code == 0, out
    printed = tomllib.loads(out)
    both = set(printed["fields"]) & set(printed["options"])
    assert not both, f"{sorted(both)} under both [fields] and [options]"
    code, out = _print_config(work, "exp.py:Fielded", "--max-epochs", "7")
    assert code == 0, out
    printed = tomllib.loads(out)  # the flag sets the field, which sets the option
    assert printed["fields"]["max_epochs"] == 7 and "max_epochs" not in printed["options"]
