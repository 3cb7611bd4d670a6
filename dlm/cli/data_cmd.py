"""`dlm tokenizer train`, `dlm pack` and `dlm validate`: parse, call the library, render.

The library modules load lazily inside each command so that `dlm pack` never pays for torch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Column, Table

from dlm.cli.common import (
    ConfigOption,
    DeviceMemoryOption,
    JsonOption,
    SetOption,
    console,
    err_console,
    given_options,
    print_json,
    refuse_other_mode,
    wants_json,
)
from dlm.cli.progress import ProgressView
from dlm.data.readers import DecodeErrors, supported_inputs
from dlm.errors import UserError

if TYPE_CHECKING:
    from dlm.data.pack import PackSummary

tokenizer_app = typer.Typer(help="Train byte-level BPE tokenizers.", no_args_is_help=True)


# The formats as the registry in `dlm.data.readers` lists them, without the backticks of its Markdown.
INPUTS_HELP = f"Files, directories (recursive) or globs: {supported_inputs().replace('`', '')}."
InputsArgument = Annotated[list[str], typer.Argument(help=INPUTS_HELP)]
TextFieldOption = Annotated[
    str,
    typer.Option("--text-field", help="Field holding the text: of .jsonl lines, of .parquet and saved-dataset rows."),
]
SOURCE_HELP = (
    "A weighted training input PATH:WEIGHT (repeatable; a file, directory or glob). Each of its training "
    "documents is packed floor(WEIGHT) times, and a share frac(WEIGHT) of them, drawn with --seed, once "
    "more: 2 = every document twice, 0.5 = a seeded half, 1.5 = all once and a seeded half twice. Repeats "
    "are whole passes over the source; validation documents are never repeated. Plain INPUTS weigh 1; "
    "WEIGHT is at most 1000."
)
ErrorsOption = Annotated[
    DecodeErrors,
    typer.Option("--errors", help="Bytes that are not UTF-8: stop with the offset, or replace with U+FFFD."),
]
OverwriteOption = Annotated[bool, typer.Option("--overwrite", help="Replace existing output files.")]


class _ProgressView(ProgressView):
    """Bytes read (and tokens written): MB/s, tokens/s and ETA, on stdout."""

    def __init__(self, description: str, as_json: bool):
        super().__init__(description, as_json, console, sys.stdout)

    def update(self, done: int, total: int, tokens: int | None = None) -> None:
        elapsed = self.elapsed
        rate = done / elapsed
        eta = (total - done) / rate if rate > 0 else None
        text = f"{rate / 1e6:.2f} MB/s"
        if tokens is not None:
            text += f"  {tokens / elapsed:,.0f} tok/s"
        text += f"  ETA {eta:.0f}s" if eta is not None else ""
        fields: dict[str, Any] = {"bytes": done, "total_bytes": total, "mb_per_s": rate / 1e6}
        if tokens is not None:
            fields.update(tokens=tokens, tokens_per_s=tokens / elapsed)
        self.show(done, total, text, {**fields, "eta_s": eta})


@tokenizer_app.command("train")
def tokenizer_train(
    inputs: InputsArgument,
    vocab_size: Annotated[int, typer.Option("--vocab-size", "-n", help="Total vocabulary, special tokens included.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="tokenizer.json to write.")],
    text_field: TextFieldOption = "text",
    errors: ErrorsOption = "strict",
    overwrite: OverwriteOption = False,
    as_json: JsonOption = False,
) -> None:
    """Train a byte-level BPE tokenizer with dlm's special tokens, streaming the corpus."""

    # lazy: dlm.data's modules import tokenizers and numpy, which `dlm --help` does without
    from dlm.data.tokenizer import train_tokenizer

    json_mode = wants_json(as_json)
    with _ProgressView("reading", json_mode) as view:
        summary = train_tokenizer(
            inputs,
            vocab_size,
            output,
            text_field=text_field,
            errors=errors,
            progress=view.update,
            overwrite=overwrite,
        )
    if summary.warning is not None:  # stderr, so that it shows beside JSON output too
        err_console.print(f"[bold yellow]warning:[/] {escape(summary.warning)}", highlight=False, soft_wrap=True)
    if json_mode:
        print_json({"event": "summary", **vars(summary)})
        return
    ids = ", ".join(f"{name} {index}" for name, index in summary.special_token_ids.items())
    # soft_wrap: lines a person copies (a path, the config lines) are never broken at the terminal's width.
    console.print(
        f"wrote [bold]{escape(str(summary.path))}[/]: vocab size {summary.vocab_size}, special ids {ids}",
        highlight=False,
        soft_wrap=True,
    )
    console.print(
        f"read {summary.files} files, {summary.documents} documents, "
        f"{summary.input_bytes / 1e6:.1f} MB in {summary.seconds:.1f}s",
        highlight=False,
    )
    if summary.replaced_characters:
        console.print(f"[yellow]replaced {summary.replaced_characters} invalid UTF-8 sequences[/]")
    console.print("paste into the \\[model] table of your config:", highlight=False)
    for line in summary.config_lines:
        console.print(f"  {escape(line)}", highlight=False, soft_wrap=True)


def pack(
    ctx: typer.Context,
    tokenizer: Annotated[Path, typer.Option("--tokenizer", "-t", help="tokenizer.json to encode with.")],
    seq_len: Annotated[int, typer.Option("--seq-len", "-l", help="Tokens per block (model.max_seq_len).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory for train/val .bin/.json.")],
    inputs: Annotated[list[str] | None, typer.Argument(help=INPUTS_HELP + " Optional with --source.")] = None,
    source: Annotated[list[str] | None, typer.Option("--source", help=SOURCE_HELP)] = None,
    val_fraction: Annotated[
        float,
        typer.Option(
            "--val-fraction",
            help="Share of the text (UTF-8 bytes) held out for validation, in whole documents drawn with --seed.",
        ),
    ] = 0.0,
    val_input: Annotated[
        list[str] | None,
        typer.Option("--val-input", help="Validation inputs (repeatable), instead of --val-fraction."),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the --val-fraction split and --source draws.")] = 0,
    text_field: TextFieldOption = "text",
    errors: ErrorsOption = "strict",
    overwrite: OverwriteOption = False,
    chat: Annotated[
        bool,
        typer.Option(
            "--chat",
            help="Instruction data: JSONL (or Parquet, saved datasets) of prompt/response or "
            "messages, one example per block, with a loss mask that leaves the prompt out (see "
            "docs/finetune.md).",
        ),
    ] = False,
    long: Annotated[
        str, typer.Option("--long", help="--chat: an example longer than a block is truncated or dropped (counted).")
    ] = "drop",
    mask_padding: Annotated[bool, typer.Option("--mask-padding", hidden=True)] = False,  # removed: refused
    as_json: JsonOption = False,
) -> None:
    """Tokenize documents, separate them with end-of-document tokens and cut fixed-length blocks.

    Byte-identical documents are packed once (a validation input's copy first); files that dlm
    cannot read are skipped and listed. With --chat, instruction examples are packed one per block.
    """

    _check_mode_options(ctx, chat)
    if chat:
        _pack_chat(
            inputs or [],
            tokenizer,
            seq_len,
            output,
            val_input or [],
            val_fraction,
            seed,
            long,
            overwrite,
            wants_json(as_json),
        )
        return
    from dlm.data.mixture import parse_source
    from dlm.data.pack import pack_corpus

    sources = [parse_source(text) for text in source or []]
    json_mode = wants_json(as_json)
    with _ProgressView("packing", json_mode) as view:
        summary = pack_corpus(
            inputs or [],
            tokenizer,
            seq_len,
            output,
            val_fraction=val_fraction,
            val_inputs=val_input or [],
            seed=seed,
            text_field=text_field,
            errors=errors,
            overwrite=overwrite,
            progress=view.update,
            sources=sources,
        )
    if json_mode:
        splits = {name: vars(split) for name, split in summary.splits.items()}
        print_json({"event": "summary", **vars(summary), "splits": splits})
    else:
        _render_pack(summary)


# Options that only one mode of `dlm pack` reads: given to the other, they are refused, never ignored.
CHAT_ONLY = ("long",)
PLAIN_ONLY = ("source", "text_field", "errors")  # --chat reads the fields of dlm.data.chat, in UTF-8


def _check_mode_options(ctx: typer.Context, chat: bool) -> None:
    names = given_options(ctx)
    if "mask_padding" in names:
        raise UserError(
            "--mask-padding was removed: it left the padding visible and unlearned, which shows the "
            "model in training where each reply ends, as it never sees when sampling (docs/finetune.md)",
            fix="drop it: the padding is learned as end-of-document tokens, which is how the model learns to stop",
        )
    if chat:
        refuse_other_mode(names, PLAIN_ONLY, "to --chat")
    else:
        refuse_other_mode(names, CHAT_ONLY, "to a plain pack (without --chat)", ", or pass --chat")


def _pack_chat(
    inputs: list[str],
    tokenizer: Path,
    seq_len: int,
    output: Path,
    val_inputs: list[str],
    val_fraction: float,
    seed: int,
    long: str,
    overwrite: bool,
    json_mode: bool,
) -> None:
    from dlm.data.chat_pack import pack_chat

    splits = pack_chat(
        [Path(p) for p in inputs],
        tokenizer,
        seq_len,
        output,
        val_inputs=[Path(p) for p in val_inputs],
        val_fraction=val_fraction,
        seed=seed,
        long=long,  # type: ignore[arg-type]
        overwrite=overwrite,
    )
    if json_mode:
        print_json({"event": "summary", "output": str(output), "chat": True, "splits": splits})
        return
    for name, counts in splits.items():
        console.print(
            f"{name}: {counts['examples']:,} examples ({counts['truncated']:,} truncated, "
            f"{counts['dropped']:,} dropped), {counts['loss_tokens']:,} loss tokens",
            highlight=False,
        )
        if counts["empty"]:
            console.print(
                f"[yellow]{name}: skipped {_count(counts['empty'], 'example')} with an empty reply[/]", highlight=False
            )


def _render_pack(summary: PackSummary) -> None:
    table = Table("split", "blocks", "tokens", "dropped", "documents", "text MB", title=escape(str(summary.output)))
    for name, split in summary.splits.items():
        table.add_row(
            name,
            f"{split.num_blocks:,}",
            f"{split.num_tokens:,}",
            f"{split.dropped_tokens:,}",
            f"{split.documents:,}",
            f"{split.text_bytes / 1e6:.2f}",
        )
    console.print(table)
    tokens = sum(split.num_tokens + split.dropped_tokens for split in summary.splits.values())
    text_bytes = sum(split.text_bytes for split in summary.splits.values())
    console.print(
        f"{text_bytes / 1e6:.1f} MB of text in {summary.seconds:.1f}s "
        f"({text_bytes / 1e6 / summary.seconds:.2f} MB/s, {tokens / summary.seconds:,.0f} tok/s), "
        f"{summary.dtype} tokens, vocab {summary.vocab_size}",
        highlight=False,
    )
    if summary.replaced_characters:
        console.print(f"[yellow]replaced {summary.replaced_characters} invalid UTF-8 sequences[/]")
    for line in _pack_notes(summary):
        console.print(line, highlight=False, soft_wrap=True)  # file names are never broken mid-name
    if "val" not in summary.splits:
        console.print("no validation split: pass --val-fraction or --val-input to make one")


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}" + ("" if number == 1 else "s")


def _pack_notes(summary: PackSummary) -> list[str]:
    """What the pack left out or chose, in words: the split realised, duplicates, skipped files."""

    notes = []
    if summary.val_share is not None:
        share = summary.val_share
        notes.append(f"validation: {share['text_bytes']:.1%} of the text bytes, {share['tokens']:.1%} of the tokens")
    dropped = summary.duplicates_dropped
    if dropped.get("documents"):
        notes.append(
            f"[yellow]dropped {_count(dropped['documents'], 'duplicate document')}[/] "
            f"({dropped['text_bytes']:,} bytes): the same text as a document kept"
        )
    skipped = summary.skipped_files
    if skipped.get("count"):
        names = ", ".join(escape(Path(path).name) for path in skipped["examples"])
        more = skipped["count"] - len(skipped["examples"])
        notes.append(
            f"[yellow]skipped {_count(skipped['count'], 'file')} dlm cannot read[/]: {names}"
            + (f" and {more:,} more" if more else "")
            + f"; it reads {escape(supported_inputs())}"
        )
    if summary.removed_temporaries:
        notes.append(f"removed {_count(len(summary.removed_temporaries), 'temporary file')} left by a killed pack")
    for entry in summary.mixture or []:
        notes.append(
            f"source {escape(entry['input'])} x{entry['weight']:g}: {_count(entry['documents_taken'], 'document')} "
            f"of {entry['documents']:,} distinct, {entry['tokens']:,} training tokens"
        )
    return notes


def validate(
    config: ConfigOption,
    overrides: SetOption = None,
    device_memory: DeviceMemoryOption = None,
    as_json: JsonOption = False,
    nproc: Annotated[
        int, typer.Option("--nproc", min=1, help="Processes the run will use (FSDP memory, checkpoint shards).")
    ] = 1,
) -> None:
    """Check a config against its tokenizer, data, output directory, memory and checkpoint size; exit 2 on
    any failure.

    Rows marked warning (a vocabulary, model or step count large for the data) do not fail it."""

    from dlm.train.preflight import validate_config_file

    _, results = validate_config_file(config, overrides, world_size=nproc, device_memory_gib=device_memory)
    failed = [result.name for result in results if not result.passed]
    warned = [result.name for result in results if result.status == "warning"]
    as_json = wants_json(as_json)
    if as_json:
        print_json({"passed": not failed, "warnings": warned, "checks": [result.to_dict() for result in results]})
    else:
        marks = {"passed": "[green]passed[/]", "warning": "[yellow]warning[/]", "failed": "[bold red]failed[/]"}
        table = Table(Column("check", no_wrap=True), "result", "detail", "fix", title=escape(str(config)))
        for result in results:
            table.add_row(result.name, marks[result.status], escape(result.detail), escape(result.fix))
        console.print(table)
    if failed:
        # The report is on stdout; stderr gets the one `error:` line that every failed command prints.
        raise UserError(
            f"{len(failed)} of {len(results)} checks failed: {', '.join(failed)}",
            fix='see the "fix" of each failed check' if as_json else "fix the rows marked failed above",
        )


def register(app: typer.Typer) -> None:
    app.add_typer(tokenizer_app, name="tokenizer")
    app.command("pack")(pack)
    app.command("validate")(validate)
