"""The cohort: a whole-sequence model's requests without a threshold or a cache, advanced together as data.

Each request must still get exactly its solo `generate` result (the model runs in float64, as in
tests/test_serve_passes.py), whatever joins, finishes or leaves around it, with no sampler of its own.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest
import test_sampling
import torch
from test_batch_sampling import transformer
from test_serve_passes import EOS, PROMPTS, WAIT, alone, churned, request, served
from tokenizers import Tokenizer

from dlm.errors import UserError
from dlm.model.kv_pool import KVPool
from dlm.sampling.generation import generate
from dlm.serving import cohort
from dlm.serving.passes import Departed, OutOfMemory
from dlm.serving.scheduler import Job, Scheduler

pytest.importorskip("greenlet", reason="greenlet is not installed (pip install -e '.[serve]')")
pytestmark = pytest.mark.serve_extra
tokenizer = pytest.fixture(scope="module")(test_sampling.tokenizer.__wrapped__)  # the sampler tests' tokenizer

OPTIONS: list[dict[str, Any]] = [
    {},
    {"steps": 5},
    {"temperature": 0.0},
    {"top_k": 5, "top_p": None},
    {"top_p": 1.0, "temperature": 0.7},
    {"block_length": 4},
    {"block_length": 3, "steps": 9},
    {"remasking": "dilated", "steps": 4},
    {"remasking": "dilated", "steps": 6, "reveal_split": "even"},  # 16 positions: 3, 3, 2, 3, 3, 2 by the schedule
    {"remasking": "dilated", "block_length": 4, "steps": 6},
    {"remasking": "confidence"},
    {"remasking": "confidence", "temperature": 0.0, "reveal_split": "even", "steps": 5},
    {"remasking": "margin", "steps": 6, "block_length": 4},
    {"remasking": "confidence", "top_k": 3, "steps": 3},
    {"remasking": "confidence", "steps": 24},  # more steps than positions: some reveal nothing, with no pass
    {"threshold": 0.3},
    {"threshold": 1e-4, "block_length": 4, "steps": 8},  # every candidate commits: blocks end before their steps
    {"threshold": 0.2, "remasking": "margin", "temperature": 0.0, "steps": 6},
    {"threshold": 0.9, "steps": 24},  # more steps than positions: still one commit a step at least
]


def no_samplers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail a test whose requests would run a sampler of their own (a greenlet) instead of the cohort."""

    def refused(self: Scheduler, job: Job) -> None:
        raise AssertionError(f"request {job.request_id} ran its own sampler")

    monkeypatch.setattr(Scheduler, "_sample", refused)


def options_of(block: int) -> list[dict[str, Any]]:
    """The options a model of `block_size` `block` takes (a block model's blocks are its own)."""

    return [option for option in OPTIONS if not block or option.get("block_length", block) == block]


@pytest.mark.parametrize("block", [0, 4])
def test_requests_of_every_kind_it_takes_equal_each_alone(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    """A whole-sequence model's requests, and a block model's (each row's finished blocks in its slot of
    the KV pool, `dlm.serving.pooled`)."""

    model = transformer(tokenizer.get_vocab_size(), block_size=block)
    generations = [
        request(tokenizer, (PROMPTS[i % len(PROMPTS)],), 8 + 4 * (i % 3), 500 + i, **option)
        for i, option in enumerate(options_of(block))
    ]
    # Several prompts: a block model's in one phase of its blocks (2 and 6 tokens; 0 and 4), as its sampler
    # batches them.
    pairs = (("ROMEO:", "HAMLET:"), ("", "To be")) if block else (("", PROMPTS[1]), ("ROMEO:", "To be"))
    generations.append(request(tokenizer, pairs[0], 10, 7, n=2))
    generations.append(request(tokenizer, ("To be",), 12, 8, n=3, remasking="dilated", steps=4))
    generations.append(request(tokenizer, pairs[1], 12, 9, n=2, remasking="confidence", steps=4))
    assert all(cohort.joins_cohort(model, generation) for generation in generations)
    expected = [alone(model, tokenizer, generation) for generation in generations]
    no_samplers(monkeypatch)
    outcomes, scheduler = served(model, tokenizer, generations)
    assert outcomes == [texts for texts, _ in expected]
    # The steps that reveal something share passes: far fewer than the requests' own.
    assert scheduler.stats.snapshot().passes < 0.5 * sum(count for _, count in expected)


@pytest.mark.parametrize("block", [0, 4])
def test_a_round_cut_short_of_a_reveal_goes_on_next_round_with_the_same_tokens(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    """A round takes each request through at most `STEPS_PER_ROUND` steps that reveal nothing (so that a
    request of very many steps does not hold the others): cut at 2, requests of many more steps than
    tokens, beside ordinary ones, still get their solo tokens, over more rounds."""

    model = transformer(tokenizer.get_vocab_size(), block_size=block)
    kinds: list[dict[str, Any]] = [{"steps": 48}, {}, {"remasking": "confidence", "steps": 40}]
    kinds += [{"threshold": 0.5, "steps": 32, **({"block_length": 4} if block else {})}]
    generations = [request(tokenizer, (PROMPTS[i % len(PROMPTS)],), 8, 40 + i, **kind) for i, kind in enumerate(kinds)]
    expected = [alone(model, tokenizer, generation)[0] for generation in generations]
    rounds = 0
    original = cohort.Cohort.calls

    def counted(self: cohort.Cohort) -> Any:
        nonlocal rounds
        rounds += 1
        return original(self)

    monkeypatch.setattr(cohort, "STEPS_PER_ROUND", 2)
    monkeypatch.setattr(cohort.Cohort, "calls", counted)
    no_samplers(monkeypatch)
    outcomes, _ = served(model, tokenizer, generations)
    assert outcomes == expected
    assert rounds >= 48 // 2  # the 48 steps of the first took at least a round for every two


@pytest.mark.parametrize("block", [0, 4])
def test_requests_that_arrive_finish_and_leave_throughout_equal_each_alone(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    """Rows join a cohort whose rows are narrower or wider than theirs, others finish or leave (so its
    columns widen and narrow, and a block model's slots in the KV pool move up), and every request that
    stays gets its solo text."""

    model = transformer(tokenizer.get_vocab_size(), block_size=block)
    lengths = [6, 20, 9, 14, 30, 8, 12, 16, 10, 24]
    prompts = ["ROMEO:", "To be", "JULIET: O Romeo, Romeo, wherefore", "", "HAMLET:"]
    options = options_of(block)
    generations = [
        request(tokenizer, (prompts[i % len(prompts)],), length, 700 + i, **options[i % len(options)])
        for i, length in enumerate(lengths)
    ]
    arrivals = {2: [3, 4], 4: [5], 7: [6, 7], 9: [8, 9]}  # pass -> the requests submitted while it runs
    leaving = {3: 1, 8: 4}  # pass -> the request whose client goes then
    no_samplers(monkeypatch)
    outcomes, scheduler = churned(model, tokenizer, generations, arrivals, leaving)
    for index, generation in enumerate(generations):
        if index in leaving.values():
            assert isinstance(outcomes[index], Departed), index
            continue
        assert outcomes[index] == alone(model, tokenizer, generation)[0], index
    assert scheduler.stats.snapshot().left == 2


def test_each_row_ends_at_its_end_of_document_and_the_request_when_all_its_rows_have(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model that often writes the end of document: rows end early, each request when every row has,
    its rows cut there as `generate` cuts them."""

    model = transformer(tokenizer.get_vocab_size())

    def likely_end(module: Any, args: Any, logits: torch.Tensor) -> torch.Tensor:
        return logits + torch.nn.functional.one_hot(torch.tensor(EOS), logits.shape[-1]) * 4.0

    model.register_forward_hook(likely_end)
    generations = [request(tokenizer, (PROMPTS[i],), 16, 900 + i, n=2) for i in range(4)]
    lengths = [
        generate(
            model,
            tokenizer,
            prompts=list(generation.prompts),
            length=16,
            seeds=[generation.seed],
            num_samples=2,
            stop_at_end=True,
            **asdict(generation.options),
        ).lengths
        for generation in generations
    ]
    assert any(max(rows) < 16 for rows in lengths)  # a request whose rows all end early
    assert any(min(rows) < 16 == max(rows) for rows in lengths)  # one with a row that runs to its length
    expected = [alone(model, tokenizer, generation) for generation in generations]
    no_samplers(monkeypatch)
    outcomes, _ = served(model, tokenizer, generations)
    assert outcomes == [texts for texts, _ in expected]
    # Where it stops: alone in the cohort, a request's passes are its own. In 8 dilated steps each of which
    # reveals something, a request whose rows all end early makes fewer.
    planned = [request(tokenizer, (PROMPTS[i],), 16, 900 + i, n=2, remasking="dilated", steps=8) for i in range(4)]
    stops = [alone(model, tokenizer, generation) for generation in planned]
    assert min(passes for _, passes in stops) < 8
    for generation, (texts, passes) in zip(generations + planned, expected + stops, strict=True):
        outcome, scheduler = served(model, tokenizer, [generation])
        assert outcome == [texts] and scheduler.stats.snapshot().passes == passes  # it stopped where `generate` did


def test_a_stream_that_cannot_take_its_text_fails_its_request_alone(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = transformer(tokenizer.get_vocab_size())
    generations = [request(tokenizer, (PROMPTS[i],), 8, 970 + i) for i in range(3)]
    expected = [alone(model, tokenizer, generation)[0] for generation in generations]

    def closed(index: int, text: str) -> None:
        raise RuntimeError("the event loop is closed (a stand-in)")

    no_samplers(monkeypatch)
    scheduler = Scheduler(model, tokenizer, max_queue=16, max_batch_rows=16)
    jobs = [Job(str(i), generation, on_text=closed if i == 1 else None) for i, generation in enumerate(generations)]
    for job in jobs:
        scheduler.submit(job)
    scheduler.start()
    try:
        assert isinstance(jobs[1].future.exception(WAIT), RuntimeError)
        assert [[c.text for c in jobs[i].future.result(WAIT).choices] for i in (0, 2)] == [expected[0], expected[2]]
    finally:
        scheduler.stop(WAIT)
    assert scheduler.failure is None and scheduler.stats.snapshot().in_flight == 0


def test_logits_too_large_together_are_scored_one_request_at_a_time(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scoring the round's logits together (`scored`) runs out of memory: each request's are scored alone
    (as its sampler scores them), and one that does not fit even alone fails with `OutOfMemory` (503)."""

    model = transformer(tokenizer.get_vocab_size())
    # One position a step each (8 dilated steps for 8 tokens): a request's logits are one row, the round's three.
    generations = [request(tokenizer, (PROMPTS[i],), 8, 980 + i, remasking="dilated", steps=8) for i in range(3)]
    expected = [alone(model, tokenizer, generation)[0] for generation in generations]
    scored = cohort.scored

    def small_only(logits: torch.Tensor, device: torch.device, forbidden: torch.Tensor) -> torch.Tensor:
        if logits.shape[0] > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (a stand-in)")
        return scored(logits, device, forbidden)

    no_samplers(monkeypatch)
    monkeypatch.setattr(cohort, "scored", small_only)
    outcomes, scheduler = served(model, tokenizer, generations)
    assert outcomes == expected and scheduler.failure is None
    monkeypatch.setattr(cohort, "scored", lambda logits, *where: small_only(logits.repeat(3, 1), *where))
    outcomes, scheduler = served(model, tokenizer, generations[:1])
    assert isinstance(outcomes[0], OutOfMemory) and scheduler.failure is None


def test_a_failing_cohort_fails_its_requests_and_the_server_goes_on(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = transformer(tokenizer.get_vocab_size())
    generations = [request(tokenizer, (PROMPTS[i],), 8, 950 + i) for i in range(2)]
    drawn = cohort.Cohort._draw

    def broken(self: cohort.Cohort, *members: Any) -> None:
        raise RuntimeError("a bug of the cohort's (a stand-in)")

    monkeypatch.setattr(cohort.Cohort, "_draw", broken)
    outcomes, scheduler = served(model, tokenizer, generations)
    assert all(isinstance(outcome, RuntimeError) for outcome in outcomes)
    assert scheduler.failure is None
    monkeypatch.setattr(cohort.Cohort, "_draw", drawn)
    outcomes, _ = served(model, tokenizer, generations)
    assert outcomes == [alone(model, tokenizer, generation)[0] for generation in generations]


def test_caches_run_their_own_samplers_beside_it(tokenizer: Tokenizer) -> None:
    model = transformer(tokenizer.get_vocab_size())
    generations = [
        request(tokenizer, ("ROMEO:",), 10, 1),
        request(tokenizer, ("To be",), 10, 2, remasking="confidence"),
        request(tokenizer, ("HAMLET:",), 10, 3, threshold=0.3),
        request(tokenizer, ("JULIET:",), 10, 4, cache="prefix", block_length=5),
        request(tokenizer, ("",), 12, 5, remasking="dilated", steps=4),
        request(tokenizer, ("ROMEO:",), 10, 6, threshold=0.3, cache="dual", block_length=5),
    ]
    assert [cohort.joins_cohort(model, generation) for generation in generations] == [True] * 3 + [False, True, False]
    autoregressive = transformer(tokenizer.get_vocab_size(), block_size=1, attention="causal")
    assert not cohort.joins_cohort(autoregressive, generations[0])
    expected = [alone(model, tokenizer, generation)[0] for generation in generations]
    outcomes, _ = served(model, tokenizer, generations)
    assert outcomes == expected


def test_a_request_the_cohort_cannot_take_fails_alone(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    model = transformer(tokenizer.get_vocab_size())
    generations = [request(tokenizer, (prompt,), 8, 960 + i) for i, prompt in enumerate(("ROMEO:", "HAMLET:", "To be"))]
    encode = cohort.encode_prompts

    def refusing(tokenizer: Tokenizer, config: Any, prompts: Any, **options: Any) -> Any:
        if "HAMLET:" in prompts:
            raise UserError("a prompt it refuses (a stand-in)")
        return encode(tokenizer, config, prompts, **options)

    monkeypatch.setattr(cohort, "encode_prompts", refusing)
    outcomes, scheduler = served(model, tokenizer, generations)
    assert isinstance(outcomes[1], UserError)
    assert [outcomes[0], outcomes[2]] == [alone(model, tokenizer, generations[i])[0] for i in (0, 2)]
    assert scheduler.failure is None


def test_a_block_models_requests_stop_at_their_end_of_document_and_never_pass_their_own_passes(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block model alone stops after the block that gives every row its end of document; in the cohort a
    request ends as soon as every row has it with nothing masked before (what follows is cut either way):
    the same text, in no more passes than its own."""

    model = transformer(tokenizer.get_vocab_size(), block_size=4)

    def likely_end(module: Any, args: Any, logits: torch.Tensor) -> torch.Tensor:
        return logits + torch.nn.functional.one_hot(torch.tensor(EOS), logits.shape[-1]) * 4.0

    model.register_forward_hook(likely_end)
    generations = [request(tokenizer, (PROMPTS[i],), 20, 900 + i, n=2) for i in range(4)]
    expected = [alone(model, tokenizer, generation) for generation in generations]
    no_samplers(monkeypatch)
    for generation, (texts, passes) in zip(generations, expected, strict=True):
        outcome, scheduler = served(model, tokenizer, [generation])
        assert outcome == [texts] and scheduler.stats.snapshot().passes <= passes


def test_a_block_models_requests_it_cannot_hold_run_their_own_samplers_beside_the_cohort(
    tokenizer: Tokenizer,
) -> None:
    """Past the context a block model's sampler slides a window over its blocks, which a slot of the
    context cannot hold; prompts in different phases of the blocks (2 and 4 tokens) it samples in separate
    batches, each with blocks of its own. Those requests run their own samplers, the others share the
    cohort's passes, and each equals its solo result."""

    model = transformer(tokenizer.get_vocab_size(), block_size=4)
    generations = [
        request(tokenizer, ("ROMEO:",), 60, 1),
        request(tokenizer, ("To be",), 12, 2),
        request(tokenizer, ("HAMLET:",), 16, 3, remasking="confidence"),
        request(tokenizer, ("ROMEO:", "To be"), 10, 4, n=2),
    ]
    assert all(cohort.joins_cohort(model, generation) for generation in generations)
    samplers: list[str] = []
    sample = Scheduler._sample

    def counted(self: Scheduler, job: Job) -> None:
        samplers.append(job.request_id)
        sample(self, job)

    expected = [alone(model, tokenizer, generation)[0] for generation in generations]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Scheduler, "_sample", counted)
        outcomes, _ = served(model, tokenizer, generations)
    assert outcomes == expected
    assert sorted(samplers) == ["0", "3"]


def test_a_block_models_request_whose_keys_do_not_fit_fails_alone_with_out_of_memory(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The KV pool cannot grow for a request that joins (the device's memory is full): that request fails
    with `OutOfMemory` (503, worth a retry) and the pool is as it was; the others are served."""

    model = transformer(tokenizer.get_vocab_size(), block_size=4)
    generations = [
        request(tokenizer, (prompt,), 12, 980 + i) for i, prompt in enumerate(("ROMEO:", "HAMLET:", "To be"))
    ]
    reserve = KVPool.reserve

    def full(self: KVPool, slots: int, positions: int) -> None:
        if slots > 2:  # the third request's rows
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (a stand-in)")
        reserve(self, slots, positions)

    monkeypatch.setattr(KVPool, "reserve", full)
    no_samplers(monkeypatch)
    outcomes, scheduler = served(model, tokenizer, generations, max_batch_rows=3)
    assert isinstance(outcomes[2], OutOfMemory)
    assert outcomes[:2] == [alone(model, tokenizer, generation)[0] for generation in generations[:2]]
    assert scheduler.failure is None


def test_a_block_models_long_prompt_is_fed_whole_and_its_steps_a_block_wide(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt of 13 tokens at block size 4: its first pass feeds it whole, one row (rows of a block each
    would each read the whole prompt's keys); every later pass is a block wide, the finished block fed as
    a row of its own beside the next; the text is the request's alone."""

    model = transformer(tokenizer.get_vocab_size(), block_size=4)
    generation = request(tokenizer, (PROMPTS[1],), 12, 31)
    passes: list[tuple[int, int, list[int]]] = []

    def seen(module: Any, args: Any, keywords: dict[str, Any]) -> None:
        step = keywords["cache"]
        passes.append((step.rows, int(args[0].shape[1]), list(step.starts)))

    hook = model.register_forward_pre_hook(seen, with_kwargs=True)
    no_samplers(monkeypatch)
    outcome, _ = served(model, tokenizer, [generation])
    hook.remove()
    assert passes[0] == (1, 16, [0])  # 13 prompt tokens and 3 to generate: the first block that holds any
    assert all(width <= 4 for _, width, _ in passes[1:])
    assert any(rows == 2 for rows, _, _ in passes[1:])  # a finished block fed beside the next
    assert outcome == [alone(model, tokenizer, generation)[0]]
