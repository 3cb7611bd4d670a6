"""`dlm import` refuses, before writing anything, a Hugging Face directory whose model could not load:
shapes that do not fit config.json, NaN or inf weights, a vocabulary that disagrees with the embedding,
a tokenizer larger than the embedding, and a shard index naming files outside the directory. The
sources are tiny Llama and Qwen2 models saved by transformers in several shards (the `hf` extra)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_hf_import import build_hf_model

import dlm
from dlm.artifacts.import_model import import_model
from dlm.errors import UserError

pytest.importorskip("transformers")
pytestmark = pytest.mark.hf_extra

INDEX = "model.safetensors.index.json"


def shard_of(source: Path, tensor: str) -> Path:
    return source / json.loads((source / INDEX).read_text())["weight_map"][tensor]


def rewrite_tensor(source: Path, tensor: str, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    shard = shard_of(source, tensor)
    tensors = load_file(str(shard))
    tensors[tensor] = change(tensors[tensor]).contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})


def edit_json(path: Path, change: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def truncate(path: Path, size: int) -> None:
    """Cut the last `size` bytes off a file, as an interrupted download does."""

    data = path.read_bytes()
    path.write_bytes(data[:-size])


def with_nan(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.view(-1)[3] = float("nan")
    return tensor


def add_tokens(data: dict) -> None:
    """Four special tokens past the 512 the embedding has rows for."""

    data["added_tokens"] += [
        {
            "id": 512 + i,
            "content": f"<extra_{i}>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i in range(4)
    ]


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "shape": (
        lambda source: rewrite_tensor(source, "model.layers.1.self_attn.o_proj.weight", lambda t: t[:, :16]),
        r"blocks\.1\.attention\.out\.weight \(from model\.layers\.1\.\*\) has shape \(32, 16\), "
        r"but config\.json implies \(32, 32\)",
    ),
    "nan": (
        lambda source: rewrite_tensor(source, "model.layers.0.mlp.up_proj.weight", with_nan),
        r"source weights hold NaN or inf values: tensor blocks\.0\.mlp\.gate_up\.weight",
    ),
    "inf": (
        lambda source: rewrite_tensor(source, "model.norm.weight", lambda t: t * float("inf")),
        r"NaN or inf values: tensor model\.norm\.weight",
    ),
    "vocab": (
        lambda source: edit_json(source / "config.json", lambda c: c.update(vocab_size=640)),
        r"config\.json's vocabulary \(640 rows\) disagrees with model\.embed_tokens\.weight, which has 512 rows",
    ),
    "tokenizer": (
        lambda source: edit_json(source / "tokenizer.json", add_tokens),
        r"tokenizer\.json has 516 tokens but the model's embedding only 512 rows",
    ),
    # A field of the wrong type: "no" read as a truth value would tie the embeddings and drop lm_head.
    "boolean": (
        lambda source: edit_json(source / "config.json", lambda c: c.update(tie_word_embeddings="no")),
        r"the field tie_word_embeddings is 'no', not true or false",
    ),
    "number": (
        lambda source: edit_json(source / "config.json", lambda c: c.update(rms_norm_eps="tiny")),
        r"the field rms_norm_eps is 'tiny', not a number",
    ),
    "rope": (
        lambda source: edit_json(source / "config.json", lambda c: c.update(rope_parameters=[1])),
        r"rope_parameters is \[1\], not an object",
    ),
    "truncated": (
        lambda source: truncate(shard_of(source, "model.norm.weight"), 64),
        r"damaged weights: tensor .* lies outside the file or has the wrong size",
    ),
    "outside": (
        lambda source: edit_json(
            source / INDEX,
            lambda index: index["weight_map"].update({"model.norm.weight": "../elsewhere/x.safetensors"}),
        ),
        r"the shard index names '\.\./elsewhere/x\.safetensors', which is not a "
        r"\.safetensors file in this directory",
    ),
}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("case", list(CASES))
def test_an_unloadable_source_is_refused_and_nothing_is_written(
    family: str, case: str, tiny_tokenizer_path: Path, tmp_path: Path
) -> None:
    source = tmp_path / family
    build_hf_model(family, source, tiny_tokenizer_path)
    if case == "outside":  # the named file exists there: the name alone must be refused
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "x.safetensors").write_bytes(shard_of(source, "model.norm.weight").read_bytes())
    corrupt, message = CASES[case]
    corrupt(source)
    output = tmp_path / "imported"
    with pytest.raises(UserError, match=message) as refused:
        import_model(source, output, add_mask_token=True, dtype="float32")
    assert refused.value.path is not None and refused.value.fix
    assert not output.exists() and not list(tmp_path.glob(".imported*"))


def test_shards_that_are_links_into_a_blob_store_import(tiny_tokenizer_path: Path, tmp_path: Path) -> None:
    # A Hugging Face cache snapshot: every file a link to a content-addressed blob elsewhere.
    source, blobs = tmp_path / "snapshot", tmp_path / "blobs"
    build_hf_model("llama", source, tiny_tokenizer_path)
    blobs.mkdir()
    for file in sorted(source.iterdir()):
        blob = blobs / f"blob-{file.name}"
        file.rename(blob)
        file.symlink_to(blob)
    output = import_model(source, tmp_path / "imported", add_mask_token=True, dtype="float32")
    model, _ = dlm.load(output)
    assert model.config.n_layers == 2


def test_each_tensor_is_placed_as_soon_as_it_is_read(tiny_tokenizer_path: Path, tmp_path: Path) -> None:
    # dlm.load hands every converted tensor to its device at once: the source is never held whole.
    from dlm.artifacts.hf.foreign import read_source

    source = tmp_path / "llama"
    build_hf_model("llama", source, tiny_tokenizer_path)
    hf = read_source(source)
    placed: list[tuple[int, ...]] = []

    def place(tensor: torch.Tensor) -> torch.Tensor:
        placed.append(tuple(tensor.shape))
        return tensor.double()

    _, weights = hf.read(hf.model(mask_token_id=0), place)
    assert len(placed) == len(weights) and all(tensor.dtype == torch.float64 for tensor in weights.values())


def test_the_import_holds_one_tensor_at_a_time(
    tiny_tokenizer_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each tensor is read as it is written and let go of after: an 8B import needs the memory of its
    # largest tensors, not of the model.
    import gc
    import weakref

    from dlm.artifacts.hf.conversion import ConvertedWeights

    source = tmp_path / "llama"
    build_hf_model("llama", source, tiny_tokenizer_path)
    alive: list[weakref.ref[torch.Tensor]] = []
    most = 0
    read = ConvertedWeights.read

    def counted(self: ConvertedWeights, name: str) -> torch.Tensor:
        nonlocal most
        gc.collect()
        most = max(most, sum(ref() is not None for ref in alive))
        tensor = read(self, name)
        alive.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(ConvertedWeights, "read", counted)
    output = import_model(source, tmp_path / "imported", add_mask_token=True, dtype="float32")
    # Embedding, head, 6 per block and the norm; while one is read, only the one just written is held.
    assert len(alive) == 2 + 2 * 6 + 1 and most == 1
    model, _ = dlm.load(output)
    assert model.config.vocab_size == 513


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ([1, 2], r"tensor w has dtype \[1, 2\]"),
        (
            {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]},
            r"tensor w lies outside the file or has the wrong size",
        ),
    ],
)
def test_a_malformed_safetensors_header_is_one_error(tmp_path: Path, entry: object, message: str) -> None:
    import struct

    from dlm.artifacts.hf.conversion import SourceTensors

    header = json.dumps({"w": entry}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(UserError, match="damaged weights: " + message):
        SourceTensors([tmp_path / "model.safetensors"])
