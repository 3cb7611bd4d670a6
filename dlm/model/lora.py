"""LoRA adapters on a `DiffusionTransformer`, through `peft` (the `lora` extra).

`add_adapters` injects peft's LoRA layers into the model in place (`peft.inject_adapter_in_model`):
each targeted `nn.Linear` becomes a layer whose frozen `base_layer` keeps the weight and whose
`lora_A` / `lora_B` train. The model stays a `DiffusionTransformer` with the same forward; its
parameter names gain `base_layer` and `lora_A.default` / `lora_B.default`. `merged_weights` folds
trained adapters into plain weights with peft's layer merge, so what it returns loads into
a model built without peft.

peft imports transformers (seconds), so it is imported only when adapters are asked for.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import Tensor, nn

from dlm.config.lora import LoraConfig
from dlm.config.schema import ModelConfig
from dlm.errors import UserError
from dlm.extras import Requirement, require
from dlm.model.transformer import DiffusionTransformer

LORA_EXTRA = Requirement("peft", "lora", "[training.lora] (LoRA adapters)")
ADAPTER = "default"  # peft's adapter name: one adapter per model
_ADAPTER_PARTS = ("lora_A", "lora_B")


def is_adapter(name: str) -> bool:
    """Whether a parameter name belongs to an adapter rather than to the base model."""

    return any(part in _ADAPTER_PARTS for part in name.split("."))


def linear_layer_names(model: nn.Module) -> list[str]:
    """The names `target_modules` may hold: the last part of every Linear layer's path in the blocks,
    once each. An untied output head is a Linear layer too, but the model multiplies by its weight
    directly, never through the module, so an adapter there would never train or take effect."""

    names = {
        path.rsplit(".", 1)[-1]
        for path, module in model.named_modules()
        if isinstance(module, nn.Linear) and path.startswith("blocks.")
    }
    return sorted(name for name in names if name not in _ADAPTER_PARTS)


def check_targets(model: nn.Module, lora: LoraConfig) -> None:
    """Refuse a target that names no Linear layer of `model`, listing the ones it has."""

    valid = linear_layer_names(model)
    if unknown := [name for name in lora.target_modules if name not in valid]:
        raise UserError(
            f"training.lora.target_modules: {', '.join(map(repr, unknown))} "
            f"{'is not a Linear layer' if len(unknown) == 1 else 'are not Linear layers'} of the model's blocks",
            fix=f"use some of: {', '.join(valid)}",
        )


def peft_config(lora: LoraConfig) -> Any:
    """peft's `LoraConfig` for `[training.lora]`; a missing peft is one error naming the extra."""

    peft = require(LORA_EXTRA)
    return peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
    )


def add_adapters(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """Inject the adapters into `model` in place and freeze every other parameter.

    The adapters' initial values come from the global RNG (peft: A Kaiming-uniform, B zero, so the
    model starts as the base); call it where the model is built, after seeding. With `base_dtype =
    "bfloat16"` the frozen Linear weights are stored in bfloat16; the embedding (the tied head), the
    norms and the adapters stay float32.
    """

    check_targets(model, lora)
    peft = require(LORA_EXTRA)
    peft.inject_adapter_in_model(peft_config(lora), model, adapter_name=ADAPTER)
    for module in model.modules():  # peft makes adapters in the dtype of the layer it wraps
        layer: Any = module  # a peft LoraLayer, read by its attributes
        adapters_a = getattr(layer, "lora_A", None)
        if adapters_a is not None and ADAPTER in adapters_a and adapters_a[ADAPTER].weight.dtype != torch.float32:
            # A base placed in bfloat16 (a run from trained weights): the adapters are float32, drawn
            # again in float32 by peft's own initialisation (A Kaiming-uniform, B zero).
            layer.lora_A[ADAPTER].float()
            layer.lora_B[ADAPTER].float()
            layer.reset_lora_parameters(ADAPTER, True)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(is_adapter(name))
    if lora.base_dtype == "bfloat16":
        for path, module in model.named_modules():
            if isinstance(module, nn.Linear) and not is_adapter(path):
                module.weight.data = module.weight.data.to(torch.bfloat16)
    return model


def trainable_parameters(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' tensors by parameter name: all a checkpoint of a LoRA run holds of the model."""

    return {name: parameter.detach() for name, parameter in model.named_parameters() if is_adapter(name)}


def base_weight_names(model: nn.Module) -> dict[str, str]:
    """Each base weight's name in a plain model -> its name in `model` (with `base_layer` where adapted)."""

    renamed = {}
    for name in model.state_dict():
        if not is_adapter(name):
            renamed[name.replace(".base_layer.", ".")] = name
    return renamed


@torch.no_grad()
def load_base_and_adapters(
    model: nn.Module, base: Mapping[str, Tensor], adapters: Mapping[str, Tensor] | None = None
) -> None:
    """Load a plain model's weights into the adapted `model` (each in its parameter's dtype), and the
    adapters when given (else they keep their values). Names that do not fit are refused."""

    state = model.state_dict()
    names = base_weight_names(model)
    if missing := sorted(set(names) - set(base)):
        raise UserError(f"the base model lacks weights the adapted model needs ({missing[:3]})")
    if adapters is not None:
        expected = {name for name in state if is_adapter(name)}
        if set(adapters) != expected or any(adapters[n].shape != state[n].shape for n in expected):
            raise UserError(
                f"the adapters do not fit [training.lora] (saved {len(adapters)} tensors, the config makes "
                f"{len(expected)}, e.g. {sorted(set(adapters) ^ expected)[:2]})",
                fix="use the [training.lora] settings the adapters were trained with",
            )
    loaded = {target: base[source].to(state[target].dtype) for source, target in names.items()}
    for name in state:
        if is_adapter(name):
            loaded[name] = (state if adapters is None else adapters)[name].to(state[name].dtype)
    model.load_state_dict(loaded, strict=True)


def merged_weights(
    model_config: ModelConfig, lora: LoraConfig, base: Mapping[str, Tensor], adapters: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """Plain float32 weights: `base` with the trained `adapters` merged in (W + alpha / r x B A, by
    each peft layer's own `merge`). They load into a `DiffusionTransformer` built without peft."""

    peft = require(LORA_EXTRA)
    with torch.device("cpu"):
        model = DiffusionTransformer(model_config)
    # Merged in float32 whatever base_dtype trained with: the sum keeps the adapters' precision.
    add_adapters(model, lora.model_copy(update={"base_dtype": "float32"}))
    load_base_and_adapters(model, base, adapters)
    # peft's model-level merge_and_unload reads a transformers config, which this model has not:
    # merge layer by layer and put each base layer back in its place.
    layer = peft.tuners.lora.LoraLayer
    adapted = [(path, module) for path, module in model.named_modules() if isinstance(module, layer)]
    for path, module in adapted:
        module.merge(safe_merge=True, adapter_names=[ADAPTER])
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, module.get_base_layer())
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


# peft's own file layout (`PeftModel.save_pretrained`): names under the wrapper's prefix, without the
# adapter's name, so the adapters of an export load with peft's tools too.
_PEFT_PREFIX = "base_model.model."


def to_peft_names(adapters: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {_PEFT_PREFIX + name.replace(f".{ADAPTER}.", "."): tensor for name, tensor in adapters.items()}


def from_peft_names(saved: Mapping[str, Tensor]) -> dict[str, Tensor]:
    renamed = {}
    for name, tensor in saved.items():
        name = name.removeprefix(_PEFT_PREFIX)
        for part in _ADAPTER_PARTS:
            name = name.replace(f".{part}.", f".{part}.{ADAPTER}.")
        renamed[name] = tensor
    return renamed


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model alone while the block runs (every adapter layer bypassed), the adapters back after:
    a LoRA run's reference policy without a second copy of the weights."""

    layers = [module for module in model.modules() if hasattr(module, "enable_adapters")]
    for layer in layers:
        cast(Any, layer).enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            cast(Any, layer).enable_adapters(True)
