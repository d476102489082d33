"""The word-level tokenizer of benchmark checkpoints (`streamscope.testing.tokenizer.word_tokenizer`): every id of
the model's vocabulary is a token of its own, so an engine's detokenizer never meets an id it lacks."""

from __future__ import annotations

from transformers import AutoTokenizer

from streamscope.testing.tokenizer import word_tokenizer


def test_every_id_is_a_word_of_its_own_and_the_special_ids_are_where_asked(tmp_path):
    word_tokenizer(1000, bos_token_id=7, eos_token_id=8, pad_token_id=0).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == 1000
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (7, 8, 0)
    words = tokenizer.convert_ids_to_tokens(list(range(1000)))
    assert len(set(words)) == 1000 and words[999] == "w999" and words[3] == "w3"
    assert tokenizer.decode([3, 999, 500]) == "w3 w999 w500"
    assert tokenizer("w3 w999 nonsense")["input_ids"] == [7, 3, 999, 0]  # BOS first; an unknown word is pad
