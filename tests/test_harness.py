"""lm-evaluation-harness runs a tiny exported dlm model on local tasks (multiple choice, rolling
perplexity, generation) through its Python API and its command line; the numbers it reports are
the adapter's own. Nothing is downloaded: the tasks read a JSONL file written here."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import train_tiny_run

from dlm.artifacts.export import export_model

pytestmark = pytest.mark.lm_eval_extra
lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[lm-eval]')")

DOCS = [
    {
        "question": "ROMEO: I will",
        "choices": ["go", "not", "see thee"],
        "answer": 0,
        "text": "To be, or not to be, that is the question.",
        "prompt": "KING:",
        "target": "my lord",
    },
    {
        "question": "JULIET: O Romeo,",
        "choices": ["Romeo", "wherefore", "art"],
        "answer": 1,
        "text": "Now is the winter of our discontent\nmade glorious summer by this sun of York.",
        "prompt": "HAMLET:",
        "target": "the king",
    },
]
COMMON = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
"""
TASKS = {
    "dlm_tiny_choice": """output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
    "dlm_tiny_rolling": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
""",
    "dlm_tiny_generate": """output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
}


@pytest.fixture(scope="module")
def exported(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("harness-model")
    return export_model(train_tiny_run(tiny_data_dir, root / "run"), root / "export", dtype="float32")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("harness-tasks")
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS), encoding="utf-8")
    for name, body in TASKS.items():
        text = f"task: {name}\n" + COMMON.format(data=data, cache=root / "cache") + body.format()
        (root / f"{name}.yaml").write_text(text, encoding="utf-8")
    return root


def instance(kind: str, arguments: Any) -> Any:
    from lm_eval.api.instance import Instance

    return Instance(kind, {}, tuple(arguments), 0)


def test_simple_evaluate_reports_the_adapters_own_numbers(exported: Path, task_dir: Path) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from dlm.harness import DlmLM

    results = simple_evaluate(
        model="dlm",
        model_args=f"pretrained={exported},mc_samples=4",
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
        batch_size=2,
        device="cpu",
    )
    assert set(results["results"]) == set(TASKS)
    samples = results["samples"]
    # The same requests through the adapter directly, in batches of another size.
    direct = DlmLM(pretrained=str(exported), mc_samples=4, batch_size=5, device="cpu")
    correct = []
    for sample in samples["dlm_tiny_choice"]:
        scores = direct.loglikelihood([instance("loglikelihood", pair) for pair in sample["arguments"]])
        logged = [response[0] for response in sample["resps"]]
        assert [s for s, _ in scores] == pytest.approx([s for s, _ in logged], abs=1e-4)
        assert [g for _, g in scores] == [g for _, g in logged]
        correct.append(max(range(len(scores)), key=lambda i: scores[i][0]) == sample["target"])
    assert results["results"]["dlm_tiny_choice"]["acc,none"] == pytest.approx(sum(correct) / len(correct))

    texts = [doc["text"] for doc in DOCS]
    logprobs = direct.loglikelihood_rolling([instance("loglikelihood_rolling", (text,)) for text in texts])
    assert all(value < 0 for value in logprobs)
    words = sum(len(re.split(r"\s+", text)) for text in texts)
    perplexity = results["results"]["dlm_tiny_rolling"]["word_perplexity,none"]
    assert perplexity == pytest.approx(math.exp(-sum(logprobs) / words), rel=1e-4)

    for sample in samples["dlm_tiny_generate"]:
        context, gen_kwargs = sample["arguments"][0]
        [text] = direct.generate_until([instance("generate_until", (context, gen_kwargs))])
        assert sample["resps"][0][0] == text and "\n" not in text
    assert 0.0 <= results["results"]["dlm_tiny_generate"]["exact_match,none"] <= 1.0


def test_python_m_dlm_harness_is_lm_evals_command_line(exported: Path, task_dir: Path, tmp_path: Path) -> None:
    output = tmp_path / "results"
    command = [
        sys.executable,
        "-m",
        "dlm.harness",
        "--model",
        "dlm",
        "--model_args",
        f"pretrained={exported},mc_samples=2",
        "--tasks",
        "dlm_tiny_choice",
        "--include_path",
        str(task_dir),
        "--device",
        "cpu",
        "--output_path",
        str(output),
    ]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "dlm_tiny_choice" in done.stdout
    [written] = output.rglob("results_*.json")
    assert "acc,none" in json.loads(written.read_text())["results"]["dlm_tiny_choice"]


def test_a_model_the_adapter_cannot_load_is_one_error_line(
    task_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dlm.harness import main

    monkeypatch.chdir(tmp_path)
    arguments = [
        "--model",
        "dlm",
        "--model_args",
        f"pretrained={tmp_path / 'missing'}",
        "--tasks",
        "dlm_tiny_choice",
        "--include_path",
        str(task_dir),
        "--device",
        "cpu",
    ]
    monkeypatch.setattr(sys, "argv", ["dlm.harness"])
    with pytest.raises(SystemExit) as exit_info:
        main(arguments)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "missing" in errors[0]


def test_model_args_are_checked(exported: Path) -> None:
    from dlm.errors import UserError
    from dlm.harness import DlmLM

    with pytest.raises(UserError, match="unknown model_args mc_sample"):
        DlmLM(pretrained=str(exported), mc_sample=4)
    with pytest.raises(UserError, match="lacks pretrained"):
        DlmLM()
    with pytest.raises(UserError, match="ema="):
        DlmLM(pretrained=str(exported), ema="maybe")
