"""An ark given where a table file is expected (`--scp feats.ark`) is named as an ark, with the
scp that indexes it, instead of being read as text that is not UTF-8."""

import shutil

import pytest

from conftest import REALDATA
from seqshard import pack_data
from seqshard.cli import main
from seqshard.errors import InputError, SeqshardError

GENERATED = REALDATA / "kaldi/generated_kaldi"


@pytest.mark.parametrize(
    ("ark", "what", "tool"),
    [
        ("feats/fbank80_fm.ark", "matrices", "copy-feats"),
        ("feats/fbank80_method2.ark", "matrices", "copy-feats"),  # compressed (CM2)
        ("feats/mfcc_segmented_text.ark", "text matrices", "copy-feats"),
        ("tokens/text_bpe5000.ark", "integer vectors", "copy-int-vector"),
    ],
)
def test_a_real_ark_given_as_scp_is_named_with_the_scp_it_needs(tmp_path, ark, what, tool):
    (tmp_path / "text").write_text("a x\n")
    beside = GENERATED / ark
    with pytest.raises(InputError) as error:  # a skip would count every "line" of the ark
        pack_data(beside, tmp_path / "text", tmp_path / "out", skip_bad=True, progress=False)
    assert error.value.reason == "not_a_table" and error.value.where.line == 1 and not error.value.skippable
    message = str(error.value)
    assert f"Kaldi archive (ark) of {what}, not a table file" in message and "UTF-8" not in message
    if beside.with_suffix(".scp").is_file():
        assert f"give {beside.with_suffix('.scp')} (beside it)" in message

    alone = tmp_path / "alone.ark"
    shutil.copy(beside, alone)
    with pytest.raises(InputError) as error:
        pack_data(alone, tmp_path / "text", tmp_path / "out", progress=False)
    assert f"`{tool} ark:{alone} ark,scp:{tmp_path / 'alone_copy.ark'},{tmp_path / 'alone.scp'}` (Kaldi)" in str(
        error.value
    )


def test_a_wav_ark_given_as_wav_scp_on_the_command_line(tmp_path, capsys):
    (tmp_path / "text").write_text("a x\n")
    ark = GENERATED / "wav/wav_zh.ark"
    args = ["pack", "--wav-scp", str(ark), "--text", str(tmp_path / "text"), "--out", str(tmp_path / "o"), "--quiet"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "Kaldi archive (ark) of WAV files (wav-in-ark)" in err and f"give {GENERATED / 'wav/wav_zh.scp'}" in err
    assert "--skip-bad" not in err


def test_table_lines_that_resemble_ark_entries_are_read_as_tables(tmp_path):
    scp = tmp_path / "feats.scp"
    scp.write_text("utt1 [x.ark:12\n")  # not a text matrix (`KEY  [` alone on its line)
    (tmp_path / "text").write_text("utt1 [noise] RIFF\n")
    with pytest.raises(SeqshardError, match=r"nothing was packed.*\(missing_ark=1\)"):  # read as an scp line
        pack_data(scp, tmp_path / "text", tmp_path / "out", skip_bad=True, progress=False)


@pytest.mark.parametrize(
    ("name", "what"),
    [("feats/global_cmvn.ark", "matrix"), ("feats/global_cmvn.txt", "text matrix"), (None, "text vector")],
)
def test_a_keyless_kaldi_object_given_as_scp_is_named_as_such(tmp_path, name, what):
    """compute-cmvn-stats' global_cmvn.ark has no key: it was read as text that is not UTF-8
    ("try iconv -f GBK"), or as a line without a value."""
    (tmp_path / "text").write_text("a x\n")
    path = GENERATED / name if name else tmp_path / "vector.txt"
    if name is None:
        path.write_text(" [ 1.5 -2 3e4 ]\n")
    with pytest.raises(InputError) as error:
        pack_data(path, tmp_path / "text", tmp_path / "out", skip_bad=True, progress=False)
    assert error.value.reason == "not_a_table" and error.value.where.line == 1 and not error.value.skippable
    message = str(error.value)
    assert f"the file is one Kaldi {what} written without a key" in message and "iconv" not in message
    assert "run `seqshard cmvn` on the shards" in message
