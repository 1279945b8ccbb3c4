"""LoRA on the Megatron actor against `peft` on the same tiny HF model and the same adapter: logits,
the adapters' gradients, the first forward, the frozen base, the export in PEFT's layout, at TP 2,
PP 2 and DP 2 (TP 1)."""
import json

import pytest
import torch
from orz.models.checkpoint import HFCheckpoint
from orz.models.local_world import run_world
from orz.rollout.driver import generate
from orz.rollout.engine import SamplingConfig
from orz.rollout.fleet import EngineFleet, FleetConfig
from orz.rollout.weight_sync import TensorSource

from reference_models import reference_models

RANK, ALPHA = 4, 8.0  # scaling 2: a dropped alpha/rank shows
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHARED_A = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # one Megatron layer each: one A
# (tp, pp, dp, distributed optimizer) in one world of 2
LAYOUTS = [(2, 1, 1, False), (1, 2, 1, False), (1, 1, 2, False), (1, 1, 2, True)]
PROMPTS = [[1, 4, 5, 16, 6, 7, 18], [1, 6, 6, 16, 9], [1, 12, 17, 8]]
PROMPT_IDS = [1, 4, 5, 16, 6, 7, 18, 9, 12]
TWO_TARGETS = ("linear_qkv", "linear_fc2")  # the engine test's: adapters on some layers only


def _peft_model(path: str):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0))


def _nll(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """−Σ log p(next token) / the number of predicted tokens."""
    logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None])
    return -logprobs.sum() / tokens[:, 1:].numel()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The base, a random adapter (B nonzero; fused modules' A shared), peft's logits and gradients."""
    tokens, models = reference_models(tmp_path_factory, {"qwen3": dict(
        family="qwen3", vocab_size=101, tie_word_embeddings=True, head_dim=32, num_layers=2)}, seq=12)
    tokens = torch.cat([tokens, tokens[:1].flip(1)])  # 4 rows: 2 per DP replica
    path, _, base_logits = models["qwen3"]
    base_logits = _peft_model(path).base_model.model(tokens).logits.detach()
    model = _peft_model(path)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.base_model.model.model.layers:
            for group in SHARED_A:
                modules = [getattr(layer.self_attn if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else
                                   layer.mlp, name) for name in group]
                for module in modules:
                    module.lora_A["default"].weight.copy_(modules[0].lora_A["default"].weight)
            for name, param in layer.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.2, generator=generator)
    adapter = {name.replace(".default", ""): p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}
    logits = model(tokens).logits
    _nll(logits, tokens).backward()
    grads = {name.replace(".default", ""): p.grad.clone() for name, p in model.named_parameters() if "lora_" in name}
    return dict(path=path, tokens=tokens, base_logits=base_logits, adapter=adapter, logits=logits.detach(), grads=grads)


def _lora_at_layouts(rank, world, layouts, path, tokens, adapter):
    from orz.models.checkpoint import HFCheckpoint
    from orz.models.lora import adapter_layers, adapters_off
    from orz.models.megatron_model import MegatronModel, ModelInputs
    from orz.models.parallel import init_model_parallel
    from orz.models.spec import LoraSpec, ModelSpec, OptimSpec, Sizes
    from megatron.core import parallel_state as ps

    out = {}
    for tp, pp, dp, zero in layouts:
        sizes = Sizes(tp=tp, pp=pp, dp=dp)
        init_model_parallel(sizes)
        ckpt = HFCheckpoint(path)
        optim = OptimSpec(lr=1e-3, clip_grad=1e6, use_distributed_optimizer=zero)
        model = MegatronModel(ckpt.arch, ModelSpec(sizes=sizes, optim=optim, lora=LoraSpec(rank=RANK, alpha=ALPHA)))
        model.load_hf(ckpt)
        rows = tokens.chunk(dp)[ps.get_data_parallel_rank()]
        first = model.full_logits(rows)
        with adapters_off(model.module):
            base = model.full_logits(rows)
        model.load_adapter(adapter)
        logits = model.full_logits(rows)
        with adapters_off(model.module):
            off = model.full_logits(rows)

        def nll(hidden, batch):
            loss = -model.next_token_logprobs(hidden, batch.input_ids).sum() / tokens[:, 1:].numel()
            return loss, {}

        exported = {name: t.clone() for name, t in model.adapter_tensors()}
        grad_norm = model.train_step([ModelInputs(rows)], nll)["grad_norm"]  # clip_grad 1e6: grads unscaled
        stepped = {name: t.clone() for name, t in model.adapter_tensors()}
        trained = {name: p.numel() for name, p in model.module.named_parameters() if p.requires_grad}
        in_optimizer = sum(p.numel() for g in model.optimizer.param_groups for p in g["params"])  # its fp32 masters
        with torch.no_grad():  # the gradients, exported as the adapters are
            for _, layer in adapter_layers(model.module):
                layer.lora_A.copy_(layer.lora_A.main_grad)
                layer.lora_B.copy_(layer.lora_B.main_grad)
        grads = dict(model.adapter_tensors())
        out[tp, pp, dp, zero] = dict(first=first, base=base, logits=logits, off=off, exported=exported, grads=grads,
                                     trained=trained, in_optimizer=in_optimizer, grad_norm=grad_norm, stepped=stepped)
    return out


def test_megatron_lora_matches_peft_at_tp2_pp2_dp2(reference):
    ref = reference
    ranks = run_world(_lora_at_layouts, 2, LAYOUTS, ref["path"], ref["tokens"], ref["adapter"])
    for tp, pp, dp, zero in LAYOUTS:
        results = [r[tp, pp, dp, zero] for r in ranks]
        holders = [r for r in results if r["logits"] is not None]  # the last stage's TP rank 0, per replica
        assert len(holders) == dp
        logits = torch.cat([r["logits"] for r in holders])
        # The first forward (B = 0) is the base's exactly, and the base's is transformers'.
        assert all(torch.equal(r["first"], r["base"]) for r in holders)
        assert (torch.cat([r["base"] for r in holders]) - ref["base_logits"]).abs().max() < 1e-4
        # With the adapter: peft's logits; with it off: the base's again.
        assert (logits - ref["logits"]).abs().max() < 1e-4, (tp, pp, dp)
        assert (torch.cat([r["off"] for r in holders]) - ref["base_logits"]).abs().max() < 1e-4
        # Only the adapters train: 2 matrices × 4 layers per transformer layer, over this rank's stage;
        # the optimizer holds their elements only, split over DP by the distributed optimizer.
        for r in results:
            assert r["trained"] and all(name.rsplit(".", 1)[1] in ("lora_A", "lora_B") for name in r["trained"])
            assert len(r["trained"]) == 2 * 4 * 2 // pp
        adapter_elements = [sum(r["trained"].values()) for r in results]
        if zero:
            assert adapter_elements[0] == adapter_elements[1] == sum(r["in_optimizer"] for r in results)
            assert all(0 < r["in_optimizer"] < adapter_elements[0] for r in results)
        else:
            assert [r["in_optimizer"] for r in results] == adapter_elements
        # The export, on rank 0 only: peft's tensors bit for bit; the gradients: peft's, a shared A's
        # the sum of its modules'.
        exported, grads = results[0]["exported"], results[0]["grads"]
        assert all(r["exported"] == {} for r in results[1:])
        assert exported.keys() == ref["adapter"].keys()
        for name, tensor in ref["adapter"].items():
            assert torch.equal(exported[name], tensor), name
        # One Adam step from the same gradients: the distributed optimizer's adapters are the plain one's.
        if zero:
            plain = ranks[0][tp, pp, dp, False]["stepped"]
            assert plain.keys() == results[0]["stepped"].keys() == exported.keys()
            assert all(not torch.equal(plain[name], exported[name]) for name in plain)  # the premise: it stepped
            assert all((results[0]["stepped"][name] - plain[name]).abs().max() <= 1e-6 for name in plain)
            assert all(r["grad_norm"] == pytest.approx(ranks[0][tp, pp, dp, False]["grad_norm"], rel=1e-6)
                       for r in results)
            continue  # its gradients are reduce-scattered: each rank holds its shard's only
        squares = 0.0  # Σ g² over Megatron's parameters: each B once, each shared A once
        for name, want in ref["grads"].items():
            group = next((g for g in SHARED_A if any(f".{m}." in name for m in g)), None)
            if "lora_A" in name and group:
                want = sum(ref["grads"][name.replace(f".{m0}.", f".{m}.")] for m in group
                           for m0 in group if f".{m0}." in name)
            assert (grads[name] - want).abs().max() <= 1e-4 * want.abs().max(), (tp, pp, dp, name)
            squares += float(want.square().sum()) if "lora_B" in name or not group or f".{group[0]}." in name else 0.0
        # The optimizer's norm counts a TP-split matrix over every rank, a replicated one once.
        assert all(r["grad_norm"] == pytest.approx(squares ** 0.5, rel=1e-4) for r in results), (tp, pp, dp)


def _trained_adapter(rank, world, path, tokens):
    """A TP 2 LoRA actor after two Adam steps on `tokens`: its adapter (PEFT names), its merged
    weights and its base weights, as the engines and exports take them."""
    from orz.models.checkpoint import HFCheckpoint
    from orz.models.megatron_model import MegatronModel, ModelInputs
    from orz.models.parallel import init_model_parallel
    from orz.models.spec import LoraSpec, ModelSpec, OptimSpec, Sizes

    sizes = Sizes(tp=2)
    init_model_parallel(sizes)
    ckpt = HFCheckpoint(path)
    model = MegatronModel(ckpt.arch, ModelSpec(sizes=sizes, optim=OptimSpec(lr=0.05, clip_grad=100.0),
                                               lora=LoraSpec(rank=RANK, alpha=ALPHA, targets=TWO_TARGETS)))
    model.load_hf(ckpt)

    def nll(hidden, batch):
        return -model.next_token_logprobs(hidden, batch.input_ids).sum() / tokens[:, 1:].numel(), {}

    grad_norms = [model.train_step([ModelInputs(tokens)], nll)["grad_norm"] for _ in range(2)]
    return dict(adapter={n: t.clone() for n, t in model.adapter_tensors()}, merged=dict(model.hf_tensors(merged=True)),
                base=dict(model.hf_tensors()), grad_norms=grad_norms)


def test_the_engine_serves_the_synced_adapter_as_peft_and_the_merged_model_compute(ray_cluster, arith_qwen3, tmp_path):
    """After a LoRA update at TP 2 (adapters on linear_qkv and linear_fc2 only), the adapter alone is
    synced (its bytes: Σ r·(in + out) over q, k, v and down_proj, fp32), the engine serves it, and its log-probs of what it sampled equal peft's on the
    exported adapter directory and transformers' on the merged weights; the base is untouched."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from orz.models.checkpoint import save_hf
    from orz.models.peft_format import adapter_config, write_adapter
    from orz.models.spec import LoraSpec

    ckpt = HFCheckpoint(arith_qwen3)
    tokens = torch.tensor([PROMPT_IDS * 3])
    actor = run_world(_trained_adapter, 2, arith_qwen3, tokens)[0]
    assert min(actor["grad_norms"]) > 0  # the premise: the adapter trained
    for name, tensor in actor["base"].items():  # the base stays the base
        assert torch.equal(tensor, ckpt.get(name)), name
    config = adapter_config(LoraSpec(rank=RANK, alpha=ALPHA, targets=TWO_TARGETS), arith_qwen3)
    exported = write_adapter(tmp_path / "adapter", actor["adapter"].items(), config)
    save_hf(tmp_path / "merged", actor["merged"].items(), ckpt.config, extra_files_from=arith_qwen3)
    arch = ckpt.arch
    # q, k, v and down_proj only (actor.lora.targets=[linear_qkv, linear_fc2]), (out, in) each
    shapes = [(arch.num_heads * arch.head_dim, arch.hidden_size)] + [(arch.num_kv_heads * arch.head_dim, arch.hidden_size)] * 2 \
        + [(arch.hidden_size, arch.intermediate_size)]
    adapter_bytes = arch.num_layers * sum(RANK * (into + out) for out, into in shapes) * 4

    fleet = EngineFleet(arith_qwen3, FleetConfig(num_engines=1, engine_args={"max_model_len": 256}, kv_cache_gib=1,
                                                 adapter=config))
    try:
        fleet.sync(TensorSource(actor["adapter"]), version=1)
        sent_bytes = sum(t.numel() * t.element_size() for t in actor["adapter"].values())
        assert fleet.sent_digests.keys() == actor["adapter"].keys() and sent_bytes == adapter_bytes
        samples = generate(fleet, PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=10, n=2, seed=3))
    finally:
        fleet.shutdown()
    served = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(arith_qwen3, dtype=torch.float32), exported)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(arith_qwen3, dtype=torch.float32)
    moved = 0.0
    for sample in samples:
        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        got = torch.tensor(sample.logprobs)
        for reference in (served, merged):
            assert torch.allclose(got, _response_logprobs(reference, ids, len(sample.prompt_ids)), atol=1e-3)
        moved = max(moved, (got - _response_logprobs(base, ids, len(sample.prompt_ids))).abs().max().item())
    assert moved > 0.05  # the premise: the trained adapter moved the log-probs beyond the bound, 50×


def _response_logprobs(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    with torch.no_grad():
        logprobs = model(ids).logits[0, :-1].float().log_softmax(-1)
    return logprobs[prompt_len - 1:].gather(1, ids[0, prompt_len:, None])[:, 0]


def test_grpo_with_lora_through_orz_train_trains_the_adapter_against_its_own_base_and_resumes_exactly(
        ray_cluster, tiny_run, arith_model, tmp_path):
    """GRPO with rank-8 adapters, a KL term and a shaped reward (the share of spaces): no reference role
    starts (the KL's reference is the actor with its adapters off: 0 at the first iteration, where
    B = 0, and not after), the adapters train and the reward rises, the engines serve each version's
    adapter (their log-probs of their own samples are the actor's π_old), the run ends with a PEFT
    adapter that peft loads and the merged model. Its checkpoints hold the adapters (and their
    optimizer) for a base named by path and fingerprint: a resume from iteration 4 repeats the rest
    exactly, at TP 2 within 1e-5, and onto another base is refused."""
    import shutil

    from megatron.core.dist_checkpointing import load_tensors_metadata
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from orz.config import ConfigError, load_config
    from orz.convert import mcore2hf
    from orz.models.checkpoint import read_megatron_meta, weights_fingerprint
    from orz.train import run as train
    from run_history import deterministic, history

    def overrides(out):
        return [*tiny_run(out, "grpo", iterations=6), "actor.lora.rank=8", "actor.lora.alpha=16", "actor.lr=5e-3",
                "actor.lora.export_merged=true", "algorithm.kl_coef=0.01", "rollout.stop=[]", "data.eval={}",
                "reward.custom={spaces: 'shaped_reward:space_share'}", "reward.weights={spaces: 1.0}",
                "trainer.save_every=4", "trainer.dump_per_token=true"]

    out = tmp_path / "run"
    train(load_config(None, overrides(out)))
    rows = history(out)[1:]
    assert all(row["actor/grad_norm"] > 0 for row in rows)
    # k1 = log π − log π_ref per token: exactly 0 while B = 0, then a trained adapter's own share
    assert rows[0]["actor/kl_ref"] == 0.0 and all(row["actor/kl_ref"] != 0.0 for row in rows[1:])
    rewards = [row["reward/mean"] for row in rows]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.02, rewards  # measured 0.0145 -> 0.08
    logs = {p.name.split("-")[0] for p in (out / "logs").iterdir()}
    assert "actor" in logs and "ref" not in logs, logs
    # The engines served the trained adapter: their log-probs of what they sampled in iteration 3 are
    # the actor's own π_old (taken by Megatron with the adapters on).
    for sample in map(json.loads, (out / "samples" / "iter_000003.jsonl").read_text().splitlines()):
        gap = max(abs(a - b) for a, b in zip(sample["rollout_logprobs"], sample["old_logprobs"]))
        assert gap < 1e-3, gap
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 16.0)  # actor.lora.rank and alpha reached the model
    served = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(arith_model, dtype=torch.float32),
                                       out / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        assert (served(ids).logits - merged(ids).logits).abs().max() < 1e-4
    # Any LoRA checkpoint exports as the run did: its adapter, or the merged model (`orz convert mcore2hf`).
    last = out / "checkpoints" / "iter_000006" / "actor"
    again = load_file(mcore2hf(str(last), str(tmp_path / "adapter"), None) / "adapter_model.safetensors")
    assert again.keys() == load_file(out / "adapter" / "adapter_model.safetensors").keys()
    assert all(torch.equal(t, load_file(out / "adapter" / "adapter_model.safetensors")[n]) for n, t in again.items())
    merged_again = load_file(mcore2hf(str(last), str(tmp_path / "merged"), None, merged=True) / "model.safetensors")
    assert all(torch.equal(t, load_file(out / "hf" / "model.safetensors")[n]) for n, t in merged_again.items())
    # The checkpoint holds the adapters and their optimizer only, and names its base by a fingerprint.
    saved = out / "checkpoints" / "iter_000004"
    keys = load_tensors_metadata(str(saved / "actor")).keys()
    assert keys and all("lora_" in key for key in keys if "decoder.layers" in key), sorted(keys)[:5]
    assert not [key for key in keys if "embedding" in key or "final_layernorm" in key]
    assert read_megatron_meta(saved / "actor")["lora_base"] == {"path": arith_model,
                                                                "fingerprint": weights_fingerprint(arith_model)}
    whole = {row["step"]: row for row in history(out)}
    branch = tmp_path / "branch"
    train(load_config(None, [*overrides(branch), f"trainer.resume_from={saved}"]))
    resumed = history(branch)
    assert [row["step"] for row in resumed] == [5, 6]
    assert all(deterministic(row) == deterministic(whole[row["step"]]) for row in resumed)
    # At TP 2 the adapters are re-cut (B of linear_qkv/fc1 by rows, A of linear_proj/fc2 by columns):
    # the same samples, the update's figures within 1e-5 (sums in another order). This branch syncs
    # the merged weights (rollout.lora_sync=merged), which the engines hold exactly as sent
    # (sync_check=held reads them back) and sample from as the actor computes.
    tp2 = tmp_path / "tp2"
    train(load_config(None, [*overrides(tp2), "trainer.iterations=5", "actor.tp=2", "rollout.lora_sync=merged",
                             "rollout.sync_check=held", f"trainer.resume_from={saved}"]))
    again = history(tp2)[0]
    assert again["step"] == 5 and again["reward/mean"] == whole[5]["reward/mean"]
    for key in ("actor/grad_norm", "actor/pg_loss", "actor/entropy", "actor/kl_ref"):
        assert again[key] == pytest.approx(whole[5][key], rel=1e-5, abs=1e-9), key
    for sample in map(json.loads, (tp2 / "samples" / "iter_000005.jsonl").read_text().splitlines()):
        assert max(abs(a - b) for a, b in zip(sample["rollout_logprobs"], sample["old_logprobs"])) < 1e-3
    # Onto another base (the same architecture, other weights) the adapters are refused before start.
    other = tmp_path / "other_base"
    shutil.copytree(arith_model, other)
    weights = load_file(other / "model.safetensors")
    save_file({name: t + 0.01 for name, t in weights.items()}, other / "model.safetensors")
    with pytest.raises(ConfigError, match=f"trained on the base model {arith_model}, whose weights differ from "
                                          f"this run's model.path={other}"):
        train(load_config(None, [*overrides(tmp_path / "refused"), f"model.path={other}",
                                 f"trainer.resume_from={saved}"]))


@pytest.mark.parametrize("overrides,arch,expected", [
    (["actor.lora.rank=-1"], None, "actor.lora.rank=-1"),
    (["actor.lora.rank=8", "actor.lora.alpha=0"], None, "actor.lora.alpha=0"),
    (["actor.lora.rank=8", "actor.lora.targets=[linear_qkv, q_proj]"], None,
     "actor.lora.targets=['linear_qkv', 'q_proj']: ['q_proj']; this model's layers that take an adapter are "
     "['linear_qkv', 'linear_fc1', 'linear_proj', 'linear_fc2']"),
    (["actor.lora.rank=1024"], None, "actor.lora.rank=1024 is above the engines' LoRA rank bound (512"),
    (["actor.lora.rank=8", "critic.lora.rank=8", "algorithm.advantage=gae"], None,
     "critic.lora.rank=8: adapters are built for the actor only"),
    (["actor.lora.rank=8", "rollout.sync_check=held"], None, "rollout.sync_check=held reads the engines' base"),
    (["actor.lora.rank=8"], "Qwen3-30B-A3B", "is a mixture of experts, whose adapters"),
    (["actor.lora.rank=8"], "Qwen3.5-27B", "is a Gated DeltaNet hybrid, whose adapters"),
    (["actor.lora.alpha=8", "rollout.lora_sync=merged"], None,
     "actor.lora.alpha, rollout.lora_sync set while actor.lora.rank=0 (LoRA off)"),
])
def test_lora_settings_that_cannot_take_effect_are_refused_naming_the_key(tmp_path, overrides, arch, expected):
    from orz.config import ConfigError, load_config
    from orz.models.presets import MODELS
    from orz.run import run_rules

    cfg = load_config(None, [f"trainer.output_dir={tmp_path}", *overrides])
    with pytest.raises(ConfigError, match="") as err:
        run_rules.check(cfg, MODELS[arch] if arch else None)
    assert expected in str(err.value)


def test_a_rank_within_vllms_bound_is_taken_and_the_bound_is_vllms_own():
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    from orz.config import VLLM_LORA_RANKS
    from orz.rollout.engine import lora_rank_bound

    assert VLLM_LORA_RANKS == get_args(MaxLoRARanks)
    assert [lora_rank_bound(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
