"""Qwen3-MoE in Megatron against transformers: logits at EP ∈ {1, 2} × TP ∈ {1, 2} and PP=2 with
EP=2, both routings (norm_topk_prob on and off), dense layers among sparse ones, and the export
(experts gathered over EP) bit-exact. One world of 4 ranks runs every layout (the rest of it is
DP) and checks both models in each: a world costs far more to start than a tiny forward."""
import pytest
import torch

from orz.models.arch import read_arch
from orz.models.local_world import run_world
from reference_models import check_logits_and_export, logits_and_exports, reference_models

EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
MODELS = {
    # layer 2 dense (mlp_only_layers), the others sparse; renormalised top-k weights; untied
    "norm_topk": dict(vocab_size=101, moe=EXPERTS | dict(norm_topk_prob=True, mlp_only_layers=[2])),
    # every second layer sparse (layers 1 and 3); raw softmax weights; tied; head_dim 32 != 64 / 4
    "raw_topk": dict(vocab_size=96, tie_word_embeddings=True,
                     moe=EXPERTS | dict(norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[])),
}
LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 1), (2, 1, 2), (1, 2, 2)]  # (tp, pp, ep)
WORLD = 4
SEQ = 20


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tokens, models = reference_models(tmp_path_factory, MODELS, SEQ, family="qwen3_moe", num_layers=4, head_dim=32)
    return tokens, {name: (path, logits) for name, (path, _, logits) in models.items()}


def test_arch_reads_the_expert_fields(checkpoints):
    _, ckpts = checkpoints
    norm, raw = (read_arch(ckpts[n][0]).moe for n in ("norm_topk", "raw_topk"))
    assert (norm.num_experts, norm.top_k, norm.intermediate_size, norm.norm_topk_prob) == (4, 2, 32, True)
    assert norm.layers == (0, 1, 3) and raw.layers == (1, 3) and not raw.norm_topk_prob


@pytest.fixture(scope="module")
def ranks(checkpoints):
    tokens, ckpts = checkpoints
    return run_world(logits_and_exports, WORLD, tokens, {name: path for name, (path, _) in ckpts.items()}, LAYOUTS,
                     timeout=600)


@pytest.mark.parametrize("tp,pp,ep", LAYOUTS)
@pytest.mark.parametrize("name", MODELS)
def test_moe_logits_match_transformers_and_export_is_exact(tp, pp, ep, name, checkpoints, ranks):
    check_logits_and_export([r[tp, pp, ep, name] for r in ranks], WORLD // (tp * pp), *checkpoints[1][name])


AUX_COEF = 0.01


def _train_steps(rank, world, tokens, path):
    """On a world of 2 (DP=2, each rank its share of `tokens`): one NLL step at EP=1 and at EP=2
    from the same weights, then one step of the load-balancing loss alone (both ranks on all
    of `tokens`) at EP=2."""
    from orz.models.checkpoint import HFCheckpoint
    from orz.models.megatron_model import MegatronModel, ModelInputs
    from orz.models.parallel import init_model_parallel
    from orz.models.spec import ModelSpec, OptimSpec, Sizes

    ckpt = HFCheckpoint(path)
    optim = OptimSpec(lr=1e-3, clip_grad=100.0, adam_eps=1e-6)  # eps: see test_models' train step
    total_tokens = tokens[:, 1:].numel()

    def nll(hidden, batch):
        logprobs = engine.next_token_logprobs(hidden, batch.input_ids)
        loss = -logprobs.sum() / total_tokens
        return loss, {"loss": loss.detach()}

    result = {}
    # Replicas with unlike passes (token budgets do that): two of 1 row (one narrower) on rank 0,
    # one of 2 rows on rank 1; the experts' collectives still pair them up.
    mine = [tokens[:1], tokens[1:2, :15]] if rank == 0 else [tokens[2:]]
    # Packed at EP=2, the replicas pack S and 2·S tokens, then 15 and none: evened in tokens (a row
    # of padding on rank 0, a micro-batch of padding on rank 1), which the load-balancing loss leaves
    # out. The all-to-all dispatcher sends each rank its experts' tokens only, in uneven splits.
    steps = [(1, False, 0.0, "allgather"), (2, False, 0.0, "allgather"), (2, True, 0.0, "allgather"),
             (2, False, AUX_COEF, "allgather"), (2, True, AUX_COEF, "allgather"), (2, False, 0.0, "alltoall"),
             (2, True, AUX_COEF, "alltoall")]
    for ep, packed, aux, dispatcher in steps:
        init_model_parallel(Sizes(ep=ep))
        engine = MegatronModel(ckpt.arch, ModelSpec(sizes=Sizes(ep=ep), optim=optim, moe_aux_loss_coef=aux,
                                                    moe_dispatcher=dispatcher))
        engine.load_hf(ckpt)
        inputs = [ModelInputs(t, padding=torch.zeros(t.shape, dtype=torch.bool),
                              lengths=torch.full((len(t),), t.shape[1]) if packed else None) for t in mine]
        out = engine.train_step(inputs, nll)
        assert ("moe_aux_loss" in out) == (aux > 0)  # off by default
        result[ep, packed, aux, dispatcher] = {"loss": sum(m["loss"] for m in out["metrics"]).item(), "grad_norm": out["grad_norm"],
                                   "weights": dict(engine.hf_tensors()), "moe_aux_loss": out.get("moe_aux_loss"),
                                   "dispatchers": {type(m.token_dispatcher).__name__ for m in engine.module.modules()
                                                   if hasattr(m, "token_dispatcher")},
                                   "passes": [(tuple(p.input_ids.shape), p.lengths.tolist() if p.lengths is not None
                                               else None) for p, _ in engine._even_shapes(inputs)]}
    engine = MegatronModel(ckpt.arch, ModelSpec(sizes=Sizes(ep=ep), optim=optim, moe_aux_loss_coef=AUX_COEF))
    engine.load_hf(ckpt)
    out = engine.train_step([ModelInputs(t) for t in _aux_micro_batches(tokens)],
                            lambda logits, batch: (0.0 * logits.sum(), {}))
    result["aux"] = {"moe_aux_loss": out["moe_aux_loss"], "grad_norm": out["grad_norm"]}
    return result


def _aux_micro_batches(tokens):
    """The load-balancing step's micro-batches on each rank: 1 row of S tokens, then 3 rows of 15."""
    return [tokens[:1], tokens[1:, :15]]


def test_moe_train_step_ep2_matches_ep1_and_aux_loss_matches_transformers(checkpoints):
    """EP moves experts, not math: loss, gradient norm and updated weights agree at DP=2 with EP=1
    and EP=2. The load-balancing loss and its gradient are transformers' (per sparse layer
    E·Σ_e f_e·P̄_e, f_e the share of top-k picks), divided by top-k as Megatron defines it, over
    micro-batches of unlike sizes weighted by their tokens (a plain mean's gradient is 21% off)."""
    from transformers import AutoModelForCausalLM

    tokens, ckpts = checkpoints
    path = ckpts["norm_topk"][0]
    tokens = torch.cat([tokens, tokens.flip(0)])[:4]
    ranks = run_world(_train_steps, 2, tokens, path)
    s = tokens.shape[1]
    assert [r[2, True, 0.0, "allgather"]["passes"] for r in ranks] == [
        [((2, s), [s, s]), ((1, 15), [15])], [((2, s), [s, s]), ((1, 15), None)]]  # the premises
    assert ranks[0][2, False, 0.0, "alltoall"]["dispatchers"] == {"MoEAlltoAllTokenDispatcher"}
    assert ranks[0][2, False, 0.0, "allgather"]["dispatchers"] == {"MoEAllGatherTokenDispatcher"}
    one = ranks[0][1, False, 0.0, "allgather"]
    for key in ((2, False, 0.0, "allgather"), (2, True, 0.0, "allgather"), (2, False, 0.0, "alltoall")):
        two = ranks[0][key]  # EP=2 padded, packed, and through the all-to-all dispatcher
        assert abs(one["loss"] - two["loss"]) <= 1e-5 * abs(one["loss"])
        assert abs(one["grad_norm"] - two["grad_norm"]) <= 1e-5 * one["grad_norm"]
        for name, w in one["weights"].items():
            assert (w - two["weights"][name]).abs().max() < 1e-5, name
    padded = ranks[0][2, False, AUX_COEF, "allgather"]
    for packed in (ranks[0][2, True, AUX_COEF, "allgather"], ranks[0][2, True, AUX_COEF, "alltoall"]):
        assert abs(padded["moe_aux_loss"] - packed["moe_aux_loss"]) <= 1e-5 * padded["moe_aux_loss"]
        assert abs(padded["grad_norm"] - packed["grad_norm"]) <= 1e-5 * padded["grad_norm"]

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    moe = read_arch(path).moe
    router_logits = hf(tokens, output_router_logits=True).router_logits  # one (B·S, E) per sparse layer
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    # Per micro-batch m of n_m tokens and sparse layer l, aux_ml; the objective is their token-weighted
    # mean c·Σ_m n_m·Σ_l aux_ml / (k·Σ_m n_m) (both ranks hold the same micro-batches: DP's sum of
    # their gradients over N = 2·Σ_m n_m is the same), the metric their plain mean over m and l, / k.
    micro = _aux_micro_batches(tokens)
    per_layer = torch.stack([torch.stack([load_balancing_loss_func((g,), moe.num_experts, moe.top_k)
                                          for g in hf(t, output_router_logits=True).router_logits]) for t in micro])
    sizes = torch.tensor([float(t.numel()) for t in micro])
    (AUX_COEF * (sizes[:, None] * per_layer).sum() / (moe.top_k * sizes.sum())).backward()
    ref_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in hf.parameters() if p.grad is not None)).item()
    aux = ranks[0]["aux"]
    assert abs(aux["moe_aux_loss"] - per_layer.mean().item() / moe.top_k) < 1e-6
    assert ref_norm > 0 and abs(aux["grad_norm"] - ref_norm) <= 1e-4 * ref_norm
