"""Prompt templates: ORZ's think-then-answer template for base models, and the tokenizer's own
chat template for chat models. Both turn a question into the text the policy continues, and say
how a worked solution ends (for pre-training the tiny models on synthetic tasks).

    template = make_template("think_answer")            # or make_template("chat", tokenizer)
    text = template.prompt("What is 12 + 30?")
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE = "<think>", "</think>", "<answer>", "</answer>"
TEMPLATE_TAGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)

THINK_ANSWER_INSTRUCTION = (
    "The user gives the assistant a problem. The assistant works it out step by step inside "
    "<think> </think>, then writes only the final result inside <answer> </answer>, "
    "like this: <think> steps </think> <answer> result </answer>."
)


def answer_tag_response(reasoning: str, answer: str) -> str:
    """A worked solution continuing a think_answer prompt (which ends with the opened <think>)."""
    return f" {reasoning} {THINK_CLOSE} {ANSWER_OPEN}{answer}{ANSWER_CLOSE}"


def boxed_response(reasoning: str, answer: str) -> str:
    return f"{reasoning}\nThe answer is \\boxed{{{answer}}}."


# How a worked solution ends, by name (synthetic tasks take one of these names).
TEMPLATES = ("think_answer", "chat")  # data.template: make_template's names
RESPONSE_FORMATS = {"answer_tag": answer_tag_response, "boxed": boxed_response}


@dataclass(frozen=True)
class ThinkAnswerTemplate:
    """For base models: the instruction, the question, and the opened <think> tag, so that the
    policy's first token is already reasoning (ORZ's design). Answers are read from <answer>."""

    instruction: str = THINK_ANSWER_INSTRUCTION

    def prompt(self, question: str) -> str:
        return f"{self.instruction}\nUser: {question}\nAssistant: {THINK_OPEN}"

    def response(self, reasoning: str, answer: str) -> str:
        """How a worked solution continues the prompt."""
        return answer_tag_response(reasoning, answer)


@dataclass(frozen=True)
class ChatTemplate:
    """For chat models: the tokenizer's own template around one user turn; answers are boxed."""

    tokenizer: Any  # a transformers tokenizer with a chat_template
    instruction: str = "Put the final answer in \\boxed{}."
    tools: tuple[dict, ...] = ()  # OpenAI function schemas the template shows the model (rollout.tool_format=chat)

    def __post_init__(self):
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this tokenizer has no chat_template; use the 'think_answer' template")

    def prompt(self, question: str) -> str:
        messages = [{"role": "user", "content": f"{question}\n{self.instruction}"}]
        return self.tokenizer.apply_chat_template(messages, tools=list(self.tools) or None, tokenize=False,
                                                  add_generation_prompt=True)

    def response(self, reasoning: str, answer: str) -> str:
        return boxed_response(reasoning, answer)


def encode_prompt(tokenizer: Any, template: Any, question: str) -> list[int]:
    """Token ids of the templated question. A chat template writes its own special tokens (BOS
    included), so they are not added twice; a plain template gets what the tokenizer adds."""
    text = template.prompt(question)
    return tokenizer(text, add_special_tokens=not isinstance(template, ChatTemplate))["input_ids"]


def make_template(name: str, tokenizer: Any = None, instruction: str = "",
                  tools: tuple[dict, ...] = ()) -> ThinkAnswerTemplate | ChatTemplate:
    """The template called `name`: "think_answer" or "chat" (which needs the tokenizer, and shows
    `tools`), with `instruction` in place of its default one when given (data.instruction)."""
    if name == "think_answer":
        return ThinkAnswerTemplate(instruction) if instruction else ThinkAnswerTemplate()
    if name == "chat":
        if tokenizer is None:
            raise ValueError("the 'chat' template needs the model's tokenizer")
        return ChatTemplate(tokenizer, *([instruction] if instruction else []), tools=tuple(tools))
    raise ValueError(f"unknown template {name!r}; valid: {list(TEMPLATES)}")


def tool_message_wrap(tokenizer: Any) -> tuple[str, str]:
    """(before, after): what the chat template writes between an assistant turn's text and a tool
    message's content, and after that content up to where the next assistant turn's text begins.
    Read off the template itself by rendering two markers (Qwen3: "<|im_end|>\\n<|im_start|>user\\n
    <tool_response>\\n" and "\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n")."""
    turn, output = "\x00turn\x00", "\x00output\x00"
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": turn},
                {"role": "tool", "content": output}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if text.count(turn) != 1 or text.count(output) != 1 or text.index(turn) > text.index(output):
        raise ValueError("rollout.tool_format=chat needs a chat template that renders tool messages (role 'tool') "
                         "after the assistant's turn; this tokenizer's does not")
    between, after = text.split(turn)[1].split(output)
    return between, after


def reward_model_inputs(tokenizer: Any, question: str, response: str) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of one exchange as a reward model with a chat template reads
    it (Skywork-Reward, the Llama and Qwen RMs): the user's question and the assistant's response
    rendered by its own template, split where the assistant's turn begins."""
    user = [{"role": "user", "content": question}]
    prompt = list(tokenizer.apply_chat_template(user, tokenize=True, add_generation_prompt=True, return_dict=False))
    whole = list(tokenizer.apply_chat_template([*user, {"role": "assistant", "content": response}], tokenize=True,
                                               return_dict=False))
    if whole[:len(prompt)] != prompt:  # a template that renders the turn differently once answered
        raise ValueError("the reward model's chat template does not render the question the same way before "
                         "and after the response; cannot tell the response's tokens apart")
    return prompt, whole[len(prompt):] or [tokenizer.eos_token_id]
