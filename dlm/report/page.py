"""The page of `dlm report`: a `RunHistory` (`dlm.report`) as one self-contained HTML file.

The charts are plotly's (the `report` extra) because they are interactive (hover gives the numbers,
drag zooms) and plotly's whole JavaScript inlines into the page: the file opens anywhere, offline.
Every string that comes from the run (config values, samples, file names, notes) is HTML-escaped,
and plotly escapes `</` in the chart data it embeds.
"""

from __future__ import annotations

import importlib
import warnings
from html import escape
from pathlib import Path
from typing import Any

from dlm import __version__
from dlm.errors import UserNote, reported_os_errors
from dlm.extras import Requirement, require
from dlm.fileio import atomic_write_text
from dlm.report.history import (
    GENERATOR_TAG,
    EvalResult,
    RunHistory,
    Series,
    check_report_output,
    config_rows,
    default_output,
    gather_run,
)

PLOTLY = Requirement("plotly.graph_objects", "report", "drawing the report's charts")
CHART_HEIGHT = 340  # px: two charts side by side still read on a laptop screen
PLOT_CONFIG = {"displaylogo": False, "responsive": True}  # no logo linking out to plotly.com
TRAIN_COLOUR, VALIDATION_COLOUR, EVAL_COLOUR = "#1f77b4", "#ff7f0e", "#2ca02c"
VALIDATION = "validation (fixed noise)"

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #1d2430; background: #f4f6f9; }
main { max-width: 1400px; margin: 0 auto; padding: 16px 24px 48px; }
h1 { font-size: 1.6rem; margin: 8px 0 2px; } h2 { font-size: 1.2rem; margin: 28px 0 10px; }
.path { color: #5b6575; font-family: ui-monospace, monospace; font-size: 0.85rem; margin-bottom: 12px; }
section, .card { background: #fff; border: 1px solid #dde2ea; border-radius: 8px; padding: 12px 16px; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 14px; }
.card { padding: 6px; }
table { border-collapse: collapse; font-size: 0.9rem; }
td, th { text-align: left; padding: 4px 12px 4px 0; border-bottom: 1px solid #eef0f4; vertical-align: top; }
th { color: #5b6575; font-weight: 600; }
td.number { text-align: right; font-variant-numeric: tabular-nums; }
code, pre { font-family: ui-monospace, "SFMono-Regular", Menlo, monospace; font-size: 0.85rem; }
pre { white-space: pre-wrap; overflow-wrap: anywhere; background: #f7f8fa; padding: 8px; border-radius: 6px;
      margin: 4px 0 14px; }
.note { color: #8a5a00; } .none { color: #5b6575; font-style: italic; }
footer { color: #5b6575; font-size: 0.8rem; margin-top: 32px; }
"""


def _layout(title: str, y_title: str, last_step: int, **extra: Any) -> dict[str, Any]:
    """One chart's layout; every chart over steps spans 0 to the run's last step, so they line up."""

    return {
        "title": {"text": title, "x": 0.02, "font": {"size": 15}},
        "xaxis": {"title": {"text": "step"}, "range": [0, last_step * 1.02], "rangemode": "tozero"},
        "yaxis": {"title": {"text": y_title}},
        "template": "plotly_white",
        "height": CHART_HEIGHT,
        "margin": {"l": 64, "r": 20, "t": 48, "b": 48},
        "legend": {"orientation": "h", "y": -0.22, "x": 0},
        "hovermode": "x unified",
        **extra,
    }


def _trace(go: Any, series: Series, label: str, colour: str, markers: bool = False) -> Any:
    mode = "lines+markers" if markers or len(series.steps) < 3 else "lines"
    return go.Scatter(x=series.steps, y=series.values, name=label, mode=mode, line={"color": colour})


def _eval_trace(go: Any, history: RunHistory, key: str, error_key: str, label: str) -> Any | None:
    steps, values, errors = history.eval_series(key, error_key)
    if not steps:
        return None
    return go.Scatter(
        x=steps,
        y=values,
        name=label,
        mode="markers",
        marker={"color": EVAL_COLOUR, "size": 9},
        error_y={"type": "data", "array": errors, "visible": True},
    )


def _train_and_validation(go: Any, history: RunHistory, name: str, figure: Any) -> Any:
    figure.add_trace(_trace(go, history.train_series(name), "training", TRAIN_COLOUR))
    if history.validation:
        figure.add_trace(_trace(go, history.validation_series(name), VALIDATION, VALIDATION_COLOUR, markers=True))
    return figure


def _loss_charts(go: Any, history: RunHistory, last: int) -> list[Any]:
    layout = _layout("Loss", "nats per token", last, showlegend=True)
    loss = _train_and_validation(go, history, "loss", go.Figure(layout=layout))
    elbo = _eval_trace(go, history, "nll", "nll_stderr", "dlm eval: ELBO NLL ± 1 s.e.")
    if elbo is not None:
        loss.add_trace(elbo)
    y_title = "share of masked tokens right"
    axis = {"title": {"text": y_title}, "tickformat": ".0%"}
    layout = _layout("Masked accuracy", y_title, last, yaxis=axis, showlegend=True)
    return [loss, _train_and_validation(go, history, "masked_accuracy", go.Figure(layout=layout))]


def _noise_chart(go: Any, history: RunHistory, last: int) -> Any | None:
    names, steps, rows = history.loss_by_t()
    values = sorted(value for row in rows for value in row if value is not None)
    if not values:
        return None
    # The colours span the 5th to 95th percentile: one noisy bucket (tiny t, few masks) must not wash out the rest.
    low, high = values[int(0.05 * (len(values) - 1))], values[int(0.95 * (len(values) - 1))]
    heatmap = go.Heatmap(
        x=steps,
        y=names,
        z=rows,
        colorscale="Viridis",
        zmin=low,
        zmax=max(high, low + 1e-6),
        colorbar={"title": {"text": "nats/token"}},
        hovertemplate="step %{x}<br>t in %{y}<br>loss %{z:.4f}<extra></extra>",
    )
    layout = _layout("Training loss by noise level t", "noise level t (bucket)", last, hovermode="closest")
    return go.Figure(heatmap, layout=layout)


def _bits_chart(go: Any, history: RunHistory, last: int) -> Any | None:
    trace = _eval_trace(go, history, "bits_per_byte", "bits_per_byte_stderr", "dlm eval ± 1 s.e.")
    if trace is None:
        return None
    layout = _layout("Bits per byte (dlm eval reports)", "bits per byte", last, showlegend=True)
    figure = go.Figure(trace, layout=layout)
    # The level of token frequencies alone: a model at or above it has learned nothing of context.
    steps, unigram, _ = history.eval_series("unigram_bits_per_byte", "")
    if len(set(unigram)) == 1:  # one data set: one level across the chart
        steps, unigram = [0, last], unigram[:1] * 2
    if steps:
        figure.add_trace(
            go.Scatter(
                x=steps,
                y=unigram,
                name="unigram level (no context)",
                mode="lines+markers",
                line={"color": "#7f7f7f", "dash": "dash"},
                marker={"size": 4},
            )
        )
    return figure


def _reward_chart(go: Any, history: RunHistory, last: int) -> Any | None:
    """An RL run's rewards: the rollouts' mean reward and accuracy, and the held-out accuracy ± 1 s.e."""

    if not history.rollouts:
        return None
    layout = _layout("Rewards (dlm rl)", "per rollout", last, showlegend=True)
    figure = go.Figure(layout=layout)
    figure.add_trace(_trace(go, history.rollout_series("mean_reward"), "mean reward", TRAIN_COLOUR))
    figure.add_trace(_trace(go, history.rollout_series("accuracy"), "rollout accuracy", "#9467bd"))
    if history.heldout:
        figure.add_trace(
            go.Scatter(
                x=[event.step for event in history.heldout],
                y=[event.accuracy for event in history.heldout],
                name="held-out accuracy ± 1 s.e.",
                mode="lines+markers",
                line={"color": EVAL_COLOUR},
                error_y={"type": "data", "array": [event.stderr for event in history.heldout], "visible": True},
            )
        )
    return figure


def build_charts(history: RunHistory) -> list[Any]:
    """The plotly figures of the page, in order; empty when the run logged no training step."""

    go = require(PLOTLY)
    if not history.train:
        return []
    steps = [event.step for event in history.train] + [event.step for event in history.validation]
    last = max(steps + [result.step for result in history.evals if result.step is not None])
    figures = _loss_charts(go, history, last)
    optional = (_reward_chart(go, history, last), _noise_chart(go, history, last), _bits_chart(go, history, last))
    figures += [chart for chart in optional if chart is not None]
    for field, title, y_title, colour in (
        ("learning_rate", "Learning rate", "learning rate", TRAIN_COLOUR),
        ("grad_norm", "Gradient norm (before clipping)", "L2 norm", "#9467bd"),
        ("tokens_per_second", "Throughput", "tokens per second", "#8c564b"),
    ):
        # From zero: these are never negative, and a constant one (a flat learning rate) stays readable.
        axis = {"title": {"text": y_title}, "rangemode": "tozero"}
        figure = go.Figure(layout=_layout(title, y_title, last, showlegend=False, yaxis=axis))
        figure.add_trace(_trace(go, history.train_series(field), y_title, colour))
        figures.append(figure)
    return figures


# ------------------------------------------------------------------------------ HTML


def _table(rows: list[tuple[str, str]], header: tuple[str, str] | None = None) -> str:
    head = f"<tr><th>{escape(header[0])}</th><th>{escape(header[1])}</th></tr>" if header else ""
    body = "".join(f"<tr><th>{escape(name)}</th><td>{escape(value)}</td></tr>" for name, value in rows)
    return f"<table>{head}{body}</table>"


def _with_error(value: float | None, error: float | None, digits: int = 4) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}" + ("" if error is None else f" ± {error:.{digits}f}")


def _eval_section(evals: list[EvalResult]) -> str:
    if not evals:
        return (
            '<p class="none">No eval reports in the run directory. Write one with '
            "<code>dlm eval RUN_DIR --output RUN_DIR/eval.json</code>.</p>"
        )
    columns = (
        "report",
        "step",
        "bits per byte",
        "unigram level",
        "ELBO NLL (nats/token)",
        "perplexity bound",
        "fixed-noise loss",
        "masked accuracy",
        "sequences",
        "tokens",
    )
    rows = []
    for result in evals:
        figure = result.figure
        cells = (
            result.name,
            "n/a" if result.step is None else str(result.step),
            _with_error(figure("bits_per_byte"), figure("bits_per_byte_stderr")),
            _with_error(figure("unigram_bits_per_byte"), None),
            _with_error(figure("nll"), figure("nll_stderr")),
            _with_error(figure("perplexity_bound"), None, 2),
            _with_error(figure("fixed_noise_loss"), None),
            _with_error(figure("fixed_noise_accuracy"), None),
            str(result.report.get("sequences", "n/a")),
            str(result.report.get("tokens", "n/a")),
        )
        rows.append("<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in cells) + "</tr>")
    notes = [
        f"<li>{escape(result.name)}: {escape(str(note))}</li>"
        for result in evals
        for note in result.report.get("notes", [])
    ]
    header = "<tr>" + "".join(f"<th>{escape(column)}</th>" for column in columns) + "</tr>"
    text = f"<table>{header}{''.join(rows)}</table>"
    return text + (f'<ul class="note">{"".join(notes)}</ul>' if notes else "") + "<p>± is one standard error.</p>"


def _samples_section(samples: list[dict[str, Any]]) -> str:
    if not samples:
        return (
            '<p class="none">No samples recorded with this run (<code>dlm demo</code> writes '
            "<code>samples.json</code>). Draw some with <code>dlm sample MODEL</code>.</p>"
        )
    parts = []
    for index, sample in enumerate(samples, 1):
        label = str(sample.get("label") or f"sample {index}")
        given = [f"{key}: {sample[key]!s}" for key in ("prompt", "template") if sample.get(key)]
        caption = escape(label) + (f" <code>{escape('; '.join(given))}</code>" if given else "")
        parts.append(f"<div><strong>{caption}</strong><pre>{escape(str(sample['text']))}</pre></div>")
    return "".join(parts)


def _rollouts_section(history: RunHistory, shown: int = 8) -> str:
    """An RL run's last rollouts (one per log step), prompt and reply, newest first."""

    if not history.rollouts:
        return ""
    rows = [(f"step {event.step}", escape(event.sample)) for event in reversed(history.rollouts[-shown:])]
    body = "".join(f"<tr><td>{step}</td><td><code>{text}</code></td></tr>" for step, text in rows)
    return f"<h3>Rollouts (dlm rl)</h3><table>{body}</table>"


def _charts_section(figures: list[Any]) -> str:
    if not figures:
        return '<p class="none">The run logged no training step yet: nothing to chart.</p>'
    pio = importlib.import_module("plotly.io")
    divs = [
        pio.to_html(figure, include_plotlyjs=False, full_html=False, config=PLOT_CONFIG, div_id=f"chart-{index}")
        for index, figure in enumerate(figures)
    ]
    return '<div class="charts">' + "".join(f'<div class="card">{div}</div>' for div in divs) + "</div>"


def render_page(history: RunHistory) -> str:
    """The whole page: summary, charts, eval reports, samples and config, with plotly's JS inline."""

    figures = build_charts(history)
    plotly_js = importlib.import_module("plotly.offline").get_plotlyjs()
    name = history.name
    notes = "".join(f'<li class="note">{escape(note)}</li>' for note in history.notes)
    config = (
        _table(config_rows(history.config), ("field", "value"))
        if history.config is not None
        else '<p class="none">No config.json in the run directory.</p>'
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">{GENERATOR_TAG}
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>dlm report: {escape(name)}</title><style>{STYLE}</style>
<script>{plotly_js}</script></head>
<body><main>
<h1>dlm report: {escape(name)}</h1><div class="path">{escape(str(history.run_dir))}</div>
<section>{_table(history.summary())}{f"<ul>{notes}</ul>" if notes else ""}</section>
<h2>Training</h2>{_charts_section(figures)}
<h2>Evaluation</h2><section>{_eval_section(history.evals)}</section>
<h2>Samples</h2><section>{_samples_section(history.samples)}{_rollouts_section(history)}</section>
<h2>Config</h2><section>{config}</section>
<footer>Written by dlm {escape(__version__)} from the files of the run directory.</footer>
</main></body></html>
"""


def write_report(run: str | Path, output: str | Path | None = None, overwrite: bool = False) -> Path:
    """Write the report of the run in `run` to `output` (default RUN/report.html), atomically.

    An earlier report at `output` is replaced; any other file only with `overwrite`."""

    output = default_output(run) if output is None else Path(output)
    history = gather_run(run)  # a wrong directory is said first, with or without the extra
    check_report_output(output, overwrite)
    require(PLOTLY)
    page = render_page(history)
    with reported_os_errors("the report", output):
        atomic_write_text(output, page)
    for note in history.notes:  # on the page too; said here as well, so that a file left out is not missed
        warnings.warn(note, UserNote, stacklevel=2)
    return output
