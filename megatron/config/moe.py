"""Configuration of mixture-of-experts layers (Megatron-LM's --moe-* flags and defaults)."""
import ast
from dataclasses import dataclass
from typing import List, Optional, Union

from megatron.config.errors import ConfigError, require

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")
DISPATCHERS = ("allgather", "alltoall")
DROP_POLICIES = ("probs", "position")
ROUTER_DTYPES = ("fp32", "fp64")
# The fields that change what an MoE model computes (the rest are training details: losses,
# capacity, dispatch); an export must express each (checkpointing/hf/families.py).
ARCHITECTURE_FIELDS = (
    "num_experts", "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate", "moe_apply_probs_on_input")


def parse_layer_freq(value: str, flag: str = "--moe-layer-freq") -> Union[int, List[int]]:
    """A per-layer flag (--moe-layer-freq; also --window-attn-skip-freq and --no-rope-freq):
    an int N or Megatron's list form, a Python expression such as `([0]*1+[1]*3)*8` (one
    0/1 per layer)."""
    text = str(value).strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        pattern = _eval_list(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError) as err:
        raise ConfigError(f"{flag} {value!r} is neither an int nor a list expression "
                          f"such as ([0]*1+[1]*3)*8 ({err})") from None
    return pattern


def _eval_list(node) -> list:
    """A list expression of int literals, + and * only (no eval of arbitrary code)."""
    if isinstance(node, ast.List):
        return [_int(e) for e in node.elts]
    if isinstance(node, ast.Tuple) and len(node.elts) == 1:
        return _eval_list(node.elts[0])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _eval_list(node.left) + _eval_list(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        if isinstance(node.right, ast.Constant):
            return _eval_list(node.left) * _int(node.right)
        return _eval_list(node.right) * _int(node.left)
    raise ValueError("only lists of 0/1, + and * are allowed")


def _int(node) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    raise ValueError(f"{ast.dump(node)} is not an int")


@dataclass
class MoEConfig:
    """Mixture of experts; all off unless --num-experts is given."""

    num_experts: Optional[int] = None
    """Routed experts per MoE layer (--num-experts)."""
    moe_ffn_hidden_size: Optional[int] = None
    """Inner width of each expert (default: --ffn-hidden-size)."""
    moe_layer_freq: Union[int, List[int], str] = 1
    """Every N-th layer is MoE (from layer 0), or a 0/1 list per layer."""
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    """softmax over all experts before top-k (else softmax over the k selected logits)."""
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_num_groups: Optional[int] = None
    """Expert groups of group-limited routing (DeepSeek)."""
    moe_router_group_topk: Optional[int] = None
    """Groups each token may pick experts from."""
    moe_router_dtype: Optional[str] = None
    """fp32 | fp64: dtype of the router gemm and routing math (default: the model's)."""
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing: a per-expert bias added to the scores for top-k only."""
    moe_router_bias_update_rate: float = 1e-3
    moe_expert_capacity_factor: Optional[float] = None
    """None: dropless. Else each expert takes ceil(tokens x topk / experts x factor) tokens."""
    moe_token_drop_policy: str = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Width of the always-on shared expert(s) (None: no shared expert)."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x . w_gate) (Qwen-MoE)."""
    moe_apply_probs_on_input: bool = False
    """The router's weight scales each expert's input instead of its output
    (--moe-apply-probs-on-input, Megatron-LM's; Llama 4); needs --moe-router-topk 1."""
    moe_grouped_gemm: bool = False
    """All local experts in one batched matmul (else a loop over experts)."""
    moe_token_dispatcher_type: str = "allgather"

    def __post_init__(self):
        if isinstance(self.moe_layer_freq, str):
            self.moe_layer_freq = parse_layer_freq(self.moe_layer_freq)
        if self.num_experts is None:
            require(self.moe_ffn_hidden_size is None,
                    "--moe-ffn-hidden-size needs --num-experts (it is the width of each expert)")
            return
        require(self.num_experts > 0, f"--num-experts must be positive, got {self.num_experts}")
        require(0 < self.moe_router_topk <= self.num_experts,
                f"--moe-router-topk ({self.moe_router_topk}) must be in [1, --num-experts "
                f"({self.num_experts})]")
        for flag, value, allowed in (
                ("--moe-router-score-function", self.moe_router_score_function, SCORE_FUNCTIONS),
                ("--moe-router-load-balancing-type", self.moe_router_load_balancing_type,
                 LOAD_BALANCING_TYPES),
                ("--moe-token-dispatcher-type", self.moe_token_dispatcher_type, DISPATCHERS),
                ("--moe-token-drop-policy", self.moe_token_drop_policy, DROP_POLICIES)):
            require(value in allowed, f"{flag} {value!r} is not one of {allowed}")
        require(self.moe_router_dtype in (None,) + ROUTER_DTYPES,
                f"--moe-router-dtype {self.moe_router_dtype!r} is not one of {ROUTER_DTYPES}")
        factor = self.moe_expert_capacity_factor
        require(factor is None or factor > 0,
                f"--moe-expert-capacity-factor must be > 0, got {factor} (omit it for dropless)")
        require(not self.moe_pad_expert_input_to_capacity or factor is not None,
                "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
        require(self.moe_aux_loss_coeff >= 0 and (self.moe_z_loss_coeff or 0) >= 0,
                "--moe-aux-loss-coeff and --moe-z-loss-coeff must be >= 0")
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            value = getattr(self, name)
            require(value is None or value > 0,
                    f"--{name.replace('_', '-')} must be positive, got {value}")
        self._check_routing()
        self._check_groups()
        self._check_probs_on_input()

    def _check_routing(self):
        """The routing settings Megatron-Core's TransformerConfig refuses."""
        score, kind = self.moe_router_score_function, self.moe_router_load_balancing_type
        require(not (kind == "sinkhorn" and self.moe_aux_loss_coeff),
                "--moe-router-load-balancing-type sinkhorn takes no --moe-aux-loss-coeff; set it to 0")
        require(not (kind == "sinkhorn" and self.moe_expert_capacity_factor is not None),
                "--moe-expert-capacity-factor works with --moe-router-load-balancing-type "
                "aux_loss, seq_aux_loss or none, not sinkhorn (as in Megatron-Core)")
        require(not self.moe_router_enable_expert_bias or score == "sigmoid",
                f"--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid "
                f"(got {score}), as in Megatron-Core's aux-loss-free routing")
        require(not (self.moe_router_topk == 1 and score == "softmax" and kind != "sinkhorn"
                     and not self.moe_router_pre_softmax),
                "--moe-router-topk 1 with --moe-router-score-function softmax needs "
                "--moe-router-pre-softmax: a softmax over the one selected logit is 1, so the "
                "router would get no gradient from the loss (Megatron-Core refuses it too)")

    def _check_probs_on_input(self):
        require(not self.moe_apply_probs_on_input or self.moe_router_topk == 1,
                f"--moe-apply-probs-on-input needs --moe-router-topk 1, got "
                f"{self.moe_router_topk} (as in Megatron-Core)")

    def _check_groups(self):
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if not group_topk:
            return
        require(groups is not None, "--moe-router-group-topk needs --moe-router-num-groups "
                                    "(the expert groups of group-limited routing)")
        require(groups > 0 and self.num_experts % groups == 0,
                f"--moe-router-num-groups ({groups}) must divide --num-experts ({self.num_experts})")
        require(0 < group_topk <= groups and self.moe_router_topk % group_topk == 0,
                f"--moe-router-group-topk ({group_topk}) must be in [1, {groups}] and divide "
                f"--moe-router-topk ({self.moe_router_topk})")

    @property
    def enabled(self) -> bool:
        return self.num_experts is not None

    def layer_pattern(self, num_layers: int) -> List[int]:
        """1 for each MoE layer, 0 for each dense one (Megatron's moe_layer_pattern)."""
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            require(freq > 0, f"--moe-layer-freq must be positive, got {freq}")
            return [1 if i % freq == 0 else 0 for i in range(num_layers)]
        require(len(freq) == num_layers and set(freq) <= {0, 1},
                f"--moe-layer-freq lists {len(freq)} entries of 0/1; it needs one per layer "
                f"({num_layers})")
        return list(freq)
