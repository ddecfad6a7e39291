"""The demo runs end to end in a few seconds with --steps 3; it prints each run's row as
the run finishes, keeps what finished when stopped, and says when ours equals native."""

import io
import subprocess
import sys

import pytest
import torch

from dispatch_amp import demo

SMALL = ["--steps", "3", "--batch", "4", "--seq", "32"]


def _outputs(tmp_path) -> list[str]:
    return ["--plot", str(tmp_path / "demo.png"), "--table", str(tmp_path / "demo.md")]


def test_demo_runs_with_three_steps(tmp_path, capsys):
    assert demo.main(SMALL + _outputs(tmp_path)) == 0
    out = capsys.readouterr().out
    table = (tmp_path / "demo.md").read_text()
    for run in demo.RUNS:
        assert f"| {run} |" in out and f"| {run} |" in table
    assert "matmul FLOPs in bfloat16" in out and "matmul FLOPs in bfloat16" in table
    assert (tmp_path / "demo.png").stat().st_size > 0


def test_a_log_of_the_output_holds_whole_rows_and_no_bars(tmp_path):
    # `python -m dispatch_amp.demo > demo.log 2>&1`: a bar's carriage returns on stderr ran
    # into the rows on stdout, on the same lines. Bars only on a terminal.
    with open(tmp_path / "demo.log", "w") as log:
        done = subprocess.run([sys.executable, "-m", "dispatch_amp.demo", *SMALL, "--no-plot",
                               "--table", str(tmp_path / "demo.md")],
                              stdout=log, stderr=subprocess.STDOUT, timeout=600)
    assert done.returncode == 0
    text = (tmp_path / "demo.log").read_text()
    assert "\r" not in text and "it/s" not in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows] == ["| run"] + [f"| {run}" for run in demo.RUNS]
    assert all(row.endswith("|") for row in rows)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bars_only_on_a_terminal():
    pytest.importorskip("tqdm")
    log, terminal = io.StringIO(), _Terminal()
    assert list(demo._progress_bar(log)(range(3), desc="fp32")) == [0, 1, 2]
    assert log.getvalue() == ""
    assert list(demo._progress_bar(terminal)(range(3), desc="fp32")) == [0, 1, 2]
    assert "fp32" in terminal.getvalue()


def test_ms_per_step_leaves_out_the_first_step_and_says_so(tmp_path, capsys):
    # The first step carries one-time setup (the first region's kernels): with --steps 3
    # it decided a run's ms/step. The median is over the steps after it.
    args = demo.build_parser().parse_args(SMALL)
    text = demo.load_corpus()[:2000]
    args.alphabet = sorted(set(text))
    data = torch.tensor([args.alphabet.index(c) for c in text])
    run = demo._Run("dispatch_amp", data, len(args.alphabet), args, torch.device("cpu"), torch.bfloat16)
    for step in range(3):
        run.step(step)
    run.times = [10.0, 0.001, 0.003]  # a slow first step
    assert run.finish().step_ms == pytest.approx(2.0)

    assert demo.main(SMALL + _outputs(tmp_path)) == 0
    note = "ms/step: the median of each run's steps 2 to 3 (step 1 carries one-time setup)."
    out = capsys.readouterr().out
    assert "| dispatch_amp |" in out and note in out.split("| dispatch_amp |")[1]
    assert (tmp_path / "demo.md").read_text().rstrip().endswith(note)


def test_demo_float16_uses_the_scaler_and_reports_skips(tmp_path, capsys):
    args = ["--steps", "2", "--batch", "2", "--seq", "16", "--dtype", "float16"] + _outputs(tmp_path)
    assert demo.main(args) == 0
    out = capsys.readouterr().out
    assert "matmul FLOPs in float16" in out and (tmp_path / "demo.png").stat().st_size > 0


def test_demo_rejects_bad_options():
    with pytest.raises(SystemExit):
        demo.main(["--steps", "0"])
    with pytest.raises(SystemExit):
        demo.main(["--device", "meta"])


def test_each_row_is_printed_as_its_run_finishes(tmp_path, capsys, monkeypatch):
    train_run = demo._train_run
    seen_before = {}

    def recording(name, *args):
        seen_before[name] = capsys.readouterr().out  # printed before this run started
        return train_run(name, *args)

    monkeypatch.setattr(demo, "_train_run", recording)
    assert demo.main(SMALL + _outputs(tmp_path)) == 0
    assert list(seen_before) == list(demo.RUNS)
    assert "| run | ms/step |" in seen_before["fp32"] and "| fp32 |" not in seen_before["fp32"]
    assert "| fp32 |" in seen_before["torch.autocast"]
    assert "| torch.autocast |" in seen_before["dispatch_amp"]


def test_ctrl_c_after_the_first_run_writes_its_table_and_plot(tmp_path, capsys, monkeypatch):
    train_run = demo._train_run

    def interrupted_after_the_first(name, *args):
        if name != demo.RUNS[0]:
            raise KeyboardInterrupt
        return train_run(name, *args)

    monkeypatch.setattr(demo, "_train_run", interrupted_after_the_first)
    assert demo.main(SMALL + _outputs(tmp_path)) == 130
    out = capsys.readouterr().out
    assert "stopped: 1 of 3 runs finished" in out
    table = (tmp_path / "demo.md").read_text()
    assert "| fp32 |" in table and "| torch.autocast |" not in table and "| dispatch_amp |" not in table
    assert table.splitlines()[0].startswith("| run | ms/step |")
    assert (tmp_path / "demo.png").stat().st_size > 0


def test_ctrl_c_before_any_run_finished_writes_nothing(tmp_path, capsys, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "_train_run", interrupted)
    assert demo.main(SMALL + _outputs(tmp_path)) == 130
    assert "stopped: 0 of 3 runs finished" in capsys.readouterr().out
    assert not (tmp_path / "demo.md").exists() and not (tmp_path / "demo.png").exists()


def _results(ours: list[float], native: list[float]) -> list:
    return [demo.RunResult("fp32", losses=[3.0, 2.5, 2.0]), demo.RunResult("torch.autocast", losses=native),
            demo.RunResult("dispatch_amp", losses=ours)]


def _difference_panel(results):
    pytest.importorskip("matplotlib")
    fig = demo._draw_demo(results, title="t")
    return fig, fig.axes[1]


def test_the_difference_panel_says_identical_when_ours_equals_native():
    losses = [3.0, 2.4, 2.1]
    fig, ax = _difference_panel(_results(list(losses), list(losses)))
    assert [t.get_text() for t in ax.texts] == ["identical: the same loss at all 3 steps"]
    assert not ax.lines  # no flat line on a tiny axis
    demo._pyplot().close(fig)


def test_the_difference_panel_draws_a_difference_that_is_not_zero():
    fig, ax = _difference_panel(_results([3.0, 2.4, 2.1], [3.0, 2.4, 2.1 + 2**-10]))
    assert not ax.texts
    drawn = ax.lines[0].get_ydata()
    assert list(drawn) == [0.0, 0.0, -(2**-10)]
    demo._pyplot().close(fig)


def test_the_plot_without_both_amp_runs_has_no_difference_panel(tmp_path):
    pytest.importorskip("matplotlib")
    fig = demo._draw_demo(_results([3.0], [3.0])[:2], title="t")
    assert len(fig.axes) == 1
    demo._pyplot().close(fig)


def test_format_table_is_the_markdown_table_of_the_results():
    results = _results([2.0], [2.0])
    for r, ms in zip(results, (10.0, 5.0, 4.0)):
        r.step_ms, r.peak_mb = ms, 100.0
    lines = demo.format_table(results, torch.bfloat16).splitlines()
    assert lines[0] == "| run | ms/step | vs fp32 | peak MB | final loss | skipped steps | matmul FLOPs in bfloat16 |"
    assert lines[1] == "|---|---:|---:|---:|---:|---:|---:|"
    assert lines[3] == "| torch.autocast | 5.0 | 2.00x | 100 | 2.000 | 0 | 0.0% |"
    assert lines[4] == "| dispatch_amp | 4.0 | 2.50x | 100 | 2.000 | 0 | 0.0% |"


def test_corpus_ships_with_the_package():
    text = demo.load_corpus()
    assert 100_000 < len(text) < 400_000 and text.isascii()


def test_char_gpt_shapes():
    model = demo.CharGPT(vocab=10, d=12, heads=2, layers=1, seq=8)
    assert model(torch.randint(0, 10, (2, 8))).shape == (2, 8, 10)


class _BuiltNow:
    """A process loader whose build ran in this process, as on a machine's first run."""

    def __init__(self, directory):
        self.build_seconds, self.directory = 12.3, directory


def _stop_at_the_first_run(monkeypatch, events):
    def first_run(*args, **kwargs):
        events.append("run")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "_train_run", first_run)


def test_a_build_of_the_compiled_engine_is_said_once_before_any_step(tmp_path, capsys, monkeypatch):
    events = []
    _stop_at_the_first_run(monkeypatch, events)
    monkeypatch.setattr(demo._engine_choice, "compiled_module", lambda quiet=False: events.append(quiet) or object())
    monkeypatch.setattr(demo._engine_loader, "PROCESS_LOADER", _BuiltNow(tmp_path / "engine"))
    assert demo.main(SMALL + ["--no-plot", "--table", str(tmp_path / "demo.md")]) == 130
    assert events == [True, "run"]  # decided (quietly: the demo says it) before the first run
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "engine" in line]
    assert lines == [f"dispatch_amp engine: compiled, built now in 12 s (once per torch release, before the first "
                     f"step: no row counts it; cached in {tmp_path / 'engine'})"]
    assert out.index(lines[0]) < out.index("| run |")


@pytest.mark.parametrize("module, name", [(None, "python"), (object(), "compiled")])
def test_the_demo_names_its_engine(tmp_path, capsys, monkeypatch, module, name):
    _stop_at_the_first_run(monkeypatch, [])
    monkeypatch.setattr(demo._engine_choice, "compiled_module", lambda quiet=False: module)
    monkeypatch.setattr(demo._engine_loader, "PROCESS_LOADER", demo._engine_loader.Loader())  # nothing built here
    assert demo.main(SMALL + ["--no-plot", "--table", str(tmp_path / "demo.md")]) == 130
    assert f"\ndispatch_amp engine: {name}\n" in capsys.readouterr().out


def test_a_required_engine_that_cannot_build_stops_the_demo_with_the_cause(tmp_path, monkeypatch):
    from dispatch_amp._compiled import loader

    monkeypatch.setenv("DISPATCH_AMP_ENGINE", "compiled")
    monkeypatch.setenv("CXX", "/nonexistent")
    monkeypatch.setattr(loader, "PROCESS_LOADER", loader.Loader(root=tmp_path))
    with pytest.raises(SystemExit, match="DISPATCH_AMP_ENGINE=compiled: .*'/nonexistent'"):
        demo.main(SMALL + ["--no-plot", "--table", str(tmp_path / "demo.md")])
