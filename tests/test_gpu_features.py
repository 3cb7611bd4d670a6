"""GPU checks of the features beyond the training step (`pytest -m gpu`): a block model's flex attention
against the masked SDPA kernel (loss and gradients in bfloat16), cached block sampling against the
uncached reference, an imported Llama against transformers, the exact resume of LoRA and sharded (DCP)
runs, a distillation and its student, and bfloat16 loading (dtype, device, logits, peak GPU memory), all
on the device. scripts/gpu_check.sh runs them on a machine with a GPU, where each takes seconds (the flex
kernel's first compilation apart); without CUDA they skip. `DLM_GPU_TESTS_DEVICE=cpu pytest -m gpu
tests/test_gpu_features.py` runs their logic on the CPU instead (the checks that only mean something on
CUDA, such as the peak GPU memory, then skip).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import check_resume_is_exact, tiny_experiment, train_losses, train_tiny_run

import dlm
import dlm.model.attention
import dlm.model.transformer
from dlm.artifacts.events import Event
from dlm.artifacts.export import export_model, write_export
from dlm.artifacts.export_layout import read_export_config
from dlm.artifacts.loading import load_model, read_model_source
from dlm.artifacts.sharded_checkpoint import read_sharded_weights
from dlm.config.schema import ModelConfig
from dlm.diffusion.objective import corrupt_tokens, diffusion_cross_entropy
from dlm.diffusion.schedules import LinearSchedule
from dlm.distill.run import distill, distillation_experiment
from dlm.model.attention import AttentionMask, flex_attention, training_kernel
from dlm.model.denoiser import masked_logits
from dlm.model.transformer import DiffusionTransformer
from dlm.runtime.device import autocast_context
from dlm.sampling.block_model import denoise_blocks
from dlm.sampling.generation import generate
from dlm.sampling.options import SamplingOptions
from dlm.sampling.row_noise import noise_device
from dlm.train.loop import train

DEVICE = os.environ.get("DLM_GPU_TESTS_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ON_CUDA = torch.device(DEVICE).type == "cuda"
MASK_ID = 1


@pytest.fixture
def full_float32() -> Iterator[None]:
    """float32 matmuls in full precision: a training run on CUDA turns TF32 on for the whole process."""

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture(scope="module")
def device_run(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step tiny run trained on the device: a LoRA base, a teacher and a model to export."""

    return train_tiny_run(tiny_data_dir, tmp_path_factory.mktemp("device-run") / "run", f"training.device={DEVICE}")


def block_model(block_size: int, seq_len: int = 64, seed: int = 0) -> DiffusionTransformer:
    """A tiny block model on the device; heads 64 wide, as the flex kernel wants them."""

    torch.manual_seed(seed)
    config = ModelConfig(
        vocab_size=64,
        mask_token_id=MASK_ID,
        max_seq_len=seq_len,
        d_model=128,
        n_layers=2,
        n_heads=2,
        pad_vocab_multiple=64,
        block_size=block_size,
    )
    return DiffusionTransformer(config).to(DEVICE)


# ------------------------------------------------------------------------------ block diffusion


def bfloat16_loss_and_gradients(model: DiffusionTransformer, block_size: int) -> tuple[float, dict[str, torch.Tensor]]:
    """The training pass of a block model under bfloat16 autocast, as `dlm.train.step` makes it."""

    length = model.config.max_seq_len
    clean = torch.randint(2, 64, (4, length), generator=torch.Generator().manual_seed(1))
    # Times of at least 1/4 keep the 1/t weights small, so the loss stays near log 64; the noise is
    # drawn on the CPU, the same on every device.
    times = 0.25 + 0.75 * torch.rand(4, length // block_size, generator=torch.Generator().manual_seed(2))
    drawn = corrupt_tokens(clean, MASK_ID, times, 1e-3, torch.Generator().manual_seed(3), block_size=block_size)
    moved = ("noisy_tokens", "mask", "time", "mask_probability", "mask_rate")
    corruption = dataclasses.replace(drawn, **{name: getattr(drawn, name).to(DEVICE) for name in moved})
    clean = clean.to(DEVICE)
    model.zero_grad()
    with autocast_context(torch.device(DEVICE), "bfloat16"):
        logits = masked_logits(model, corruption.noisy_tokens, corruption.mask, clean)
    assert logits.dtype == torch.bfloat16
    loss = diffusion_cross_entropy(logits, clean, corruption).loss
    loss.backward()
    return loss.item(), {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("block_size", [4, 16])
def test_the_block_training_loss_of_the_device_kernel_equals_the_masked_sdpa_loss_in_bfloat16(
    block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if ON_CUDA and flex_attention is not None:
        assert training_kernel(torch.device(DEVICE)) == "flex"
    kernels: list[str] = []
    attend = dlm.model.transformer.attend

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None) -> torch.Tensor:
        kernels.append("none" if mask is None else mask.kernel)
        return attend(q, k, v, mask)

    monkeypatch.setattr(dlm.model.transformer, "attend", spy)
    model = block_model(block_size).train()
    loss, grads = bfloat16_loss_and_gradients(model, block_size)
    assert set(kernels) == {training_kernel(torch.device(DEVICE))} and len(kernels) == 2  # one call per layer
    kernels.clear()
    for module in (dlm.model.attention, dlm.model.transformer):
        monkeypatch.setattr(module, "training_kernel", lambda device: "sdpa-mask")
    want_loss, want_grads = bfloat16_loss_and_gradients(model, block_size)
    assert kernels == ["sdpa-mask", "sdpa-mask"]
    assert math.isfinite(loss) and 3 < want_loss < 6  # about log 64 = 4.2 for an untrained model
    assert loss == pytest.approx(want_loss, abs=2e-2)
    assert grads.keys() == want_grads.keys() and len(grads) == len(list(model.parameters()))
    for name in (
        "token_embedding.weight",
        "blocks.0.attention.qkv.weight",
        "blocks.1.attention.out.weight",
        "blocks.1.mlp.down.weight",
    ):
        difference = (grads[name] - want_grads[name]).norm() / want_grads[name].norm()
        assert difference.item() < 5e-2, (name, difference.item())


# Float32 only: on the CPU bfloat16 holds as well (its kernels compute each row the same whatever rows
# come with it), but CUDA's matmul and attention kernels choose their tiling by shape, so the cached
# pass (one block's rows) and the reference (the whole prefix again) round differently. In bfloat16 that
# moves the logits by ~1e-2, enough to flip a drawn token now and then; in float32 with TF32 off the
# ~1e-7 differences decide no draw.
@pytest.mark.parametrize("remasking", ["confidence", "random"])
def test_cached_block_sampling_on_the_device_equals_the_uncached_reference(remasking: str, full_float32: None) -> None:
    model = block_model(4, seq_len=32).eval()
    tokens = torch.randint(2, 64, (3, 32), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    fill = torch.zeros(32, dtype=torch.bool, device=DEVICE)
    fill[6:29] = True  # a prompt ending inside a block, and fixed text after the generated span
    options = SamplingOptions(steps=12, remasking=remasking)
    outputs = []
    with torch.inference_mode():
        for cached in (True, False):
            generator = torch.Generator(device=noise_device(torch.device(DEVICE))).manual_seed(7)
            outputs.append(
                denoise_blocks(
                    model, tokens, fill, options, generator=generator, schedule=LinearSchedule(), kv_cache=cached
                )
            )
    (cached_tokens, cached_passes), (reference, reference_passes) = outputs
    assert cached_tokens.device.type == torch.device(DEVICE).type
    assert torch.equal(cached_tokens, reference)
    assert not bool((cached_tokens == MASK_ID).any()) and torch.equal(cached_tokens[:, ~fill], tokens[:, ~fill])
    if remasking == "confidence":
        assert cached_passes == reference_passes
    else:
        assert cached_passes >= reference_passes


# ------------------------------------------------------------------------------ imported models


def test_an_imported_llama_gives_the_transformers_logits_on_the_device(
    tiny_tokenizer_path: Path, tmp_path: Path, full_float32: None
) -> None:
    transformers = pytest.importorskip("transformers")
    from test_hf_import import VOCAB, build_hf_model

    from dlm.artifacts.import_model import import_model

    source = tmp_path / "llama"
    build_hf_model("llama", source, tiny_tokenizer_path)
    assert len(list(source.glob("model-*.safetensors"))) > 1  # saved sharded
    output = import_model(source, tmp_path / "imported", add_mask_token=True, dtype="float32")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).to(DEVICE).eval()
    model, _ = dlm.load(output, device=DEVICE)
    tokens = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with torch.no_grad():
        expected = hf_model(tokens).logits
        logits = model(tokens)
    assert logits.device == expected.device and logits.device.type == torch.device(DEVICE).type
    assert logits.dtype == expected.dtype == torch.float32 and logits.shape == (2, 40, VOCAB + 1)
    assert (logits[..., :VOCAB] - expected).abs().max().item() < 1e-4


# ------------------------------------------------------------------------------ exact resume


def test_a_lora_run_on_the_device_resumes_bit_exactly(tiny_data_dir: Path, device_run: Path, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from test_lora import lora_settings

    settings = lora_settings(device_run, f"training.device={DEVICE}", "training.precision=bfloat16")
    losses = check_resume_is_exact(tiny_data_dir, tmp_path, settings, 3)
    assert len(losses) == 6 and all(loss is not None and math.isfinite(loss) for loss in losses)


def test_a_sharded_run_saved_and_resumed_on_the_device_continues_exactly(tiny_data_dir: Path, tmp_path: Path) -> None:
    settings = (
        f"training.device={DEVICE}",
        "training.checkpoint_format=dcp",
        "training.max_steps=4",
        "training.warmup_steps=1",
        "training.log_interval=1",
        "training.save_interval=2",
        "training.eval_interval=100",
        "training.ema_decay=0.9",
    )
    straight_events: list[Event] = []
    straight = train(tiny_experiment(tiny_data_dir, tmp_path / "straight", *settings), sink=straight_events.append)
    split = tiny_experiment(tiny_data_dir, tmp_path / "split", *settings)
    first: list[Event] = []
    paused = train(split, max_run_steps=2, sink=first.append)
    assert paused.status == "paused" and paused.step == 2 and paused.checkpoint.is_dir()
    second: list[Event] = []
    resumed = train(split, resume=paused.checkpoint, sink=second.append)
    assert resumed.status == "complete" and resumed.step == straight.step == 4
    assert resumed.checkpoint == tmp_path / "split" / "step-00000004"
    losses = train_losses(straight_events)
    assert len(losses) == 4 and train_losses(first) + train_losses(second) == losses
    for use_ema in (False, True):  # the live weights and the EMA
        _, got, got_kind = read_sharded_weights(resumed.checkpoint, use_ema=use_ema)
        _, want, want_kind = read_sharded_weights(straight.checkpoint, use_ema=use_ema)
        assert got_kind == want_kind == ("ema" if use_ema else "live") and want and got.keys() == want.keys()
        assert all(torch.equal(got[name], want[name]) for name in want), use_ema


# ------------------------------------------------------------------------------ distillation


def test_a_distillation_on_the_device_gives_a_student_that_samples_in_its_steps(
    tiny_data_dir: Path, device_run: Path, tmp_path: Path
) -> None:
    teacher = export_model(device_run, tmp_path / "teacher", dtype="float32")
    fields = {"teacher_steps": 8, "rounds": 2, "steps_per_round": 2}
    experiment = distillation_experiment(
        teacher, tiny_data_dir, tmp_path / "run", fields, ["training.eval_batches=1", f"training.device={DEVICE}"]
    )
    assert experiment.training.device == DEVICE
    events: list[Event] = []
    result = distill(experiment, sink=events.append)
    assert result.status == "complete" and result.step == 4
    losses = train_losses(events)
    assert losses and all(loss is not None and math.isfinite(loss) for loss in losses)
    student = export_model(tmp_path / "run", tmp_path / "student")
    record = read_export_config(student)["distillation"]
    assert record["steps"] == 2 and record["teacher_steps"] == 8 and record["rounds_done"] == 2
    model, tokenizer = dlm.load(student, device=DEVICE)
    assert all(p.device.type == torch.device(DEVICE).type for p in model.parameters())
    sampled = generate(model, tokenizer, prompt="ROMEO:", length=16, seed=1)
    assert sampled.steps == 2 and sampled.texts[0].startswith("ROMEO:") and "<|mask|>" not in sampled.texts[0]


# ------------------------------------------------------------------------------ bfloat16 loading


def test_a_bfloat16_export_loads_onto_the_device_in_bfloat16_with_the_logits_of_a_cpu_load(
    device_run: Path, tmp_path: Path
) -> None:
    exported = export_model(device_run, tmp_path / "model", dtype="bfloat16")
    model, _ = dlm.load(exported, device=DEVICE, dtype=torch.bfloat16)
    parameters = dict(model.named_parameters())
    assert parameters and all(p.dtype == torch.bfloat16 for p in parameters.values())
    assert all(p.device.type == torch.device(DEVICE).type for p in model.parameters())
    assert all(b.device.type == torch.device(DEVICE).type for b in model.buffers())
    moved, _ = load_model(exported, dtype=torch.bfloat16)
    moved = moved.to(DEVICE)
    tokens = torch.randint(
        3, model.config.vocab_size, (2, model.config.max_seq_len), generator=torch.Generator().manual_seed(5)
    ).to(DEVICE)
    with torch.no_grad():
        logits, want = model(tokens), moved(tokens)
    assert logits.dtype == torch.bfloat16 and bool(torch.isfinite(logits).all())
    torch.testing.assert_close(logits.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_a_bfloat16_load_onto_the_gpu_peaks_at_the_weights_own_bytes(device_run: Path, tmp_path: Path) -> None:
    if not ON_CUDA:
        pytest.skip("the peak of GPU memory is measured on CUDA only")
    # A ~76M-parameter model written as a bfloat16 export (the small run's tokenizer and settings).
    config = ModelConfig(
        vocab_size=512, mask_token_id=1, max_seq_len=64, d_model=1024, n_layers=6, n_heads=8, pad_vocab_multiple=64
    )
    with torch.device(DEVICE):
        weights = {name: t.to("cpu", torch.bfloat16) for name, t in DiffusionTransformer(config).state_dict().items()}
    info, _ = read_model_source(device_run)
    exported = write_export(
        dataclasses.replace(info, model=config),
        weights,
        tmp_path / "large",
        dtype="bfloat16",
        tokenizer=info.tokenizer_path,
        tokenizer_settings=None,
    )
    del weights
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()  # what earlier tests left allocated, if anything
    torch.cuda.reset_peak_memory_stats()
    model, _ = dlm.load(exported, device=DEVICE, dtype=torch.bfloat16)
    peak = torch.cuda.max_memory_allocated() - before
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 50e6 < model.num_parameters < 100e6 and all(p.dtype == torch.bfloat16 for p in model.parameters())
    # Each weight is placed on the GPU once, in bfloat16: no float32 model built there first.
    assert peak <= 1.15 * weight_bytes, f"peak {peak / 2**20:.0f} MiB for {weight_bytes / 2**20:.0f} MiB of weights"


@pytest.mark.parametrize("compiled", [False, True])
def test_a_causal_model_trains_without_seeing_the_future(compiled: bool) -> None:
    # configs/shakespeare-ar.toml diverged on an H200 (torch 2.11, default kernels: cuDNN attention
    # first, compiled): validation loss rose from 7.3 to 13.0 nats while the diffusion config trained.
    # A model that saw later tokens in training would do just that. So, on the kernels a run uses:
    # the loss over the first half of a row has no gradient from the second half's tokens, and changing
    # the last token changes no earlier position's logits.
    if compiled and not ON_CUDA:
        pytest.skip("compiled CPU attention is not what the GPU run used")
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=256,
        mask_token_id=MASK_ID,
        max_seq_len=256,
        d_model=384,
        n_layers=2,
        n_heads=6,
        pad_vocab_multiple=64,
        block_size=1,
        attention="causal",
    )
    model = DiffusionTransformer(config).to(DEVICE).train()
    forward = torch.compile(model) if compiled else model
    precision = "bfloat16" if ON_CUDA else "float32"
    clean = torch.randint(2, 256, (8, 256), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    every = torch.ones_like(clean, dtype=torch.bool)
    embedded: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        out.retain_grad()  # the shifted row's embeddings: position i holds token i - 1
        embedded.append(out)

    hook = model.token_embedding.register_forward_hook(keep)
    try:
        with autocast_context(torch.device(DEVICE), precision):
            logits = forward(torch.full_like(clean, MASK_ID), every, clean_tokens=clean).float().view(8, 256, -1)
        first_half = logits[:, :128].reshape(-1, logits.shape[-1])
        torch.nn.functional.cross_entropy(first_half, clean[:, :128].reshape(-1)).backward()
    finally:
        hook.remove()
    grad = embedded[0].grad
    assert grad is not None and grad[:, :128].abs().max().item() > 0
    # Position 127 reads token 126 and is the last the first half's loss may depend on.
    assert grad[:, 128:].abs().max().item() == 0.0, "the first half's loss reached later tokens"
    changed = clean.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 254 + 2
    with torch.no_grad(), autocast_context(torch.device(DEVICE), precision):
        again = forward(torch.full_like(clean, MASK_ID), every, clean_tokens=changed).float().view(8, 256, -1)
    assert (again[:, :-1] - logits.detach()[:, :-1]).abs().max().item() <= 1e-3
