"""DeepSeek mixture of experts: top-k router, routed experts in stacked weights, shared experts,
and per-layer expert load counters.

Routing follows each config (and transformers' DeepseekV2/V3 modules, whose numerics the tests
compare against):
- DeepSeek-V2 (`topk_method` "greedy" / "group_limited_greedy"): softmax scores; with groups, only
  experts of the `topk_group` groups with the highest single-expert score may be chosen (the
  node-limited routing of the V2 paper); weights = scores of the chosen experts times
  `routed_scaling_factor`, or renormalised to sum 1 when `norm_topk_prob` is set (the original
  V2 code's choice; no V2 checkpoint sets it).
- DeepSeek-V3 ("noaux_tc"): sigmoid scores; the choice uses scores + `e_score_correction_bias`,
  groups ranked by the sum of their two best biased scores; weights are the unbiased scores,
  renormalised when `norm_topk_prob`, times `routed_scaling_factor`.

Experts are held as two stacked tensors, gate+up `[E, 2I, H]` and down `[E, H, I]`, so one call can
run every expert at once. Two execution paths compute the same function:
- `grouped`: token copies sorted by expert, then two grouped GEMMs (`torch.nn.functional.grouped_mm`
  with per-expert row offsets) for all experts together. No host synchronisation, so it runs inside
  CUDA graphs; torch runs it on CUDA (bf16, sm90+) and, more slowly, on CPU.
- `loop`: one GEMM pair per expert that received tokens (index_select / index_add); a host sync
  per layer for the counts. The CPU default (fastest there for few tokens) and the fallback where
  grouped GEMMs are unavailable (fp32/fp16 on CUDA, older GPUs); inside a CUDA-graph capture that
  fallback becomes `_dense` (every expert on every token, routing-weighted), which needs no sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.layers import KernelSwitches, SwiGLU, UsesKernelSwitches, _triton_ops
from kvserve.stats import ExpertLoadStats

MOE_IMPLEMENTATIONS = ("auto", "grouped", "loop")


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs for activations like `x` here (CUDA: bf16 on sm90+)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        return True
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(x.device)[0] >= 9


def _grouped_mm(x: torch.Tensor, weight_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    grouped = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return grouped(x, weight_t, offs=offsets)


@dataclass
class RoutingConfig:
    num_experts: int
    top_k: int
    scoring: str                  # "softmax" (V2) or "sigmoid" (V3)
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"      # V2: best expert of a group; V3: sum of its two best
    normalize: bool = False
    routed_scaling_factor: float = 1.0
    scale_after_normalize: bool = True   # V3 scales normalised weights; V2 scales only unnormalised ones
    correction_bias: bool = False

    @classmethod
    def from_hf(cls, cfg, v3: bool) -> "RoutingConfig":
        num_experts = cfg.n_routed_experts
        num_groups = int(getattr(cfg, "n_group", None) or 1)
        topk_groups = int(getattr(cfg, "topk_group", None) or num_groups)
        if v3:
            return cls(num_experts, cfg.num_experts_per_tok, "sigmoid", num_groups, topk_groups, "top2_sum",
                       bool(cfg.norm_topk_prob), float(cfg.routed_scaling_factor), True, True)
        method = getattr(cfg, "topk_method", None) or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"unsupported DeepSeek-V2 topk_method {method!r}")
        if method == "greedy":
            num_groups = topk_groups = 1
        return cls(num_experts, cfg.num_experts_per_tok, "softmax", num_groups, topk_groups, "max",
                   bool(getattr(cfg, "norm_topk_prob", False)), float(cfg.routed_scaling_factor), False, False)


def route(logits: torch.Tensor, cfg: RoutingConfig,
          correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] fp32 -> (weights [T, k] fp32, expert ids [T, k] int64)."""
    scores = logits.softmax(dim=-1) if cfg.scoring == "softmax" else logits.sigmoid()
    choice = scores + correction_bias if correction_bias is not None else scores
    if cfg.num_groups > 1 and cfg.topk_groups < cfg.num_groups:
        grouped = choice.view(-1, cfg.num_groups, cfg.num_experts // cfg.num_groups)
        if cfg.group_score == "top2_sum":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        group_idx = torch.topk(group_scores, k=cfg.topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(-1, cfg.num_experts)
        # Softmax scores are >= 0, so V2 masks with 0 (as its reference does); sigmoid+bias may not be.
        fill = float("-inf") if cfg.scoring == "sigmoid" else 0.0
        choice = choice.masked_fill(~expert_mask, fill)
    if correction_bias is not None or cfg.scoring == "sigmoid":
        ids = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    else:
        weights, ids = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False)
    if cfg.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if cfg.scale_after_normalize:
            weights = weights * cfg.routed_scaling_factor
    else:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids


def _silu_mul(gate_up: torch.Tensor, switches: KernelSwitches) -> torch.Tensor:
    if switches.fused(gate_up):
        return _triton_ops()[0].silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class DeepseekMoE(UsesKernelSwitches, nn.Module):
    """Router + routed experts (stacked weights) + shared experts, for one decoder layer."""

    implementation = "auto"    # set per model by DeepseekForCausalLM (see MOE_IMPLEMENTATIONS)

    def __init__(self, cfg, v3: bool) -> None:
        super().__init__()
        self.routing = RoutingConfig.from_hf(cfg, v3)
        num_experts, hidden, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        if num_experts % self.routing.num_groups:
            raise ValueError(f"{num_experts} experts do not split into {self.routing.num_groups} groups")
        self.num_experts, self.top_k, self.intermediate_size = num_experts, cfg.num_experts_per_tok, inter
        # The router runs in fp32 whatever the model dtype (transformers keeps gate.weight in fp32):
        # a bf16 router flips expert choices near ties.
        self.gate_weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))
                                        if self.routing.correction_bias else None)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter))
        num_shared = int(getattr(cfg, "n_shared_experts", 0) or 0)
        self.shared_experts = (SwiGLU(hidden, inter * num_shared, bias=bool(getattr(cfg, "mlp_bias", False)))
                               if num_shared else None)
        # Token-expert assignments since the last reset (tokens per expert), on the model's device.
        self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    def forward(self, hidden: torch.Tensor, token_weight: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [T, H]; token_weight [T] int64 (1 = real token, 0 = CUDA-graph padding row) for
        the load counters."""
        logits = F.linear(hidden.float(), self.gate_weight)
        weights, ids = route(logits, self.routing, self.e_score_correction_bias)
        self._count(ids, token_weight)
        routed = self.run_experts(hidden, weights, ids)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(hidden)
        return routed

    def _count(self, ids: torch.Tensor, token_weight: torch.Tensor | None) -> None:
        # scatter_add_ (not bincount): fixed output size, no host sync, capturable in a graph.
        if token_weight is None:
            counts = torch.ones_like(ids)
        else:
            counts = token_weight[:, None].expand_as(ids)
        self.expert_tokens.scatter_add_(0, ids.reshape(-1), counts.reshape(-1))

    def run_experts(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        implementation = self.implementation
        if implementation == "auto":
            implementation = "grouped" if hidden.is_cuda and grouped_mm_available(hidden) else "loop"
        if implementation == "grouped" and grouped_mm_available(hidden):
            return self._grouped(hidden, weights, ids)
        if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
            # The loop reads expert counts on the host, which a CUDA-graph capture forbids.
            return self._dense(hidden, weights, ids)
        return self._loop(hidden, weights, ids)

    def _dense(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by the routing (0 where not chosen): no host
        sync, E/k times the FLOPs. Only for captured decode steps where grouped GEMMs are
        unavailable (fp32/fp16, GPUs before sm90), whose few tokens make that affordable."""
        combine = torch.zeros(hidden.shape[0], self.num_experts, dtype=torch.float32, device=hidden.device)
        combine.scatter_(1, ids, weights)
        out = torch.zeros(hidden.shape[0], hidden.shape[1], dtype=torch.float32, device=hidden.device)
        for expert in range(self.num_experts):
            expert_out = F.linear(_silu_mul(F.linear(hidden, self.w13[expert]), self.switches), self.w2[expert])
            out += expert_out.float() * combine[:, expert:expert + 1]
        return out.to(hidden.dtype)

    def _grouped(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """All experts in two grouped GEMMs over the token copies sorted by expert."""
        num_tokens, top_k = ids.shape
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=hidden.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = hidden.index_select(0, order // top_k)
        gate_up = _grouped_mm(rows, self.w13.transpose(1, 2), offsets)
        out_sorted = _grouped_mm(_silu_mul(gate_up, self.switches), self.w2.transpose(1, 2), offsets)
        # Back to (token, k) order, then a weighted sum over k: deterministic (no atomics).
        out = torch.empty_like(out_sorted).index_copy_(0, order, out_sorted)
        out = out.view(num_tokens, top_k, -1).float() * weights[:, :, None]
        return out.sum(dim=1).to(hidden.dtype)

    def _loop(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """One GEMM pair per expert that has tokens (the reference; the CPU path)."""
        num_tokens, top_k = ids.shape
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        flat_weights = weights.reshape(-1)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            picks = order[start:start + count]
            start += count
            tokens = picks // top_k
            rows = hidden.index_select(0, tokens)
            expert_out = F.linear(_silu_mul(F.linear(rows, self.w13[expert]), self.switches), self.w2[expert])
            out.index_add_(0, tokens, expert_out.float() * flat_weights[picks, None])
        return out.to(hidden.dtype)


# --- expert load statistics -------------------------------------------------------------------------
def collect_expert_load(model: nn.Module) -> Optional[ExpertLoadStats]:
    """The counters of every DeepseekMoE in `model` (one device->host copy), or None without MoE."""
    layers, counters, top_k = [], [], 1
    for index, layer in enumerate(getattr(model, "layers", [])):
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, DeepseekMoE):
            layers.append(index)
            counters.append(mlp.expert_tokens)
            top_k = mlp.top_k
    if not counters:
        return None
    table = torch.stack(counters).cpu().tolist()
    return ExpertLoadStats(tuple(layers), tuple(tuple(row) for row in table), top_k)


def reset_expert_load(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, DeepseekMoE):
            module.expert_tokens.zero_()
