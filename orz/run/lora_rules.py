"""What a LoRA run must satisfy (docs/lora.md), checked before any worker starts: adapters on the
actor only, on layers that exist and that vLLM can serve, with settings that take effect.

    lora_problems(cfg, arch)           # one line per problem, naming the key
    base_problems(ckpt, cfg)           # a checkpoint's adapters against this run's base model
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from orz.config import VLLM_LORA_RANKS, ExperimentConfig, LoraConfig, RolloutConfig
from orz.models.spec import LORA_TARGETS


def lora_problems(cfg: ExperimentConfig, arch) -> list[str]:
    lora = cfg.actor.lora
    problems = [f"{name}.lora.rank={role.lora.rank}: adapters are built for the actor only (a critic's LoRA is "
                "not built; a frozen role trains nothing); remove it"
                for name, role in (("critic", cfg.critic), ("ref", cfg.ref), ("reward.model", cfg.reward.model),
                                   *((f"teachers.{n}", t) for n, t in cfg.teachers.items()))
                if role.lora.rank > 0]
    if lora.rank == 0:
        unused = [f"actor.lora.{f.name}" for f in fields(LoraConfig)
                  if f.name != "rank" and getattr(lora, f.name) != getattr(LoraConfig(), f.name)]
        if cfg.rollout.lora_sync != RolloutConfig.lora_sync:
            unused.append("rollout.lora_sync")
        return problems + ([f"{', '.join(unused)} set while actor.lora.rank=0 (LoRA off): set a rank, or unset them"]
                           if unused else [])
    unknown = [t for t in lora.targets if t not in LORA_TARGETS]
    if unknown or not lora.targets:
        problems.append(f"actor.lora.targets={lora.targets}: {unknown or 'none given'}; this model's layers that take "
                        f"an adapter are {list(LORA_TARGETS)} (Megatron's names: q/k/v, o, gate/up, down)")
    adapter = cfg.rollout.lora_sync == "adapter"
    if adapter and lora.rank > max(VLLM_LORA_RANKS):
        problems.append(f"actor.lora.rank={lora.rank} is above the engines' LoRA rank bound ({max(VLLM_LORA_RANKS)}, "
                        "vLLM's largest max_lora_rank): lower it, or set rollout.lora_sync=merged")
    if adapter and cfg.rollout.sync_check == "held":
        problems.append("rollout.sync_check=held reads the engines' base weights back, and with "
                        "rollout.lora_sync=adapter a sync carries the adapter only: use sync_check=received")
    if arch is not None and (arch.moe or arch.linear_attention):
        kind = "a mixture of experts" if arch.moe else "a Gated DeltaNet hybrid"
        problems.append(f"actor.lora.rank={lora.rank}: {cfg.model.path} is {kind}, whose adapters (experts, GDN "
                        "projections) are not built; LoRA runs on dense Llama/Qwen2/Qwen3 models")
    return problems


def base_problems(ckpt: Path, cfg: ExperimentConfig) -> list[str]:
    """A resume whose actor checkpoint holds adapters for another base than model.path (by the
    fingerprint of its weights), or holds LoRA where the run has none, or the reverse."""
    from orz.models.checkpoint import read_megatron_meta, weights_fingerprint

    saved = read_megatron_meta(ckpt / "actor").get("lora_base")
    rank = cfg.actor.lora.rank
    if bool(saved) != bool(rank):
        held = f"LoRA adapters for {saved['path']}" if saved else "the whole actor (no adapters)"
        return [f"{ckpt / 'actor'} holds {held}, and this run has actor.lora.rank={rank}: resume with the "
                "setting it was saved with"]
    if saved and saved["fingerprint"] != weights_fingerprint(cfg.model.path):
        return [f"{ckpt / 'actor'}: its adapters were trained on the base model {saved['path']}, whose weights "
                f"differ from this run's model.path={cfg.model.path}; resume on the base they were trained on"]
    return []
