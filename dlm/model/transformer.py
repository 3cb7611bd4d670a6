"""The denoiser: a bidirectional pre-norm transformer with rotary positions and a tied head.

A masked diffusion model sees a sequence in which some tokens are replaced by the mask token and
predicts the original token at every masked position. Unlike a GPT it attends in both directions
and, as in MDLM and LLaDA, it gets no time input: the fraction of masks in the input tells it the
noise level. Everything here is a pure `nn.Module`; optimizers, devices, precision and parallelism
belong to the caller.

    tokens [B, L] -> embedding -> n_layers x Block -> RMSNorm -> (gather) -> tied head -> logits

With `mask_logit = "subs"` the logits are MDLM's SUBS parameterisation (`subs_logits`): the mask
token is never predicted and an unmasked position predicts itself. It is not the default: at equal
steps on the CPU recipe it scored 0.012 bits/byte worse, and it learned a copy task in fewer seeds
(0.11 lab notes, "SUBS parameterisation (`[model] mask_logit`)": git show cece22c:docs/benchmarks.md).

Each Block is `x + attention(norm(x))` then `x + swiglu(norm(x))`. Rotary embeddings are not
optional: on Shakespeare a bidirectional model with learned absolute positions stalled at the
unigram level, while the same network with rotary positions trained well.

Checkpoints imported from other families (`dlm.artifacts.hf`) bring variant properties, each a
`ModelConfig` field whose default keeps the network above: grouped-query attention, q/k/v biases,
per-head q/k norms, a head width of its own, an untied head, scaled rotary frequencies, causal
attention, and logits shifted by one position (Dream). With the defaults the parameters, their
names and every operation are those of the network above.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dlm.config.schema import ModelConfig
from dlm.model.attention import (
    AttentionAnneal,
    AttentionMask,
    KVCache,
    attend,
    bd3_mask,
    block_causal_mask,
    causal_mask,
    padded_bd3_mask,
    padded_mask,
    same_document,
    same_document_flex,
    training_kernel,
)
from dlm.model.denoiser import autoregressive_inputs
from dlm.model.kv_pool import PoolPass
from dlm.model.rotary import apply_rotary, cpu_rotary_tables, head_tables, rotary_at, rotary_tables


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain and no bias (cheaper than LayerNorm, as good)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if hasattr(F, "rms_norm"):  # fused kernel, torch >= 2.4
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class Attention(nn.Module):
    """Multi-head self-attention; one fused QKV matmul, `dlm.model.attention` applies the mask and kernel.

    With grouped-query attention (`n_kv_heads` < `n_heads`) each key / value head serves
    n_heads / n_kv_heads query heads; the fused projection then holds H query heads followed by
    KV key and KV value heads. `qk_norm` normalises each query and key head before the rotation.
    """

    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.layer = layer  # its slot in a KV cache
        self.n_heads, self.kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_dim
        widths = (self.n_heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        self.widths = widths
        self.qkv = nn.Linear(config.d_model, sum(widths), bias=config.qkv_bias)
        self.q_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.out = nn.Linear(widths[0], config.d_model, bias=False)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: AttentionMask | None = None,
        cache: KVCache | PoolPass | None = None,
        queries: slice | None = None,
    ) -> Tensor:
        """Attention output [B, L, W]; with `queries`, only for those positions (keys and values of all)."""

        batch, length, width = x.shape
        if self.kv_heads == self.n_heads:
            q, k, v = self.qkv(x).view(batch, length, 3, self.n_heads, self.head_dim).unbind(dim=2)  # [B, L, H, D]
        else:
            q, k, v = (part.unflatten(-1, (-1, self.head_dim)) for part in self.qkv(x).split(self.widths, dim=-1))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        k = apply_rotary(k, cos, sin)
        if queries is None:
            q = apply_rotary(q, cos, sin)
        else:
            q = apply_rotary(q[:, queries], cos[..., queries, :, :], sin[..., queries, :, :])
            # A boolean mask over every position is cut to the queries; a flex mask comes built to size.
            if mask is not None and isinstance(mask.mask, Tensor) and mask.mask.shape[-2] == length:
                mask = AttentionMask(mask.kernel, mask.mask[..., queries, :])
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, L, D] views
        groups = self.n_heads // self.kv_heads  # query heads to each key / value head
        if isinstance(cache, PoolPass):  # rows over slots of a KV pool: it writes and reads them in place
            assert mask is not None
            y = cache.attend(self.layer, q, k, v, mask, groups)
        else:
            if cache is not None:
                k, v = cache.extend(self.layer, k, v)
            if q.shape[2] == 0:  # keys and values only (a cache commit)
                return x.new_zeros(batch, 0, width)
            y = attend(q, k, v, mask, groups)
        return self.out(y.transpose(1, 2).reshape(batch, q.shape[2], self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    """Gated MLP: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(config.d_model, 2 * config.ffn_size, bias=False)
        self.down = nn.Linear(config.ffn_size, config.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm residual block: the residual stream itself is never normalised."""

    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attention = Attention(config, layer)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: AttentionMask | None = None,
        cache: KVCache | PoolPass | None = None,
        queries: slice | None = None,
    ) -> Tensor:
        attended = self.attention(self.attention_norm(x), cos, sin, mask, cache, queries)
        x = (x if queries is None else x[:, queries]) + attended
        return x + self.mlp(self.mlp_norm(x))


class DiffusionTransformer(nn.Module):
    """Predicts the clean token at every (or every selected) position of a partly masked sequence."""

    rope_cos: Tensor  # buffers, registered in __init__
    rope_sin: Tensor

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # Rows beyond vocab_size only round the matrix up to a fast matmul shape; they are zero,
        # never indexed (token ids < vocab_size) and sliced off the logits, so they stay zero.
        self.token_embedding = nn.Embedding(config.padded_vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        # An untied head (`tie_embeddings = false`, as most imported checkpoints have) has its own rows.
        self.head = None if config.tie_embeddings else nn.Linear(config.d_model, config.padded_vocab_size, bias=False)
        # Set by training for the causal -> bidirectional anneal (`training.attention_anneal_steps`).
        self.attention_anneal: AttentionAnneal | None = None
        # Non-persistent: derived from the config, so checkpoints hold weights only.
        cos, sin = rotary_tables(config.max_seq_len, config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: Mapping[str, Tensor]) -> DiffusionTransformer:
        """A model whose parameters are `weights` themselves, where and in the dtype each already is:
        built on the meta device and assigned, so nothing is drawn at random and nothing is copied.
        The rotary tables, derived from the config, are computed on the CPU in float64 (which MPS
        lacks) and moved to the weights' device."""

        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(dict(weights), strict=True, assign=True)
        device = next(iter(weights.values())).device
        cos, sin = cpu_rotary_tables(config)
        model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
        return model

    @classmethod
    def empty(cls, config: ModelConfig) -> DiffusionTransformer:
        """A model on the CPU whose weights are allocated but not drawn (they hold whatever the memory
        held), for one whose weights are loaded next, as a distillation's teacher is: nothing random is
        drawn or paid for. The rotary tables, which are no weights, are computed."""

        with torch.device("meta"):
            model = cls(config)
        model.to_empty(device="cpu")
        model.rope_cos, model.rope_sin = cpu_rotary_tables(config)
        return model

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every weight and rebuild the rotary tables (also after `to_empty()`)."""

        std = self.config.init_std
        # Each block adds two outputs to the residual stream; scaling their projections keeps
        # the stream's variance independent of depth at initialisation (GPT-2).
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.zero_()
        for block in cast(Iterable[Block], self.blocks):
            block.attention.out.weight.normal_(0.0, residual_std)
            block.mlp.down.weight.normal_(0.0, residual_std)
        self.token_embedding.weight[self.config.vocab_size :].zero_()
        if self.head is not None:
            self.head.weight[self.config.vocab_size :].zero_()
        cos, sin = rotary_tables(
            self.config.max_seq_len, self.config.head_dim, self.config.rope_theta, self.config.rope_scaling
        )
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(
        self,
        tokens: Tensor,
        output_positions: Tensor | None = None,
        *,
        clean_tokens: Tensor | None = None,
        cache: KVCache | PoolPass | None = None,
        pad: Tensor | None = None,
        documents: Tensor | None = None,
        pad_after: Tensor | None = None,
    ) -> Tensor:
        """Logits [B, L, vocab_size], or [N, vocab_size] at the N true entries of `output_positions`.

        A block model (`config.block_size`) scores noisy `tokens` given `clean_tokens` in one pass
        over both (the BD3 pattern of `dlm.model.attention`); without them it attends block-causally. An
        autoregressive model (`config.is_autoregressive`) scores `clean_tokens` in one causal pass over
        them shifted by one; without them `tokens` are what it reads, already shifted. With
        a `cache`, `tokens` continue the cached positions. A whole-sequence model ignores
        `clean_tokens`. `pad` [B] left-pads a batch: row b's first `pad[b]` positions are padding,
        which no other position sees, and its positions count from the first one after them;
        `pad_after` [B] right-pads `tokens` (with `pad`, over a cache holding no keys after them): row
        b's last `pad_after[b]` fed positions are padding no other position sees (rows of different
        widths in one pass, `dlm.serving.passes`). `documents` [B, L] (`dlm.model.attention.document_ids`
        of the clean row) limits every position to the keys of its own document
        (`model.document_separator_id`); sampling feeds one document.
        """

        if isinstance(cache, PoolPass):
            return self._pool_pass(tokens, output_positions, cache)
        start = cache.length if cache is not None else 0
        length = tokens.shape[1]
        inputs = tokens  # the noisy tokens, before a block model appends its clean copy
        seen = (cache.stored if cache is not None else 0) + length
        if seen > self.config.max_seq_len:
            raise ValueError(f"sequence length {seen} exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = self._rotary(start, length, pad)
        mask = last_mask = None
        pad_in_mask = False  # whether `mask` already hides the padding (the block model's padded 2L pass)
        queries = None  # the positions the last layer computes outputs for (all when None)
        if self.config.is_autoregressive and clean_tokens is not None:
            # One causal pass over the clean row shifted by one: position i reads token i - 1 and
            # predicts token i, so every position is scored (the noisy row is all masks: ignored).
            tokens = inputs = autoregressive_inputs(clean_tokens, self.config.mask_token_id, pad)
            mask = causal_mask(length, tokens.device)  # narrowed to the real keys below when padded
        elif self.config.is_block_model:
            if clean_tokens is not None:  # rotary positions of the clean copy repeat the noisy copy's
                tokens, cos, sin = (
                    torch.cat((tokens, clean_tokens), 1),
                    torch.cat((cos, cos), -2),
                    torch.cat((sin, sin), -2),
                )
                # The clean copy's last-layer outputs are never read (its keys and values are): the
                # last layer's queries, attention output and MLP run over the noisy copy only.
                queries = slice(0, length)
                mask, last_mask = self._two_copy_masks(length, pad, tokens.device)
                pad_in_mask = pad is not None
            else:
                key_start = cache.dropped if cache is not None else 0
                mask = block_causal_mask(start, start + length, self.config.block_size, tokens.device, key_start)
        elif self.config.attention == "causal":  # block-causal with blocks of one position
            mask = block_causal_mask(start, start + length, 1, tokens.device)
        elif self.attention_anneal is not None and self.training:
            mask = self.attention_anneal.mask(length, tokens.device)
        if self.config.shift_logits and cache is not None:
            raise ValueError("a shifted-logits model predicts from the position before: feed whole sequences")
        if documents is not None:
            if cache is not None or pad is not None:
                raise ValueError("documents are for scoring whole packed rows, not with a cache or padding")
            mask, last_mask = self._document_masks(documents, mask, last_mask, length, tokens.shape[1])
        if pad_after is not None and (
            pad is None or clean_tokens is not None or (cache is not None and cache.stored != cache.length)
        ):
            raise ValueError("pad_after needs pad, no clean copy, and a cache holding no keys after the fed tokens")
        if pad is not None and not pad_in_mask:
            pad_keys = pad - (cache.dropped if cache is not None else 0)
            mask = padded_mask(mask, pad, start, length, seen, pad_keys, pad_after)
        if cache is not None and cache.committing and output_positions is not None and clean_tokens is None:
            # A pass that stores keys and values needs every position's, but outputs only at
            # `output_positions`: the last layer's attention output and MLP run only over the
            # columns holding them (none at all for a pure commit).
            columns = output_positions.any(dim=0).nonzero()
            queries = slice(int(columns[0]), int(columns[-1]) + 1) if len(columns) else slice(0, 0)
        cos, sin = head_tables(cos, sin)
        x = self._blocks(self.token_embedding(tokens), cos, sin, mask, cache, queries, last_mask)
        if queries is not None:
            output_positions = output_positions[:, queries] if output_positions is not None else None
            inputs = inputs[:, queries]
        if cache is not None and cache.committing:
            cache.length += length if cache.keep is None else cache.keep
        x = x[:, :length]  # the noisy copy only: the clean one is context
        if self.config.shift_logits:  # position i predicts from the output at i - 1 (the first from its own)
            x = torch.cat((x[:, :1], x[:, :-1]), dim=1)
        return self._logits(x, inputs, output_positions)

    def _logits(self, x: Tensor, inputs: Tensor, output_positions: Tensor | None) -> Tensor:
        """The last blocks' outputs `x` [B, L, W] as logits, at `output_positions` if given (`forward`)."""

        if output_positions is not None:
            if output_positions.dtype != torch.bool:
                raise TypeError(f"output_positions must be a boolean mask, got {output_positions.dtype}")
            # Gather before the norm and the head: the vocabulary matmul, the largest of a small
            # model, is then paid only at masked positions. The gather's size depends on the data,
            # so it sits after every block, outside the part torch.compile wants as one graph.
            x = x[output_positions]
            inputs = inputs[output_positions]
        x = self.norm(x)
        # The matmul runs against all padded rows (aligned shapes), then the padding is dropped.
        head = self.token_embedding.weight if self.head is None else self.head.weight
        logits = F.linear(x, head)[..., : self.config.vocab_size]
        if self.config.mask_logit == "subs":
            return subs_logits(logits, inputs, self.config.mask_token_id)
        return logits

    def _pool_pass(self, tokens: Tensor, output_positions: Tensor | None, cache: PoolPass) -> Tensor:
        """A block model's pass over rows of a `KVPool` (`dlm.model.kv_pool`): each row's positions and
        block-causal mask are its own, its keys written into and read from its slot."""

        if not self.config.is_block_model or self.config.shift_logits:
            raise ValueError("a KV pool serves block models, whose passes feed blocks over their cached prefix")
        if cache.keys > self.config.max_seq_len:
            raise ValueError(f"sequence length {cache.keys} exceeds max_seq_len {self.config.max_seq_len}")
        if cache.keys > cache.pool.positions:
            raise ValueError(f"position {cache.keys} is past the pool's {cache.pool.positions} (reserve them)")
        width, start = tokens.shape[1], max(cache.starts)
        # Each row's positions from its own start: as a padded batch's, counted back from the latest start.
        behind = None if start == min(cache.starts) else torch.tensor([start - s for s in cache.starts])
        cos, sin = head_tables(*self._rotary(start, width, behind))
        queries = None  # only the columns holding outputs need the last layer's attention and MLP
        if output_positions is not None:
            columns = output_positions.any(dim=0).nonzero()
            queries = slice(int(columns[0]), int(columns[-1]) + 1) if len(columns) else slice(0, 0)
        x = self._blocks(self.token_embedding(tokens), cos, sin, cache.mask(width, tokens.device), cache, queries, None)
        if queries is not None and output_positions is not None:
            output_positions, tokens = output_positions[:, queries], tokens[:, queries]
        return self._logits(x, tokens, output_positions)

    def _two_copy_masks(
        self, length: int, pad: Tensor | None, device: torch.device
    ) -> tuple[AttentionMask, AttentionMask]:
        """The 2L pass's masks: over all 2L queries, and over the noisy copy's only (the last layer's).
        A padded batch gets a mask per row, its blocks counted from the row's first real token."""

        block = self.config.block_size
        if pad is None:
            return bd3_mask(length, block, device), bd3_mask(length, block, device, noisy_queries_only=True)
        # A boolean mask per row for SDPA, on CUDA too (where the unpadded pass uses flex attention):
        # padded 2L passes score RL rollouts, whose rows are short.
        mask = padded_bd3_mask(length, block, pad)
        assert mask.mask is not None
        return mask, AttentionMask("sdpa-mask", mask.mask[:, :, :length])

    def _blocks(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: AttentionMask | None,
        cache: KVCache | PoolPass | None,
        queries: slice | None,
        last_mask: AttentionMask | None,
    ) -> Tensor:
        """Every block over `x`; the last one computes outputs at `queries` only, under `last_mask` if given."""

        recompute = self.config.activation_checkpointing and self.training and torch.is_grad_enabled()
        last = len(self.blocks) - 1
        for index, block in enumerate(self.blocks):
            if queries is not None and index == last:
                args: tuple[object, ...] = (x, cos, sin, mask if last_mask is None else last_mask, cache, queries)
            else:
                args = (x, cos, sin, mask, cache)
            x = checkpoint(block, *args, use_reentrant=False) if recompute else block(*args)
        return x

    def _document_masks(
        self, documents: Tensor, mask: AttentionMask | None, last_mask: AttentionMask | None, length: int, keys: int
    ) -> tuple[AttentionMask, AttentionMask | None]:
        """`mask` and `last_mask` limited to each position's document. Positions are not restarted per
        document: with rotary embeddings a score depends only on the distance between query and key,
        and a query now sees only keys of its own document, so the scores are those of the document
        fed alone (up to rounding), with no per-row position tables."""

        if keys != length:  # the 2L pass: the clean copy's keys belong to the documents of the noisy copy
            documents = documents.repeat(1, keys // length)
        block = self.config.block_size if keys != length else 0
        if self.config.is_autoregressive and keys == length:  # the one causal pass: within the document too
            if training_kernel(documents.device) == "flex":
                return same_document_flex(documents, keys, length, 0, causal=True), None
            return same_document(mask, documents, keys), None
        if training_kernel(documents.device) == "flex" and (mask is None or mask.kernel == "flex"):
            flex_last = None if last_mask is None else same_document_flex(documents, length, length, block)
            return same_document_flex(documents, keys, length, block), flex_last
        last = None if last_mask is None else same_document(last_mask, documents, length)
        return same_document(mask, documents, keys), last

    def _rotary(self, start: int, length: int, pad: Tensor | None) -> tuple[Tensor, Tensor]:
        """cos and sin of positions [start, start + length), per row when padded, past the table if need be."""

        end = start + length
        if pad is None and end <= self.rope_cos.shape[0]:
            return self.rope_cos[start:end].float(), self.rope_sin[start:end].float()
        positions = torch.arange(start, end, device=self.rope_cos.device)
        if pad is not None:
            positions = (positions[None, :] - pad.to(positions.device)[:, None]).clamp_min(0)
        if end <= self.rope_cos.shape[0]:
            return self.rope_cos[positions].float(), self.rope_sin[positions].float()
        # A sliding window past max_seq_len (block models): same values as a longer table.
        return rotary_at(positions, self.config.head_dim, self.config.rope_theta, self.config.rope_scaling)

    @property
    def num_parameters(self) -> int:
        """Number of distinct trainable values (the tied embedding / head counted once)."""

        return sum(p.numel() for p in self.parameters())  # parameters() already deduplicates

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6N for the matmuls (forward + backward) plus attention scores.

        A block model's training pass runs over 2 x seq_len tokens (noisy and clean copies), each
        query against 2 x seq_len keys: twice the matmuls and four times the attention of a
        whole-sequence model, per token of data (SDPA with a boolean mask computes every score; flex
        skips the masked-out tiles, so there this overstates the attention work). It also counts the
        clean copy's last-layer queries and MLP, which the pass skips: nearly 1 / (2 n_layers) of the
        layers' matmuls.
        """

        attention = 12 * self.config.n_layers * self.config.n_heads * self.config.head_dim * seq_len
        if self.config.is_autoregressive:  # one pass over seq_len tokens; the causal kernel skips half the scores
            return 6 * self.num_parameters + attention // 2
        if self.config.is_block_model:
            return 2 * 6 * self.num_parameters + 4 * attention
        return 6 * self.num_parameters + attention


def subs_logits(logits: Tensor, inputs: Tensor, mask_token_id: int) -> Tensor:
    """MDLM's SUBS parameterisation of logits [..., V] at positions holding `inputs` [...], in place.

    The mask token gets logit -inf: the clean data never holds it, so probability spent on it only
    loosens the ELBO (and the sampler would forbid it anyway). A position that is not masked keeps
    its token in the reverse process, so it predicts that token with probability 1 (logit 0, all
    others -inf); the ELBO never scores such positions, and training never computes them. Every
    step is in place, and autograd keeps only [..., 1] tensors for the backward pass.
    """

    unmasked = (inputs != mask_token_id)[..., None]
    logits.masked_fill_(unmasked, float("-inf"))
    # A masked row gets -inf at its input, the mask token; an unmasked row gets 0 at its own token.
    kept = torch.zeros_like(unmasked, dtype=logits.dtype).masked_fill_(~unmasked, float("-inf"))
    return logits.scatter_(-1, inputs[..., None], kept)
