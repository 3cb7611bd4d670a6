"""Loading holds no second copy of the weights: a large model (or any model on an accelerator) is built on
the meta device and takes each stored tensor as its parameter, with the logits of the plain build."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlm.artifacts import loading
from dlm.config.schema import ModelConfig
from dlm.errors import UserError
from dlm.model.transformer import DiffusionTransformer

CONFIG = ModelConfig(
    vocab_size=96,
    mask_token_id=1,
    max_seq_len=32,
    d_model=32,
    n_layers=2,
    n_heads=4,
    rope_scaling={"type": "linear", "factor": 2.0},
)


def stored_weights(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {name: tensor.to(dtype) for name, tensor in DiffusionTransformer(CONFIG).state_dict().items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_meta_build_equals_the_plain_build_and_shares_the_weights(dtype: torch.dtype) -> None:
    weights = stored_weights(dtype)
    plain = loading._built_and_copied(CONFIG, weights, dtype, Path("w"))
    stored = dict(weights)
    meta = loading._built_on_meta(CONFIG, weights, torch.device("cpu"), dtype, Path("w"))
    assert weights == {}  # taken over: the build holds the only references
    # Every parameter is the stored tensor itself: no float32 model beside the weights, no copy.
    assert all(parameter.data_ptr() == stored[name].data_ptr() for name, parameter in meta.named_parameters())
    assert all(parameter.dtype == dtype and parameter.device.type == "cpu" for parameter in meta.parameters())
    # The rotary tables, not stored, are rebuilt from the config (float32, as in a plain build).
    assert torch.equal(meta.rope_cos, plain.rope_cos) and torch.equal(meta.rope_sin, plain.rope_sin)
    assert meta.rope_cos.dtype == torch.float32
    tokens = torch.randint(2, CONFIG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(meta.eval()(tokens), plain.eval()(tokens))


def test_an_upcast_meta_build_converts_each_stored_tensor_once() -> None:
    """A bfloat16 source built in float32 on the meta path: the plain build's model, the source emptied as
    it is placed (no converted weight beside the whole source), and a tensor stored under two names
    converted once and shared, as it was stored."""

    weights = stored_weights(torch.bfloat16)
    weights["blocks.0.mlp_norm.weight"] = weights["blocks.0.attention_norm.weight"]  # one tensor, two names
    plain = loading._built_and_copied(CONFIG, dict(weights), torch.float32, Path("w"))
    meta = loading._built_on_meta(CONFIG, weights, torch.device("cpu"), torch.float32, Path("w"))
    assert weights == {}
    parameters = dict(meta.named_parameters())
    assert all(parameter.dtype == torch.float32 for parameter in parameters.values())
    shared = parameters["blocks.0.attention_norm.weight"], parameters["blocks.0.mlp_norm.weight"]
    assert shared[0].data_ptr() == shared[1].data_ptr()
    assert parameters["blocks.1.attention_norm.weight"].data_ptr() != parameters["blocks.1.mlp_norm.weight"].data_ptr()
    tokens = torch.randint(2, CONFIG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(meta.eval()(tokens), plain.eval()(tokens))


def test_large_models_and_accelerators_take_the_meta_build(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []

    def builder(kind: str) -> object:
        def build(*args: object) -> DiffusionTransformer:
            built.append(kind)
            return DiffusionTransformer(CONFIG)

        return build

    monkeypatch.setattr(loading, "_built_on_meta", builder("meta"))
    monkeypatch.setattr(loading, "_built_and_copied", builder("copy"))
    weights = stored_weights(torch.float32)
    loading.build_model(CONFIG, weights)
    monkeypatch.setattr(loading, "_META_BUILD_MIN_PARAMETERS", 1000)
    model = loading.build_model(CONFIG, weights)
    assert built == ["copy", "meta"] and not model.training  # returned in eval mode either way


def test_wrong_shapes_are_refused_before_anything_is_placed() -> None:
    weights = stored_weights(torch.float32)
    weights["norm.weight"] = torch.ones(7)
    with pytest.raises(UserError, match="wrong shape"):
        loading._built_on_meta(CONFIG, weights, torch.device("cpu"), torch.float32, Path("w"))


def test_a_run_from_trained_weights_takes_them_without_a_random_draw() -> None:
    # training.init_from: the weights become the parameters (no float32 model drawn at random first, which
    # for 8B would need 32 GB of host memory); stored in float32 they are the very tensors given.
    from dlm.config.schema import ExperimentConfig
    from dlm.train.distributed import DistributedContext
    from dlm.train.step import TrainingStep

    experiment = ExperimentConfig.model_validate({"model": CONFIG.model_dump(), "training": {"device": "cpu"}})
    weights = stored_weights(torch.float32)
    draws: list[str] = []
    original = DiffusionTransformer.init_weights

    def counted(model: DiffusionTransformer) -> None:
        draws.append(next(model.parameters()).device.type)
        original(model)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DiffusionTransformer, "init_weights", counted)
        step = TrainingStep(experiment, torch.device("cpu"), "float32", DistributedContext(), initial=weights)
    assert draws == ["meta"]  # built on the meta device: nothing drawn for real
    parameters = dict(step.model.named_parameters())
    assert all(parameters[name].data_ptr() == weights[name].data_ptr() for name in parameters)
    assert torch.equal(step.model.rope_cos, DiffusionTransformer(CONFIG).rope_cos)
