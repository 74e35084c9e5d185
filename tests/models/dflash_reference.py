"""A plain torch DFlash / DFlash2 drafter for tests, written from the published algorithm.

One request, everything in fp32, straight from the checkpoint's tensors and config.json: the
context features fc([streams]) -> hidden_norm, every layer attending from the block over
[context keys | block keys] with one explicit mask (causal or not, sliding window), the grouped
dynamic convolutions as loops over rows and taps, and the selector's walk one position at a
time. Nothing here shares code with ninfer.models.dflash.
"""

from __future__ import annotations

import math

import torch


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [L, heads, D], neox halves over the whole head."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat((angles, angles), -1).cos()[:, None], torch.cat((angles, angles), -1).sin()[:, None]
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


def _layer_attention_mode(config: dict, layer: int) -> tuple[bool, int | None]:
    layer_type = (config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"])[layer]
    sliding = layer_type == "sliding_attention"
    causal = config.get("is_causal", config["dflash_config"].get("causal"))
    causal = sliding if causal is None else bool(causal)
    window = config["dflash_config"].get("swa_window_size", config.get("sliding_window")) if sliding else None
    return causal, window


def _conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, group: int) -> torch.Tensor:
    """x [Q, H]; delta [Q, taps, groups]; base [taps, H]: out_t = sum_j (base_j + delta_tj) * x_{t-j}."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(base.shape[0]):
            if t - j >= 0:
                out[t] += (base[j] + delta[t, j].repeat_interleave(group)) * x[t - j]
    return out


def block_hidden(
    tensors: dict[str, torch.Tensor], config: dict, streams: torch.Tensor, embeds: torch.Tensor
) -> torch.Tensor:
    """streams [S, n, H]: the target's streams of the S tokens before the block (positions 0..S-1);
    embeds [Q, H]: the block rows at positions S..S+Q-1 -> final-normed hidden [Q, H]."""
    w = {name: t.float() for name, t in tensors.items()}
    eps, theta = config["rms_norm_eps"], config["rope_parameters"]["rope_theta"]
    heads, kv_heads, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    num_context, num_rows = streams.shape[0], embeds.shape[0]
    context = _rms(streams.flatten(1).float() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    q_pos = torch.arange(num_context, num_context + num_rows)
    k_pos = torch.arange(num_context + num_rows)
    x = embeds.float()
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        causal, window = _layer_attention_mode(config, i)
        convs = {}
        for name in ("attention_conv", "mlp_conv"):
            if p + name + ".base_kernel" in w:
                convs[name] = (w[p + name + ".base_kernel"], w[p + name + ".kernel_projection.weight"])

        def around(name: str, h: torch.Tensor, sublayer) -> torch.Tensor:
            if name not in convs:
                return sublayer(h)
            base, projection = convs[name]
            deltas = (h @ projection.T).view(num_rows, 2, base.shape[1], -1)
            group = h.shape[1] // deltas.shape[-1]
            return _conv(sublayer(_conv(h, deltas[:, 0], base[0], group)), deltas[:, 1], base[1], group)

        def attention(h: torch.Tensor) -> torch.Tensor:
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(num_rows, heads, dim)
            source = torch.cat((context, h))
            k = (source @ w[p + "self_attn.k_proj.weight"].T).view(-1, kv_heads, dim)
            v = (source @ w[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, dim)
            q = _rope(_rms(q, w[p + "self_attn.q_norm.weight"], eps), q_pos, theta)
            k = _rope(_rms(k, w[p + "self_attn.k_norm.weight"], eps), k_pos, theta)
            distance = q_pos[:, None] - k_pos[None, :]
            visible = torch.ones_like(distance, dtype=torch.bool)
            if causal:
                visible &= distance >= 0
            if window is not None:
                visible &= distance < window
                if not causal:
                    visible &= distance > -window
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            out = torch.einsum("hqk,khd->qhd", probs, v).reshape(num_rows, heads * dim)
            return out @ w[p + "self_attn.o_proj.weight"].T

        def mlp(h: torch.Tensor) -> torch.Tensor:
            gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
            return (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T

        x = x + around("attention_conv", _rms(x, w[p + "input_layernorm.weight"], eps), attention)
        x = x + around("mlp_conv", _rms(x, w[p + "post_attention_layernorm.weight"], eps), mlp)
    return _rms(x, w["norm.weight"], eps)


def scaled_logits(config: dict, logits: torch.Tensor) -> torch.Tensor:
    draft = config["dflash_config"]
    logits = logits.float() * draft.get("output_multiplier", 1.0)
    cap = draft.get("final_logit_softcapping")
    return torch.tanh(logits / cap) * cap if cap else logits


def select_path(
    tensors: dict[str, torch.Tensor], config: dict, logits: torch.Tensor, hidden: torch.Tensor, first: int,
    temperature: float = 0.0, noise: torch.Tensor | None = None,
) -> tuple[list[int], list[dict[int, float]]]:
    """DFlash2's walk for one request: logits [K, V] (scaled), hidden [K, H] -> the K tokens and,
    per position, q over the candidates ({} when greedy). noise [K, C]: Exp(1) draws, the pick is
    argmax q / noise (a draw from q)."""
    top_k = config["dflash_config"]["selector_top_k"]
    predecessors = tensors["candidate_selector.predecessor_codebook"].float()
    successors = tensors["candidate_selector.successor_codebook"].float()
    projection = tensors["candidate_selector.hidden_projection.weight"].float()
    tokens, qs, previous = [], [], first
    for t in range(logits.shape[0]):
        unary, candidates = torch.topk(logits[t].float(), top_k)
        context = predecessors[previous] * (projection @ hidden[t].float())
        scores = unary + successors[candidates] @ context
        if temperature > 0:
            q = torch.softmax(scores / temperature, -1)
            pick = int(torch.argmax(q / noise[t, :top_k]))
            qs.append({int(c): float(p) for c, p in zip(candidates, q)})
        else:
            pick = int(torch.argmax(scores))
            qs.append({})
        previous = int(candidates[pick])
        tokens.append(previous)
    return tokens, qs
