"""The reward-model role: an HF sequence-classification checkpoint (Llama, Llama with 3.1's RoPE
scaling, Qwen2, Qwen3) loaded as a Megatron role with its scalar head, its score read at each
sequence's last token, equal to transformers' own score at TP 1 and 2 and at PP 2; a head that is
not scalar is refused by name."""
import pytest
import torch

from orz.config import RoleConfig
from orz.models.local_world import run_world
from orz.ppo.workers import MegatronWorker
from orz.ppo.experience import experience_from_rollouts
from worker_specs import worker_spec


def make_reward_model(path, family="llama", num_labels=1, seed=0):
    """A random tiny sequence classifier, as `AutoModelForSequenceClassification` writes one."""
    import transformers

    prefix = {"llama": "Llama", "llama31": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    config_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix}ForSequenceClassification")
    # Llama 3.1's RoPE scaling, its original length 8 shorter than the sequences
    scaled = dict(rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                         high_freq_factor=4.0, original_max_position_embeddings=8))
    config = config_cls(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_labels=num_labels, pad_token_id=0,
                        max_position_embeddings=256, tie_word_embeddings=False,
                        head_dim=32 if family == "qwen3" else 16,  # Qwen3's need not be hidden / heads
                        **(scaled if family == "llama31" else {}))
    torch.manual_seed(seed)
    model = model_cls(config).float()
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # a head that tells sequences apart
        for layer in model.model.layers if family == "qwen3" else []:
            layer.self_attn.q_norm.weight.normal_(1.0, 0.2)  # q/k norm weights that matter
            layer.self_attn.k_norm.weight.normal_(1.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model


def _rollouts():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in torch.randint(3, 7, (6,), generator=g)]
    responses = [torch.randint(1, 64, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (6,), generator=g)]
    return prompts, responses


def _scores(rank, world, path, tp, pp=1):
    prompts, responses = _rollouts()
    exp = experience_from_rollouts(prompts, responses, [[0.0] * len(r) for r in responses], pad_id=0)
    spec = worker_spec(path, RoleConfig(tp=tp, pp=pp, micro_batch_size=4), name="reward_model")
    import os

    worker = MegatronWorker(spec, rank, world)
    worker.setup((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
    out = worker.scores(exp)
    return None if out is None else (out[1], exp.response_mask)


@pytest.mark.parametrize("family, tp, pp", [("llama31", 1, 1), ("llama", 2, 1), ("qwen2", 2, 1), ("llama", 1, 2),
                                            ("qwen3", 2, 1)])
def test_scores_equal_transformers_at_tp_and_pp(tmp_path, family, tp, pp):
    model = make_reward_model(tmp_path / "rm", family)
    by_token, mask = next(r for r in run_world(_scores, tp * pp, str(tmp_path / "rm"), tp, pp) if r is not None)
    last = mask.long().sum(1) - 1
    assert (by_token != 0).sum(1).le(1).all()  # the score sits on the last response token only
    assert torch.equal(by_token.abs().argmax(1), last)
    prompts, responses = _rollouts()
    with torch.no_grad():
        expected = torch.stack([model(torch.tensor([p + r])).logits[0, 0] for p, r in zip(prompts, responses)])
    torch.testing.assert_close(by_token.sum(1), expected, atol=1e-4, rtol=0)


def test_a_head_that_is_not_scalar_is_refused(tmp_path):
    make_reward_model(tmp_path / "rm", num_labels=3)
    with pytest.raises(RuntimeError, match=r"score.weight has shape \(3, 64\); a reward model's head must be scalar"):
        run_world(_scores, 1, str(tmp_path / "rm"), 1)


def make_digit_counter(path, texts, extra_chars="!"):
    """A reward model whose score rises with the share of digits in the sequence, built by hand:
    one layer whose attention is uniform (zero queries and keys) and averages a "digit" coordinate
    of the embeddings into the residual, where the head reads it. Its tokenizer numbers the
    characters differently from the policy's (`extra_chars` shift them), so the trainer must
    re-tokenize the text for it."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from orz.data.tokenizers import char_tokenizer

    tokenizer = char_tokenizer([*texts, extra_chars, "0123456789"])
    tokenizer.save_pretrained(path)
    hidden, heads = 64, 4
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=heads, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, max_position_embeddings=512, tie_word_embeddings=False)
    model = LlamaForSequenceClassification(config).float()
    layer = model.model.layers[0]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, model.model.norm):
            norm.weight.fill_(1.0)
        vocab = tokenizer.get_vocab()
        model.model.embed_tokens.weight[:, 0] = 1.0  # every token: e0 ...
        for digit in "0123456789":
            model.model.embed_tokens.weight[vocab[digit]] = torch.nn.functional.one_hot(torch.tensor(1), hidden).float()
        layer.self_attn.v_proj.weight[0, 1] = 1.0  # head 0 carries the digit coordinate ...
        layer.self_attn.o_proj.weight[2, 0] = 1.0  # ... averaged over the sequence into coordinate 2
        model.score.weight[0, 2] = 1.0
    model.save_pretrained(path, safe_serialization=True)
    return model, tokenizer


def test_the_digit_counter_counts_digits(tmp_path):
    model, tokenizer = make_digit_counter(tmp_path / "rm", ["What is 1 + 2? abc"])
    scores = [model(torch.tensor([tokenizer(t)["input_ids"]])).logits[0, 0].item()
              for t in ("What is ab", "What is 1b", "What is 12", "1212121212")]
    assert scores == sorted(scores) and scores[0] < scores[-1] - 3


@pytest.mark.slow
def test_training_on_the_reward_models_score_alone_raises_it(ray_cluster, tiny_run, arith_model, tmp_path):
    """GRPO on a reward model that likes digits, its tokenizer (with a chat template of its own)
    not the policy's, no verifiable reward (weights.math = 0): the policy learns to write digits
    and the score rises."""
    from orz.data.synthetic import arithmetic_rows
    from orz.data.templates import ThinkAnswerTemplate
    from orz.train import run as train
    from orz.config import load_config
    from run_history import history

    rows = arithmetic_rows(200, seed=0, digits=(1, 2))
    _, tokenizer = make_digit_counter(tmp_path / "rm", [ThinkAnswerTemplate("Compute.").prompt(r["prompt"])
                                                        + r["solution"] for r in rows] + ["<|user|><|assistant|>"])
    # The reward model reads question and response in its own chat template (reward_model_inputs).
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tokenizer.save_pretrained(tmp_path / "rm")
    out = tmp_path / "run"
    overrides = [*tiny_run(out, "grpo", iterations=10), f"reward.model.path={tmp_path / 'rm'}",
                 "reward.weights={math: 0.0}", "rollout.stop=[]", "trainer.save_every=0", "data.eval={}",
                 "actor.lr=3e-3"]
    train(load_config(None, overrides))
    scores = [row["reward/model/mean"] for row in history(out)[1:]]
    assert [row["reward/mean"] for row in history(out)[1:]] == pytest.approx(scores)  # the model's score alone
    first, last = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert last > first + 0.5, scores


def test_reward_model_settings_are_refused_before_any_worker(tmp_path, arith_model):
    from orz.config import ConfigError, load_config
    from orz.run import run_rules

    def check(*overrides):
        run_rules.check(load_config(None, [f"model.path={arith_model}", "data.train=[synthetic:arithmetic]", *overrides]))

    with pytest.raises(ConfigError, match="is not a sequence classifier"):
        check(f"reward.model.path={arith_model}")
    make_reward_model(tmp_path / "three", num_labels=3)
    with pytest.raises(ConfigError, match="num_labels=3; a reward model's head must be scalar"):
        check(f"reward.model.path={tmp_path / 'three'}")
    with pytest.raises(ConfigError, match="weighs a reward model, but reward.model.path is not set"):
        check("reward.weights={model: 1.0}")
    make_reward_model(tmp_path / "rm")
    with pytest.raises(ConfigError, match="'reward.model.path' cannot change between stages"):
        check(f"reward.model.path={tmp_path / 'rm'}", "stages=[{iterations: 1, overrides: {reward.model.path: x}}]")
    check(f"reward.model.path={tmp_path / 'rm'}", "reward.weights={model: 0.5, math: 1.0}")  # accepted
