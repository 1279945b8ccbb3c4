"""Templates: ORZ-style think/answer prompts for base models, the tokenizer's chat template otherwise."""
import pytest

from orz.data.templates import ChatTemplate, ThinkAnswerTemplate, make_template, reward_model_inputs
from orz.data.tokenizers import char_tokenizer
from orz.data.answers import extract_answer

CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_think_answer_prompt_opens_the_think_tag():
    template = make_template("think_answer")
    prompt = template.prompt("What is 2 + 2?")
    assert prompt.endswith("User: What is 2 + 2?\nAssistant: <think>")
    assert "<answer>" in template.instruction and "</think>" in template.instruction
    completion = template.response("2+2=4", "4")
    assert extract_answer(prompt + completion) == "4"


def test_chat_template_uses_the_tokenizer():
    tokenizer = char_tokenizer(["abc"])
    tokenizer.chat_template = CHAT
    template = make_template("chat", tokenizer)
    assert template.prompt("What is 2 + 2?") == ("<|user|>What is 2 + 2?\nPut the final answer in "
                                                 "\\boxed{}.\n<|assistant|>")
    assert extract_answer(template.response("2+2=4", "4")) == "4"
    own = make_template("chat", tokenizer, "Answer in one word.")  # data.instruction, with chat too
    assert own.prompt("Why?") == "<|user|>Why?\nAnswer in one word.\n<|assistant|>"
    assert make_template("think_answer", instruction="Compute.").prompt("1+1?").startswith("Compute.\nUser: 1+1?")


def test_template_errors():
    with pytest.raises(ValueError, match="valid"):
        make_template("alpaca")
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        make_template("chat")
    with pytest.raises(ValueError, match="no chat_template"):
        ChatTemplate(char_tokenizer(["abc"]))
    assert isinstance(make_template("think_answer"), ThinkAnswerTemplate)


def test_reward_model_inputs_render_the_exchange_in_the_models_own_template():
    tokenizer = char_tokenizer(["<|user|><|assistant|>What is 2 + 3? 5\n"])
    tokenizer.chat_template = CHAT
    prompt, response = reward_model_inputs(tokenizer, "What is 2 + 3?", "5")
    assert tokenizer.decode(prompt) == "<|user|>What is 2 + 3?\n<|assistant|>"
    assert tokenizer.decode(response) == "5\n"
    # a template whose question renders differently once answered cannot be split
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}?{% endif %}"
    with pytest.raises(ValueError, match="does not render the question the same way"):
        reward_model_inputs(tokenizer, "What is 2 + 3", "5")
