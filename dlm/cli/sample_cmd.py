"""`dlm sample`: generate text with a trained model and watch it denoise.

On a terminal a rich Live view shows every sample while its masked positions (a dim block
character each) are revealed step by step; otherwise the final texts, or JSON with `--json`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Group
from rich.text import Text

from dlm.choices import CacheMode, Remasking, RevealSplit
from dlm.cli.common import DeviceOption, DtypeOption, JsonOption, console, given_options, print_json
from dlm.errors import UserError

if TYPE_CHECKING:
    import torch
    from rich.console import RenderableType

    from dlm.sampling.options import SampleResult, SamplingOptions

MASK_GLYPH = "░"


def render_samples(
    tokenizer: Any, tokens: torch.Tensor, mask_token_id: int, step: int, steps: int | None
) -> RenderableType:
    """One panel per sample: known text as is, each masked token as a dim block character. `steps`
    None counts tokens instead (an autoregressive model's step is one token)."""

    # lazy (here and below): rich's panels, and the library with torch, load only when `dlm sample` runs
    from rich.panel import Panel

    from dlm.sampling.prompting import split_masked

    panels = []
    rows = tokens.tolist()
    for index, row in enumerate(rows):
        body = Text()
        for part in split_masked(tokenizer, row, mask_token_id):
            if isinstance(part, int):
                body.append(MASK_GLYPH * part, style="dim")
            else:
                body.append(part)
        title = f"sample {index + 1}/{len(rows)}" if len(rows) > 1 else "sample"
        subtitle = f"step {step}/{steps}" if steps else f"token {step}"
        panels.append(Panel(body, title=title, title_align="left", subtitle=subtitle))
    return Group(*panels)


def _print_result(result: SampleResult, live_view: bool) -> None:
    if not live_view:
        for index, text in enumerate(result.texts):
            if len(result.texts) > 1:
                typer.echo(f"=== sample {index + 1}/{len(result.texts)} ===")
            typer.echo(text)
        return
    from rich.panel import Panel

    for index, text in enumerate(result.texts):
        title = f"sample {index + 1}/{len(result.texts)}" if len(result.texts) > 1 else "sample"
        console.print(Panel(Text(text), title=title, title_align="left"))
    console.print(f"[dim]{result.steps} steps, {result.forward_passes} forward passes, {result.seconds:.2f} s[/]")


ModelArgument = Annotated[
    Path, typer.Argument(metavar="MODEL", help="Exported model directory (or a training checkpoint).")
]
PromptOption = Annotated[str, typer.Option("--prompt", "-p", help="Text to continue; empty generates unconditionally.")]
TextOption = Annotated[
    str | None,
    typer.Option(
        "--text",
        "-t",
        help="Infilling template instead of a prompt: [MASK] is one token to generate, [MASK*N] is N "
        "tokens, the rest stays fixed token for token, e.g. 'ROMEO: [MASK*20] fair Verona'.",
        show_default=False,
    ),
]
LengthOption = Annotated[int, typer.Option("--length", "-n", help="Tokens to generate after the prompt.")]
StepsOption = Annotated[
    int | None,
    typer.Option(
        "--steps",
        show_default=False,
        help="Denoising steps (time from 1 to 0) \\[default: a distilled student's own steps, else 64]; an "
        "autoregressive model: one per token.",
    ),
]
SamplesOption = Annotated[int, typer.Option("--num-samples", help="Samples, generated as one batch.")]
SeedOption = Annotated[int, typer.Option("--seed", help="Seed; the same seed on the same device repeats a sample.")]
TemperatureOption = Annotated[
    float, typer.Option("--temperature", help="Softmax temperature; 0 picks the most likely token.")
]
TopKOption = Annotated[
    int | None, typer.Option("--top-k", help="Sample only among the K most likely tokens.", show_default=False)
]
TopPOption = Annotated[
    float | None,
    typer.Option("--top-p", help="Sample only from the smallest set of tokens with probability >= P (1 turns it off)."),
]
RemaskingOption = Annotated[
    Remasking | None,
    typer.Option(
        "--remasking",
        help="Which predictions each step keeps: random (ancestral), dilated (a planned order that spreads "
        "each step's positions far apart: the best few-step text), confidence (most probable first, LLaDA) "
        "or margin (largest top-1 minus top-2 probability first). Default: random, or the order a distilled "
        "student was distilled for.",
        show_default=False,
    ),
]
BlockOption = Annotated[
    int | None,
    typer.Option(
        "--block-length",
        help="Semi-autoregressive: generate blocks of B tokens left to right, the steps split between them.",
        show_default=False,
    ),
]

StopOption = Annotated[
    bool,
    typer.Option(
        "--stop-at-end",
        "--stop-at-eos",
        help="End each sample at its first generated <|endoftext|>; generation stops once every sample has one.",
    ),
]

ThresholdOption = Annotated[
    float | None,
    typer.Option(
        "--threshold",
        metavar="P",
        help="Parallel decoding: each step commits every masked position of the block whose sampled token has "
        "probability above P (with --remasking margin: top-1 minus top-2 probability above P); at least one, at "
        "least the scheduled count.",
        show_default=False,
    ),
]
PromptFileOption = Annotated[
    Path | None,
    typer.Option(
        "--prompt-file",
        help="Sample every line of this text file as a prompt, in padded batches of --batch-size prompts; prints a "
        "JSON line per sample as each batch finishes: prompt, sample, seed, text (the generated part), tokens, stop "
        "(end or length). The i-th prompt draws the random numbers of --prompt with --seed SEED+i and gets its "
        "tokens up to float rounding (a near-tie can go either way).",
        show_default=False,
    ),
]
BatchSizeOption = Annotated[
    int,
    typer.Option(
        "--batch-size",
        min=1,
        help="With --prompt-file: prompts sampled together (each with --num-samples rows); memory grows with it. "
        "On one machine the same seed and batch size repeat a run bit for bit.",
    ),
]
CacheOption = Annotated[
    CacheMode,
    typer.Option(
        "--cache",
        help="Approximate KV cache of a whole-sequence model, refreshed at every block: none, prefix (keys before "
        "the block) or dual (before and after it).",
    ),
]

RevealSplitOption = Annotated[
    RevealSplit,
    typer.Option(
        "--reveal-split",
        help="How a block's fixed-count steps (--remasking confidence or margin, the minimum of --threshold) "
        "share its n positions: schedule, the differences of floor(n*m(t)) under the model's noise schedule, or "
        "even, LLaDA's split: n // steps each, the first n % steps steps one more. 6 positions in 4 steps: "
        "schedule 2,1,2,1, even 2,2,1,1.",
    ),
]


ChatOption = Annotated[
    str | None,
    typer.Option(
        "--chat",
        help="Ask a fine-tuned model: QUESTION in the chat template of `dlm pack --chat`; prints the reply, "
        "ended at its end-of-document token (--stop-at-end is implied). Every sampling option applies.",
        show_default=False,
    ),
]


@dataclass(frozen=True)
class SampleRequest:
    """What `dlm sample` hands the sampler, checked before the model loads.

    Plain sampling, `--chat` and `--prompt-file` all pass `generate_kwargs()` on, so an option of
    `SamplingOptions` reaches every one of them or none.
    """

    options: SamplingOptions
    length: int
    num_samples: int
    seed: int
    stop_at_end: bool
    device: str
    batch_size: int = 16  # --prompt-file only: prompts per padded batch
    model_steps: bool = False  # no --steps: the model's own (a distilled student's, else the default)
    model_remasking: bool = False  # no --remasking: likewise

    def generate_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `dlm.sampling.generation.generate` (and `dlm.sampling.chat.chat_sample`),
        prompt aside."""

        settings = {
            "length": self.length,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "stop_at_end": self.stop_at_end,
            "device": self.device,
        }
        own = {"steps": None} if self.model_steps else {}
        return asdict(self.options) | settings | own | ({"remasking": None} if self.model_remasking else {})


def _refuse_unused(
    ctx: typer.Context, *, text: str | None, chat: str | None, prompt_file: Path | None, temperature: float
) -> None:
    """One `error:` line for an option given on the command line that the request would ignore."""

    given = set(given_options(ctx))
    if prompt_file is not None and given & {"prompt", "text", "chat"}:
        raise UserError("--prompt-file cannot be combined with --prompt, --text or --chat", fix="pass one of them")
    if prompt_file is None and "batch_size" in given:
        raise UserError("--batch-size applies to --prompt-file only", fix="drop it, or sample a --prompt-file")
    if chat is not None and given & {"prompt", "text"}:
        flag = "--prompt" if "prompt" in given else "--text"
        raise UserError(
            f"--chat cannot be combined with {flag}: the question is the prompt",
            fix="pass the question to --chat alone",
        )
    if text is not None and "length" in given:
        raise UserError(
            "--length does nothing with --text: its [MASK*N] spans say how many tokens to generate",
            fix="drop --length, or change the spans",
        )
    if temperature == 0:
        for name, flag in (("top_k", "--top-k"), ("top_p", "--top-p")):
            if name in given:
                raise UserError(
                    f"{flag} does nothing at --temperature 0, which takes the most likely token",
                    fix=f"drop {flag}, or sample with a temperature above 0",
                )


def sample_request(
    ctx: typer.Context,
    *,
    prompt: str,
    text: str | None,
    chat: str | None,
    prompt_file: Path | None,
    device: str,
    **values: Any,
) -> SampleRequest:
    """The checked request of `dlm sample`'s options: `values` are the `SamplingOptions` fields and
    length, num_samples, seed, stop_at_end, batch_size. Every refusal happens here, before a model loads,
    but that of a --reveal-split beside the model's own order, which only the model knows."""

    from dlm.runtime.device import resolve_device
    from dlm.sampling.options import DEFAULT_STEPS, SamplingOptions
    from dlm.sampling.prompting import check_request

    names = {field.name for field in fields(SamplingOptions)}
    model_steps = values.get("steps") is None
    if model_steps:
        values = {**values, "steps": DEFAULT_STEPS}  # checked as the default; the model may have its own
    model_remasking = values.get("remasking") is None
    if model_remasking:
        # Checked as the default order. A --reveal-split, which the default (ancestral) order refuses, is
        # checked with a planned order instead: the model may sample in its own (a student distilled for
        # `dilated`), and `generate` refuses it once the model is loaded if its order is ancestral.
        split = values.get("reveal_split", "schedule")
        values = {**values, "remasking": "random" if split == "schedule" else "dilated"}
    options = SamplingOptions(**{name: value for name, value in values.items() if name in names})
    rest = {name: value for name, value in values.items() if name not in names}
    check_request(prompt=prompt, text=text, length=rest["length"], num_samples=rest["num_samples"], seed=rest["seed"])
    _refuse_unused(ctx, text=text, chat=chat, prompt_file=prompt_file, temperature=options.temperature)
    device = str(resolve_device(device, "--device"))
    return SampleRequest(options, device=device, model_steps=model_steps, model_remasking=model_remasking, **rest)


def _generate_live(model: Any, tokenizer: Any, kwargs: dict[str, Any]) -> SampleResult:
    """Generate while a transient Live view redraws the samples after every step."""

    from rich.live import Live

    from dlm.sampling.generation import generate

    mask_id = model.config.mask_token_id
    from dlm.sampling.options import sampling_steps

    # What `generate` runs (its own note, if any, is said there once).
    steps = kwargs["steps"] if kwargs["steps"] is not None else sampling_steps(model, None)
    steps = None if getattr(model.config, "is_autoregressive", False) else steps
    with Live(console=console, refresh_per_second=15, transient=True) as live:

        def show(step: int, tokens: torch.Tensor) -> None:
            live.update(render_samples(tokenizer, tokens, mask_id, step, steps))

        return generate(model, tokenizer, on_step=show, **kwargs)


def sample(
    ctx: typer.Context,
    model_path: ModelArgument,
    prompt: PromptOption = "",
    text: TextOption = None,
    length: LengthOption = 64,
    steps: StepsOption = None,
    num_samples: SamplesOption = 1,
    seed: SeedOption = 0,
    temperature: TemperatureOption = 1.0,
    top_k: TopKOption = None,
    top_p: TopPOption = 0.9,
    remasking: RemaskingOption = None,
    block_length: BlockOption = None,
    stop_at_end: StopOption = False,
    threshold: ThresholdOption = None,
    cache: CacheOption = "none",
    reveal_split: RevealSplitOption = "schedule",
    prompt_file: PromptFileOption = None,
    batch_size: BatchSizeOption = 16,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    chat: ChatOption = None,
    as_json: JsonOption = False,
) -> None:
    """Generate text by reversing the masking process; a terminal shows it denoise live.

    Masked positions are drawn as dim blocks while they wait to be revealed. Without a terminal
    the final texts are printed, or with --json the texts, steps, forward passes and seconds.

    Faster: --steps 8 --remasking dilated writes 8 tokens a pass; on the ten-minute demo model it ran
    about 5x the default's tokens per CPU second at +10% judge perplexity, and a student distilled for
    it (`dlm distill --remasking dilated`, which then samples so by default) at +5%. Fewer steps in the
    default order cost far more (+87% at 8). --threshold pays only on a confident model (docs/distill.md;
    docs/benchmarks.md, "Few-step generation: the dilated order").

    An option that the others would make do nothing is refused with one error line.
    """

    request = sample_request(
        ctx,
        prompt=prompt,
        text=text,
        chat=chat,
        prompt_file=prompt_file,
        device=device,
        length=length,
        steps=steps,
        num_samples=num_samples,
        seed=seed,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        remasking=remasking,
        block_length=block_length,
        stop_at_end=stop_at_end,
        threshold=threshold,
        cache=cache,
        reveal_split=reveal_split,
        batch_size=batch_size,
    )
    from dlm.runtime.device import compute_dtype

    wanted = compute_dtype(dtype)
    if chat is not None:
        from dlm.artifacts.loading import load_model_with_info
        from dlm.sampling.chat import chat_sample

        loaded = load_model_with_info(model_path, device=request.device, dtype=wanted)
        replies, result = chat_sample(
            loaded.model, loaded.tokenizer, loaded.info.tokenizer_path, chat, **request.generate_kwargs()
        )
        # The fields of plain sampling's --json, and the replies alone (texts hold the templated prompt too).
        print_json({"replies": replies, **result.to_dict()}) if as_json else typer.echo("\n".join(replies))
        return
    from dlm.sampling.prompt_batch import read_prompt_file

    prompts = None if prompt_file is None else read_prompt_file(prompt_file)
    from dlm.artifacts.loading import load_model

    model, tokenizer = load_model(model_path, device=request.device, dtype=wanted)
    if prompts is not None:
        _sample_prompts(model, tokenizer, prompts, request)
        return
    from dlm.sampling.generation import generate

    kwargs = request.generate_kwargs() | {"prompt": prompt, "text": text}
    live_view = not as_json and console.is_terminal
    result = _generate_live(model, tokenizer, kwargs) if live_view else generate(model, tokenizer, **kwargs)
    if as_json:
        print_json(result.to_dict())
    else:
        _print_result(result, live_view)


def _sample_prompts(model: Any, tokenizer: Any, prompts: list[str], request: SampleRequest) -> None:
    """Print a JSON line per sample of --prompt-file as each batch of --batch-size finishes."""

    from dlm.sampling.generation import generate_records

    for record in generate_records(
        model, tokenizer, prompts, batch_size=request.batch_size, **request.generate_kwargs()
    ):
        typer.echo(json.dumps(record, ensure_ascii=False))  # click's echo flushes: out as its batch ends


def register(app: typer.Typer) -> None:
    app.command("sample")(sample)
