"""A dlm masked diffusion language model for Hugging Face transformers, with its sampler.

Shipped inside every `dlm export --format hf` directory and loaded with `trust_remote_code=True`,
so it imports only torch and transformers: it repeats `dlm/model/transformer.py` and `dlm/sampling/generation.py` on
purpose, so that an exported directory runs without dlm installed (tests check that the two agree).
The network is dlm's `DiffusionTransformer`, operation
for operation, so logits match dlm's bit for bit in float32:

    input_ids [B, L] -> embed_tokens -> num_hidden_layers x DlmBlock -> RMSNorm -> tied head

Each block is `x + attention(norm(x))` then `x + swiglu(norm(x))`, with one fused QKV matmul, a
fused gate / up matmul, and rotary positions whose angles are formed in float64 and applied in
float32. The model attends in both directions and gets no time input; a block diffusion model
(`config.block_size`) attends block-causally: a query sees every key of its own and earlier blocks.

`generate` (also `diffusion_generate`) runs dlm's reverse process: masks are revealed over `steps`
steps, by low-confidence remasking (`confidence`, `margin`), ancestrally (`random`) or in the
dilated order (`dilated`: each step's positions spread far apart), optionally block by block
(`block_length`; a block model always runs its own blocks left to right, each seeing the prefix up
to its end); `reveal_split="even"` gives remasking steps LLaDA's split of the
reveals instead of the noise schedule's. It draws its random numbers in the same order as `dlm.sample`, so the
same seed and settings give the same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput

from .configuration_dlm import SCHEDULES, DlmDiffusionConfig

REMASKING = ("confidence", "margin", "random", "dilated")
REVEAL_SPLITS = ("schedule", "even")


class DlmRMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain and no bias."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if hasattr(F, "rms_norm"):  # the fused kernel dlm also uses, so results agree exactly
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and sin [seq_len, 1, head_dim] in float32 over a whole head: cos twice, sin negated then
    as it is (`apply_rotary`). The angles are float64, whose precision long contexts need (position
    x frequency reaches ~1e5 radians)."""

    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv_freq)
    cos, sin = angles.cos().float(), angles.sin().float()
    return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x_i, x_{i + D/2}) of x [B, L, H, D], in float32 whatever x's dtype: x cos +
    swap(x) sin over the whole head, which is x1 cos - x2 sin, x2 cos + x1 sin bit for bit."""

    wide = x.float()
    x1, x2 = wide.split(x.shape[-1] // 2, dim=-1)
    return (wide * cos).add_(torch.cat((x2, x1), dim=-1).mul_(sin)).type_as(x)


def subs_logits(logits: Tensor, inputs: Tensor, mask_token_id: int) -> Tensor:
    """MDLM's SUBS parameterisation of logits [..., V] at positions holding `inputs` [...], in place:
    the mask token never predicted, an unmasked position predicting its own token (dlm's own)."""

    unmasked = (inputs != mask_token_id)[..., None]
    logits.masked_fill_(unmasked, float("-inf"))
    kept = torch.zeros_like(unmasked, dtype=logits.dtype).masked_fill_(~unmasked, float("-inf"))
    return logits.scatter_(-1, inputs[..., None], kept)


def model_block_size(config: DlmDiffusionConfig) -> int:
    """The block size of a block diffusion model; 0 when one block covers every position."""

    block_size = getattr(config, "block_size", 0) or 0
    return block_size if block_size < config.max_position_embeddings else 0


def block_causal_mask(length: int, block_size: int, device: torch.device) -> Tensor | None:
    """[length, length] bool: a query sees the keys of its own and earlier blocks (None: one block)."""

    if block_size == 0 or (length - 1) // block_size == 0:
        return None
    block = torch.arange(length, device=device) // block_size
    return block[None, :] <= block[:, None]


def row_documents(input_ids: Tensor, separator: int | None) -> Tensor | None:
    """Each position's document [B, L] in rows of documents each closed by `separator` (None: no
    document-aware attention). Computed from the input, a masked separator does not split its row:
    to score packed text as dlm does, pass the documents of the clean row as `document_ids`."""

    if separator is None:
        return None
    ends = (input_ids == separator).long()
    return ends.cumsum(dim=1) - ends


class DlmAttention(nn.Module):
    """Multi-head self-attention with one fused QKV projection; `key_mask` holds any block-causal pattern."""

    def __init__(self, config: DlmDiffusionConfig):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, key_mask: Tensor | None) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv_proj(x).view(batch, length, 3, self.n_heads, self.head_dim).unbind(dim=2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if key_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=False)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return self.o_proj(y.transpose(1, 2).reshape(batch, length, width))


class DlmMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, config: DlmDiffusionConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DlmBlock(nn.Module):
    """Pre-norm residual block."""

    def __init__(self, config: DlmDiffusionConfig):
        super().__init__()
        self.input_layernorm = DlmRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DlmAttention(config)
        self.post_attention_layernorm = DlmRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DlmMLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, key_mask: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, key_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DlmDiffusionPreTrainedModel(PreTrainedModel):
    config_class = DlmDiffusionConfig
    base_model_prefix = "model"
    _no_split_modules: ClassVar[list[str]] = ["DlmBlock"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        # dlm's initialisation, for weights a checkpoint lacks (a model built from its config).
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, std)
        elif isinstance(module, DlmRMSNorm):
            module.weight.data.fill_(1.0)


class DlmDiffusionModel(DlmDiffusionPreTrainedModel):
    """The transformer body: final hidden states [B, L, hidden_size]."""

    def __init__(self, config: DlmDiffusionConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DlmBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = DlmRMSNorm(config.hidden_size, config.rms_norm_eps)
        # Rotary tables per device, kept out of the state dict and out of dtype casts: they are
        # derived from the config and must stay float32 in a bf16 model.
        self._rotary: dict[torch.device, tuple[Tensor, Tensor]] = {}
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def _tables(self, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
        if device not in self._rotary:
            config = self.config
            # MPS has no float64: form the angles on the CPU and move them.
            home = torch.device("cpu") if device.type == "mps" else device
            # Normal tensors even when first built under inference mode (generate), so that a later
            # forward pass with autograd (fine-tuning) can use them.
            head_dim = config.hidden_size // config.num_attention_heads
            with torch.inference_mode(False), torch.no_grad():
                cos, sin = rotary_tables(config.max_position_embeddings, head_dim, config.rope_theta, home)
                self._rotary[device] = (cos.to(device), sin.to(device))
        cos, sin = self._rotary[device]
        return cos[:length], sin[:length]

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        normed: bool = True,
    ) -> Tensor:
        """The hidden states [B, L, hidden_size] after the final norm (before it, `normed=False`)."""

        length = input_ids.shape[1]
        if length > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {length} exceeds {self.config.max_position_embeddings} positions")
        cos, sin = self._tables(length, input_ids.device)
        key_mask = block_causal_mask(length, model_block_size(self.config), input_ids.device)
        if attention_mask is not None and not bool(attention_mask.all()):
            padding = attention_mask.bool()[:, None, None, :]  # padding keys are ignored by every query
            key_mask = padding if key_mask is None else padding & key_mask
        if document_ids is None:
            document_ids = row_documents(input_ids, getattr(self.config, "document_separator_id", None))
        if document_ids is not None:  # a query sees keys of its own document only
            same = (document_ids[:, :, None] == document_ids[:, None, :])[:, None]
            key_mask = same if key_mask is None else same & key_mask
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, key_mask)
        return self.norm(x) if normed else x


class DlmDiffusionForMaskedLM(DlmDiffusionPreTrainedModel):
    """Logits over the vocabulary at every position (the head is the embedding), and a sampler."""

    def __init__(self, config: DlmDiffusionConfig):
        super().__init__(config)
        self.model = DlmDiffusionModel(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def logits_at(
        self,
        input_ids: Tensor,
        positions: Tensor | None = None,
        attention_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Logits [B, L, vocab_size], or [N, vocab_size] at the true entries of bool `positions`.

        A model trained with SUBS (`config.mask_logit`) gives the mask token logit -inf and an
        unmasked position logit 0 for its own token, -inf for every other (probability 1)."""

        x = self.model(input_ids, attention_mask, document_ids, normed=False)
        inputs = input_ids
        if positions is not None:  # gathered before the final norm and the head, as dlm does
            x, inputs = x[positions], input_ids[positions]
        x = self.model.norm(x)
        # The padded rows take part in the matmul (dlm's shapes) and are dropped from the logits.
        logits = F.linear(x, self.model.embed_tokens.weight)[..., : self.config.vocab_size]
        if getattr(self.config, "mask_logit", "plain") == "subs":  # absent from exports made before SUBS
            return subs_logits(logits, inputs, self.config.mask_token_id)
        return logits

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        return_dict: bool | None = None,
        document_ids: Tensor | None = None,
        **kwargs: object,
    ) -> MaskedLMOutput | tuple[Tensor, ...]:
        """Logits [B, L, vocab_size]; with `labels` (-100 where ignored) also their mean cross-entropy
        (a SUBS model predicts an unmasked position's own token: label it so, or -100). A model with
        document-aware attention takes each position's document as `document_ids` [B, L] (default:
        from the separators in `input_ids`)."""

        logits = self.logits_at(input_ids, None, attention_mask, document_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        if return_dict is False:
            return (logits,) if loss is None else (loss, logits)
        return MaskedLMOutput(loss=loss, logits=logits)

    @torch.inference_mode()
    def diffusion_generate(
        self,
        input_ids: Tensor | None = None,
        *,
        max_new_tokens: int = 64,
        steps: int | None = None,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = 0.9,  # the defaults of dlm.sample
        remasking: str | None = None,
        block_length: int | None = None,
        num_samples: int = 1,
        seed: int = 0,
        generator: torch.Generator | None = None,
        forbidden_token_ids: Sequence[int] | None = None,
        reveal_split: str = "schedule",
    ) -> Tensor:
        """Token ids [B * num_samples, L]: `input_ids` followed by `max_new_tokens` generated tokens.

        Mask tokens (`config.mask_token_id`) already in `input_ids` are filled too (infilling); they
        must sit in the same columns in every row. `forbidden_token_ids` (default: padding) are never
        generated. The default generator is seeded with `seed` on the model's device. `steps` defaults
        to the steps a distilled student was distilled for (`dlm distill`; its config's
        `dlm.distillation.steps`), else 64, and `remasking` to its reveal order, else `random`, as in dlm.
        """

        record = (getattr(self.config, "dlm", None) or {}).get("distillation") or {}
        if steps is None:
            steps = int(record.get("steps") or 64)
        if remasking is None:
            remasking = str(record.get("remasking") or "random")
        options = _Options(steps, temperature, top_k, top_p, remasking, block_length, reveal_split)
        device = self.model.embed_tokens.weight.device
        tokens = _starting_tokens(input_ids, max_new_tokens, num_samples, self.config.mask_token_id, device)
        if tokens.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"{tokens.shape[1]} tokens exceed the model's {self.config.max_position_embeddings}")
        if generator is None:
            generator = torch.Generator(device="cpu" if device.type == "mps" else device).manual_seed(seed)
        if forbidden_token_ids is None:
            pad = self.config.pad_token_id
            forbidden_token_ids = [pad] if pad is not None and pad < self.config.vocab_size else []
        was_training = self.training
        self.eval()
        try:
            return _Reverse(self, options, generator, forbidden_token_ids).run(tokens)
        finally:
            self.train(was_training)

    def generate(self, input_ids: Tensor | None = None, **kwargs: object) -> Tensor:
        """The masked-diffusion sampler (`diffusion_generate`); autoregressive decoding does not apply."""

        return self.diffusion_generate(input_ids, **kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# The reverse process: a transcription of dlm.sampling, random draws in the same order.


class _Options:
    def __init__(
        self,
        steps: int,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        remasking: str,
        block_length: int | None,
        reveal_split: str = "schedule",
    ) -> None:
        if steps < 1:
            raise ValueError(f"steps must be at least 1 (got {steps})")
        if not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (got {temperature})")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be at least 1 (got {top_k})")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {top_p})")
        if remasking not in REMASKING:
            raise ValueError(f"remasking must be one of {', '.join(REMASKING)} (got {remasking!r})")
        if block_length is not None and block_length < 1:
            raise ValueError(f"block_length must be at least 1 (got {block_length})")
        if reveal_split not in REVEAL_SPLITS or (reveal_split != "schedule" and remasking == "random"):
            raise ValueError(
                f"reveal_split must be one of {', '.join(REVEAL_SPLITS)}, and schedule for random "
                f"remasking (got {reveal_split!r})"
            )
        self.reveal_split = reveal_split
        self.steps, self.temperature, self.top_k, self.top_p = steps, temperature, top_k, top_p
        self.remasking, self.block_length = remasking, block_length


def dilated_order(size: int) -> Tensor:
    """Ranks 0 .. size - 1 by their bit-reversed binary digits: each run of them spread out evenly."""

    bits = max(1, (size - 1).bit_length())
    ranks = torch.arange(size)
    reversed_bits = torch.zeros_like(ranks)
    for bit in range(bits):
        reversed_bits |= ((ranks >> bit) & 1) << (bits - 1 - bit)
    return ranks[reversed_bits.argsort()]


def _starting_tokens(
    input_ids: Tensor | None, new: int, num_samples: int, mask_id: int, device: torch.device
) -> Tensor:
    if input_ids is None:
        input_ids = torch.empty((1, 0), dtype=torch.long)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if new < 0 or num_samples < 1:
        raise ValueError(f"max_new_tokens must be >= 0 and num_samples >= 1 (got {new}, {num_samples})")
    rows = input_ids.to(device=device, dtype=torch.long).repeat_interleave(num_samples, dim=0)
    masks = torch.full((rows.shape[0], new), mask_id, dtype=torch.long, device=device)
    return torch.cat((rows, masks), dim=1)


def filter_logits(logits: Tensor, top_k: int | None, top_p: float | None) -> Tensor:
    """-inf for all but the top-k logits and all but the top-p nucleus: the tokens whose strictly more
    likely tokens hold less than top_p (ties at either cut kept)."""

    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        values = logits.sort(dim=-1, descending=True).values
        probs = values.softmax(dim=-1)
        kept = (probs.cumsum(dim=-1) - probs < top_p).sum(dim=-1, keepdim=True).clamp_min(1)
        logits = logits.masked_fill(logits < values.gather(-1, kept - 1), float("-inf"))
    return logits


def draws_per_row(top_p: float | None) -> int:
    """Uniforms per row: one per rejection trial (all fail with chance <= 1/1000), one for the fallback."""

    if top_p is None or top_p >= 1:
        return 1
    return max(1, min(16, math.ceil(math.log(1e-3) / math.log1p(-top_p)))) + 1


def _below(values: Tensor, totals: Tensor) -> Tensor:
    """`values` capped at the largest float below `totals`: the first cumulative sum past it has weight."""

    return torch.minimum(values, torch.nextafter(totals, torch.zeros_like(totals)))


def inverse_cdf(weights: Tensor, uniform: Tensor) -> Tensor:
    """The token of each row of `weights` [N, V] whose cumulative weight passes u x total: the block of
    64 by its (float32-summed) mass, then the entry by a float64 cumulative sum inside it."""

    rows, vocab = weights.shape
    blocks = F.pad(weights, (0, -vocab % 64)).view(rows, -1, 64)
    mass = blocks.sum(dim=-1).double()
    ends = mass.cumsum(dim=-1)
    target = _below(uniform.to(ends)[:, None] * ends[:, -1:], ends[:, -1:])
    block = torch.searchsorted(ends, target, right=True).clamp_(max=ends.shape[-1] - 1)
    start = torch.where(block > 0, ends.gather(-1, (block - 1).clamp_min(0)), 0)
    within = (target - start) / mass.gather(-1, block)
    entries = blocks.gather(1, block[:, :, None].expand(-1, -1, 64)).squeeze(1).double()
    cumulative = entries.cumsum(dim=-1)
    inside = _below(within.clamp(0, 1) * cumulative[:, -1:], cumulative[:, -1:])
    entry = torch.searchsorted(cumulative, inside, right=True).clamp_(max=63)
    return (block * 64 + entry).squeeze(-1).clamp_(max=vocab - 1)  # NaN rows: still a token


def _weights(scores: Tensor) -> Tensor:
    """exp(scores - each row's maximum), in a fresh buffer, as dlm's draw makes them."""

    return torch.sub(scores, scores.amax(dim=-1, keepdim=True)).exp_()


def _mass_ahead(weights: Tensor, picks: Tensor) -> Tensor:
    """The weight of the tokens strictly heavier than each row's pick, summed as dlm's draw sums it."""

    heavier = torch.gt(weights, weights.gather(-1, picks[:, None]), out=torch.empty_like(weights))
    return heavier.mul_(weights).sum(dim=-1)


def _nucleus(weights: Tensor, top_p: float) -> Tensor:
    """0 outside the top-p nucleus by weight: the tokens whose strictly heavier tokens hold less than
    top_p of the row's mass (ties at the cut kept), with a float64 running sum."""

    values = weights.sort(dim=-1, descending=True).values
    running = values.double().cumsum(dim=-1)
    kept = (running - values.double() < top_p * running[:, -1:]).sum(dim=-1, keepdim=True).clamp_min(1)
    return weights.masked_fill(weights < values.gather(-1, kept - 1), 0)


def sample_tokens(
    logits: Tensor, options: _Options, generator: torch.Generator, probabilities: bool = False
) -> tuple[Tensor, Tensor | None]:
    """One token per row, as `dlm.sampling.tokens.sample_with_probabilities`: float64 uniforms, an
    inverse of the distribution function, the top-p nucleus by rejection (a sorted fallback after
    the trials); and the model's own distribution (untempered, unfiltered), which remasking ranks by."""

    scores = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if options.temperature == 0:
        return scores.argmax(dim=-1), scores.softmax(dim=-1) if probabilities else None
    drawn = scores / options.temperature if options.temperature != 1 else scores
    drawn = filter_logits(drawn, options.top_k, None)
    top_p, width = options.top_p, draws_per_row(options.top_p)
    uniform = torch.rand((scores.shape[0], width), dtype=torch.float64, device=scores.device, generator=generator)
    weights = _weights(drawn)
    blocks = F.pad(weights, (0, -weights.shape[1] % 64)).view(weights.shape[0], -1, 64)
    total = blocks.sum(dim=-1).double().cumsum(dim=-1)[:, -1]  # the total as inverse_cdf sums it
    picks = inverse_cdf(weights, uniform[:, 0])
    if width > 1:
        assert top_p is not None
        # A pick holding more than 1 - top_p of the mass is in the nucleus without a test.
        pending = (weights.gather(-1, picks[:, None]).squeeze(-1) <= (1 - top_p) * total).nonzero().squeeze(-1)
        for trial in range(width - 1):
            if trial:
                picks[pending] = inverse_cdf(weights[pending], uniform[pending, trial])
            pending = pending[~(_mass_ahead(weights[pending], picks[pending]) < top_p * total[pending])]
            if pending.numel() == 0:
                break
        if pending.numel():
            picks[pending] = inverse_cdf(_nucleus(weights[pending], top_p), uniform[pending, -1])
    if not probabilities:
        return picks, None
    plain = options.temperature == 1 and (options.top_k is None or options.top_k >= scores.size(-1))
    return picks, weights / total[:, None].to(weights.dtype) if plain else scores.softmax(dim=-1)


def _mask_probability(schedule: str, t: float) -> float:
    return t if schedule == "linear" else 2 * math.sin(t * (math.pi / 4)) ** 2


def masked_count(schedule: str, n: int, t: Fraction) -> int:
    """floor(n m(t)): positions of n still masked at time t (exact on the linear schedule's grid)."""

    if schedule == "linear":
        return math.floor(n * t)
    if t >= 1:
        return n
    if t <= 0:
        return 0
    return min(n, math.floor(n * _mask_probability(schedule, float(t)) + 1e-9))


def reveal_odds(schedule: str, s: Fraction, t: Fraction) -> float:
    """1 / p for the probability p that a position masked at t is revealed by s."""

    if schedule == "linear":
        probability: float | Fraction = (t - s) / t
    elif s <= 0:
        probability = 1.0
    else:
        masked_then = _mask_probability(schedule, float(t))
        probability = (masked_then - _mask_probability(schedule, float(s))) / masked_then
    return float(1 / probability) if probability > 0 else math.inf


class _Reverse:
    """One run of the reverse process over a batch whose rows share their masked columns."""

    def __init__(
        self, model: DlmDiffusionForMaskedLM, options: _Options, generator: torch.Generator, forbidden: Sequence[int]
    ) -> None:
        self.model, self.options, self.generator = model, options, generator
        self.mask_id = model.config.mask_token_id
        self.schedule = model.config.schedule
        if self.schedule not in SCHEDULES:
            raise ValueError(f"no sampler for the {self.schedule!r} noise schedule (have {', '.join(SCHEDULES)})")
        never = [self.mask_id, *(token for token in forbidden if token != self.mask_id)]
        self.forbidden = torch.tensor(never, device=generator.device)
        self.end: int | None = None  # a block model sees the positions before the end of the current block

    def predict(self, tokens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor | None]:
        end = self.end
        logits = self.model.logits_at(tokens[:, :end], positions[:, :end])
        logits = logits.to(self.generator.device, torch.promote_types(logits.dtype, torch.float32))
        logits[:, self.forbidden] = float("-inf")
        ranked = self.options.remasking not in ("random", "dilated")
        new, probs = sample_tokens(logits, self.options, self.generator, ranked)  # probs untempered, unfiltered
        confidence = None
        if probs is not None:
            if self.options.remasking == "margin":
                top2 = probs.topk(2, dim=-1).values
                confidence = top2[:, 0] - top2[:, 1]
            else:
                confidence = probs.gather(-1, new[:, None]).squeeze(-1)
        return new.to(tokens.device), confidence

    def reveal_random(self, tokens: Tensor, block: Tensor, odds: float) -> None:
        masked = tokens[:, block] == self.mask_id
        draws = torch.rand(masked.shape, dtype=torch.float64, device=self.generator.device, generator=self.generator)
        self.reveal(tokens, block, masked & (draws * odds < 1).to(tokens.device))

    def reveal_planned(self, tokens: Tensor, block: Tensor, chosen: Tensor) -> None:
        reveal = torch.zeros(tokens.shape[0], block.numel(), dtype=torch.bool, device=tokens.device)
        reveal[:, chosen.to(tokens.device)] = True
        self.reveal(tokens, block, reveal & (tokens[:, block] == self.mask_id))

    def reveal(self, tokens: Tensor, block: Tensor, reveal: Tensor) -> None:
        rows = reveal.any(dim=1)
        if not bool(rows.any()):
            return  # nothing revealed: the model is not called
        positions = torch.zeros_like(tokens, dtype=torch.bool)
        positions[:, block] = reveal
        sub_tokens, sub_positions = tokens[rows], positions[rows]
        new, _ = self.predict(sub_tokens, sub_positions)
        sub_tokens[sub_positions] = new
        tokens[rows] = sub_tokens

    def reveal_confident(self, tokens: Tensor, block: Tensor, count: int) -> None:
        if count == 0:
            return
        candidates = torch.zeros_like(tokens, dtype=torch.bool)
        candidates[:, block] = tokens[:, block] == self.mask_id
        new, confidence = self.predict(tokens, candidates)
        assert confidence is not None
        scores = torch.full(tokens.shape, float("-inf"), dtype=confidence.dtype, device=confidence.device)
        scores[candidates.to(scores.device)] = confidence
        chosen = scores.topk(count, dim=1).indices.to(tokens.device)
        proposal = tokens.clone()
        proposal[candidates] = new
        tokens.scatter_(1, chosen, proposal.gather(1, chosen))

    def run(self, tokens: Tensor) -> Tensor:
        fill = tokens == self.mask_id
        if not bool((fill == fill[:1]).all()):
            raise ValueError("mask tokens must sit in the same columns of every row")
        positions = fill[0].nonzero().squeeze(-1)
        if positions.numel() == 0:
            return tokens
        options, block_size = self.options, model_block_size(self.model.config)
        if block_size:  # the model's own blocks, aligned to position 0 as in training
            if options.block_length not in (None, block_size):
                raise ValueError(
                    f"block_length {options.block_length} differs from the model's block_size {block_size}: omit it"
                )
            index_of = positions // block_size
            blocks = [positions[index_of == b] for b in index_of.unique().tolist()]
        else:
            blocks = list(positions.split(options.block_length)) if options.block_length else [positions]
        if len(blocks) > options.steps:
            raise ValueError(f"steps ({options.steps}) are fewer than the {len(blocks)} blocks to generate")
        per_block = [options.steps // len(blocks) + (i < options.steps % len(blocks)) for i in range(len(blocks))]
        for block, block_steps in zip(blocks, per_block, strict=True):
            if block_size:
                self.end = min((int(block[0]) // block_size + 1) * block_size, tokens.shape[1])
            done, size = 0, block.numel()
            for index in range(block_steps):
                t, s = Fraction(block_steps - index, block_steps), Fraction(block_steps - index - 1, block_steps)
                if options.remasking == "random":
                    self.reveal_random(tokens, block, reveal_odds(self.schedule, s, t))
                    continue
                count = masked_count(self.schedule, size, t) - masked_count(self.schedule, size, s)
                if options.reveal_split == "even":  # LLaDA's get_num_transfer_tokens
                    count = size // block_steps + (index < size % block_steps)
                if options.remasking == "dilated":
                    self.reveal_planned(tokens, block, dilated_order(size)[done : done + count])
                else:
                    self.reveal_confident(tokens, block, count)
                done += count
        return tokens
