"""Tiny HF models built locally and transformers' own logits on them: the independent reference
that the Megatron parity tests (test_models, test_models_moe) compare against."""
import torch

from orz.models.tiny import make_tiny_hf


def reference_models(tmp_path_factory, models: dict[str, dict], seq: int, **common):
    """tokens (3, seq) and, per name of `models` (make_tiny_hf's arguments, beside `common`),
    (the model's directory, the transformers model, its fp32 logits on the tokens)."""
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, 96, (3, seq), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, kwargs in models.items():
        path = make_tiny_hf(tmp_path_factory.mktemp(name), **common, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            out[name] = (str(path), model, model(tokens).logits)
    return tokens, out


def logits_and_exports(rank, world, tokens, paths: dict[str, str], layouts: list[tuple[int, int, int]]) -> dict:
    """A local world's rank function (run_world): for each (tp, pp, ep) layout and each model of
    `paths`, Megatron's full logits on `tokens` (None but on the last stage's TP rank 0 of each
    replica) and its export (empty but on rank 0), keyed (tp, pp, ep, name)."""
    from orz.models.checkpoint import HFCheckpoint
    from orz.models.megatron_model import MegatronModel
    from orz.models.parallel import init_model_parallel
    from orz.models.spec import ModelSpec, Sizes

    result = {}
    for tp, pp, ep in layouts:
        sizes = Sizes(tp=tp, pp=pp, ep=ep)
        init_model_parallel(sizes)
        for name, path in paths.items():
            ckpt = HFCheckpoint(path)
            engine = MegatronModel(ckpt.arch, ModelSpec(sizes=sizes))
            engine.load_hf(ckpt)
            result[tp, pp, ep, name] = {"logits": engine.full_logits(tokens), "exported": dict(engine.hf_tensors())}
    return result


def check_logits_and_export(results: list[dict], replicas: int, path: str, ref_logits: torch.Tensor) -> None:
    """One layout's `logits_and_exports` results, rank by rank: logits from one rank per DP replica,
    each within 1e-4 of transformers'; rank 0's export bit for bit the checkpoint; no other rank's."""
    from safetensors.torch import load_file

    logits = [r["logits"] for r in results if r["logits"] is not None]
    assert len(logits) == replicas  # the last stage's TP rank 0 of each DP replica
    for out in logits:
        assert (out - ref_logits).abs().max() < 1e-4
    original, exported = load_file(f"{path}/model.safetensors"), results[0]["exported"]
    assert exported.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
    assert all(r["exported"] == {} for r in results[1:])
