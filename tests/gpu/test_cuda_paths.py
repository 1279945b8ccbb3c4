"""The CUDA paths the CPU suite cannot reach: skipped without a GPU; `make test-gpu` on a lent one.

    bash scripts/gpu_wheels.sh        # here: megatron-core and pytest as cp312 wheels in .whl/
    make test-gpu                     # there (device tool, carry .whl): this file; one JSON line at the end

Covers Megatron-core on CUDA with the local layer spec (no Transformer Engine on that machine):
bf16 logits against transformers', one actor step on a Qwen2.5-0.5B-shaped random model with
its MFU, the offload/onload hooks measured by torch.cuda.memory_allocated, and the weight gather
and bucketing on GPU tensors as a CPU-side receiver unpacks them. Not covered (one GPU, no vLLM
there): the NCCL weight-sync group between two ranks and the CUDA vLLM engine.
"""
import json
import os
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
H200_BF16_DENSE_FLOPS = 989e12  # the peak MFU is measured against


@pytest.fixture(scope="module")
def world():
    from orz.models.parallel import host_store, init_model_parallel

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    init_model_parallel(store=host_store("127.0.0.1"))


def _engine(path, optim=True):
    from orz.models.checkpoint import HFCheckpoint
    from orz.models.megatron_model import MegatronModel
    from orz.models.spec import ModelSpec, OptimSpec

    ckpt = HFCheckpoint(path)
    engine = MegatronModel(ckpt.arch, ModelSpec(optim=OptimSpec(lr=1e-5) if optim else None, dtype="bfloat16"))
    engine.load_hf(ckpt)
    return ckpt, engine


REPORT: dict = {}  # check -> its figures, printed as one JSON line when the module is done


@pytest.fixture(scope="module", autouse=True)
def one_json_line():
    yield
    print(json.dumps({"bench": "gpu_checks", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      **REPORT}), flush=True)


def _report(check, **figures):
    REPORT[check] = figures


def test_bf16_logits_match_transformers(world, tmp_path):
    from transformers import AutoModelForCausalLM

    from orz.models.tiny import make_tiny_hf

    path = make_tiny_hf(tmp_path / "llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4,
                        num_heads=8, num_kv_heads=2)
    tokens = torch.randint(0, 512, (2, 64), device="cuda")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        expected = hf(tokens).logits.float()
    _, engine = _engine(path, optim=False)
    engine.model.eval()
    with torch.no_grad():
        logits = engine.full_logits(tokens).float()
    diff = (logits - expected).abs()
    _report("bf16_logits_vs_hf", max_abs_diff=diff.max().item(), mean_abs_diff=diff.mean().item(),
            logit_scale=expected.abs().max().item())
    # bf16 keeps 8 bits of mantissa: both sides round differently at every layer.
    assert diff.mean().item() <= 2e-2 and diff.max().item() <= 0.25


def test_actor_step_on_a_qwen2_0_5b_shaped_model_and_offload(world, tmp_path):
    from orz.models.inputs import ModelInputs
    from orz.models.tiny import make_tiny_hf

    path = make_tiny_hf(tmp_path / "qwen", family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                        num_layers=24, num_heads=14, num_kv_heads=2, tie_word_embeddings=True, dtype=torch.bfloat16)
    ckpt, engine = _engine(path)
    batch, seq = 8, 1024
    tokens = torch.randint(0, 151936, (batch, seq), device="cuda")
    micro = [ModelInputs(tokens)]

    def loss(hidden, _):  # through the LM head, as the log-probs go (orz/models/logprobs.py)
        return (hidden @ engine.lm_head_weight().t()).float().square().mean() * 1e-3, {}

    engine.train_step(micro, loss)  # warm-up: kernels, allocator
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = engine.train_step(micro, loss)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in engine.module.parameters())
    mfu = 6 * params * batch * seq / seconds / H200_BF16_DENSE_FLOPS
    before = torch.cuda.memory_allocated()
    engine.offload()
    torch.cuda.synchronize()
    offloaded = torch.cuda.memory_allocated()
    engine.onload()
    torch.cuda.synchronize()
    onloaded = torch.cuda.memory_allocated()
    again = engine.train_step(micro, loss)
    _report("actor_step_qwen2_0.5b_shape", params=params, tokens=batch * seq, seconds=seconds, mfu=mfu,
            grad_norm=out["grad_norm"], memory_gib={"trained": before / 2**30, "offloaded": offloaded / 2**30,
                                                    "onloaded": onloaded / 2**30})
    assert out["update_ok"] and again["update_ok"] and torch.isfinite(torch.tensor(out["grad_norm"]))
    assert offloaded < before - 2**30  # grads and Adam states (GiBs at 0.5B) left the GPU
    assert onloaded >= before - 2**28


def test_weight_gather_and_buckets_on_gpu_reach_a_cpu_receiver(world, tmp_path):
    from orz.models.tiny import make_tiny_hf
    from orz.rollout.weight_sync import _pack, _unpack, buckets, digest, new_staging

    path = make_tiny_hf(tmp_path / "llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4)
    _, engine = _engine(path, optim=False)
    named = dict(engine.hf_tensors())
    assert all(t.is_cuda for t in named.values())
    staging, received = new_staging("cuda"), {}
    for bucket in buckets(named.items(), bucket_bytes=1 << 20):
        metas, data = _pack(bucket, staging)  # what the sender broadcasts, on the GPU
        received.update(_unpack(metas, data.cpu()))  # what a CPU engine's receiver unpacks
    assert received.keys() == named.keys()
    assert all(torch.equal(received[n], t.cpu()) and digest(received[n]) == digest(t.cpu()) for n, t in named.items())
    _report("weight_buckets_gpu_to_cpu", tensors=len(named), bytes=sum(t.numel() * t.element_size()
                                                                        for t in named.values()))


def test_an_asynchronous_save_finishes_then_loads_back_exactly(world, tmp_path):
    """trainer.async_save's path: Megatron writes the files in the background; orz_checkpoint.json
    (what makes it a checkpoint orz reads) appears only once the save is finished, and a fresh model
    loads back the weights and the optimizer's state exactly."""
    from orz.models import dist_checkpoint
    from orz.models.checkpoint import MEGATRON_META
    from orz.models.inputs import ModelInputs
    from orz.models.tiny import make_tiny_hf

    path = make_tiny_hf(tmp_path / "llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2)
    ckpt, engine = _engine(path)
    tokens = torch.randint(0, 512, (2, 64), device="cuda")
    engine.train_step([ModelInputs(tokens)], lambda hidden, b: (engine.next_token_logprobs(hidden, b.input_ids).mean(), {}))
    start = time.perf_counter()
    request = dist_checkpoint.save(engine, tmp_path / "ck", {"scheduler_steps": 1}, ckpt.config, asynchronous=True)
    returned = time.perf_counter() - start
    saves = dist_checkpoint.PendingSaves()
    saves.add(request)
    assert not (tmp_path / "ck" / MEGATRON_META).exists()  # not a checkpoint until finished
    saves.finish()
    assert (tmp_path / "ck" / MEGATRON_META).is_file()
    _, fresh = _engine(path)
    dist_checkpoint.load(fresh, tmp_path / "ck")
    for (name, a), (_, b) in zip(engine.module.state_dict().items(), fresh.module.state_dict().items()):
        if not name.endswith("_extra_state"):
            assert torch.equal(a, b), name
    _report("async_save", seconds_to_return=returned, seconds_in_all=time.perf_counter() - start)
