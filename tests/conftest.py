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
    """One local Ray cluster for the whole test session."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
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


@pytest.fixture(scope="session")
def arith_model(tmp_path_factory):
    """A tiny random Llama whose character tokenizer covers the arithmetic task's text."""
    from orz.data.synthetic import arithmetic_rows
    from orz.data.templates import ThinkAnswerTemplate
    from orz.data.tokenizers import char_tokenizer
    from orz.models.tiny import make_tiny_hf

    path = tmp_path_factory.mktemp("arith_llama")
    rows = arithmetic_rows(200, seed=0, digits=(1, 2))
    texts = [ThinkAnswerTemplate("Compute.").prompt(r["prompt"]) + r["solution"] for r in rows]
    tokenizer = char_tokenizer(texts)
    tokenizer.save_pretrained(path)
    make_tiny_hf(path, vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2,
                 num_layers=2, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id)
    return str(path)
