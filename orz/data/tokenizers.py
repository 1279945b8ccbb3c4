"""Tokenizers: load an HF tokenizer directory or a SentencePiece `.model`; build small ones for
tiny models, always as transformers tokenizers, so that `save_pretrained(dir)` writes the HF
directory (tokenizer.json, tokenizer_config.json) that transformers and vLLM load beside
config.json and the safetensors.

    tok = char_tokenizer(texts)                      # the arithmetic demo: one token per character
    model = train_sentencepiece(texts, "tiny", 400)  # a subword tokenizer: tiny.model
    tok = load_tokenizer(model)                      # or an HF directory
    tok.save_pretrained("tiny-model/")
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from orz.data.templates import TEMPLATE_TAGS

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
_SPACE = "\u2581"  # SentencePiece's visible space


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """An HF tokenizer directory, or a SentencePiece .model (converted, see sentencepiece_to_hf)."""
    path = Path(path)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(path)
    if path.suffix == ".model":
        return sentencepiece_to_hf(path)
    raise ValueError(f"{path}: expected an HF tokenizer directory or a SentencePiece .model file")


def char_tokenizer(texts: Iterable[str], extra_tokens: Iterable[str] = TEMPLATE_TAGS) -> PreTrainedTokenizerFast:
    """One token per character seen in `texts`, plus `extra_tokens` as single tokens (the
    template's tags) and <s>, </s>, <pad>, <unk>. Text made of those characters round-trips
    exactly through encode and decode; an unseen character becomes <unk>."""
    specials = [PAD, BOS, EOS, UNK]
    characters = sorted(set().union(*map(set, texts)))
    vocab = {token: i for i, token in enumerate(specials + characters)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t in extra_tokens])
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    return _wrap(tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK)


def train_sentencepiece(texts: Iterable[str], model_prefix: str | Path, vocab_size: int) -> Path:
    """Trains a unigram SentencePiece model on `texts`; returns the path of `<prefix>.model`.

    Options chosen so that text round-trips exactly and the HF conversion is faithful: no
    normalisation or whitespace collapsing, digits split one by one (arithmetic), byte fallback
    for unseen characters (so vocab_size must exceed 256 plus the alphabet), the template's tags
    as single pieces, and ids 0-3 for <pad>, <unk>, <s>, </s>."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(texts)),
        model_prefix=str(model_prefix),
        vocab_size=vocab_size,
        model_type="unigram",
        character_coverage=1.0,
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        split_digits=True,
        byte_fallback=True,
        hard_vocab_limit=False,
        user_defined_symbols=list(TEMPLATE_TAGS),
        pad_id=0, unk_id=1, bos_id=2, eos_id=3,
        pad_piece=PAD, unk_piece=UNK, bos_piece=BOS, eos_piece=EOS,
        minloglevel=2,
    )
    return Path(f"{model_prefix}.model")


# Covers what differs between SentencePiece options: leading and repeated spaces, digits,
# compatibility characters (NFKC would rewrite them), a tag, an unseen character (byte fallback).
_CONVERSION_PROBE = "  What is 12+345?\n<answer>  x\uff11\ufb01</answer> \u00e9\U0001f600 "


def sentencepiece_to_hf(model_path: str | Path) -> PreTrainedTokenizerFast:
    """Rebuilds a SentencePiece unigram model as a transformers tokenizer with the same pieces,
    scores and ids. Faithful for models trained like `train_sentencepiece`'s; for others (NFKC
    normalisation, dummy prefix) the ids would differ, so it checks on a probe and refuses."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    pieces = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=sp.unk_id(), byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", _SPACE)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(_SPACE, behavior="merged_with_next")
    tokenizer.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    user_defined = [p for i, (p, _) in enumerate(pieces) if _is_user_defined(sp, i)]
    tokenizer.add_tokens([AddedToken(p, normalized=False) for p in user_defined])
    control = [p for i, (p, _) in enumerate(pieces) if sp.is_control(i) or sp.is_unknown(i)]
    tokenizer.add_special_tokens([AddedToken(p, normalized=False, special=True) for p in control])
    ids = {"bos_token": sp.bos_id(), "eos_token": sp.eos_id(), "pad_token": sp.pad_id(), "unk_token": sp.unk_id()}
    converted = _wrap(tokenizer, **{name: sp.id_to_piece(i) for name, i in ids.items() if i >= 0})
    expected = sp.encode(_CONVERSION_PROBE)
    got = converted.encode(_CONVERSION_PROBE, add_special_tokens=False)
    if got != expected:
        raise ValueError(f"{model_path}: converting this SentencePiece model to an HF tokenizer does not "
                         f"reproduce its ids (trained with normalisation or a dummy prefix?); train it with "
                         f"orz.data.tokenizers.train_sentencepiece, or convert it with transformers")
    return converted


def _is_user_defined(sp, i: int) -> bool:
    """SentencePiece's Python API has no such test: user-defined symbols are the pieces that are
    neither control, unknown, unused nor byte and score 0 (normal pieces score a log-probability < 0)."""
    special = sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i) or sp.is_byte(i)
    return not special and sp.get_score(i) == 0.0


def _wrap(tokenizer: Tokenizer, **special_tokens: str) -> PreTrainedTokenizerFast:
    """encode() adds no <s> or </s>: the caller decides (the rollout appends </s> as EOS)."""
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, clean_up_tokenization_spaces=False, **special_tokens)
