"""Arks whose values changed after they were written (git's CR LF conversion) are refused, not
decoded to finite garbage: each value must end where the ark's next entry begins."""

import io
import re
from pathlib import Path

import kaldiio
import numpy as np
import pytest
from kaldiio.matio import read_kaldi, write_array

from conftest import REALDATA, read_shards
from seqshard import pack_data
from seqshard.errors import InputError, Where
from seqshard.formats.peers.kaldi import MatrixReader, parse_location
from seqshard.scp_dataset import ScpDataset

DIM = 3
FSDD = REALDATA / "kaldi" / "kaldi-pr1626-fsdd-digits"
FSDD_MAP = ["/home/abhilash/kaldi/egs/0_MP_Digits/mfcc/=corrupt/mfcc/"]
GIT = {"crlf_to_lf": (b"\r\n", b"\n"), "lf_to_crlf": (b"\n", b"\r\n")}  # checkout/commit conversions


def pack_both_ways(scp: Path, text: Path, out: Path, **kwargs):
    """Pack strictly (returns the error) and with skip_bad (returns the report and the shards)."""
    with pytest.raises(InputError) as error:
        pack_data(scp, text, out / "strict", progress=False, **kwargs)
    report = pack_data(scp, text, out / "skip", skip_bad=True, progress=False, **kwargs)
    found = read_shards(sorted((out / "skip").rglob("data-*.tar")))
    assert report.packed + sum(report.dropped.values()) == report.input_utts
    assert report.packed == len(found)
    return error.value, report, found


# ---------------------------------------------------------------------------------------
# real data: an ark that git damaged (CR LF -> LF) in a Kaldi recipe's repository


def fsdd_pack(tmp_path: Path, **kwargs):
    scp = tmp_path / "train.scp"
    scp.write_text((FSDD / "corrupt/mfcc/raw_mfcc_train.1.scp").read_text())
    text = tmp_path / "text"
    text.write_text("".join(f"{line.split()[0]} digit\n" for line in scp.read_text().splitlines()))
    return scp, text, dict(path_root=FSDD, path_map=FSDD_MAP, **kwargs)


def true_values(ark: bytes) -> dict[str, tuple[int, int]]:
    """key -> (value start, value end) found by scanning the ark itself, whatever the scp says."""
    found = [(m.group(1).decode(), m.start(), m.end() - 2) for m in re.finditer(rb"(Speaker\d+_\d) \0B", ark)]
    return {
        key: (start, found[i + 1][1] if i + 1 < len(found) else len(ark)) for i, (key, _, start) in enumerate(found)
    }


def test_git_damaged_realdata_ark_packs_exactly_its_intact_values(tmp_path):
    scp, text, options = fsdd_pack(tmp_path)
    ark_path = FSDD / "corrupt/mfcc/raw_mfcc_train.1.ark"
    ark = ark_path.read_bytes()
    listed = {line.split()[0]: int(line.rsplit(":", 1)[1]) for line in scp.read_text().splitlines()}
    spans = true_values(ark)
    assert len(spans) == len(listed) == 89

    # Which values git altered: one CR was removed inside Speaker10_9's value, so its declared
    # size runs one byte into the next key, and every later value sits one byte before its offset.
    altered = {key for key, (start, end) in spans.items() if start + _declared_size(ark, start) != end}
    assert altered == {"Speaker10_9"}
    shifted = {key for key, (start, _) in spans.items() if start != listed[key]}
    assert len(shifted) == 79 and not shifted & altered

    error, report, found = pack_both_ways(scp, text, tmp_path / "out", **options)
    assert error.reason == "damaged_value" and error.where.key == "Speaker10_9" and error.where.line == 10
    assert str(ark_path) in str(error) and "byte 7095" in str(error) and "byte 7857" in str(error)
    assert "*.ark binary" in str(error) and "CR LF" in str(error)
    assert report.dropped == {"bad_offset": 79, "damaged_value": 1}
    intact = set(listed) - altered - shifted
    assert set(found) == intact == {f"Speaker10_{i}" for i in range(9)}

    # What packs is the ark's own bytes decoded: kaldiio on each intact value ...
    for key in intact:
        np.testing.assert_array_equal(found[key][0], kaldiio.load_mat(f"{ark_path}:{listed[key]}"))
    # ... and what Kaldi itself decoded before the damage: Kaldi's CMVN statistics of speaker 10
    # (compute-cmvn-stats over the undamaged features) are matched by the nine packed matrices
    # plus the damaged one with the CR that git removed put back before one of its LFs.
    stats = dict(kaldiio.load_ark(str(FSDD / "mfcc/cmvn_train.ark")))["Speaker10"]
    packed = [found[key][0].astype(np.float64) for key in sorted(intact)]
    start, end = spans["Speaker10_9"]
    repaired = []
    for lf in [i for i in range(start, end) if ark[i : i + 1] == b"\n"]:
        candidate = read_kaldi(io.BytesIO(ark[start:lf] + b"\r" + ark[lf:end])).astype(np.float64)
        every = [*packed, candidate]
        sums = sum(m.sum(axis=0) for m in every)
        squares = sum((m**2).sum(axis=0) for m in every)
        if np.allclose(sums, stats[0, :-1], rtol=1e-6) and np.allclose(squares, stats[1, :-1], rtol=1e-6):
            repaired.append(lf)
    assert len(repaired) == 1 and stats[0, -1] == sum(len(m) for m in packed) + 49


def _declared_size(ark: bytes, start: int) -> int:
    """Bytes of a CM value by its header (b"\\0BCM " + min, range, rows, cols + columns + data)."""
    assert ark[start : start + 5] == b"\0BCM "
    rows, cols = np.frombuffer(ark[start + 13 : start + 21], "<i4")
    return 5 + 16 + 8 * int(cols) + int(rows) * int(cols)


# ---------------------------------------------------------------------------------------
# synthetic: arks written by kaldiio, then damaged the way git does


def value_bytes(array: np.ndarray, method: int | None) -> bytes:
    buffer = io.BytesIO()
    write_array(buffer, array, compression_method=method)
    return buffer.getvalue()


def draw(seed: int, rows: int, method: int | None, accept) -> np.ndarray:
    """The first random matrix (from ``seed`` on) whose written bytes ``accept`` takes."""
    for attempt in range(seed, seed + 20000):
        array = (np.random.default_rng(attempt).standard_normal((rows, DIM)) * 4).astype(np.float32)
        if accept(value_bytes(array, method)):
            return array
    raise AssertionError("no such matrix")


def clean(seed: int, method: int | None) -> np.ndarray:
    """A matrix whose bytes hold neither CR nor LF: git's conversion leaves it alone."""
    return draw(seed * 1000, 5, method, lambda b: b"\n" not in b and b"\r" not in b)


def dirty(method: int | None) -> np.ndarray:
    """A matrix whose bytes hold CR LF (and so LF)."""
    if method is None:  # FM: place the bytes in a float (0x3F800A0D = 1.0003...), plus a lone LF
        array = np.full((6, DIM), 1.5, np.float32)
        array[2, 1] = np.frombuffer(b"\r\n\x80\x3f", "<f4")[0]
        array[4, 0] = np.frombuffer(b"\x00\n\x80\x3f", "<f4")[0]
        return array
    return draw(7, 300, method, lambda b: b"\r\n" in b)


def write_ark(path: Path, arrays: dict[str, np.ndarray], kind: str) -> list[str]:
    """Write an ark and return its scp lines."""
    scp = path.with_suffix(".scp")
    if kind == "text":
        kaldiio.save_ark(str(path), arrays, scp=str(scp), text=True)
    else:
        kaldiio.save_ark(str(path), arrays, scp=str(scp), compression_method=METHODS[kind])
    return scp.read_text().splitlines()


METHODS = {"FM": None, "CM": 2}  # kaldiio's compression methods: 2 is Kaldi's kSpeechFeature (CM)
CASES = [
    (kind, direction, position)
    for kind in ("FM", "CM", "text")
    for direction in GIT
    for position in ("only", "last", "middle")
    if not (kind == "text" and direction == "crlf_to_lf")  # Kaldi text arks hold no CR to lose
]


@pytest.mark.parametrize(("kind", "direction", "position"), CASES)
def test_git_damaged_value_is_refused_and_the_rest_packs(tmp_path, kind, direction, position):
    method = METHODS.get(kind)
    target = "utt-damaged"
    others = {f"utt-a{i}": clean(i, method) for i in range(2)}  # a second, intact ark
    arrays = {"only": {}, "last": {"utt-b0": clean(5, method)}, "middle": {"utt-b0": clean(5, method)}}[position]
    arrays[target] = dirty(method) if kind != "text" else np.arange(12, dtype=np.float32).reshape(4, DIM) / 4
    if position == "middle":
        arrays["utt-b2"] = clean(6, method)
    lines = write_ark(tmp_path / "a.ark", others, kind) + write_ark(tmp_path / "b.ark", arrays, kind)
    (tmp_path / "feats.scp").write_text("".join(f"{line}\n" for line in lines))
    (tmp_path / "text").write_text("".join(f"{line.split()[0]} words of {line.split()[0]}\n" for line in lines))
    originals = dict(kaldiio.load_scp(str(tmp_path / "feats.scp")))

    ark = tmp_path / "b.ark"
    data = ark.read_bytes()
    offsets = {line.split()[0]: int(line.rsplit(":", 1)[1]) for line in lines}
    start = offsets[target]
    following = [k for k in arrays if offsets.get(k, 0) > start]
    end = offsets[following[0]] - len(following[0]) - 1 if following else len(data)
    old, new = GIT[direction]
    assert old in data[start:end]  # the value holds the bytes git converts ...
    damaged = data[:start] + data[start:end].replace(old, new) + data[end:]
    if kind != "text":  # ... and only it: converting the whole ark, as git does, is the same
        assert data.count(old) == data[start:end].count(old) and damaged == data.replace(old, new)
    ark.write_bytes(damaged)

    error, report, found = pack_both_ways(tmp_path / "feats.scp", tmp_path / "text", tmp_path / "out")
    line = 3 + list(arrays).index(target)
    assert error.reason == "damaged_value" and error.where.key == target and error.where.line == line
    assert f"{tmp_path / 'feats.scp'}:{line}" in str(error) and str(ark) in str(error)
    assert f"byte {start}" in str(error) and ".gitattributes" in str(error)
    expected_drops = {"damaged_value": 1, **({"bad_offset": 1} if position == "middle" else {})}
    assert report.dropped == expected_drops and report.input_utts == len(lines)
    intact = {*others, *({"utt-b0"} if position != "only" else set())}
    assert set(found) == intact
    for key in intact:
        np.testing.assert_array_equal(found[key][0], originals[key])


def test_subsets_renamed_keys_and_shared_values_are_not_taken_for_damage(tmp_path):
    """Kaldi data dirs list arks partly (subset_data_dir.sh, fix_data_dir.sh), rename keys
    (copy_data_dir.sh --utt-prefix) and cut one matrix into ranges: all of it still packs."""
    arrays = {f"utt{i}": clean(i, None)[: 3 + i % 3] for i in range(8)}
    lines = write_ark(tmp_path / "a.ark", arrays, "FM")
    text = tmp_path / "text"
    variants = {
        "subset": [line for i, line in enumerate(lines) if i % 3 == 1],
        "renamed": [f"rev1-{line}" for line in lines],
        "renamed_subset": [f"sp1-{line}" for line in lines[2:6:2]],
        "ranges": [
            f"{line.split()[0]}-{half} {line.split()[1]}[{rows}]"
            for line in lines
            for half, rows in enumerate(["0:1", "2:2"])
        ],
        "shuffled": lines[::-1],
    }
    for name, scp_lines in variants.items():
        scp = tmp_path / f"{name}.scp"
        scp.write_text("".join(f"{line}\n" for line in scp_lines))
        text.write_text("".join(f"{line.split()[0]} x\n" for line in scp_lines))
        report = pack_data(scp, text, tmp_path / name, progress=False)
        assert (report.packed, report.dropped) == (len(scp_lines), {}), name


def test_reader_without_plan_still_checks_the_end_of_the_ark(tmp_path):
    """ScpDataset reads without knowing the next listed value: a value must still be followed
    by the end of the ark or by a next entry, so trailing bytes from LF -> CR LF are refused."""
    lines = write_ark(tmp_path / "a.ark", {"u0": clean(0, None), "u1": dirty(None)}, "FM")
    scp = tmp_path / "feats.scp"
    scp.write_text("".join(f"{line}\n" for line in lines))
    ark = tmp_path / "a.ark"
    ark.write_bytes(ark.read_bytes().replace(b"\n", b"\r\n"))
    with MatrixReader() as reader:  # as ScpDataset reads: no successor
        location = parse_location(lines[0].split()[1], Where(scp, 1))
        np.testing.assert_array_equal(reader.read(location, Where(scp, 1, "u0")), clean(0, None))
    dataset = ScpDataset(scp)
    dataset[0]  # the intact value reads
    with pytest.raises(InputError) as error:
        dataset[1]
    assert error.value.reason == "damaged_value" and error.value.where.key == "u1"
    assert "neither the end of the ark nor a next entry" in str(error.value)
