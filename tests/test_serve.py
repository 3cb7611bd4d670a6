"""`dlm serve`: OpenAI's API over a tiny exported model, called with the real `openai` client.

Servers run on a free port of 127.0.0.1: in a thread of this process (the model in float64, where
a batch equals one-by-one sampling token for token, as in tests/test_batch_sampling.py), and as a
`dlm serve` subprocess for SIGTERM. Where a test needs requests to wait, a gate (a forward pre-hook)
holds the model until the requests are where the test wants them, so nothing depends on timing.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi", reason="fastapi is not installed (pip install -e '.[serve-test]')")
pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install -e '.[serve-test]')")
openai = pytest.importorskip("openai", reason="openai is not installed (pip install -e '.[serve-test]')")
import httpx  # noqa: E402 (openai's own dependency)
from helpers import train_tiny_run  # noqa: E402

from dlm.artifacts.export import export_model  # noqa: E402
from dlm.data.chat import Turn  # noqa: E402
from dlm.serving.app import PARSING_THREADS  # noqa: E402
from dlm.serving.protocol import DEFAULT_MAX_TOKENS, Limits  # noqa: E402
from dlm.serving.rows import RowStream, finish_row  # noqa: E402
from dlm.serving.server import Server, ServeSettings, load_served  # noqa: E402

pytestmark = pytest.mark.serve_extra
WAIT = 60.0  # the bound on every wait: a broken server fails the test instead of hanging it


@pytest.fixture(scope="module")
def model_dir(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("serve")
    return export_model(train_tiny_run(tiny_data_dir, root / "run"), root / "model", dtype="float32")


class Gate:
    """Holds every forward pass of the model while closed (at most WAIT seconds); `holding` is set once a
    pass waits at the closed gate."""

    def __init__(self, model: Any) -> None:
        self.opened = threading.Event()
        self.opened.set()
        self.holding = threading.Event()
        model.register_forward_pre_hook(self._hold)

    def _hold(self, module: Any, args: Any) -> None:
        if not self.opened.is_set():
            self.holding.set()
        self.opened.wait(WAIT)

    def close(self) -> None:
        self.holding.clear()
        self.opened.clear()

    def open(self) -> None:
        self.holding.clear()
        self.opened.set()

    @contextmanager
    def closed(self) -> Iterator[None]:
        self.close()
        try:
            yield
        finally:
            self.open()


class Running:
    def __init__(self, server: Server, gate: Gate, api_key: str | None) -> None:
        self.server, self.gate = server, gate
        self.url = f"http://127.0.0.1:{server.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key or "unused", max_retries=0, timeout=WAIT)
        self.log: list[dict[str, Any]] = []

    @property
    def stats(self) -> Any:
        return self.server.scheduler.stats.snapshot()

    def until(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting until {what}"
            time.sleep(0.01)

    def complete(self, **request: Any) -> Any:
        request = {"model": "model", "prompt": "ROMEO:", "max_tokens": 8} | request
        return self.client.completions.create(**request)

    def start_queued(self, requests: list[dict[str, Any]], what: str) -> tuple[list[Any], list[threading.Thread]]:
        """Send each request from a thread of its own; return once all of them wait in the queue, with
        the list their answers land in (by position) and the threads."""

        answers: list[Any] = [None] * len(requests)
        threads = [
            threading.Thread(target=lambda i=i: answers.__setitem__(i, self.complete(**requests[i])))
            for i in range(len(requests))
        ]
        for thread in threads:
            thread.start()
        self.until(lambda: self.stats.queued == len(requests), what)
        return answers, threads

    def assert_healthy(self) -> None:
        """After a fault: /health answers, and so does a normal request."""

        assert httpx.get(f"{self.url}/health", timeout=WAIT).json()["status"] == "ok"
        answer = self.complete(seed=1)
        assert answer.choices[0].finish_reason in ("stop", "length")


def start_in_thread(server: Server) -> threading.Thread:
    """Run `server` in a daemon thread and return once it listens (at most WAIT seconds)."""

    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    return thread


@contextmanager
def running(model_dir: Path, api_key: str | None = None, **settings: Any) -> Iterator[Running]:
    served = load_served(model_dir, dtype="float64", name="model")
    gate = Gate(served.model)
    log: list[dict[str, Any]] = []
    server = Server(served, ServeSettings(port=0, api_key=api_key, **settings), on_request=log.append)
    thread = start_in_thread(server)
    handle = Running(server, gate, api_key)
    handle.log = log
    try:
        yield handle
    finally:
        server.stop()
        thread.join(WAIT)
        assert not thread.is_alive()


@pytest.fixture(scope="module")
def live(model_dir: Path) -> Iterator[Running]:
    with running(model_dir, limits=Limits(max_n=4, max_body_bytes=1 << 16)) as handle:
        yield handle


def test_models_completions_and_chat(live: Running, model_dir: Path) -> None:
    assert [model.id for model in live.client.models.list().data] == ["model"]
    assert live.client.models.retrieve("model").id == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        live.client.models.retrieve("other")
    assert missing.value.response.json()["error"]["code"] == "model_not_found"
    # No such route, or not with that method: OpenAI's error body all the same.
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
        answer = httpx.request(method, f"{live.url}{path}", timeout=WAIT)
        assert answer.status_code == status and answer.json()["error"]["message"].startswith(f"{method} {path}")
    answer = live.complete(prompt="ROMEO:", max_tokens=12, seed=3)
    (choice,) = answer.choices
    served = load_served(model_dir)
    assert answer.usage.prompt_tokens == len(served.tokenizer.encode("ROMEO:").ids)
    assert answer.usage.completion_tokens <= 12 and answer.usage.total_tokens == (
        answer.usage.prompt_tokens + answer.usage.completion_tokens
    )
    assert choice.finish_reason in ("stop", "length") and choice.text
    assert live.complete(prompt="ROMEO:", max_tokens=12, seed=3).choices[0].text == choice.text  # same seed, same text
    chat = live.client.chat.completions.create(
        model="model", messages=[{"role": "user", "content": "Who art thou?"}], max_tokens=10, seed=4
    )
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content is not None
    prompt = served.template.prompt([Turn("user", "Who art thou?")])
    assert chat.usage.prompt_tokens == len(served.tokenizer.encode(prompt).ids)  # the template of `dlm pack --chat`
    live.until(
        lambda: any(record["path"] == "/v1/chat/completions" and record["status"] == 200 for record in live.log),
        "the request is logged",
    )


def test_n_samples_and_sampler_options(live: Running) -> None:
    answer = live.complete(n=3, seed=5, extra_body={"steps": 4, "remasking": "confidence", "block_length": 4})
    assert [choice.index for choice in answer.choices] == [0, 1, 2]
    assert len({choice.text for choice in answer.choices}) > 1  # three rows of one random stream
    assert answer.usage.completion_tokens <= 3 * 8
    again = live.complete(n=3, seed=5, extra_body={"steps": 4, "remasking": "confidence", "block_length": 4})
    assert [c.text for c in again.choices] == [c.text for c in answer.choices]


def test_a_list_of_prompts_is_each_prompt_with_its_seed(live: Running) -> None:
    both = live.complete(prompt=["ROMEO:", "To be"], n=2, seed=20, max_tokens=6)
    first = live.complete(prompt="ROMEO:", n=2, seed=20, max_tokens=6)
    second = live.complete(prompt="To be", n=2, seed=21, max_tokens=6)
    assert [c.text for c in both.choices] == [c.text for c in first.choices + second.choices]
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert both.usage.prompt_tokens == first.usage.prompt_tokens + second.usage.prompt_tokens
    chat = live.client.chat.completions.create(
        model="model", messages=[{"role": "user", "content": "Hail!"}], max_completion_tokens=5, seed=6
    )
    assert chat.usage is not None and 1 <= chat.usage.completion_tokens <= 5


def test_stop_strings_cut_the_text(live: Running) -> None:
    whole = live.complete(max_tokens=16, seed=7).choices[0].text
    stop = whole[4:6]
    cut = live.complete(max_tokens=16, seed=7, stop=[stop])
    assert cut.choices[0].text == whole[: whole.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens <= 16


def test_streaming_sends_the_text_of_a_whole_request(live: Running) -> None:
    whole = live.complete(max_tokens=10, seed=9)
    chunks = list(live.client.completions.create(model="model", prompt="ROMEO:", max_tokens=10, seed=9, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    chat = live.client.chat.completions.create(
        model="model",
        messages=[{"role": "user", "content": "Speak."}],
        max_tokens=6,
        seed=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    events = list(chat)
    assert events[0].choices[0].delta.role == "assistant"
    assert events[-1].usage is not None and events[-1].usage.completion_tokens <= 6
    text = "".join(event.choices[0].delta.content or "" for event in events if event.choices)
    plain = live.client.chat.completions.create(
        model="model", messages=[{"role": "user", "content": "Speak."}], max_tokens=6, seed=2
    )
    assert text == plain.choices[0].message.content


def test_streaming_sends_each_block_as_it_becomes_final(live: Running) -> None:
    request = {"max_tokens": 16, "seed": 11, "extra_body": {"steps": 16, "block_length": 4}}
    whole = live.complete(**request).choices[0]
    assert whole.finish_reason == "length"  # no end of document: all four blocks are text

    def streamed(**extra: Any) -> list[str]:
        chunks = live.complete(stream=True, **request, **extra)
        return [text for chunk in chunks if (text := chunk.choices[0].text)]

    pieces = streamed()
    assert "".join(pieces) == whole.text and len(pieces) > 1  # sent while later blocks were still masked
    figures = live.stats  # a streamed request's time to its first text counts; nothing runs now
    assert figures.p50_first_text_seconds is not None and figures.admitted_tokens == 0 and figures.pass_ms
    stop = whole.text[len(whole.text) // 2 :][:2]
    cut = live.complete(stop=stop, **request).choices[0].text
    assert "".join(streamed(stop=stop)) == cut == whole.text[: whole.text.index(stop)]


def test_a_row_streams_only_final_text(model_dir: Path) -> None:
    tokenizer = load_served(model_dir).tokenizer
    text = "ab€cd STOP and more"
    ids = tokenizer.encode(text).ids
    assert len(tokenizer.encode("€").ids) > 1  # a character split across tokens
    mask, eos = 1, 0
    for stops, final in (((), text), (("STOP",), "ab€cd ")):
        stream = RowStream(tokenizer, mask, eos, stops)
        sent = ""
        for revealed in range(len(ids) + 1):  # left to right, one position at a time
            piece = stream.update(ids[:revealed] + [mask] * (len(ids) - revealed))
            assert "\ufffd" not in piece
            sent += piece
            assert final.startswith(sent)
        assert sent + stream.finish(final) == final


@pytest.mark.parametrize(
    ("request_fields", "param", "status"),
    [
        ({"max_tokens": 10**9}, "max_tokens", 400),
        ({"extra_body": {"steps": 0}}, "steps", 400),
        ({"extra_body": {"threshold": 1.5}}, "threshold", 400),
        ({"max_tokens": 16, "extra_body": {"steps": 2, "block_length": 4}}, "steps", 400),  # the sampler's check
        ({"extra_body": {"cache": "all"}}, "cache", 400),
        ({"extra_body": {"stpes": 3}}, "stpes", 400),
        ({"temperature": -1.0}, "temperature", 400),
        ({"temperature": 2.5}, "temperature", 400),  # past OpenAI's range, as OpenAI refuses it
        ({"top_p": 0.0}, "top_p", 400),
        ({"n": 5}, "n", 400),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", 400),
        ({"prompt": "x <|mask|> y"}, "prompt", 400),
        ({"model": "../../etc/passwd"}, "model", 404),
        ({"max_tokens": 2, "extra_body": {"steps": 10**8}}, "steps", 400),  # it would hold the engine for hours
        ({"extra_body": {"max_tokens": "8"}}, "max_tokens", 400),  # strict types, as OpenAI's
        ({"extra_body": {"max_tokens": True}}, "max_tokens", 400),
        ({"extra_body": {"temperature": "0.5"}}, "temperature", 400),
        ({"extra_body": {"stream": "yes"}}, "stream", 400),
    ],
)
def test_refusals_name_the_field(live: Running, request_fields: dict[str, Any], param: str, status: int) -> None:
    with pytest.raises(openai.APIStatusError) as refused:
        live.complete(**request_fields)
    assert refused.value.status_code == status
    body = refused.value.response.json()
    assert body["error"]["param"] == param and body["error"]["message"]
    assert "Traceback" not in refused.value.response.text
    live.assert_healthy()


def test_the_fields_common_clients_send_are_taken_at_their_neutral_values(live: Running) -> None:
    # What OpenAI's SDK and frameworks send by default: accepted, and the text is what it is without them.
    neutral = {
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "logprobs": None,
        "user": "u1",
        "extra_body": {"service_tier": "auto", "store": False, "metadata": {}},
    }
    assert live.complete(seed=9, **neutral).choices[0].text == live.complete(seed=9).choices[0].text
    nulls = {"extra_body": {"n": None, "stream": None, "echo": None, "logprobs": False}}  # unset, as clients say it
    assert live.complete(seed=9, **nulls).choices[0].text == live.complete(seed=9).choices[0].text
    parts = [{"type": "text", "text": "Who art"}, {"type": "text", "text": "thou?"}]
    messages = [{"role": "developer", "content": "Speak as a player."}, {"role": "user", "content": parts}]
    chat = live.client.chat.completions.create(
        model="model",
        messages=messages,
        max_tokens=6,
        seed=4,
        response_format={"type": "text"},
        logprobs=False,
        top_logprobs=0,
        tool_choice="none",
        parallel_tool_calls=False,
    )
    # The developer message renders as the system one; text parts join with a newline.
    plain = [{"role": "system", "content": "Speak as a player."}, {"role": "user", "content": "Who art\nthou?"}]
    again = live.client.chat.completions.create(model="model", messages=plain, max_tokens=6, seed=4)  # type: ignore[arg-type]
    assert chat.choices[0].message.content == again.choices[0].message.content
    assert chat.usage is not None and again.usage is not None
    assert chat.usage.prompt_tokens == again.usage.prompt_tokens
    # The SDK's own assistant message sent back as it returned it, with a part carrying a client's key.
    sent_back = chat.choices[0].message.model_dump()
    assert "refusal" in sent_back  # the SDK's fields beside the content
    replied = [{"role": "user", "content": "Who?"}, sent_back, {"role": "user", "content": [parts[1] | {"x": 1}]}]
    turn = live.client.chat.completions.create(model="model", messages=replied, max_tokens=4, seed=4)  # type: ignore[arg-type]
    assert turn.choices[0].message.content is not None
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    with pytest.raises(openai.BadRequestError) as refused:  # named by its own part, not "a valid string"
        live.client.chat.completions.create(
            model="model",
            messages=[{"role": "user", "content": [image]}],  # type: ignore[list-item]
            max_tokens=4,
        )
    assert refused.value.response.json()["error"]["param"] == "messages.0.content.0.type"
    with pytest.raises(openai.BadRequestError) as empty:  # only an assistant's turn may come back without content
        live.client.chat.completions.create(model="model", messages=[{"role": "user"}], max_tokens=4)  # type: ignore[list-item, typeddict-item]
    assert "needs its content" in empty.value.response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"logprobs": 2}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "and so to bed"}, "suffix"),
    ],
)
def test_a_field_asking_what_dlm_does_not_do_is_refused_by_name(
    live: Running, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.APIStatusError) as refused:
        live.complete(**fields)
    error = refused.value.response.json()["error"]
    assert refused.value.status_code == 400 and error["param"] == param and "not supported" in error["message"]
    with pytest.raises(openai.APIStatusError) as typo:  # an unknown field stays an error: a typo is not ignored
        live.complete(extra_body={"presense_penalty": 0})
    assert typo.value.response.json()["error"]["param"] == "presense_penalty"


def test_top_p_defaults_to_the_whole_distribution_as_openai_s_does(live: Running) -> None:
    from dlm.serving.protocol import CompletionRequest, _options

    assert _options(CompletionRequest(prompt="ROMEO:"), 8).top_p == 1.0  # `dlm sample`'s own default is 0.9
    assert _options(CompletionRequest(prompt="ROMEO:", top_p=0.9), 8).top_p == 0.9
    assert _options(CompletionRequest(prompt="ROMEO:", top_p=None), 8).top_p == 1.0  # null, as clients send unset
    left_out = live.complete(prompt="ROMEO:", max_tokens=8, seed=11).choices[0].text
    assert left_out == live.complete(prompt="ROMEO:", max_tokens=8, seed=11, top_p=1.0).choices[0].text


def test_malformed_and_oversized_bodies(live: Running) -> None:
    post = f"{live.url}/v1/completions"
    for content, status in (
        (b'{"prompt": "ROMEO:",', 400),
        (b"[1, 2]", 400),
        (b'{"prompt": 7}', 400),
        (b'{"prompt": "a", "temperature": "hot"}', 400),
    ):
        answer = httpx.post(post, content=content, headers={"content-type": "application/json"}, timeout=WAIT)
        assert answer.status_code == status and answer.json()["error"]["type"] == "invalid_request_error"
        assert answer.headers["x-request-id"]
    assert httpx.post(post, content=b'{"prompt": 7}', timeout=WAIT).json()["error"]["param"] == "prompt"
    big = b'{"prompt": "' + b"a" * 10_000_000 + b'"}'
    answer = httpx.post(post, content=big, timeout=WAIT)
    assert answer.status_code == 413 and "bytes" in answer.json()["error"]["message"]
    chunked = httpx.post(post, content=iter([big[:8_000_000], big[8_000_000:]]), timeout=WAIT)  # no length given
    assert chunked.status_code == 413
    live.assert_healthy()


@contextmanager
def pass_rows(model: Any) -> Iterator[list[int]]:
    """The rows of every forward pass of `model` while open (after the gate: a held pass counts once it runs)."""

    rows: list[int] = []
    hook = model.register_forward_pre_hook(lambda module, args: rows.append(int(args[0].shape[0])) and None)
    try:
        yield rows
    finally:
        hook.remove()


def test_requests_of_any_length_and_steps_share_passes_and_equal_each_alone(live: Running) -> None:
    prompts = [
        "ROMEO:",
        "JULIET: O Romeo, Romeo, wherefore",
        "To be",
        "",
        "MERCUTIO: A plague",
        "Now is the winter",
        "HAMLET:",
        "What light",
    ]
    # Lengths 6 and 10, steps from 4 to 10, and some with a threshold: each its own reverse process.
    requests = [
        {
            "prompt": prompts[i % len(prompts)],
            "max_tokens": 6 + 4 * (i % 2),
            "seed": 100 + i,
            "extra_body": {"steps": 4 + i % 4 + 2 * (i % 2)} | ({"threshold": 0.5} if i % 5 == 0 else {}),
        }
        for i in range(16)
    ]
    with pass_rows(live.server.scheduler.model) as rows:
        alone = [live.complete(**request).choices[0].text for request in requests]
    passes_alone = len(rows)
    answers: list[Any] = [None] * len(requests)

    def send(index: int) -> None:
        answers[index] = live.complete(**requests[index])

    with pass_rows(live.server.scheduler.model) as rows:
        with live.gate.closed():
            blocker = threading.Thread(target=live.complete, kwargs={"seed": 1})
            blocker.start()
            live.until(live.gate.holding.is_set, "the blocker's first pass is held")
            threads = [threading.Thread(target=send, args=(index,)) for index in range(len(requests))]
            for thread in threads:
                thread.start()
            live.until(lambda: live.stats.queued == len(requests), "all sixteen wait")
        for thread in [blocker, *threads]:
            thread.join(WAIT)
    assert [answer.choices[0].text for answer in answers] == alone
    # All sixteen start together at the blocker's next pass and make one call a step each, all of them
    # without a cache, so every step is one pass: no more passes than the blocker's 8 steps and the longest
    # request's 10, against one pass a request a step alone.
    assert max(rows) >= len(requests) and len(rows) <= 1 + 10 < passes_alone


def test_a_client_that_leaves_is_dropped(live: Running) -> None:
    before = live.stats
    with live.gate.closed():
        blocker = threading.Thread(target=live.complete, kwargs={"seed": 1})
        blocker.start()
        live.until(live.gate.holding.is_set, "the blocker's first pass is held")
        body = {"model": "model", "prompt": "ROMEO:", "max_tokens": 8, "stream": True}
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=WAIT) as response:
            assert response.status_code == 200
            live.until(lambda: live.stats.queued == 1, "the stream waits")
        live.until(lambda: live.stats.dropped == before.dropped + 1, "the server drops it")
    blocker.join(WAIT)
    live.until(lambda: live.stats.queued == 0 and live.stats.in_flight == 0, "the queue empties")
    assert live.stats.left == before.left  # it left the queue: it never ran
    live.assert_healthy()


def test_a_streaming_client_that_leaves_mid_batch_takes_its_rows_out(live: Running) -> None:
    """Its rows leave before the next pass: the passes after it shrink, the others' text is what it is alone."""

    extra = {"steps": 40, "block_length": 4}  # a block of 4 is final (and streamed) after its 4 steps
    leaving = {"prompt": "ROMEO:", "max_tokens": 40, "seed": 41, "extra_body": extra}
    staying = [
        {"prompt": prompt, "max_tokens": 40, "seed": 42 + i, "extra_body": extra}
        for i, prompt in enumerate(["To be", "JULIET: O Romeo"])
    ]
    alone = [live.complete(**request).choices[0] for request in [leaving, *staying]]
    assert all(choice.finish_reason == "length" for choice in alone)  # they run all their steps
    leaving_alone, alone = alone[0], alone[1:]
    before = live.stats
    model = live.server.scheduler.model
    rows: list[int] = []  # of every pass after the first (held while the others come)

    def hold_the_fifth(module: Any, args: Any) -> None:  # runs after the gate's hook, so the next pass waits
        rows.append(int(args[0].shape[0]))
        if len(rows) == 3:  # the fourth pass: the leaving request has run 4 steps, its first block is final
            live.gate.close()

    live.gate.close()
    stream = live.client.completions.create(model="model", stream=True, **leaving)
    live.until(live.gate.holding.is_set, "the leaving request's first pass is held")
    answers, threads = live.start_queued(staying, "the others wait")
    counter = model.register_forward_pre_hook(hold_the_fifth)
    try:
        live.gate.open()  # the others join at the next pass
        first = next(chunk.choices[0].text for chunk in stream if chunk.choices[0].text)
        assert leaving_alone.text.startswith(first)
        stream.close()
        live.until(lambda: live.stats.dropped == before.dropped + 1, "the server sees the client leave")
        live.until(live.gate.holding.is_set, "the fifth pass waits")
        left_at = len(rows)  # passes before it left; the one held at the gate may still hold its row
        live.gate.open()
        for thread in threads:
            thread.join(WAIT)
    finally:
        counter.remove()
    assert [answer.choices[0].text for answer in answers] == [choice.text for choice in alone]
    # Every running request makes one call a pass; once its client has gone, no pass after the held one has its
    # row, while the others (10 blocks' worth of steps each, a few done) still run together.
    assert rows[0] == 1 + len(staying) and len(rows) > left_at + 1
    assert rows[left_at + 1] == max(rows[left_at + 1 :]) == len(staying)
    live.until(lambda: live.stats.left == before.left + 1, "its request ends")
    live.assert_healthy()


def test_a_request_whose_client_left_stops_at_its_next_pass(live: Running) -> None:
    passes: list[int] = []
    counter = live.server.scheduler.model.register_forward_pre_hook(lambda module, args: passes.append(1))
    before = live.stats
    try:
        with live.gate.closed():
            body = {"model": "model", "prompt": "ROMEO:", "max_tokens": 40, "steps": 40, "stream": True}
            with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=WAIT) as response:
                assert response.status_code == 200
                live.until(live.gate.holding.is_set, "its first pass is held")
            live.until(lambda: live.stats.dropped == before.dropped + 1, "the server sees the client leave")
        live.until(lambda: live.stats.in_flight == 0, "it stops")
    finally:
        counter.remove()
    assert len(passes) <= 1  # the pass that was held; its next step stops it: not 40 steps' worth
    assert live.stats.left == before.left + 1
    live.assert_healthy()


def test_a_full_queue_answers_429_and_nothing_hangs(model_dir: Path) -> None:
    with running(model_dir, max_queue=8) as server:

        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=WAIT, limits=httpx.Limits(max_connections=200)) as client:
                tasks = [
                    asyncio.create_task(
                        client.post(
                            f"{server.url}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4, "seed": i}
                        )
                    )
                    for i in range(200)
                ]
                while sum(task.done() for task in tasks) + server.stats.queued + server.stats.in_flight < 200:
                    await asyncio.sleep(0.01)
                server.gate.opened.set()  # the surplus is answered: let the held requests run
                return await asyncio.gather(*tasks)

        server.gate.opened.clear()
        answers = asyncio.run(asyncio.wait_for(flood(), WAIT))
        statuses = [answer.status_code for answer in answers]
        assert set(statuses) == {200, 429}
        assert 8 < statuses.count(200) <= 8 + 32 and statuses.count(429) == server.stats.rejected
        refused = next(answer for answer in answers if answer.status_code == 429)
        assert int(refused.headers["retry-after"]) >= 1 and refused.json()["error"]["type"] == "rate_limit_error"
        server.assert_healthy()


def test_a_full_queue_refuses_before_reading_the_body(model_dir: Path) -> None:
    with running(model_dir, max_queue=1) as handle:
        with handle.gate.closed():
            first = threading.Thread(target=handle.complete, kwargs={"seed": 1})
            first.start()
            handle.until(handle.gate.holding.is_set, "a request is in its pass")
            answers, threads = handle.start_queued([{"seed": 2}], "one request waits: the queue is full")
            # Not even parsed: a body that is not JSON gets the 429 a full queue gives, not a 400.
            refused = httpx.post(f"{handle.url}/v1/completions", content=b"{not json", timeout=WAIT)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        for thread in [first, *threads]:
            thread.join(WAIT)
        assert answers[0].choices[0].text is not None
        handle.assert_healthy()


def test_a_request_past_its_deadline_gets_504_and_leaves_its_batch(model_dir: Path) -> None:
    with running(model_dir, limits=Limits(request_timeout=0.5)) as handle:
        with handle.gate.closed():
            with pytest.raises(openai.APIStatusError) as late:
                handle.complete(seed=1, max_tokens=8)
            handle.gate.open()
        error = late.value.response.json()["error"]
        assert late.value.status_code == 504 and error["code"] == "timeout" and "--request-timeout" in error["message"]
        handle.until(lambda: handle.stats.in_flight == 0, "the late request has left its batch")
        assert handle.stats.timed_out == 1 and handle.stats.dropped == 0
        handle.assert_healthy()


def test_health_says_stalled_while_one_round_runs_too_long(model_dir: Path) -> None:
    with running(model_dir, limits=Limits(stall_seconds=0.3)) as handle:
        answers: list[Any] = []
        with handle.gate.closed():
            sender = threading.Thread(target=lambda: answers.append(handle.complete(seed=1)))
            sender.start()
            handle.until(handle.gate.holding.is_set, "a pass is held")
            time.sleep(0.4)
            stalled = httpx.get(f"{handle.url}/health", timeout=WAIT)
        sender.join(WAIT)
        assert stalled.status_code == 503 and stalled.json()["status"] == "stalled"
        assert stalled.json()["round_seconds"] > 0.3 and answers  # the request itself is answered once freed
        handle.assert_healthy()


def test_a_request_may_set_a_tighter_deadline_of_its_own(model_dir: Path) -> None:
    with running(model_dir, limits=Limits(request_timeout=30)) as handle:
        with handle.gate.closed():
            with pytest.raises(openai.APIStatusError) as late:
                handle.complete(seed=1, max_tokens=8, extra_body={"timeout": 0.3})
            handle.gate.open()
        assert late.value.status_code == 504 and "its 0.3 s" in late.value.response.json()["error"]["message"]
        handle.until(lambda: handle.stats.in_flight == 0, "the late request has left its batch")
        for bad in (0, -1):
            with pytest.raises(openai.BadRequestError) as refused:
                handle.complete(extra_body={"timeout": bad})
            assert refused.value.response.json()["error"]["param"] == "timeout"
        assert handle.complete(seed=2, extra_body={"timeout": 60}).choices[0].text is not None


def test_a_stream_whose_text_keeps_coming_still_ends_at_its_deadline() -> None:
    """The deadline is looked at after every wait, not only when nothing arrived: a stream fed text every
    millisecond, whose request never ends, is answered 504 (and its job cancelled) all the same."""

    from dlm.sampling.options import SamplingOptions
    from dlm.serving.app import Endpoints
    from dlm.serving.jobs import Job
    from dlm.serving.protocol import ApiError, Generation

    cancelled: list[Job] = []

    class Stats:
        def count(self, name: str) -> None:
            pass

    class Scheduler:
        stats = Stats()

        def cancel(self, job: Job) -> None:
            cancelled.append(job)
            job.cancelled.set()

    class Request:
        async def is_disconnected(self) -> bool:
            return False

    generation = Generation(("ROMEO:",), (2,), 8, 1, 0, SamplingOptions(), (), True, False, False, timeout=0.05)
    job = Job("stream", generation)
    endpoints = Endpoints(None, Scheduler(), Limits())  # type: ignore[arg-type]

    async def stream() -> None:
        texts: asyncio.Queue[tuple[int, str]] = asyncio.Queue()

        async def feed() -> None:
            while True:
                texts.put_nowait((0, "x"))
                await asyncio.sleep(0.001)

        feeder = asyncio.ensure_future(feed())
        try:
            async for _ in endpoints.wait(Request(), job, texts):  # type: ignore[arg-type]
                pass
        finally:
            feeder.cancel()

    with pytest.raises(ApiError) as late:
        asyncio.run(asyncio.wait_for(stream(), WAIT))
    assert late.value.status == 504 and cancelled == [job]


def test_a_shared_pass_out_of_memory_runs_its_calls_one_by_one(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dlm.serving.passes as passes

    run_batch = passes._run_batch
    shared: list[int] = []

    def too_large_together(model: Any, batch: list[Any], config: Any) -> Any:
        if len(batch) > 1:  # raised by the model's forward pass of a shared batch, as CUDA raises it
            shared.append(len(batch))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (a stand-in)")
        return run_batch(model, batch, config)

    with running(model_dir) as handle:
        requests = [{"prompt": prompt, "max_tokens": 6, "seed": 30 + i} for i, prompt in enumerate(("ROMEO:", "To be"))]
        alone = [handle.complete(**request).choices[0].text for request in requests]
        monkeypatch.setattr(passes, "_run_batch", too_large_together)
        with handle.gate.closed():
            blocker = threading.Thread(target=handle.complete, kwargs={"seed": 1})
            blocker.start()
            handle.until(handle.gate.holding.is_set, "the blocker's first pass is held")
            answers, threads = handle.start_queued(requests, "both wait")
        for thread in [blocker, *threads]:
            thread.join(WAIT)
        assert shared and [answer.choices[0].text for answer in answers] == alone  # each as it runs alone
        assert handle.stats.errors == 0
        # A pass that does not fit even alone: its request alone gets 503, worth a retry.
        monkeypatch.setattr(passes, "_run_batch", lambda *args: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError()))
        with pytest.raises(openai.APIStatusError) as refused:
            handle.complete(seed=5)
        assert refused.value.status_code == 503 and "does not fit the device's memory" in refused.value.response.text
        assert int(refused.value.response.headers["Retry-After"]) >= 1  # worth a retry, and when
        monkeypatch.setattr(passes, "_run_batch", run_batch)
        handle.assert_healthy()


def test_a_request_without_max_tokens_gets_the_default_and_one_past_the_budget_is_refused(
    model_dir: Path, run_cli
) -> None:  # type: ignore[no-untyped-def]
    with running(model_dir, limits=Limits(default_max_tokens=3), max_batch_tokens=40) as handle:
        answer = handle.client.completions.create(model="model", prompt="ROMEO:", seed=2, max_tokens=None)
        assert answer.usage.completion_tokens <= 3 and answer.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.APIStatusError) as refused:
            handle.complete(max_tokens=20, n=2)  # 2 rows of prompt + 20 positions: more than 40
        body = refused.value.response.json()["error"]
        assert (
            refused.value.status_code == 400
            and body["param"] == "max_tokens"
            and "more than a batch" in body["message"]
        )
        handle.assert_healthy()
    # The CLI's help names the server's default, which lives in dlm.serving.protocol.
    assert f"default: {DEFAULT_MAX_TOKENS}" in " ".join(run_cli("serve", "--help").stdout.split())


def test_running_requests_hold_no_thread_of_their_own(model_dir: Path) -> None:
    """24 requests running at once (their passes held at the gate) are greenlets of the one engine thread:
    the server's own threads do not grow with them, and every request still gets its text alone."""

    requests = [{"prompt": "ROMEO:", "max_tokens": 4 + i % 3, "seed": 40 + i} for i in range(24)]
    with running(model_dir, max_batch_rows=32) as handle:
        alone = [handle.complete(**request).choices[0].text for request in requests[:3]]
        before = {thread.name for thread in threading.enumerate() if thread.name.startswith("dlm-")}
        answers: list[Any] = [None] * len(requests)
        with handle.gate.closed():
            threads = [
                threading.Thread(target=lambda i=i: answers.__setitem__(i, handle.complete(**requests[i])))
                for i in range(len(requests))
            ]
            for thread in threads:
                thread.start()
            handle.until(lambda: handle.stats.in_flight + handle.stats.queued == len(requests), "all arrive")
            # The engine may not have reached the gate yet with the requests it started first: its pass held
            # is what the gate opens for.
            handle.until(handle.gate.holding.is_set, "the first pass is held")
            handle.gate.open()
            handle.gate.close()  # the first pass (of the requests started then) is released, the next held
            handle.until(handle.gate.holding.is_set, "a shared pass is held")
            running_now = handle.stats.in_flight
            during = {thread.name for thread in threading.enumerate() if thread.name.startswith("dlm-")}
        for thread in threads:
            thread.join(WAIT)
        assert running_now == len(requests)  # all of them run together, in one shared pass
        # The engine, and at most the fixed pool that parses requests off the event loop.
        assert "dlm-scheduler" in during and not any(name.startswith("dlm-request") for name in during)
        assert len(during - {"dlm-scheduler"}) <= PARSING_THREADS and during - before <= {
            f"dlm-parse_{index}" for index in range(PARSING_THREADS)
        }
        assert [answer.choices[0].text for answer in answers[:3]] == alone
        handle.assert_healthy()


def test_a_scheduler_that_stops_fails_every_request_and_health_says_so(model_dir: Path) -> None:
    with running(model_dir) as handle:
        statuses: list[int] = []

        def send(seed: int) -> None:
            try:
                handle.complete(seed=seed)
                statuses.append(200)
            except openai.APIStatusError as exc:
                statuses.append(exc.status_code)

        with handle.gate.closed():
            threads = [threading.Thread(target=send, args=(1,))]
            threads[0].start()
            handle.until(handle.gate.holding.is_set, "a request is in its pass")
            threads.append(threading.Thread(target=send, args=(2,)))
            threads[1].start()
            handle.until(lambda: handle.stats.queued == 1, "a second request waits")

            def broken() -> None:
                raise RuntimeError("scheduler bug")

            handle.server.scheduler._next_calls = broken  # type: ignore[method-assign]
        for thread in threads:
            thread.join(WAIT)
            assert not thread.is_alive(), "a client waits forever"
        assert statuses == [503, 503]  # the running request and the queued one, each told why
        health = httpx.get(f"{handle.url}/health", timeout=WAIT)
        assert health.status_code == 503 and health.json()["status"] == "error" and "scheduler bug" in health.text
        with pytest.raises(openai.APIStatusError) as refused:
            handle.complete(seed=3)
        assert refused.value.status_code == 503 and "scheduler has stopped" in refused.value.response.text
        assert int(refused.value.response.headers["Retry-After"]) >= 1


def test_api_key(model_dir: Path) -> None:
    with running(model_dir, api_key="sesame") as server:
        assert server.complete().choices  # the client sends the right key
        for key in ("wrong", None):
            headers = {} if key is None else {"Authorization": f"Bearer {key}"}
            answer = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a"}, headers=headers, timeout=WAIT)
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
        assert httpx.get(f"{server.url}/health", timeout=WAIT).status_code == 200  # open to probes
        server.assert_healthy()


@pytest.mark.slow
def test_sigterm_finishes_the_requests_in_flight_and_exits_0(model_dir: Path, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "dlm", "serve", str(model_dir), "--port", "0", "--json", "--device", "cpu"]
    # The console's lines go to a file: a pipe nobody reads fills up (a line per /health poll) and
    # then blocks the server's writes, which under load would outlast the requests being awaited.
    log, errors = tmp_path / "serve.jsonl", tmp_path / "serve.err"
    environment = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with open(log, "w") as output, open(errors, "w") as error_output:
        process = subprocess.Popen(command, stdout=output, stderr=error_output, text=True, env=environment)
    try:
        deadline = time.monotonic() + WAIT
        while not log.read_text().endswith("\n"):  # the start line, once written whole
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
        start = json.loads(log.read_text().splitlines()[0])
        assert start["event"] == "start" and " parameters in " in start["computes"]
        assert start["computes"].endswith(" on cpu")
        url = start["url"]
        # Three requests at once, SIGTERM while one at least is still held and the others have reached the
        # server (answered ones count). Their max_tokens differ, so they run one after another; a wave that
        # all finishes before a poll sees it held (a fast machine) is followed by another.
        deadline, waves = time.monotonic() + 2 * WAIT, 0
        while True:
            waves += 1
            answers: list[httpx.Response] = []
            requests = [{"prompt": "ROMEO:", "max_tokens": 20 + i, "seed": i, "steps": 600} for i in range(3)]
            threads = [
                threading.Thread(
                    target=lambda r=r, got=answers: got.append(
                        httpx.post(f"{url}/v1/completions", json=r, timeout=WAIT)
                    )
                )
                for r in requests
            ]
            for thread in threads:
                thread.start()
            while True:
                health = httpx.get(f"{url}/health", timeout=WAIT).json()
                held = health["in_flight"] + health["queued"]
                if (held and held + len(answers) >= 3) or len(answers) == 3:
                    break
                assert time.monotonic() < deadline, (health, [a.status_code for a in answers], errors.read_text())
                time.sleep(0.005)
            if held:
                break
            for thread in threads:
                thread.join(WAIT)
        process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(WAIT)
        assert process.wait(WAIT) == 0, errors.read_text()
        assert [answer.status_code for answer in answers] == [200, 200, 200]
        assert all(answer.json()["choices"][0]["text"] is not None for answer in answers)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=WAIT)
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        assert lines[-1]["event"] == "stop" and lines[-1]["requests"] == 3 * waves
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_missing_extra_is_one_error_line(model_dir: Path, monkeypatch: pytest.MonkeyPatch, run_cli: Any) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # what an install without the extra imports
    result = run_cli("serve", model_dir)
    assert result.exit_code == 2
    assert "dlm serve needs uvicorn, which is not installed" in result.stderr and "dlm[serve]" in result.stderr


def test_a_block_model_shares_passes_across_phases_streams_by_block_and_slides(
    tiny_data_dir: Path, tmp_path: Path
) -> None:
    run = train_tiny_run(tiny_data_dir, tmp_path / "run", "model.block_size=8")
    model_dir = export_model(run, tmp_path / "block-model", dtype="float32")
    with running(model_dir, limits=Limits(max_tokens=96)) as server:  # more than the window of 64
        tokenizer = server.server.scheduler.tokenizer
        prompts = ["ROMEO:", "JULIET: O Romeo, Romeo, wherefore", "To be", "MERCUTIO: A plague"]
        assert len({len(tokenizer.encode(prompt).ids) % 8 for prompt in prompts}) > 1  # phases differ
        requests = [
            {"prompt": prompt, "max_tokens": 16 + 8 * (i % 2), "seed": 30 + i, "extra_body": {"steps": 16 + 4 * i}}
            for i, prompt in enumerate(prompts)
        ]
        alone = [server.complete(**request).choices[0].text for request in requests]
        with pass_rows(server.server.scheduler.model) as rows:
            with server.gate.closed():
                blocker = threading.Thread(target=server.complete, kwargs={"seed": 1})
                blocker.start()
                server.until(server.gate.holding.is_set, "the blocker's first pass is held")
                answers, threads = server.start_queued(requests, "all four wait")
            for thread in [blocker, *threads]:
                thread.join(WAIT)
        assert [answer.choices[0].text for answer in answers] == alone
        # Steps within a block feed one block each over caches of other lengths: they share passes.
        assert max(rows) >= len(requests)
        # Past the context (64 tokens), where --max-tokens allows it: the block model slides its window on.
        long = server.complete(max_tokens=80, seed=3, extra_body={"steps": 80})
        assert long.usage.completion_tokens <= 80 and long.choices[0].text
        pieces = [
            text for chunk in server.complete(max_tokens=32, seed=4, stream=True) if (text := chunk.choices[0].text)
        ]
        whole = server.complete(max_tokens=32, seed=4).choices[0]
        assert "".join(pieces) == whole.text
        assert len(pieces) > 1 or whole.finish_reason == "stop"  # a block at a time, unless it ended in the first


def test_the_console_shows_the_figures() -> None:
    from io import StringIO

    from rich.console import Console

    from dlm.cli.serve_view import ServeConsole
    from dlm.serving.stats import ServeStats

    stats = ServeStats(max_batch_rows=8)
    stats.pass_done(rows=4, seconds=0.012)
    stats.generated(tokens=64, seconds=0.5)
    stats.answered(0.25)
    stats.first_text(0.125)
    stats.queue_changed(queued=1, in_flight=2, admitted_tokens=1234)
    output = StringIO()
    view = ServeConsole(
        stats,
        live=True,
        url="http://127.0.0.1:1",
        model="m",
        console=Console(file=output, force_terminal=True, color_system=None, width=100),
        computes="1.2M parameters in float32 on cpu",
    )
    view.start()
    view.request({"id": "abc", "method": "POST", "path": "/v1/completions", "status": 429, "seconds": 0.001})
    view.close()
    text = output.getvalue()
    assert "in flight / queued" in text and "50% of the rows a pass holds (1 passes)" in text
    assert "0.250 s / 0.250 s" in text and "0.125 s / 0.125 s" in text and "12.0 ms (mean over 30 s)" in text
    assert "2 / 1  (1,234 positions admitted)" in text
    assert "429 POST /v1/completions request abc" in text
    assert "model" in text and "1.2M parameters in float32 on cpu" in text


def test_a_taken_port_is_one_error_line(model_dir: Path, run_cli: Any) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = run_cli("serve", model_dir, "--port", str(taken.getsockname()[1]), "--device", "cpu")
    assert result.exit_code == 2
    assert "error: cannot listen on 127.0.0.1:" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--max-n", "0"), "--max-n must be at least 1"),
        (("--max-n", "16", "--max-batch", "8"), "--max-n (16) is more than --max-batch (8)"),
        (("--port", "70000"), "--port must be in [0, 65535]"),
        (("--batch-wait", "-1"), "--batch-wait must be in [0, 10000] ms"),
        (("--api-key", " "), "the API key is empty"),
    ],
)
def test_server_options_are_checked_before_loading(
    options: tuple[str, ...], message: str, run_cli: Any, tmp_path: Path
) -> None:
    result = run_cli("serve", tmp_path / "no-model", *options)  # the model is never read
    assert result.exit_code == 2 and f"error: {message}" in result.stderr


def test_a_row_ends_at_its_end_of_document_or_stop_string(model_dir: Path) -> None:
    tokenizer = load_served(model_dir).tokenizer
    prompt = tokenizer.encode("ROMEO:").ids
    body = tokenizer.encode(" thou art fair").ids
    eos = 0
    ended = finish_row(tokenizer, prompt + body + [eos], len(prompt), eos, ())
    assert (ended.text, ended.finish_reason, ended.completion_tokens) == (" thou art fair", "stop", len(body) + 1)
    full = finish_row(tokenizer, prompt + body, len(prompt), eos, ())
    assert (full.text, full.finish_reason, full.completion_tokens) == (" thou art fair", "length", len(body))
    cut = finish_row(tokenizer, prompt + body + [eos], len(prompt), eos, ("art", "zzz"))
    assert (cut.text, cut.finish_reason) == (" thou ", "stop")
    assert tokenizer.decode(body[: cut.completion_tokens]).startswith(" thou ")  # the tokens up to the cut
    assert not tokenizer.decode(body[: cut.completion_tokens - 1]).startswith(" thou ")


def test_the_load_benchmark_bursts_and_counts_statuses(model_dir: Path, tmp_path: Path) -> None:
    from benchmarks.serve_load import serve_load

    serve_load(model_dir, clients=12, sequential_requests=0, max_queue=2, max_batch=4, tokens=3, results=tmp_path)
    figures = json.loads((tmp_path / "serve-load.json").read_text())["figures"]
    burst = figures["burst"]
    statuses = {int(status): count for status, count in burst["statuses"].items()}
    # Up to 4 run and 2 wait (how many depends on when each arrives); the others are told to come back.
    assert (
        set(statuses) <= {200, 429}
        and sum(statuses.values()) == 12
        and statuses.get(200, 0) >= 3
        and statuses.get(429, 0) >= 1
    )
    assert burst["failures"] == 0 and "sequential" not in figures
    assert 0 < burst["most_threads"] <= 16


def test_the_serving_benchmark_compares_served_with_one_at_a_time(model_dir: Path, tmp_path: Path) -> None:
    from benchmarks.serve import serve

    serve(
        model_dir,
        clients="1,2",
        tokens=4,
        requests_per_client=1,
        rounds=1,
        stream=True,
        own_samplers=True,
        results=tmp_path,
    )
    result = json.loads((tmp_path / "serve.json").read_text())
    assert set(result["figures"]) == {"clients_1", "clients_2"}
    for count in (1, 2):
        row = result["figures"][f"clients_{count}"]
        assert row["alone"]["tokens_per_second"] > 0 and row["served"]["tokens_per_second"] > 0
        assert row["speedup"] == row["served"]["tokens_per_second"] / row["alone"]["tokens_per_second"]
        assert row["engine_speedup"] == row["engine"]["tokens_per_second"] / row["alone"]["tokens_per_second"]
        assert 0 < row["served"]["first_text_p50"] <= row["served"]["p99"]
        assert 0 < row["engine"]["first_text_p50"] <= row["engine"]["p99"]
        assert len(result["rounds"][f"served_{count}"]) == len(result["rounds"][f"engine_{count}"]) == 1
        # The engine with every request on its own sampler, in the same rounds.
        assert row["samplers_speedup"] == row["samplers"]["tokens_per_second"] / row["alone"]["tokens_per_second"]
        assert len(result["rounds"][f"samplers_{count}"]) == 1 and row["engine_over_samplers"]["median"] > 0
        # The shared pass's saving per row, timed in the same rounds, and the rates against it.
        one, own = (statistics.median(r["ms_per_row"] for r in result["rounds"][f"pass_{n}"]) for n in (1, count))
        assert row["pass_saving"] == one / own and (count > 1 or row["pass_saving"] == 1)
        assert row["served_over_saving"] == row["speedup"] / row["pass_saving"]
        assert row["engine_over_saving"] == row["engine_speedup"] / row["pass_saving"]
