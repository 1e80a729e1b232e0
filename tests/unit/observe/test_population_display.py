"""A population run as people watch it: one readable line per epoch (the best member and the
spread, never every member's `name/i`), the members table once at the end, the train bar that
says how many members still train, and nothing with progress=False."""

from __future__ import annotations

import io
import json
import re

import pytest
from conftest import Tiny
from helpers.notebook import DisplayRecorder
from rich.console import Console

import jaxnitro as jn
from jaxnitro._src.observe import members as population_view
from jaxnitro._src.observe.display import Display
from jaxnitro._src.steps.population import Population

SMOOTHING = [0.0, 0.1, 0.2]


def _plain_run(tmp_path, **kw):
    n = jn.Nitro(Tiny(), run_dir=tmp_path / "run", progress=False, **kw)
    out = io.StringIO()
    n.services.display = Display("plain", file=out)
    return n, jn.train(n), out.getvalue()


def _validations(run_dir) -> list[dict]:
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r.get("context") == "validate"]


@pytest.mark.slow
def test_the_epoch_line_names_the_best_member_and_the_spread_not_every_member(tmp_path):
    top = jn.TopKCheckpointer(metric="acc", mode="max")
    n, _, text = _plain_run(tmp_path, population={"smoothing": SMOOTHING}, checkpointer=top)
    lines = [line for line in text.splitlines() if re.match(r"epoch \d/2: ", line)]
    assert len(lines) == 2, text
    for line, val in zip(lines, _validations(n.run_dir), strict=True):
        assert not re.search(r"\w/\d", line.split(":", 1)[1]), line  # no `acc/0` wall
        assert "(mean of 3)" in line, line
        assert f"best member {val['member']}: " in line, line
        assert f"acc {val['acc']:.4f}" in line and f"val_loss {val['val_loss']:.4f}" in line
        accs = [val[f"acc/{i}"] for i in range(3)]
        assert f"acc over members {min(accs):.4f}–{max(accs):.4f}" in line, line
        assert "steps/s" in line
    # what the loggers get is unchanged: every member's values and the best one's by name
    assert {"acc/0", "acc/1", "acc/2", "member", "acc"} <= set(_validations(n.run_dir)[-1])


def test_the_members_table_comes_once_ranked_with_the_values_the_population_varies(tmp_path):
    top = jn.TopKCheckpointer(metric="acc", mode="max")
    _, result, text = _plain_run(tmp_path, population={"smoothing": SMOOTHING}, checkpointer=top)
    assert text.count("members, best first by acc") == 1, text
    lines = text.splitlines()
    at = lines.index("members, best first by acc:")
    assert lines[at + 1].split() == ["member", "smoothing", "acc", "val_loss"], lines[at + 1]
    rows = [line.split() for line in lines[at + 3 : at + 6]]
    assert result.members is not None
    assert [int(r[0]) for r in rows] == [m["member"] for m in result.members]  # best first
    for row, member in zip(rows, result.members, strict=True):
        assert row[1:] == [
            str(SMOOTHING[member["member"]]),
            f"{member['acc']:.4f}",
            f"{member['val_loss']:.4f}",
        ]
    assert text.index("members, best first") < text.index("done (completed)")  # before the end


@pytest.mark.slow
def test_a_population_by_seed_shows_the_seeds_and_one_model_no_table(tmp_path):
    _, result, text = _plain_run(tmp_path / "pop", population=2)
    at = text.splitlines().index("members, best first by val_loss:")
    assert text.splitlines()[at + 1].split()[:2] == ["member", "seed"]
    assert result.members is not None
    assert [m["seed"] for m in result.members] == [
        int(line.split()[1]) for line in text.splitlines()[at + 3 : at + 5]
    ]
    _, _, single = _plain_run(tmp_path / "one")
    assert "members" not in single and "best member" not in single


def test_a_big_population_shows_its_best_and_worst_and_where_the_rest_are():
    pop = Population(20, tuple(range(42, 62)))
    ranked = [
        {"member": i, "seed": 42 + i, "val_loss": 0.1 * i, "acc": 1 - 0.01 * i} for i in range(20)
    ]
    shown = population_view.table(pop, ranked, metric="val_loss")
    assert shown is not None
    text, html = shown
    lines = text.splitlines()
    assert "20; jn.train(n).members lists every one" in lines[0], lines[0]
    members = [line.split()[0] for line in lines[3:]]
    assert members == [*map(str, range(10)), "…", "17", "18", "19"], lines
    assert "… 7 more" in text and "… 7 more" in html
    assert html.count("<tr>") == 1 + 14  # the header, 10 best, the gap, the 3 worst
    assert population_view.table(pop, [{"member": 0, "seed": 42}], metric="val_loss") is None


def _one_member_stops(tmp_path) -> jn.Nitro:
    """Two members; member 1 learns at a rate of 0: its val_loss never improves, so it stops
    at epoch 2 while member 0 trains on."""
    es = jn.EarlyStopping(metric="val_loss", patience=1, min_delta=0.0)
    return jn.Nitro(
        Tiny(max_epochs=3),
        run_dir=tmp_path / "run",
        progress=False,
        population={"learning_rate": [1e-2, 0.0]},
        early_stop=es,
    )


@pytest.mark.slow
def test_the_bar_says_how_many_members_still_train_and_the_notebook_keeps_the_table(tmp_path):
    n = _one_member_stops(tmp_path)
    rec = DisplayRecorder()
    n.services.display = Display("notebook", file=io.StringIO(), show=rec)
    result = jn.train(n)
    assert [m.stopped_epoch for m in n.progress.early_stop] == [None, 2]
    seen = rec.shown + rec.updates
    assert any("<b>epoch 1/3 · 2 members</b> <progress" in u for u in seen), seen
    assert any("<b>epoch 3/3 · 1/2 members training</b> <progress" in u for u in seen), seen
    assert not any("epoch 2/3 · 1/2" in u for u in seen)  # it stopped at the end of epoch 2
    last = rec.updates[-1]
    assert "<caption>members, best first by val_loss</caption>" in last, last
    header = re.search(r"<caption>members.*?</thead>", last)
    assert header is not None
    assert re.findall(r"<th>(.*?)</th>", header.group(0)) == [
        "member",
        "learning_rate",
        "val_loss",
        "acc",
        "stopped_epoch",
    ]
    assert result.members is not None
    assert [m["stopped_epoch"] for m in result.members] == [None, 2]
    assert "<td>2</td></tr>" in last  # member 1's row ends with its stopped_epoch
    assert "epoch 3/3" in last and "<progress" not in last


@pytest.mark.slow
def test_progress_off_shows_nothing_of_a_population(tmp_path, capsys):
    n = _one_member_stops(tmp_path)
    jn.train(n)
    assert capsys.readouterr().out == ""


def test_the_terminal_bar_names_the_members_where_the_row_fits():
    buf = io.StringIO()
    d = Display("rich", file=buf)
    d.console = Console(file=buf, force_terminal=True, width=120, color_system=None)
    d.start_epoch(9, 10, 14000, members=(15, 16))
    d.update(12800, 0.5472, 1868.0)

    def row(width: int) -> str:
        d.console.width = width
        out = io.StringIO()
        assert d._progress is not None
        Console(file=out, force_terminal=True, width=width, color_system=None).print(
            next(iter(d._progress.get_renderables()))
        )
        lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
        assert len(lines) == 1 and len(lines[0]) <= width and "…" not in lines[0], lines
        return lines[0]

    wide = row(120)
    assert "epoch 10/10 · 15/16 members training" in wide and "mean loss 0.5472" in wide
    assert "12800/14000" in wide and "steps/s" in wide
    # 100 columns: the full row without the note (its count and rate intact)
    assert "members" not in row(100) and "steps/s" in row(100)
    assert "members" not in row(60) and "12800/14000" in row(60)  # the compact row
    d.end_train(14000)
    d.end_epoch("train_loss 0.5")
    assert "epoch 10/10: train_loss 0.5" in buf.getvalue()  # the line names no members
