"""HF (Llama/Qwen2/Qwen3/Qwen3-MoE/Qwen3.5) <-> Megatron-core parameters, for any TP, PP, EP and ETP.
Pure tensor code.

Megatron's layout differs from HF's in these places:
- q, k, v are one `linear_qkv` whose rows are grouped per KV group: [q heads of group g; k_g; v_g];
  TP ranks hold whole groups (a contiguous slice of rows). With Qwen3.5's output gate, HF's q_proj
  holds [q_h; gate_h] per head and a group is [q heads of g; their gates; k_g; v_g].
- SwiGLU's gate and up are one `linear_fc1`; TP rank r holds [gate_r; up_r], which is NOT a
  contiguous slice of the full [gate; up]. A Gated DeltaNet's `in_proj` is the same kind of
  concatenation, [q_r; k_r; v_r; z_r; b_r; a_r] of HF's in_proj_qkv (= [q; k; v]), _z, _b and _a, and
  its conv1d's channels are [q_r; k_r; v_r].
- Embedding and LM head rows are padded to the padded vocabulary and split by rows.
Row-parallel layers (`linear_proj`, `linear_fc2`) split columns; norms are replicated.
Layer i of the model is local layer i - pp_rank * layers_per_stage on its pipeline stage.
Qwen3-Next holds the GDN's projections pre-fused and interleaved per key head (in_proj_qkvz,
in_proj_ba): cut into the same parts first. A MoE layer's router (`mlp.gate`) is replicated; its experts are spread over EP ranks, rank r
holding experts r·E/EP + i as `local_experts.i`, each a SwiGLU split over the ETP ranks like a
dense one (fc1 as [gate_r; up_r], fc2 by columns).
"""
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from orz.models.arch import ModelArch

# Megatron name within a layer -> (HF names within the layer, how it is split over TP)
_LAYER = {
    "input_layernorm.weight": (("input_layernorm.weight",), "replicated"),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "qkv",
    ),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        "qkv",
    ),
    # Qwen3's per-head q/k RMSNorm: one (head_dim,) weight shared by every head, so replicated.
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "replicated"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "replicated"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "row"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "replicated"),
}
_DENSE_MLP = {
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "fc1"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "row"),
}
# A Qwen3.5 Gated DeltaNet layer's mixer, in place of the attention's entries above.
_GATED_DELTA_NET = {
    "input_layernorm.weight": (("input_layernorm.weight",), "replicated"),
    "self_attention.in_proj.weight": (tuple(f"linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
                                      "gdn_in"),
    "self_attention.conv1d.weight": (("linear_attn.conv1d.weight",), "gdn_conv"),  # (channels, 1, taps)
    "self_attention.dt_bias": (("linear_attn.dt_bias",), "column"),  # one per value head
    "self_attention.A_log": (("linear_attn.A_log",), "column"),
    "self_attention.out_norm.weight": (("linear_attn.norm.weight",), "replicated"),
    "self_attention.out_proj.weight": (("linear_attn.out_proj.weight",), "row"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "replicated"),
}
# Qwen3-Next keeps the same projections pre-fused, interleaved per key head g: in_proj_qkvz rows
# [q_g; k_g; v_g; z_g] (its r = n_v/n_k value heads for v and z), in_proj_ba rows [b_g; a_g].
_PRE_FUSED_GDN_IN = {"self_attention.in_proj.weight": (("linear_attn.in_proj_qkvz.weight",
                                                         "linear_attn.in_proj_ba.weight"), "gdn_in_fused")}
_ROUTER = {"mlp.router.weight": (("mlp.gate.weight",), "replicated")}  # (E, H)
# Qwen3.5-MoE's shared expert beside the router: a SwiGLU split over TP like a dense one, its gate (1, H)
_SHARED_EXPERT = {
    "mlp.shared_experts.linear_fc1.weight": (("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
                                             "fc1"),
    "mlp.shared_experts.linear_fc2.weight": (("mlp.shared_expert.down_proj.weight",), "row"),
    "mlp.shared_experts.gate_weight": (("mlp.shared_expert_gate.weight",), "replicated"),
}
# one expert: Megatron name within `mlp.experts.local_experts.{i}` -> HF names within `mlp.experts.{e}`
_EXPERT = {
    "linear_fc1.weight": (("gate_proj.weight", "up_proj.weight"), "expert_fc1"),
    "linear_fc2.weight": (("down_proj.weight",), "expert_row"),
}
# Transformer Engine fuses the two norms into the following linear layers.
_TE_RENAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"
HF_EMBEDDING, HF_NORM, HF_LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
HF_SCORE = "score.weight"  # a sequence-classification (reward) model's head
VALUE_HEAD = "output_layer"  # a value model's ValueHead in Megatron's names


@dataclass(frozen=True)
class Layout:
    """Where a Megatron rank sits and how its model was built."""

    tp: int = 1
    pp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    padded_vocab: int | None = None  # None: the real vocabulary (TP must divide it)
    te: bool = False  # Transformer Engine layer names
    value_head: bool = False  # no LM head: the value head is not an HF tensor
    ep: int = 1  # expert parallel: experts spread over ep ranks
    etp: int = 1  # expert tensor parallel: each expert's SwiGLU split over etp ranks
    ep_rank: int = 0
    etp_rank: int = 0

    def layer_offset(self, arch: ModelArch) -> int:
        return self.pp_rank * (arch.num_layers // self.pp)

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


@dataclass(frozen=True)
class ParamRule:
    """One Megatron parameter of one stage and the HF tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    split: str  # replicated | row | column | qkv | fc1 | gdn_in | gdn_in_fused | gdn_conv | vocab | expert_fc1 | expert_row

    @property
    def expert(self) -> bool:
        """Split over the expert (EP × ETP) ranks rather than over TP."""
        return self.split.startswith("expert_")


def param_rules(arch: ModelArch, layout: Layout) -> list[ParamRule]:
    """The Megatron parameters held by `layout`'s stage, in a fixed order."""
    rules = []
    if layout.first_stage:
        rules.append(ParamRule(EMBEDDING, (HF_EMBEDDING,), "vocab"))
    per_stage = arch.num_layers // layout.pp
    for local in range(per_stage):
        layer = local + layout.layer_offset(arch)
        sparse, linear = arch.is_moe_layer(layer), arch.is_linear_attention_layer(layer)
        mixer = (_GATED_DELTA_NET | (_PRE_FUSED_GDN_IN if arch.family == "qwen3_next" else {})) if linear else _LAYER
        mlp = (_ROUTER | (_SHARED_EXPERT if arch.moe.shared_intermediate_size else {})) if sparse else _DENSE_MLP
        for name, (hf_names, split) in (mixer | mlp).items():
            if not _in_family(name, arch):
                continue
            # TE fuses the pre-MLP norm into a dense fc1 only, and the input norm into the attention's
            # linear_qkv only: a MoE layer keeps its pre-MLP norm, a GDN layer its input norm
            unfused = (sparse and name.startswith("pre_mlp")) or (linear and name.startswith("input_"))
            megatron = _TE_RENAMES.get(name, name) if layout.te and not unfused else name
            rules.append(
                ParamRule(
                    f"decoder.layers.{local}.{megatron}",
                    tuple(f"model.layers.{layer}.{h}" for h in hf_names),
                    split,
                )
            )
        if sparse:
            rules += _expert_rules(arch, layout, local, layer)
    if layout.last_stage:
        rules.append(ParamRule(FINAL_NORM, (HF_NORM,), "replicated"))
        # With tied embeddings and PP > 1 the last stage keeps its own copy of the embedding
        # as the LM head (Megatron keeps the two equal by all-reducing their gradients).
        tied_here = arch.tie_word_embeddings and layout.first_stage
        if not layout.value_head and not tied_here:
            rules.append(
                ParamRule(OUTPUT, (HF_EMBEDDING if arch.tie_word_embeddings else HF_LM_HEAD,), "vocab")
            )
    return rules


def _expert_rules(arch: ModelArch, layout: Layout, local: int, layer: int) -> list[ParamRule]:
    """The experts `layout.ep_rank` holds in a sparse layer (SequentialMLP's names)."""
    per_rank = arch.moe.num_experts // layout.ep
    return [
        ParamRule(
            f"decoder.layers.{local}.mlp.experts.local_experts.{i}.{name}",
            tuple(f"model.layers.{layer}.mlp.experts.{layout.ep_rank * per_rank + i}.{h}" for h in hf_names),
            split,
        )
        for i in range(per_rank)
        for name, (hf_names, split) in _EXPERT.items()
    ]


def _in_family(name: str, arch: ModelArch) -> bool:
    """Whether the layer parameter `name` exists in `arch`'s family (q/k/v biases, q/k norms)."""
    if name.endswith(".bias"):
        return arch.qkv_bias
    if name.startswith(("self_attention.q_layernorm", "self_attention.k_layernorm")):
        return arch.qk_norm
    return True


def _qkv_full(arch: ModelArch, q, k, v) -> torch.Tensor:
    """[q; k; v] rows regrouped per KV group: (G * (Q/G + 2) * D, ...); with the output gate, HF's
    per-head [q_h; gate_h] rows become [q of the group; gates of the group] before k_g, v_g."""
    groups, d, per_group = arch.num_kv_heads, arch.head_dim, arch.num_heads // arch.num_kv_heads
    tail = q.shape[1:]
    if arch.attention_output_gate:
        q = q.reshape(groups, per_group, 2, d, *tail).transpose(1, 2)  # [group, q | gate, head, d]
    q = q.reshape(groups, -1, *tail)
    k = k.reshape(groups, d, *tail)
    v = v.reshape(groups, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def _qkv_split(arch: ModelArch, full) -> list[torch.Tensor]:
    groups, d, per_group = arch.num_kv_heads, arch.head_dim, arch.num_heads // arch.num_kv_heads
    tail = full.shape[1:]
    q_rows = per_group * d * (2 if arch.attention_output_gate else 1)
    q, k, v = full.reshape(groups, q_rows + 2 * d, *tail).split([q_rows, d, d], dim=1)
    if arch.attention_output_gate:
        q = q.reshape(groups, 2, per_group, d, *tail).transpose(1, 2)  # back to per-head [q_h; gate_h]
    return [t.reshape(-1, *tail) for t in (q, k, v)]


def _sections(split: str, hf: list[torch.Tensor], arch: ModelArch) -> list[torch.Tensor]:
    """The HF tensors as the sections of which each TP rank holds the r-th slice, in Megatron's order."""
    if split == "gdn_in":
        qkv, *zba = hf
        return [*_gdn_qkv(qkv, arch), *zba]
    if split == "gdn_in_fused":
        qkvz, ba = (_per_key_head(t, arch, parts) for t, parts in zip(hf, (_QKVZ, _BA)))
        return [*qkvz, *ba]
    if split == "gdn_conv":
        return _gdn_qkv(hf[0], arch)
    return hf  # fc1: [gate, up]; column: one


def _from_sections(split: str, sections: list[torch.Tensor], arch: ModelArch) -> list[torch.Tensor]:
    if split == "gdn_in":
        return [torch.cat(sections[:3]), *sections[3:]]
    if split == "gdn_in_fused":
        return [_interleaved(sections[:4], arch), _interleaved(sections[4:], arch)]
    if split == "gdn_conv":
        return [torch.cat(sections)]
    return sections


_QKVZ = ("key", "key", "value", "value")  # Qwen3-Next's rows per key head: q, k (d_k each), v, z (r·d_v each)
_BA = ("head", "head")  # b, a (r each)


def _per_key_head(fused: torch.Tensor, arch: ModelArch, parts: tuple[str, ...]) -> list[torch.Tensor]:
    """Qwen3-Next's rows interleaved per key head, as one tensor per part over all heads."""
    gdn = arch.linear_attention
    r = gdn.num_value_heads // gdn.num_key_heads
    rows = [{"key": gdn.key_head_dim, "value": r * gdn.value_head_dim, "head": r}[p] for p in parts]
    grouped = fused.reshape(gdn.num_key_heads, -1, *fused.shape[1:])
    return [t.reshape(-1, *fused.shape[1:]) for t in grouped.split(rows, dim=1)]


def _interleaved(sections: list[torch.Tensor], arch: ModelArch) -> torch.Tensor:
    """The inverse of _per_key_head: each key head's rows of every part, head after head."""
    heads = arch.linear_attention.num_key_heads
    return torch.cat([t.reshape(heads, -1, *t.shape[1:]) for t in sections], dim=1).reshape(-1, *sections[0].shape[1:])


def _gdn_qkv(qkv: torch.Tensor, arch: ModelArch) -> list[torch.Tensor]:
    gdn = arch.linear_attention
    qk = gdn.num_key_heads * gdn.key_head_dim
    return list(qkv.split([qk, qk, gdn.num_value_heads * gdn.value_head_dim]))


def to_megatron(rule: ParamRule, hf: list[torch.Tensor], arch: ModelArch, layout: Layout) -> torch.Tensor:
    """This TP (or, for an expert, ETP) rank's shard of `rule.megatron`, from its HF tensors."""
    tp, r = (layout.etp, layout.etp_rank) if rule.expert else (layout.tp, layout.tp_rank)
    split = rule.split.removeprefix("expert_")
    if split == "replicated":
        return hf[0].clone()
    if split == "row":
        return hf[0].chunk(tp, dim=1)[r].clone()
    if split == "qkv":
        return _qkv_full(arch, *hf).chunk(tp, dim=0)[r].clone()
    if split in _SECTIONED:
        return torch.cat([t.chunk(tp, dim=0)[r] for t in _sections(split, hf, arch)], dim=0)
    if split == "vocab":
        padded = layout.padded_vocab or arch.vocab_size
        if padded % tp or padded < arch.vocab_size:
            raise ValueError(f"padded vocabulary {padded} must be >= {arch.vocab_size} and divisible by tp={tp}")
        rows = hf[0].new_zeros(padded, hf[0].shape[1])
        rows[: arch.vocab_size] = hf[0]
        return rows.chunk(tp, dim=0)[r].clone()
    raise AssertionError(rule.split)


def to_hf(rule: ParamRule, shards: list[torch.Tensor], arch: ModelArch) -> list[torch.Tensor]:
    """The HF tensors of `rule`, from the shards of all TP (expert: ETP) ranks in rank order."""
    split = rule.split.removeprefix("expert_")
    if split == "replicated":
        return [shards[0]]
    if split == "row":
        return [torch.cat(shards, dim=1)]
    if split == "qkv":
        return _qkv_split(arch, torch.cat(shards, dim=0))
    if split in _SECTIONED:
        tp = len(shards)
        sizes = [t.shape[0] // tp for t in _sections(split, [torch.empty(n) for n in hf_rows(rule, arch)], arch)]
        parts = [shard.split(sizes) for shard in shards]  # [rank][section]
        return _from_sections(split, [torch.cat(ranks) for ranks in zip(*parts)], arch)
    if split == "vocab":
        return [torch.cat(shards, dim=0)[: arch.vocab_size]]
    raise AssertionError(rule.split)


_SECTIONED = ("fc1", "gdn_in", "gdn_in_fused", "gdn_conv", "column")


def hf_rows(rule: ParamRule, arch: ModelArch) -> list[int]:
    """The number of rows of each of `rule`'s HF tensors."""
    return [hf_shape(name, arch)[0] for name in rule.hf]


def hf_to_megatron(
    get_hf: Callable[[str], torch.Tensor], arch: ModelArch, layout: Layout
) -> Iterator[tuple[str, torch.Tensor]]:
    """The state dict of one Megatron rank, one (name, tensor) at a time; `get_hf(name)` reads one
    HF tensor (lazily)."""
    for rule in param_rules(arch, layout):
        yield rule.megatron, to_megatron(rule, [get_hf(n) for n in rule.hf], arch, layout)


def first_different_tensor(saved: ModelArch, mine: ModelArch) -> str | None:
    """The first HF tensor (in the model's order) that one architecture has and the other lacks or
    shapes otherwise, as "name: (saved shape) against (this shape)"; None when they agree."""
    def shapes(arch):
        return {name: hf_shape(name, arch) for rule in param_rules(arch, Layout()) for name in rule.hf}

    theirs, ours = shapes(saved), shapes(mine)
    for name in [*theirs, *(n for n in ours if n not in theirs)]:
        if theirs.get(name) != ours.get(name):
            return f"{name}: {theirs.get(name, 'absent')} against {ours.get(name, 'absent')}"
    return None


def hf_shape(name: str, arch: ModelArch) -> tuple[int, ...]:
    """The shape of an HF tensor of `arch`, by name."""
    h, f, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    if ".mlp.experts." in name:
        f = arch.moe.intermediate_size
    if ".mlp.shared_expert." in name:
        f = arch.moe.shared_intermediate_size
    if name.endswith("mlp.gate.weight"):
        return (arch.moe.num_experts, h)
    if name.endswith("mlp.shared_expert_gate.weight"):
        return (1, h)
    if ".linear_attn." in name:
        return _gdn_shape(name, arch)
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    if name.endswith("q_proj.weight") and arch.attention_output_gate:
        return (2 * q, h)  # [q_h; gate_h] per head
    shapes = {
        "embed_tokens.weight": (arch.vocab_size, h), "lm_head.weight": (arch.vocab_size, h),
        "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h),
        "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
        "o_proj.weight": (h, q), "gate_proj.weight": (f, h), "up_proj.weight": (f, h),
        "down_proj.weight": (h, f), "q_norm.weight": (d,), "k_norm.weight": (d,),
        "layernorm.weight": (h,), "norm.weight": (h,),  # after q_norm/k_norm: suffixes match in order
    }
    for suffix, shape in shapes.items():
        if name.endswith(suffix):
            return shape
    raise KeyError(name)


def _gdn_shape(name: str, arch: ModelArch) -> tuple[int, ...]:
    gdn, h = arch.linear_attention, arch.hidden_size
    qk, v, heads = gdn.num_key_heads * gdn.key_head_dim, gdn.num_value_heads * gdn.value_head_dim, gdn.num_value_heads
    shapes = {"in_proj_qkvz.weight": (2 * qk + 2 * v, h), "in_proj_ba.weight": (2 * heads, h),
              "in_proj_qkv.weight": (2 * qk + v, h), "in_proj_z.weight": (v, h), "in_proj_b.weight": (heads, h),
              "in_proj_a.weight": (heads, h), "conv1d.weight": (2 * qk + v, 1, gdn.conv_kernel),
              "dt_bias": (heads,), "A_log": (heads,), "norm.weight": (gdn.value_head_dim,),
              "out_proj.weight": (h, v)}
    return shapes[name.rsplit(".linear_attn.", 1)[1]]
