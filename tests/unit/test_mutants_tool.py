"""tools/mutants.py: the sample `--sample N` draws and the interval its report gives, and a
sampled session of a toy target run through cosmic-ray."""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest
from helpers.paths import TESTS

spec = importlib.util.spec_from_file_location("mutants_tool", TESTS.parent / "tools" / "mutants.py")
mutants = importlib.util.module_from_spec(spec)
sys.modules["mutants_tool"] = mutants  # (dataclasses look their module up)
spec.loader.exec_module(mutants)


def test_the_sample_is_seeded_bounded_and_of_the_ids_given():
    ids = [f"job{i}" for i in range(50)]
    a = mutants.choose(ids, 10, seed=0)
    assert len(a) == 10 and a <= set(ids)
    assert mutants.choose(list(reversed(ids)), 10, seed=0) == a  # the order given is not used
    assert mutants.choose(ids, 10, seed=1) != a
    assert mutants.choose(ids[:3], 10, seed=0) == set(ids[:3])


def test_the_interval_holds_the_rate_and_narrows_with_more_mutants():
    low, high = mutants.wilson(8, 10)
    assert low < 0.8 < high and 0.4 < low and high < 1.0
    wide, narrow = mutants.wilson(8, 10), mutants.wilson(80, 100)
    assert narrow[1] - narrow[0] < wide[1] - wide[0]
    assert mutants.wilson(10, 10)[1] == 1.0 and mutants.wilson(0, 0) == (0.0, 1.0)


@pytest.mark.slow
def test_a_sampled_session_tests_only_its_sample_and_says_so(tmp_path, monkeypatch, capsys):
    pytest.importorskip("cosmic_ray")
    toy = tmp_path / "toy"
    (toy / "src").mkdir(parents=True)
    (toy / "tests").mkdir()
    (toy / "src" / "toymod.py").write_text(
        textwrap.dedent(
            """
            def clamp(x, low, high):
                if x < low:
                    return low
                if x > high:
                    return high
                return x + 0
            """
        )
    )
    (toy / "tests" / "test_toymod.py").write_text(
        "from toymod import clamp\n\n\ndef test_clamp():\n    assert clamp(5, 0, 3) == 3\n"
    )
    (toy / "pyproject.toml").write_text("")
    monkeypatch.setattr(mutants, "ROOT", toy)
    monkeypatch.setattr(mutants, "OUT", tmp_path / "out")
    target = mutants.Target("src/toymod.py", tests=("tests",), timeout=60.0)
    counts = mutants.run("toy", target, sample=3, seed=0)
    assert counts["killed"] + counts["survived"] == 3 and counts["pending"] == 0
    assert counts["not_sampled"] > 3  # the toy module has more mutants than that
    line = (tmp_path / "out" / "toy.txt").read_text().splitlines()[0]
    whole = 3 + counts["not_sampled"]
    assert f"a sample of 3 of {whole} mutants" in line and "95% within" in line
    assert line in capsys.readouterr().out
