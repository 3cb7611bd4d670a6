"""`dlm report`: the run's history read back exactly, the page it writes, and the page in a browser.

The data part (`dlm.report.history`) needs no extra. The page needs plotly (the `report` extra): those tests
are marked `report_extra`. The browser test needs playwright and pillow (the `report-test` extra)
and Chromium at /usr/bin/chromium: it is marked `browser`. Each skips cleanly without its packages.
"""

from __future__ import annotations

import io
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import CliResult
from helpers import tiny_experiment

from dlm.artifacts.events import EndEvent, StartEvent, TrainEvent, ValidationEvent
from dlm.errors import UserError
from dlm.report.history import GENERATOR_TAG, check_report_output, config_rows, current_events, find_run, gather_run
from dlm.train.loop import train

CHROMIUM = Path("/usr/bin/chromium")
# Offline and quiet: no first-run pages, no background or component traffic, no QUIC probing.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
INJECTION = "</pre><script>alert('run')</script><img src=x onerror=alert(2)>"
EVAL_REPORT = {
    "format": "dlm-eval-v2",
    "nll": 4.25,
    "nll_stderr": 0.125,
    "bits_per_byte": 3.5,
    "bits_per_byte_stderr": 0.0625,
    "unigram_bits_per_byte": 4.125,
    "perplexity_bound": 70.1,
    "fixed_noise_loss": 4.5,
    "fixed_noise_accuracy": 0.25,
    "sequences": 16,
    "tokens": 1024,
    "notes": [],
    "context": {"step": 4},
}


@pytest.fixture(scope="module")
def tiny_run(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step run, logged every step and validated every second step."""

    run_dir = tmp_path_factory.mktemp("report") / "run"
    overrides = (
        "training.max_steps=4",
        "training.warmup_steps=1",
        "training.log_interval=1",
        "training.eval_interval=2",
        "training.save_interval=2",
    )
    train(tiny_experiment(tiny_data_dir, run_dir, *overrides))
    return run_dir


@pytest.fixture
def run_copy(tiny_run: Path, tmp_path: Path) -> Path:
    """The tiny run's text files (no checkpoints) in a directory a test may change."""

    copy = tmp_path / "run"
    copy.mkdir()
    for name in ("metrics.jsonl", "config.json"):
        (copy / name).write_bytes((tiny_run / name).read_bytes())
    return copy


def _lines(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line["event"] == kind]


# ------------------------------------------------------------------------------ the data (no extra)


def test_history_holds_the_logged_figures_exactly(tiny_run: Path) -> None:
    history = gather_run(tiny_run)
    logged, validated = _lines(tiny_run, "train"), _lines(tiny_run, "validation")
    for name in ("loss", "learning_rate", "grad_norm", "tokens_per_second", "masked_accuracy"):
        series = history.train_series(name)
        assert series.steps == [1, 2, 3, 4]
        assert series.values == [line[name] for line in logged]
    assert history.validation_series("loss").steps == [2, 4]
    assert history.validation_series("loss").values == [line["loss"] for line in validated]
    names, steps, rows = history.loss_by_t()
    assert names[0] == "0.0-0.1" and len(names) == len(logged[0]["loss_by_t"]) == len(rows)
    assert steps == [1, 2, 3, 4]
    assert rows == [[line["loss_by_t"][bucket] for line in logged] for bucket in range(len(names))]
    assert history.end is not None and history.end.status == "complete"
    summary = dict(history.summary())
    assert summary["step"] == "4 of 4"
    assert summary["status"] == "complete at step 4"
    assert summary["last validation loss"] == f"{validated[-1]['loss']:.4f} (step 4)"
    assert history.config is not None and history.config["training"]["max_steps"] == 4
    assert ("training.max_steps", "4") in config_rows(history.config)
    assert history.evals == [] and history.samples == [] and history.notes == []


def _train(step: int, loss: float) -> TrainEvent:
    return TrainEvent(
        step=step,
        max_steps=4,
        loss=loss,
        masked_accuracy=0.5,
        learning_rate=1e-3,
        grad_norm=1.0,
        tokens_seen=step * 64,
        tokens_per_second=100.0,
        mfu=None,
        eta_seconds=0.0,
        loss_by_t=[loss, None],
    )


def _start(start_step: int) -> StartEvent:
    return StartEvent(
        run_dir="r",
        device="cpu",
        precision="float32",
        parameters=1,
        parameters_human="1",
        optimizer="adamw",
        compile=False,
        activation_checkpointing=False,
        fused_attention_required=False,
        world_size=1,
        parallelism=None,
        global_batch=1,
        tokens_per_step=64,
        training_blocks=1,
        start_step=start_step,
        max_steps=4,
        resumed_from=None,
        data_changed=False,
        dlm_version="0",
    )


def test_a_resume_from_an_older_checkpoint_replaces_the_steps_trained_again() -> None:
    first = [
        _start(0),
        _train(1, 9.0),
        _train(2, 8.0),
        ValidationEvent(step=2, loss=7.0, masked_accuracy=0.1, batches=1),
        _train(3, 7.5),
        EndEvent("interrupted", 3, "c", "dlm resume r"),
    ]
    again = [_start(1), _train(2, 6.0), _train(3, 5.0)]
    kept = current_events([*first, *again])
    assert [(type(event).__name__, getattr(event, "step", None)) for event in kept] == [
        ("StartEvent", None),
        ("TrainEvent", 1),
        ("StartEvent", None),
        ("TrainEvent", 2),
        ("TrainEvent", 3),
    ]
    assert [event.loss for event in kept if isinstance(event, TrainEvent)] == [9.0, 6.0, 5.0]


def test_eval_reports_and_samples_are_read_and_bad_files_noted(run_copy: Path) -> None:
    (run_copy / "eval.json").write_text(json.dumps(EVAL_REPORT))
    (run_copy / "eval-step-2.json").write_text(
        json.dumps({**EVAL_REPORT, "bits_per_byte": 3.75, "context": {"step": 2}})
    )
    (run_copy / "other.json").write_text(json.dumps({"format": "something else"}))
    (run_copy / "broken.json").write_text("{not json")
    (run_copy / "samples.json").write_text(json.dumps([{"label": "unconditional", "text": INJECTION}]))
    history = gather_run(run_copy)
    assert [result.name for result in history.evals] == ["eval-step-2.json", "eval.json"]
    assert history.eval_series("bits_per_byte", "bits_per_byte_stderr") == ([2, 4], [3.75, 3.5], [0.0625, 0.0625])
    assert history.eval_series("nll", "nll_stderr") == ([2, 4], [4.25, 4.25], [0.125, 0.125])
    assert history.samples == [{"label": "unconditional", "text": INJECTION}]
    assert len(history.notes) == 1 and history.notes[0].startswith("broken.json: cannot read")


DAMAGED_EVALS = {  # file name: (the report, the reason the note gives)
    "eval-context.json": ({**EVAL_REPORT, "context": [4]}, "its context is not an object"),
    "eval-step.json": ({**EVAL_REPORT, "context": {"step": "4"}}, "its context.step is not an integer"),
    "eval-nll.json": ({**EVAL_REPORT, "nll": "4.25"}, "nll is not a number"),
    "eval-bpb.json": ({**EVAL_REPORT, "bits_per_byte": True}, "bits_per_byte is not a number"),
    "eval-tokens.json": ({**EVAL_REPORT, "tokens": [1024]}, "tokens is not an integer"),
    "eval-notes.json": ({**EVAL_REPORT, "notes": 3}, "its notes are not a list of strings"),
}


def _damaged_evals(run_copy: Path) -> list[str]:
    """eval.json plus the damaged reports; the notes each damaged one should get, by file name."""

    (run_copy / "eval.json").write_text(json.dumps(EVAL_REPORT))
    for name, (report, _) in DAMAGED_EVALS.items():
        (run_copy / name).write_text(json.dumps(report))
    damaged = sorted(DAMAGED_EVALS.items())
    return [f"{name}: a damaged eval report ({reason}); left out" for name, (_, reason) in damaged]


def test_an_eval_report_of_the_wrong_shape_is_left_out_with_a_note(run_copy: Path) -> None:
    expected = _damaged_evals(run_copy)
    history = gather_run(run_copy)
    assert [result.name for result in history.evals] == ["eval.json"]
    assert history.notes == expected


@pytest.mark.report_extra
def test_dlm_report_warns_of_each_eval_report_it_leaves_out(run_copy: Path, run_cli: Callable[..., CliResult]) -> None:
    pytest.importorskip("plotly", reason="plotly is not installed (pip install -e '.[report]')")
    expected = _damaged_evals(run_copy)
    result = run_cli("report", run_copy, "--json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.splitlines() == [f"warning: {note}" for note in expected]
    page = (run_copy / "report.html").read_text(encoding="utf-8")
    assert "<td>eval.json</td>" in page and "<td>eval-nll.json</td>" not in page
    assert all(note in page for note in expected)  # said on the page as well


def test_a_demo_directory_is_its_run_with_the_samples_beside_it(run_copy: Path) -> None:
    demo = run_copy.parent / "demo"
    demo.mkdir()
    run_copy.rename(demo / "run")
    (demo / "samples.json").write_text(json.dumps([{"label": "prompt", "prompt": "ROMEO:", "text": "ROMEO: hi"}]))
    assert find_run(demo) == (demo / "run", demo / "samples.json")
    history = gather_run(demo)
    assert history.samples[0]["text"] == "ROMEO: hi"
    assert (history.run_dir, history.name) == (demo / "run", "demo")
    # Named itself, the demo's run shows the demo's samples too.
    assert find_run(demo / "run") == (demo / "run", demo / "samples.json")
    assert gather_run(demo / "run").samples == history.samples


def test_the_unigram_level_of_a_demo_report_is_shown(run_copy: Path) -> None:
    # `dlm demo` before 0.9 wrote the unigram level into the report's context only.
    report = {
        "format": "dlm-eval-v1",
        "bits_per_byte": 3.1,
        "nll": 5.0,
        "sequences": 4,
        "tokens": 256,
        "context": {"step": 4, "unigram_bits_per_byte": 2.991},
    }
    (run_copy / "eval.json").write_text(json.dumps(report))
    (result,) = gather_run(run_copy).evals
    assert result.figure("unigram_bits_per_byte") == 2.991


def test_not_a_run_directory_is_refused(tmp_path: Path, run_cli: Callable[..., CliResult]) -> None:
    with pytest.raises(UserError, match=r"not a dlm run directory: no metrics\.jsonl"):
        gather_run(tmp_path)
    run_cli("report", tmp_path).assert_refused("not a dlm run directory", "metrics.jsonl")
    assert list(tmp_path.iterdir()) == []


def test_only_an_earlier_report_is_replaced_without_overwrite(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "report.html", tmp_path / "notes.html"
    ours.write_text(f"<!DOCTYPE html><html><head>{GENERATOR_TAG}</head></html>")
    theirs.write_text("<html>someone's page</html>")
    check_report_output(ours, overwrite=False)
    check_report_output(tmp_path / "new.html", overwrite=False)
    with pytest.raises(UserError, match="not a report dlm wrote"):
        check_report_output(theirs, overwrite=False)
    check_report_output(theirs, overwrite=True)
    with pytest.raises(UserError, match="--output is a directory"):
        check_report_output(tmp_path, overwrite=True)
    with pytest.raises(UserError, match="directory of --output does not exist"):
        check_report_output(tmp_path / "missing" / "report.html", overwrite=False)


def test_without_the_extra_one_error_names_it(
    run_copy: Path, run_cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("plotly", "plotly.graph_objects"):  # a None entry makes the import fail, cached or not
        monkeypatch.setitem(sys.modules, name, None)
    run_cli("report", run_copy).assert_refused("drawing the report's charts needs plotly", "pip install 'dlm[report]'")
    assert not (run_copy / "report.html").exists()


# ------------------------------------------------------------------------------ the page (report extra)


def _report_run(run_copy: Path) -> Path:
    """The run with an eval report, samples and a config value that all try to inject markup."""

    (run_copy / "eval.json").write_text(json.dumps(EVAL_REPORT))
    (run_copy / "samples.json").write_text(json.dumps([{"label": "unconditional", "prompt": "", "text": INJECTION}]))
    config = json.loads((run_copy / "config.json").read_text())
    config["logging"]["run_name"] = INJECTION
    (run_copy / "config.json").write_text(json.dumps(config))
    return run_copy


@pytest.mark.report_extra
def test_the_page_is_written_self_contained_with_the_runs_numbers(
    run_copy: Path, run_cli: Callable[..., CliResult]
) -> None:
    plotly_offline = pytest.importorskip(
        "plotly.offline", reason="plotly is not installed (pip install -e '.[report]')"
    )
    from dlm.report.page import build_charts

    run_dir = _report_run(run_copy)
    result = run_cli("report", run_dir, "--json")
    assert result.exit_code == 0, result.stderr
    page_path = run_dir / "report.html"
    assert json.loads(result.stdout) == {"output": str(page_path), "bytes": page_path.stat().st_size}
    page = page_path.read_text(encoding="utf-8")
    assert GENERATOR_TAG in page
    last = _lines(run_dir, "train")[-1]
    assert json.dumps(last["loss"]) in page  # the chart data
    assert f"{last['loss']:.4f} (step 4)" in page  # the summary
    assert "3.5000 ± 0.0625" in page and "4.2500 ± 0.1250" in page  # the eval report with its errors
    assert "<td>4.1250</td>" in page  # and the unigram level beside it
    assert page.count('class="main-svg"') == 0  # drawn by the browser, not by Python
    assert len(re.findall(r'<div id="chart-\d+"', page)) == len(build_charts(gather_run(run_dir))) == 7
    # Escaped wherever the run's strings appear; never as markup.
    assert INJECTION not in page and "<img src=x" not in page
    assert page.count("&lt;/pre&gt;&lt;script&gt;alert(&#x27;run&#x27;)&lt;/script&gt;") == 2  # sample, config
    # Nothing loaded from elsewhere: no script, style or image by address, and outside plotly's own
    # code (which spells a few addresses it never fetches here) no address at all.
    assert not re.search(r"<(script|link|img|iframe)\b[^>]*\b(src|href)\s*=", page, re.IGNORECASE)
    assert not re.search(r"https?://", page.replace(plotly_offline.get_plotlyjs(), ""))
    # A second report replaces the first; a file of someone else's is kept without --overwrite.
    assert run_cli("report", run_dir).exit_code == 0
    theirs = run_dir / "theirs.html"
    theirs.write_text("mine")
    run_cli("report", run_dir, "--output", theirs).assert_refused("not a report dlm wrote", "--overwrite")
    assert theirs.read_text() == "mine"
    assert run_cli("report", run_dir, "--output", theirs, "--overwrite").exit_code == 0
    assert GENERATOR_TAG in theirs.read_text(encoding="utf-8")
    assert sorted(path.name for path in run_dir.iterdir() if path.name.startswith(".")) == []  # no temporaries left


@pytest.mark.report_extra
def test_a_person_is_told_where_the_page_is_on_one_line(
    run_copy: Path, run_cli: Callable[..., CliResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("plotly", reason="plotly is not installed (pip install -e '.[report]')")
    from rich.console import Console

    from dlm.cli import report_cmd

    monkeypatch.setattr(report_cmd, "wants_json", lambda flag: False)  # as on a terminal
    monkeypatch.setattr(report_cmd, "console", Console(width=80))
    output = run_copy / ("a-long-directory-name-" * 4) / "page.html"
    output.parent.mkdir()
    result = run_cli("report", run_copy, "-o", output)
    assert result.exit_code == 0, result.stderr
    size = output.stat().st_size / 1e6
    assert result.stdout == f"wrote {output} ({size:.1f} MB): open it in a browser\n"


# ------------------------------------------------------------------------------ the page in a browser


@pytest.mark.browser
def test_the_page_renders_in_chromium_offline(run_copy: Path) -> None:
    pytest.importorskip("plotly", reason="plotly is not installed (pip install -e '.[report-test]')")
    playwright = pytest.importorskip(
        "playwright.sync_api", reason="playwright is missing (pip install -e '.[report-test]')"
    )
    image = pytest.importorskip("PIL.Image", reason="pillow is not installed (pip install -e '.[report-test]')")
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    from dlm.report.page import build_charts, write_report

    page_path = write_report(_report_run(run_copy))
    charts = len(build_charts(gather_run(run_copy)))
    problems: list[str] = []
    requests: list[str] = []

    def only_files(route: Any) -> None:
        requests.append(route.request.url)
        if route.request.url.startswith("file:"):
            route.continue_()
        else:
            route.abort()

    with playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(180_000)  # a loaded machine parses 5 MB of JavaScript slowly
            page.on("console", lambda message: problems.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda error: problems.append(str(error)))
            page.on("dialog", lambda dialog: (problems.append("dialog: " + dialog.message), dialog.dismiss()))
            page.route("**/*", only_files)
            page.goto(page_path.as_uri(), wait_until="load")
            page.wait_for_function(f"document.querySelectorAll('.main-svg').length >= {charts}")
            drawn = [page.locator(f"#chart-{index} .main-svg").count() for index in range(charts)]
            shot = page.locator("#chart-0").screenshot()
            text = page.inner_text("body")
        finally:
            browser.close()
    assert problems == []
    assert requests == [page_path.as_uri()]  # the page alone: nothing fetched from anywhere else
    assert charts == 7 and all(count >= 1 for count in drawn), drawn  # every chart drew its svg
    assert INJECTION in text  # shown as the text it is
    colours = image.open(io.BytesIO(shot)).convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 16  # the curves, axes and labels show: not one flat colour
