"""The server's scheduler without HTTP: requests that share forward passes each get their result alone.

Each request runs its own sampler, a greenlet of the engine thread (`dlm.serving.scheduler`; the
`serve` extra's greenlet package), and `dlm.serving.passes` merges the model calls of the running
requests into shared passes. The model runs in float64, where a shared
pass gives each row its own logits to about 1e-16 and so the same tokens (as in
tests/test_batch_sampling.py); the random streams are each request's own exactly. No prompt is
empty where positions are ranked (an empty prompt's first step is an exact tie).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest
import test_sampling
import torch
from test_batch_sampling import transformer
from tokenizers import Tokenizer

from dlm.model.attention import KVCache
from dlm.model.kv_pool import PoolPass
from dlm.sampling.generation import generate
from dlm.sampling.options import SamplingOptions
from dlm.serving.passes import Call, Departed, _merged_cache
from dlm.serving.protocol import Generation
from dlm.serving.rows import finish_row
from dlm.serving.scheduler import Job, Scheduler

pytest.importorskip("greenlet", reason="greenlet is not installed (pip install -e '.[serve]')")
pytestmark = pytest.mark.serve_extra
tokenizer = pytest.fixture(scope="module")(test_sampling.tokenizer.__wrapped__)  # the sampler tests' tokenizer
WAIT = 60.0
EOS = 0


def request(
    tokenizer: Tokenizer, prompts: tuple[str, ...], length: int, seed: int, n: int = 1, **options: Any
) -> Generation:
    counts = tuple(len(tokenizer.encode(prompt).ids) for prompt in prompts)
    return Generation(
        prompts, counts, length, n, seed, SamplingOptions(**{"steps": length} | options), (), False, False, False
    )


def alone(model: Any, tokenizer: Tokenizer, generation: Generation) -> tuple[list[str], int]:
    """The request's texts sampled by itself, and the passes that took."""

    result = generate(
        model,
        tokenizer,
        prompts=list(generation.prompts),
        length=generation.length,
        seeds=[generation.seed + i for i in range(len(generation.prompts))],
        num_samples=generation.n,
        stop_at_end=True,
        **asdict(generation.options),
    )
    texts = [
        finish_row(tokenizer, ids, prompt, EOS, ()).text
        for ids, prompt in zip(result.token_ids, result.prompt_tokens, strict=True)
    ]
    return texts, result.forward_passes


def served(
    model: Any, tokenizer: Tokenizer, generations: list[Generation], **limits: int
) -> tuple[list[Any], Scheduler]:
    """Every request submitted before the scheduler starts, so that all start together (as far as `limits`
    let them); their texts (or the exception that ended them)."""

    scheduler = Scheduler(model, tokenizer, max_queue=64, **{"max_batch_rows": 64} | limits)
    jobs = [Job(str(index), generation) for index, generation in enumerate(generations)]
    for job in jobs:
        scheduler.submit(job)
    scheduler.start()
    try:
        outcomes: list[Any] = []
        for job in jobs:
            error = job.future.exception(WAIT)
            outcomes.append(error if error is not None else [c.text for c in job.future.result().choices])
    finally:
        scheduler.stop(WAIT)
    return outcomes, scheduler


def churned(
    model: Any,
    tokenizer: Tokenizer,
    generations: list[Generation],
    arrivals: dict[int, list[int]],
    leaving: dict[int, int],
) -> tuple[list[Any], Scheduler]:
    """The first three requests submitted before the scheduler starts, then while pass p runs the requests
    `arrivals[p]`, and the client of request `leaving[p]` goes; every request's texts (or the exception),
    and the scheduler."""

    scheduler = Scheduler(model, tokenizer, max_queue=16, max_batch_rows=16)
    jobs = [Job(str(i), generation) for i, generation in enumerate(generations)]
    passes = [0]

    def churn(module: Any, args: Any) -> None:
        passes[0] += 1
        for index in arrivals.get(passes[0], []):
            scheduler.submit(jobs[index])
        if passes[0] in leaving:
            scheduler.cancel(jobs[leaving[passes[0]]])

    hook = model.register_forward_pre_hook(churn)
    try:
        for job in jobs[:3]:
            scheduler.submit(job)
        scheduler.start()
        outcomes: list[Any] = []
        for job in jobs:
            error = job.future.exception(WAIT)
            outcomes.append(error if error is not None else [c.text for c in job.future.result().choices])
    finally:
        hook.remove()
        scheduler.stop(WAIT)
    assert scheduler.failure is None
    return outcomes, scheduler


PROMPTS = ("ROMEO:", "JULIET: O Romeo, Romeo, wherefore", "To be", "ROMEO: But soft", "HAMLET:")


@pytest.mark.parametrize("block", [0, 4])
def test_requests_of_every_length_steps_and_option_share_passes_and_equal_each_alone(
    tokenizer: Tokenizer, block: int
) -> None:
    model = transformer(tokenizer.get_vocab_size(), block_size=block)
    options: list[dict[str, Any]] = [
        {},
        {"steps": 5},
        {"remasking": "confidence"},
        {"threshold": 0.3},
        {"remasking": "margin", "steps": 6},
        {"temperature": 0.0, "remasking": "confidence", "reveal_split": "even"},
        {"top_k": 5, "top_p": None},
    ]
    if not block:
        options += [
            {"block_length": 4},
            {"cache": "prefix", "block_length": 4},
            {"cache": "dual", "block_length": 4},
            {"threshold": 0.3, "cache": "prefix", "block_length": 4},
        ]
    generations = [
        request(tokenizer, (PROMPTS[i % len(PROMPTS)],), 8 + 4 * (i % 3), 100 + i, **option)
        for i, option in enumerate(options)
    ]
    generations.append(request(tokenizer, ("", "To be"), 10, 7, n=2))  # two prompts (seeds 7, 8), two samples each
    if block:
        generations.append(request(tokenizer, ("ROMEO:",), 60, 9))  # past the context of 48: a sliding window
    expected = [alone(model, tokenizer, generation) for generation in generations]
    outcomes, scheduler = served(model, tokenizer, generations)
    assert outcomes == [texts for texts, _ in expected]
    passes = scheduler.stats.snapshot().passes
    # Most calls share a pass; fewer of a block model's, whose calls differ where the requests are in their blocks.
    assert passes < sum(count for _, count in expected) * (0.7 if block else 0.5)


def test_an_autoregressive_models_requests_share_passes_and_equal_each_alone(tokenizer: Tokenizer) -> None:
    model = transformer(tokenizer.get_vocab_size(), block_size=1, attention="causal")
    options: list[dict[str, Any]] = [{}, {"temperature": 0.0}, {"top_k": 5, "top_p": None}, {"steps": 3}]
    generations = [request(tokenizer, (PROMPTS[i],), 6 + 3 * i, 200 + i, **option) for i, option in enumerate(options)]
    generations.append(request(tokenizer, ("ROMEO:",), 60, 9))  # past the context of 48: a sliding window
    expected = [alone(model, tokenizer, generation) for generation in generations]
    assert [count for _, count in expected[:4]] == [6, 9, 12, 15]  # one pass per token, whatever the steps
    outcomes, scheduler = served(model, tokenizer, generations)
    assert outcomes == [texts for texts, _ in expected]
    assert scheduler.stats.snapshot().passes < sum(count for _, count in expected) * 0.7


def test_requests_draw_their_tokens_together_and_each_as_alone(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The token draws of requests of one kind run as one draw over all their rows, within the round of
    their pass (so a request that arrives stays in step), and each request draws what it draws alone."""

    from dlm.serving import passes

    model = transformer(tokenizer.get_vocab_size())
    options: list[dict[str, Any]] = [{}, {}, {"temperature": 0.7}, {}]
    generations = [request(tokenizer, (PROMPTS[i],), 12, 300 + i, **option) for i, option in enumerate(options)]
    expected = [alone(model, tokenizer, generation) for generation in generations]
    rows: list[int] = []
    drawn = passes.sample_tokens

    def counted(logits: torch.Tensor, **options: Any) -> torch.Tensor:
        rows.append(int(logits.shape[0]))
        return drawn(logits, **options)

    monkeypatch.setattr(passes, "sample_tokens", counted)
    outcomes, scheduler = served(model, tokenizer, generations)
    assert outcomes == [texts for texts, _ in expected]
    assert sum(rows) == 4 * 12  # a draw's rows are the positions revealed: each token drawn once
    # At most one draw a pass for each temperature, far fewer than the requests' own calls.
    passes_run = scheduler.stats.snapshot().passes
    assert len(rows) <= 2 * passes_run < sum(count for _, count in expected)


def test_draws_too_large_together_run_alone_and_a_draw_that_never_fits_fails_its_request(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dlm.serving import passes

    model = transformer(tokenizer.get_vocab_size())
    generations = [request(tokenizer, (PROMPTS[i],), 8, 400 + i) for i in range(3)]
    expected = [alone(model, tokenizer, generation)[0] for generation in generations]
    together = passes._draw_together

    def only_alone(batch: list[Any]) -> torch.Tensor:
        if len(batch) > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (a stand-in)")
        return together(batch)

    monkeypatch.setattr(passes, "_draw_together", only_alone)
    outcomes, _ = served(model, tokenizer, generations)
    assert outcomes == expected  # each drew alone, as it would without the server
    monkeypatch.setattr(passes, "_draw_together", lambda batch: only_alone([*batch, *batch]))
    outcomes, scheduler = served(model, tokenizer, generations[:1])
    assert isinstance(outcomes[0], passes.OutOfMemory)
    assert scheduler.failure is None  # the server goes on


def test_a_block_models_requests_share_every_pass_where_their_sequences_end_mid_block(tokenizer: Tokenizer) -> None:
    """Prompts of different lengths: each sequence's last block is cut short somewhere else. Right-padded
    to the widest, with padding no real position sees, every step of the requests (in step) shares one
    pass, and each request equals its solo result."""

    model = transformer(tokenizer.get_vocab_size(), block_size=8)  # every prompt and its first block: 2 blocks
    generations = [request(tokenizer, (prompt,), 10, 60 + i) for i, prompt in enumerate(PROMPTS[:4])]
    ends = {(len(tokenizer.encode(prompt).ids) + 10) % 8 for prompt in PROMPTS[:4]}
    assert len(ends) > 1  # the last blocks are cut short at different places
    expected = [alone(model, tokenizer, generation) for generation in generations]
    outcomes, scheduler = served(model, tokenizer, generations)
    assert outcomes == [texts for texts, _ in expected]
    assert scheduler.stats.snapshot().passes == max(count for _, count in expected)
    # Each first pass fed a prompt beside its block, two rows of one slot: the stats count request rows.
    assert scheduler.stats.pass_rows == sum(count for _, count in expected)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_requests_in_step_share_their_cached_passes(tokenizer: Tokenizer, cache: str) -> None:
    """Prompts of different lengths: caches of different lengths, merged left-padded (`dual`'s keys after
    the block included); every step's calls share one pass."""

    model = transformer(tokenizer.get_vocab_size())
    generations = [
        request(tokenizer, (prompt,), 12, 50 + i, cache=cache, block_length=4, remasking="confidence")
        for i, prompt in enumerate(PROMPTS[:4])
    ]
    expected = [alone(model, tokenizer, generation) for generation in generations]
    outcomes, scheduler = served(model, tokenizer, generations)
    assert outcomes == [texts for texts, _ in expected]
    assert scheduler.stats.snapshot().passes == max(count for _, count in expected)  # all in step


def test_a_request_that_arrives_starts_at_the_next_pass(tokenizer: Tokenizer) -> None:
    model = transformer(tokenizer.get_vocab_size())
    first = request(tokenizer, ("ROMEO:",), 24, 1, block_length=4)
    late = request(tokenizer, ("JULIET: O Romeo",), 12, 2, threshold=0.3)
    scheduler = Scheduler(model, tokenizer, max_queue=8, max_batch_rows=8)
    late_job = Job("late", late)
    rows: list[int] = []

    def arrive(module: Any, args: Any) -> None:
        rows.append(int(args[0].shape[0]))
        if len(rows) == 3:
            scheduler.submit(late_job)  # while the first request's third pass runs

    hook = model.register_forward_pre_hook(arrive)
    try:
        first_job = Job("first", first)
        scheduler.submit(first_job)
        scheduler.start()
        texts = [[c.text for c in job.future.result(WAIT).choices] for job in (first_job, late_job)]
    finally:
        hook.remove()
        scheduler.stop(WAIT)
    assert texts == [alone(model, tokenizer, generation)[0] for generation in (first, late)]
    assert rows[:3] == [1, 1, 1] and rows[3] == 2  # it joined the fourth pass


@pytest.mark.parametrize("arrival", [18, 22, 24])
def test_requests_far_apart_in_a_block_model_share_passes_each_over_its_own_slot(
    tokenizer: Tokenizer, arrival: int
) -> None:
    """One request near the end of the context, another starting its second block: each row's keys sit in
    its own slot of the KV pool (`dlm.model.kv_pool`), so their steps share passes however far apart they
    are, no pass reads past the context, and each equals its solo result."""

    model = transformer(tokenizer.get_vocab_size(), block_size=4)
    context = model.config.max_seq_len
    first, late = request(tokenizer, ("",), context, 1), request(tokenizer, ("",), 12, 2)
    scheduler = Scheduler(model, tokenizer, max_queue=8, max_batch_rows=8)
    late_job, passes_seen = Job("late", late), [0]
    widest, shared = [0], [0]

    def arrive(module: Any, args: Any, keywords: dict[str, Any]) -> None:
        passes_seen[0] += 1
        cache = keywords["cache"]
        assert isinstance(cache, PoolPass)
        widest[0] = max(widest[0], *cache.ends)
        shared[0] += cache.rows == 2
        if passes_seen[0] == arrival:
            scheduler.submit(late_job)

    hook = model.register_forward_pre_hook(arrive, with_kwargs=True)
    try:
        first_job = Job("first", first)
        scheduler.submit(first_job)
        scheduler.start()
        outcomes = [job.future.exception(WAIT) or job.future.result().choices[0].text for job in (first_job, late_job)]
    finally:
        hook.remove()
        scheduler.stop(WAIT)
    assert outcomes == [alone(model, tokenizer, generation)[0][0] for generation in (first, late)]
    assert widest[0] <= context
    assert shared[0] > 0


def test_a_departed_request_leaves_before_its_next_pass(tokenizer: Tokenizer) -> None:
    model = transformer(tokenizer.get_vocab_size())
    staying = [request(tokenizer, (prompt,), 16, 20 + i) for i, prompt in enumerate(PROMPTS[:3])]
    leaving = request(tokenizer, ("HAMLET:",), 16, 30)
    scheduler = Scheduler(model, tokenizer, max_queue=8, max_batch_rows=8)
    jobs = [Job(str(i), generation) for i, generation in enumerate([leaving, *staying])]
    rows: list[int] = []

    def depart(module: Any, args: Any) -> None:
        rows.append(int(args[0].shape[0]))
        if len(rows) == 2:
            scheduler.cancel(jobs[0])  # its client goes while the second pass runs

    hook = model.register_forward_pre_hook(depart)
    try:
        for job in jobs:
            scheduler.submit(job)
        scheduler.start()
        with pytest.raises(Departed):
            jobs[0].future.result(WAIT)
        texts = [[c.text for c in job.future.result(WAIT).choices] for job in jobs[1:]]
    finally:
        hook.remove()
        scheduler.stop(WAIT)
    assert texts == [alone(model, tokenizer, generation)[0] for generation in staying]
    # One row each, so each running request makes a call of one row a pass (each needs 11 passes or more).
    assert rows[:2] == [4, 4] and rows[2] == max(rows[2:]) == 3  # its row went after the second pass
    assert scheduler.stats.snapshot().left == 1


def test_a_failing_pass_fails_its_requests_only(tokenizer: Tokenizer) -> None:
    model = transformer(tokenizer.get_vocab_size())
    generations = [request(tokenizer, ("ROMEO:",), 8, 1), request(tokenizer, ("To be",), 8, 2)]
    calls = [0]

    def fail_once(module: Any, args: Any) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("a device failure")

    hook = model.register_forward_pre_hook(fail_once)
    try:
        outcomes, scheduler = served(model, tokenizer, generations)
    finally:
        hook.remove()
    assert all(isinstance(outcome, RuntimeError) for outcome in outcomes)  # they shared the failed pass
    assert served(model, tokenizer, generations)[0] == [alone(model, tokenizer, g)[0] for g in generations]
    del scheduler


def test_shared_passes_run_in_eval_mode_without_autograd(tokenizer: Tokenizer) -> None:
    model = transformer(tokenizer.get_vocab_size()).train()
    seen: list[tuple[bool, bool]] = []
    hook = model.register_forward_pre_hook(
        lambda module, args: seen.append((module.training, torch.is_inference_mode_enabled())) and None
    )
    try:
        served(model, tokenizer, [request(tokenizer, ("ROMEO:",), 6, 3)])
    finally:
        hook.remove()
    assert seen and set(seen) == {(False, True)}


def test_requests_are_admitted_by_their_positions(tokenizer: Tokenizer) -> None:
    """A budget of positions (rows x (prompt + length)) that holds two of the three requests: the third
    starts when one ends, oldest first, and each still equals its solo result."""

    model = transformer(tokenizer.get_vocab_size())
    generations = [request(tokenizer, (prompt,), 16, 60 + i) for i, prompt in enumerate(("ROMEO:", "To be", "HAMLET:"))]
    costs = [generation.tokens for generation in generations]
    assert costs == [len(tokenizer.encode(p).ids) + 16 for p in ("ROMEO:", "To be", "HAMLET:")]
    expected = [alone(model, tokenizer, generation) for generation in generations]
    budget = costs[0] + costs[1]
    outcomes, scheduler = served(model, tokenizer, generations, max_batch_tokens=budget)
    assert outcomes == [texts for texts, _ in expected]
    counts = [count for _, count in expected]
    # Two ran together, the third after them: more passes than all three in step would take.
    assert max(counts) < scheduler.stats.snapshot().passes <= sum(counts)
    with pytest.raises(ValueError, match="do not fit a batch"):
        scheduler.submit(Job("huge", request(tokenizer, ("ROMEO:",), 16, 1, n=budget)))


@pytest.mark.parametrize("block", [0, 4])
def test_requests_arriving_and_leaving_throughout_each_equal_their_solo_result(
    tokenizer: Tokenizer, block: int
) -> None:
    """Churn under the engine: requests of several lengths and options arrive at several passes while
    others run, finish or leave; every request that stays gets its text alone."""

    model = transformer(tokenizer.get_vocab_size(), block_size=block)
    options: list[dict[str, Any]] = [{}, {"steps": 6}, {"temperature": 0.0, "remasking": "confidence"}, {"top_k": 5}]
    generations = [
        request(tokenizer, (PROMPTS[i % len(PROMPTS)],), 8 + 4 * (i % 3), 300 + i, **options[i % len(options)])
        for i in range(9)
    ]
    arrivals = {3: [3, 4], 6: [5], 10: [6, 7], 14: [8]}  # pass -> the requests submitted while it runs
    leaving = {5: 1, 12: 5}  # pass -> the request whose client goes then
    outcomes, _ = churned(model, tokenizer, generations, arrivals, leaving)
    left = set(leaving.values())
    for index, generation in enumerate(generations):
        if index in left and isinstance(outcomes[index], Departed):
            continue  # it left before it finished (a short request may finish first)
        assert outcomes[index] == alone(model, tokenizer, generation)[0], index
    assert sum(isinstance(outcome, Departed) for outcome in outcomes) >= 1


def test_merged_caches_take_each_layers_shape_from_any_call_that_holds_it() -> None:
    held = KVCache([(torch.ones(1, 2, 4, 3), torch.ones(1, 2, 4, 3))] * 2, length=4)
    tokens = torch.zeros(1, 2, dtype=torch.long)
    for empty in (KVCache(), KVCache([None, None])):  # a cache with no keys yet, listed first
        merged, extras = _merged_cache([Call(tokens, None, empty, None), Call(tokens, None, held, None)], keep=0)
        assert extras == [4, 0] and merged.length == 4 and len(merged.layers) == 2
        for layer in merged.layers:
            assert layer is not None
            for part in layer:  # the empty row is padding only, the other keeps its keys
                assert part.shape == (2, 2, 4, 3)
                assert torch.equal(part[0], torch.zeros(2, 4, 3)) and torch.equal(part[1], torch.ones(2, 4, 3))
