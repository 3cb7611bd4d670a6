"""Document-aware attention: a packed row scores each document as if it were fed alone."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from helpers import check_resume_is_exact, tiny_experiment

from dlm.config.schema import ModelConfig
from dlm.data.pack import pack_corpus
from dlm.model.attention import document_ids, flex_attention, same_document, same_document_flex
from dlm.model.denoiser import masked_logits
from dlm.model.transformer import DiffusionTransformer
from dlm.train.loop import train
from dlm.train.preflight import CheckResult, validate_experiment

SEPARATOR = 0  # dlm's tokenizers: <|endoftext|> is id 0


def _model(**fields: object) -> DiffusionTransformer:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=64,
        mask_token_id=1,
        max_seq_len=24,
        d_model=32,
        n_layers=2,
        n_heads=4,
        pad_vocab_multiple=1,
        document_separator_id=SEPARATOR,
        **fields,
    )
    return DiffusionTransformer(config).double().eval()


def _document(length: int, seed: int) -> torch.Tensor:
    """`length` tokens of one document: ordinary tokens, then its end-of-document separator."""

    generator = torch.Generator().manual_seed(seed)
    return torch.cat((torch.randint(3, 64, (length - 1,), generator=generator), torch.tensor([SEPARATOR])))


def test_document_ids_give_the_separator_to_the_document_it_closes() -> None:
    tokens = torch.tensor([[5, 6, 0, 7, 0, 0, 8], [0, 9, 9, 9, 9, 9, 9]])
    assert document_ids(tokens, SEPARATOR).tolist() == [[0, 0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]


@pytest.mark.parametrize("block_size", [0, 4])
def test_a_packed_document_scores_as_if_fed_alone(block_size: int) -> None:
    # Two documents in one row, the second starting at position 8 (a block boundary for block_size 4).
    # Rotary scores depend on the distance between query and key only, so the second document at
    # positions 8.. scores as it does alone at 0.. (float64: equal up to the rounding of the angles).
    model = _model(block_size=block_size)
    first, second = _document(8, seed=1), _document(12, seed=2)
    clean = torch.cat((first, second))[None]
    noisy = clean.clone()
    noisy[0, [2, 5, 9, 14, 18]] = 1
    everywhere = torch.ones_like(clean, dtype=torch.bool)
    packed = masked_logits(model, noisy, everywhere, clean)
    alone = [
        masked_logits(model, noisy[:, :8], everywhere[:, :8], clean[:, :8]),
        masked_logits(model, noisy[:, 8:], everywhere[:, 8:], clean[:, 8:]),
    ]
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-10, rtol=0)
    # Without it the documents see each other: the test can tell.
    unaware = DiffusionTransformer(model.config.model_copy(update={"document_separator_id": None})).double().eval()
    unaware.load_state_dict(model.state_dict())
    assert not torch.allclose(masked_logits(unaware, noisy, everywhere, clean), packed, atol=1e-4)


def test_the_mask_composes_with_the_block_pattern_and_never_empties_a_row() -> None:
    documents = document_ids(torch.tensor([[3, 0, 0, 4, 5, 0]]), SEPARATOR)  # documents 0, 0, 1, 2, 2, 2
    mask = same_document(None, documents, 6).mask
    assert mask is not None and mask.shape == (1, 1, 6, 6)
    assert mask[0, 0].diagonal().all()
    assert mask[0, 0, 0].tolist() == [True, True, False, False, False, False]
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, True]


@pytest.mark.skipif(flex_attention is None, reason="this torch has no flex attention")
def test_the_flex_mask_selects_the_same_keys_as_the_boolean_mask() -> None:
    # CUDA takes the flex kernel; eager flex (a slow reference, forward only) runs on the CPU.
    length, block_size = 16, 4
    documents = document_ids(torch.cat((_document(6, 3), _document(10, 4)))[None].repeat(2, 1), SEPARATOR)
    documents[1] = 0  # the second row is one document
    keys = documents.repeat(1, 2)  # the 2L pass: the clean copy belongs to the same documents
    q, k, v = (torch.randn(2, 2, 2 * length, 8) for _ in range(3))
    from dlm.model.attention import bd3_mask

    boolean = same_document(bd3_mask(length, block_size, torch.device("cpu")), keys, 2 * length).mask
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=boolean)
    block_mask = same_document_flex(keys, 2 * length, length, block_size).mask
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = flex_attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(flex, expected, atol=1e-5, rtol=0)


def test_sampling_with_a_cache_or_padding_is_refused() -> None:
    model = _model()
    tokens = _document(8, seed=5)[None]
    with pytest.raises(ValueError, match="not with a cache or padding"):
        model(tokens, pad=torch.tensor([1]), documents=document_ids(tokens, SEPARATOR))


@pytest.mark.slow
def test_training_with_document_attention_resumes_exactly(tiny_data_dir: Path, tmp_path: Path) -> None:
    settings = (
        "training.max_steps=8",
        "training.log_interval=2",
        "training.warmup_steps=2",
        "training.eval_interval=4",
        "training.save_interval=100",
        f"model.document_separator_id={SEPARATOR}",
    )
    losses = check_resume_is_exact(tiny_data_dir, tmp_path, settings, pause_at=4)
    assert all(loss is not None and loss > 0 for loss in losses)


def test_validate_names_the_tokenizers_separator(tiny_data_dir: Path, tmp_path: Path) -> None:
    experiment = tiny_experiment(tiny_data_dir, tmp_path / "run", "model.document_separator_id=2")
    checks = {check.name: check for check in validate_experiment(experiment)}
    check = checks["tokenizer document_separator_id"]
    assert not check.passed and check.fix == f"set model.document_separator_id = {SEPARATOR}"


def test_validate_suggests_document_attention_for_short_documents(
    tiny_data_dir: Path, tiny_tokenizer_path: Path, tmp_path: Path
) -> None:
    # One speech-sized document a line: about 20 tokens each in 64-token rows.
    lines = [
        json.dumps({"text": f"First speaker, part {i}: my lord, the night is cold and the watch is set."})
        for i in range(300)
    ]
    (tmp_path / "short.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    pack_corpus([tmp_path / "short.jsonl"], tiny_tokenizer_path, 64, tmp_path / "data", val_fraction=0.0)

    def documents_check(data: Path, *extra: str) -> CheckResult:
        experiment = tiny_experiment(
            tiny_data_dir, tmp_path / "run", f"training.train_data={data / 'train.bin'}", *extra
        )
        return next(check for check in validate_experiment(experiment) if check.name == "train data documents")

    short = documents_check(tmp_path / "data")
    assert short.status == "warning" and short.fix.startswith(f"set model.document_separator_id = {SEPARATOR}")
    assert documents_check(tmp_path / "data", f"model.document_separator_id={SEPARATOR}").status == "passed"
    plays = documents_check(tiny_data_dir)  # whole plays: few rows cross a document's end
    assert plays.status == "passed" and "few rows cross" in plays.detail


def test_a_model_trained_with_documents_keeps_the_setting(tiny_data_dir: Path, tmp_path: Path) -> None:
    overrides = (
        "training.max_steps=2",
        "training.warmup_steps=1",
        "training.eval_interval=2",
        "training.save_interval=2",
        f"model.document_separator_id={SEPARATOR}",
    )
    result = train(tiny_experiment(tiny_data_dir, tmp_path / "run", *overrides))
    from dlm.artifacts.checkpoint import load_checkpoint

    assert load_checkpoint(result.checkpoint)["config"]["model"]["document_separator_id"] == SEPARATOR
