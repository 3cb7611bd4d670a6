"""docs/benchmarks.md quotes only measured figures: rendered from the kit's result files, each stamped."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from benchmarks import harness
from benchmarks.__main__ import BENCHMARKS
from dlm.bench.measure import MachineStamp

# A figure: a decimal, or a number followed by x, × or %. Counts of things ("2 cores", "64 tokens")
# are setup, not figures, and may stand in the prose.
FIGURE = re.compile(r"(?<![\w.{])(?:\d[\d,]*\.\d+(?:\s?[x×%](?!\w))?|\d[\d,]*\s?[x×%](?!\w))")


def _prose(template: str) -> str:
    """The template without code blocks, inline code and placeholders: what a person wrote as text."""

    text = re.sub(r"```.*?```", "", template, flags=re.S)
    text = re.sub(r"`[^`]*`", "", text)
    return re.sub(r"\{\{[^}]*\}\}", "", text)


def test_the_document_is_the_template_rendered_from_the_result_files() -> None:
    rendered = harness.render(harness.TEMPLATE.read_text(encoding="utf-8"))
    document = harness.DOCUMENT.read_text(encoding="utf-8")
    assert document.split("\n", 1)[1] == rendered, "docs/benchmarks.md is stale: python -m benchmarks render-docs"
    assert "{{" not in rendered and "}}" not in rendered  # every placeholder was one the renderer knows


def test_every_figure_of_the_template_is_a_placeholder() -> None:
    stray = FIGURE.findall(_prose(harness.TEMPLATE.read_text(encoding="utf-8")))
    # Targets are set, not measured: "at least 0.8x" is the one kind of number the prose may state.
    assert [figure for figure in stray if figure.strip() not in ("0.8x",)] == []


def test_every_result_file_is_stamped_and_names_the_command_that_wrote_it() -> None:
    files = sorted(harness.RESULTS.glob("*.json"))
    assert files, "benchmarks/results holds no result"
    for path in files:
        result = json.loads(path.read_text(encoding="utf-8"))
        assert result["benchmark"] == path.stem
        words = result["command"].split()
        settings = [word for word in words if word.split("=")[0] in harness.SETTINGS]  # as the run had them
        command = words[len(settings) :]
        assert command[:3] == ["python", "-m", "benchmarks"] and command[3] in BENCHMARKS
        assert command[3] == path.stem or f"--name {path.stem}" in result["command"]  # a run named apart
        stamp = MachineStamp(**result["machine"])  # every field present, none unknown
        assert stamp.date and stamp.cpu and stamp.torch and stamp.dlm and stamp.cores >= 1
        assert isinstance(result["figures"], dict) and result["figures"]
        assert str(harness.ROOT) not in path.read_text(encoding="utf-8")  # paths relative to the repository
        assert "/tmp/" not in path.read_text(encoding="utf-8")


def test_a_placeholder_without_a_result_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "pack.json").write_text(
        json.dumps({"benchmark": "pack", "parameters": {"rounds": 5}, "figures": {"ratio": {"median": 0.91}}}),
        encoding="utf-8",
    )
    assert harness.render("{{pack.ratio.median:.2f}}x in {{pack@rounds}} rounds", tmp_path) == "0.91x in 5 rounds"
    with pytest.raises(KeyError, match="no parameter 'seed'"):
        harness.render("{{pack@seed}}", tmp_path)
    with pytest.raises(KeyError, match=r"no figure 'ratio\.mean'"):
        harness.render("{{pack.ratio.mean:.2f}}", tmp_path)
    with pytest.raises(KeyError, match=r"no result file demo\.json"):
        harness.render("{{demo.bits_per_byte}}", tmp_path)


def test_the_figure_pattern_finds_figures_and_leaves_counts() -> None:
    assert FIGURE.findall("ran 1.25x faster, +17.6% and 0.92 of it") == ["1.25x", "17.6%", "0.92"]
    assert FIGURE.findall("on 2 cores, 64 tokens, d_model 256, 8,192 entries") == []


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""

    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_into_the_page_name_sections_it_has() -> None:
    anchors = {
        _slug(line.lstrip("#"))
        for line in harness.DOCUMENT.read_text(encoding="utf-8").splitlines()
        if line.startswith("#")
    }
    pages = [harness.ROOT / "README.md", *sorted((harness.ROOT / "docs").glob("*.md"))]
    linked = {
        (page.name, anchor)
        for page in pages
        for anchor in re.findall(r"benchmarks\.md#([\w-]+)", page.read_text(encoding="utf-8"))
    }
    assert linked, "no page links into docs/benchmarks.md"
    assert [(page, anchor) for page, anchor in sorted(linked) if anchor not in anchors] == []


def test_the_recorded_command_carries_the_settings_that_change_the_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """A result measured under another CPU's kernels, or one thread, is reproduced with them: they lead its
    command, as a person would type them."""

    monkeypatch.setattr(sys, "argv", ["__main__.py", "cpu-inference", "runs/demo/model", "--name", "x y"])
    for name in harness.SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert harness.command_line() == "python -m benchmarks cpu-inference runs/demo/model --name 'x y'"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert harness.command_line() == (
        "OMP_NUM_THREADS=1 ATEN_CPU_CAPABILITY=avx2 python -m benchmarks cpu-inference runs/demo/model --name 'x y'"
    )
