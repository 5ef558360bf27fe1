"""ESPnet's ``token_list`` (one token a line, its id the line's number from 0) is taken wherever
a units file is: the rules are ESPnet's ``TokenIDConverter`` and ``CharTokenizer`` (espnet2/text),
written here from their source."""

from __future__ import annotations

import re

import pytest
import sentencepiece

from conftest import REALDATA
from seqshard import ConfigError, TokenDataset, UnitsTokenizer, binarize
from seqshard.text.tokenizers import make_tokenizer

BPE = REALDATA / "tokenizers/librispeech.train_960_unigram5000.bpemodel"

# What `espnet2.bin.tokenize_text --token_type char --write_vocabulary true --add_symbol
# '<blank>:0' --add_symbol '<unk>:1' --add_symbol '<sos/eos>:-1'` writes: counted characters
# (space as <space>) between the added symbols.
ESPNET_CHARS = ["<blank>", "<unk>", "<space>", "E", "T", "H", "I", "S", "A", "W", "<sos/eos>"]


def espnet_ids(token_list: list[str], text: str) -> list[int]:
    """ESPnet's char route: CharTokenizer(space_symbol="<space>") then TokenIDConverter
    (the token's line number; unknown tokens to <unk>'s)."""
    token2id = {token: number for number, token in enumerate(token_list)}
    tokens = ["<space>" if char == " " else char for char in text]
    return [token2id.get(token, token2id["<unk>"]) for token in tokens]


@pytest.fixture
def token_list(tmp_path):
    path = tmp_path / "tokens.txt"
    path.write_text("\n".join(ESPNET_CHARS) + "\n", encoding="utf-8")
    return path


def test_a_token_list_numbers_its_lines_and_splits_as_espnet_does(token_list):
    tokenizer = make_tokenizer(token_list)
    assert isinstance(tokenizer, UnitsTokenizer) and tokenizer.token_list
    assert tokenizer.split == "char" and "token list" in tokenizer.describe()
    text = "THE WHITE SEA IS WET"  # C and other letters absent: <unk>
    assert tokenizer.encode(text) == espnet_ids(ESPNET_CHARS, text)
    assert tokenizer.vocab_size == len(ESPNET_CHARS) and tokenizer.unk_id == 1
    assert tokenizer.eos_id == len(ESPNET_CHARS) - 1  # <sos/eos>, last


def test_a_token_list_of_words_and_blank_lines_at_its_end(tmp_path):
    words = tmp_path / "tokens.txt"
    words.write_text("<blank>\n<unk>\nHELLO\nWORLD\n<sos/eos>\n\n\n", encoding="utf-8")
    tokenizer = make_tokenizer(words)
    assert tokenizer.split == "word" and tokenizer.encode("HELLO THERE WORLD") == [2, 1, 3]
    assert tokenizer.vocab_size == 5


@pytest.mark.parametrize(
    "lines, found",
    [
        (["<blank>", "<unk>", "", "A"], "3: found an empty line"),
        (["<blank>", "<unk>", "A 7"], "3: found 'A 7'"),
        (["<blank>", "<unk>", "A", "A"], "4: token 'A' again (first on line 3)"),
        (["<blank> 0", "<unk>"], "2: expected 'TOKEN ID'"),  # a units file stays one
    ],
)
def test_a_token_list_that_would_number_ids_wrongly_is_refused_naming_the_line(tmp_path, lines, found):
    path = tmp_path / "tokens.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(f"{path}:{found}")):
        make_tokenizer(path)


def test_binarize_takes_a_token_list(tmp_path, token_list):
    text = tmp_path / "text"
    text.write_text("THE SEA\nWHITE\n", encoding="utf-8")
    report = binarize(text, tmp_path / "train", token_list, progress=False)
    eos = ESPNET_CHARS.index("<sos/eos>")
    assert report.eos_id == eos
    assert [s.tolist() for s in TokenDataset(tmp_path / "train")] == [
        espnet_ids(ESPNET_CHARS, "THE SEA") + [eos],
        espnet_ids(ESPNET_CHARS, "WHITE") + [eos],
    ]


def test_a_bpe_token_list_maps_the_models_pieces_as_espnet_does(tmp_path):
    """ESPnet's bpe route: asr.sh writes the token list from the model's vocabulary (<blank>,
    <unk>, the pieces after <unk> <s> </s>, <sos/eos>); SentencepiecesTokenizer gives the
    model's pieces and TokenIDConverter their line numbers: the model's id less one."""
    model = sentencepiece.SentencePieceProcessor(model_file=str(BPE))
    listed = ["<blank>", "<unk>", *(model.id_to_piece(i) for i in range(3, model.get_piece_size())), "<sos/eos>"]
    path = tmp_path / "tokens.txt"
    path.write_text("\n".join(listed) + "\n", encoding="utf-8")
    tokenizer = UnitsTokenizer(path, pieces=BPE)
    text = "IT WAS THE FIRST GREAT SORROW OF HIS LIFE"
    assert tokenizer.encode(text) == [i - 1 for i in model.encode(text)] == [14, 13, 2, 137, 118, 1505, 5, 16, 169]
    unknown = "ÆSIR"  # a character the model never saw: its piece is not listed
    assert tokenizer.encode_many([text, unknown])[1] == [
        listed.index(p) if p in listed else 1 for p in model.encode(unknown, out_type=str)
    ]
    assert 1 in tokenizer.encode(unknown) and tokenizer.split == "piece" and tokenizer.eos_id == len(listed) - 1
    assert "pieces of SentencePiece model" in tokenizer.describe()
    with pytest.raises(ConfigError, match="'piece' with pieces=MODEL"):
        UnitsTokenizer(path, split="char", pieces=BPE)
