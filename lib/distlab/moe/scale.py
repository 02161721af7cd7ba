"""What expert parallelism costs at real scale: all-to-all bytes per layer, and DeepSeek-V3's shape."""

from __future__ import annotations

from dataclasses import dataclass

from distlab.runtime.comm import WIRE_BYTES

__all__ = ["all_to_all_bytes", "MoEShape", "DEEPSEEK_V3"]


# ---------------------------------------------------------------- cost model

def all_to_all_bytes(tokens: int, k: int, d_model: int, world_size: int, bytes_per_value: int = 2,
                     backward: bool = True) -> dict[str, float]:
    """Bytes one rank moves in one MoE layer's all-to-alls, with no token dropped.

    Each of ``tokens`` sends its hidden state (``d_model`` values) once per chosen expert:
    ``payload = tokens · k · d_model · bytes`` per all-to-all. Dispatch and combine move
    the same amount; backward repeats both. With uniform routing ``(N−1)/N`` of it leaves the
    rank (:data:`distlab.runtime.comm.WIRE_BYTES`, the model distlab's comm log uses).
    """
    payload = tokens * k * d_model * bytes_per_value
    calls = 4 if backward else 2
    return {"payload_per_all_to_all": payload, "calls": calls, "payload_per_layer": calls * payload,
            "sent_per_layer": calls * WIRE_BYTES["all_to_all_single"](payload, world_size)}


@dataclass(frozen=True)
class MoEShape:
    """A DeepSeek-style MoE transformer: MLA attention, SwiGLU experts, a few dense layers first."""

    name: str
    n_layer: int
    dense_layers: int  # the first layers keep a dense MLP
    d_model: int
    dense_ffn: int
    expert_ffn: int
    routed_experts: int
    shared_experts: int
    k: int
    vocab_size: int
    n_head: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def attention_params(self) -> int:
        """Multi-head latent attention: low-rank query and key/value projections, per layer."""
        d, h = self.d_model, self.n_head
        q = (d * self.q_lora_rank + self.q_lora_rank
             + self.q_lora_rank * h * (self.qk_nope_head_dim + self.qk_rope_head_dim))
        kv = (d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
              + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim))
        return q + kv + h * self.v_head_dim * d

    @property
    def expert_params(self) -> int:
        """One SwiGLU expert: gate, up and down projections."""
        return 3 * self.d_model * self.expert_ffn

    def _params(self, experts_per_layer: int) -> int:
        d = self.d_model
        norms = 2 * d
        dense = self.dense_layers * (self.attention_params + 3 * d * self.dense_ffn + norms)
        moe_layer = (self.attention_params + experts_per_layer * self.expert_params
                     + self.routed_experts * d + self.routed_experts + norms)  # router weight and bias
        return dense + (self.n_layer - self.dense_layers) * moe_layer + 2 * self.vocab_size * d + d

    @property
    def total_params(self) -> int:
        return self._params(self.routed_experts + self.shared_experts)

    @property
    def active_params(self) -> int:
        """Parameters one token uses: k routed experts and the shared ones per MoE layer."""
        return self._params(self.k + self.shared_experts)

    def expert_flops_per_token(self) -> int:
        """Training FLOPs of one MoE layer's experts per token: 6 per weight used (fwd 2, bwd 4)."""
        return 6 * (self.k + self.shared_experts) * self.expert_params


# DeepSeek-V3 (arXiv:2412.19437, its config.json): 61 layers, the first 3 dense; 256 routed experts
# + 1 shared, 8 per token; MLA attention. The multi-token-prediction module is not counted.
DEEPSEEK_V3 = MoEShape("DeepSeek-V3", n_layer=61, dense_layers=3, d_model=7168, dense_ffn=18432, expert_ffn=2048,
                       routed_experts=256, shared_experts=1, k=8, vocab_size=129280, n_head=128, q_lora_rank=1536,
                       kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
