"""`jn.inspect`: what the report shows and how it prints."""

from __future__ import annotations

from conftest import Tiny, nitro

import jaxnitro as jn


def test_inspect_prints_binding_groups_programs_and_memory(run_dir, capsys):
    n = nitro(Tiny(), run_dir=run_dir)
    result = jn.inspect(n)
    out = capsys.readouterr().out
    assert "width" in out and "GraphConst" in out and "forward() receives: x" in out
    assert "default" in out and "radam" in out
    assert "train" in out and "eval" in out and "capacity" in out
    assert result.memory


def test_printing_what_inspect_returns_shows_the_report_once(run_dir, capsys):
    n = nitro(Tiny(), run_dir=run_dir)
    print(jn.inspect(n))
    out = capsys.readouterr().out
    assert out.count("forward() receives: x") == 1 and out.count("capacity") == 1
    report = jn.inspect(n, show=False)
    assert capsys.readouterr().out == ""
    assert "forward() receives: x" in str(report) and str(report) == report.text()


def test_in_a_notebook_inspect_shows_the_report_once(run_dir, capsys, monkeypatch):
    import IPython.display

    from jaxnitro._src.train import introspect

    shown: list[str] = []
    monkeypatch.setattr(introspect, "in_notebook", lambda: True, raising=False)
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj._repr_html_()))
    result = jn.inspect(nitro(Tiny(), run_dir=run_dir))
    cell = result._repr_html_() or repr(result)  # what Jupyter shows as the cell's value
    everything = capsys.readouterr().out + "".join(shown) + cell
    assert everything.count("forward() receives: x") == 1, everything
