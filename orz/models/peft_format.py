"""A LoRA adapter as a PEFT directory: `adapter_config.json` + `adapter_model.safetensors`, the layout
`peft.PeftModel.from_pretrained` and vLLM's LoRA loader read. Tensors are named
`base_model.model.<HF module>.lora_A.weight` (r, in) and `.lora_B.weight` (out, r); the HF modules
of each Megatron target are below (a fused Megatron layer serves several)."""
import json
from pathlib import Path
from typing import Iterable

import torch

from orz.models.spec import LoraSpec

HF_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
              "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def peft_name(hf_weight: str, matrix: str) -> str:
    """`model.layers.0.self_attn.q_proj.weight`, "lora_A" -> `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return f"base_model.model.{hf_weight.removesuffix('.weight')}.{matrix}.weight"


def adapter_config(lora: LoraSpec, base_model: str) -> dict:
    """PEFT's LoraConfig fields for `lora` (no dropout, no bias, plain alpha/r scaling)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
            "fan_in_fan_out": False, "target_modules": sorted(m for t in lora.targets for m in HF_MODULES[t]),
            "modules_to_save": None, "init_lora_weights": True}


def write_adapter(out_dir: str | Path, tensors: Iterable[tuple[str, torch.Tensor]], config: dict) -> Path:
    """Writes the directory (the weights first, the config last: a directory with a config is whole)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({name: t.clone() for name, t in tensors}, out / WEIGHTS)  # a fused layer's modules share one A
    (out / CONFIG).write_text(json.dumps(config, indent=2))
    return out
