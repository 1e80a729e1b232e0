"""benchmarks/compile_options_ab.py: the two sides run in alternating order, and the figure is
the median of the per-pass ratios."""

from __future__ import annotations

import importlib.util
import sys

from helpers.paths import ROOT


def _load():
    spec = importlib.util.spec_from_file_location(
        "compile_options_ab", ROOT / "benchmarks" / "compile_options_ab.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["compile_options_ab"] = module
    spec.loader.exec_module(module)
    return module


def test_the_sides_alternate_and_the_ratio_is_the_median_per_pass():
    ab = _load()
    order: list[str] = []
    rates = {"option": iter([110.0, 90.0, 120.0]), "xla": iter([100.0, 100.0, 100.0])}

    def side(name):
        def run():
            order.append(name)
            return next(rates[name])

        return run

    got = ab.alternate({"option": side("option"), "xla": side("xla")}, passes=3)
    assert order == ["xla", "option", "option", "xla", "xla", "option"]
    assert got == {"ratio": 1.1, "option": 110.0, "xla": 100.0}  # ratios 1.1, 0.9, 1.2
