"""Tokenizers: exact round trips, HF directories that AutoTokenizer loads, SentencePiece conversion."""
import pytest
from transformers import AutoTokenizer

from orz.data.synthetic import arithmetic_rows, countdown_rows
from orz.data.templates import TEMPLATE_TAGS, ThinkAnswerTemplate
from orz.data.tokenizers import char_tokenizer, load_tokenizer, sentencepiece_to_hf, train_sentencepiece


@pytest.fixture(scope="module")
def texts():
    template = ThinkAnswerTemplate()
    rows = arithmetic_rows(200, 0) + countdown_rows(100, 0) + arithmetic_rows(50, 0, answer_format="boxed")
    return [template.prompt(r["prompt"]) + r["solution"] for r in rows]


def _round_trips(tokenizer, text):
    return tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_char_tokenizer_round_trips_and_loads_as_hf_directory(texts, tmp_path):
    tokenizer = char_tokenizer(texts)
    assert all(_round_trips(tokenizer, t) for t in texts)
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").exists()
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert all(_round_trips(loaded, t) for t in texts)
    assert loaded.encode(texts[0], add_special_tokens=False) == tokenizer.encode(texts[0], add_special_tokens=False)
    specials = {loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id, loaded.unk_token_id}
    assert None not in specials and len(specials) == 4
    assert loaded.decode([loaded.eos_token_id]) == "</s>"


def test_template_tags_are_single_tokens(texts):
    tokenizer = char_tokenizer(texts)
    for tag in TEMPLATE_TAGS:
        assert len(tokenizer.encode(tag, add_special_tokens=False)) == 1
    assert tokenizer.encode("7", add_special_tokens=False) != tokenizer.encode("<unk>", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("Ω", add_special_tokens=False)) == ["<unk>"]


def test_sentencepiece_model_loads_with_identical_ids(texts, tmp_path):
    import sentencepiece as spm

    model = train_sentencepiece(texts, tmp_path / "tiny", vocab_size=400)
    tokenizer = load_tokenizer(model)
    reference = spm.SentencePieceProcessor(model_file=str(model))
    for text in texts[::10] + ["  odd   spacing\n\n and Ω unseen 😀 "]:
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text)
        assert _round_trips(tokenizer, text)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 3, 0)
    tokenizer.save_pretrained(tmp_path / "hf")
    loaded = load_tokenizer(tmp_path / "hf")
    assert loaded.encode(texts[0], add_special_tokens=False) == reference.encode(texts[0])


def test_unfaithful_sentencepiece_conversion_is_refused(texts, tmp_path):
    import sentencepiece as spm

    # SentencePiece's defaults: NFKC normalisation and a dummy prefix, which the converter does not model.
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(tmp_path / "nfkc"),
                                   vocab_size=120, hard_vocab_limit=False, minloglevel=2)
    with pytest.raises(ValueError, match="does not reproduce"):
        sentencepiece_to_hf(tmp_path / "nfkc.model")


def test_unknown_path_kind_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="HF tokenizer directory or a SentencePiece"):
        load_tokenizer(tmp_path / "vocab.txt")
