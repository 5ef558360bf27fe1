"""Writes token_blocks.npz: fairseq 0.12.2's own language-model blocks of the Megatron files in
../megatron, the oracle of ``make_token_loader(prefix, block_size=N, block_style="fairseq")``.

Run where fairseq 0.12.2's ``fairseq.data`` imports with its Cython ``token_block_utils_fast``
built (``pip download fairseq==0.12.2 --no-deps --no-binary :all:``, then ``cythonize`` that one
``.pyx``); the blocks are ``TokenBlockDataset(..., break_mode="none", include_targets=True)``
as fairseq's ``language_modeling`` task builds it, over the sequences of each ``.bin``:
item k is ``(source, target, past_target)``; source and target are kept.

    python tests/realdata/fairseq/make_token_blocks.py
"""

import hashlib
from pathlib import Path

import numpy as np
import torch
from fairseq.data.token_block_dataset import TokenBlockDataset

HERE = Path(__file__).parent
MEGATRON = HERE.parent / "megatron"
PAD, EOS = 1, 2  # fairseq's dictionary's
CASES = {  # name -> (file, block size, kept whole)
    "ag_news_7": ("ag_news_prompt_inputs_document", 7, True),
    "ag_news_100": ("ag_news_prompt_inputs_document", 100, True),
    "openwebtext_1024": ("meg-gpt2-openwebtext_text_document", 1024, False),
}


def sequences(prefix):
    """The sequences of a Megatron .bin/.idx (MMIDIDX version 1), as fairseq's mmap dataset reads them."""
    index = (MEGATRON / f"{prefix}.idx").read_bytes()  # magic (9 bytes), version (u64), dtype code (u8),
    dtype = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}[index[17]]
    count = int(np.frombuffer(index, "<u8", 1, 18)[0])  # sequences (u64), documents (u64), sizes, pointers
    sizes = np.frombuffer(index, "<i4", count, 34)
    pointers = np.frombuffer(index, "<i8", count, 34 + 4 * count)
    data = np.fromfile(MEGATRON / f"{prefix}.bin", dtype=dtype)
    starts = pointers // np.dtype(dtype).itemsize
    return [torch.from_numpy(data[s : s + n].astype(np.int64)) for s, n in zip(starts, sizes)], sizes


out = {}
for name, (prefix, size, whole) in CASES.items():
    items, sizes = sequences(prefix)
    blocks = TokenBlockDataset(items, sizes, size, pad=PAD, eos=EOS, break_mode="none", include_targets=True)
    pairs = [blocks[k][:2] for k in range(len(blocks))]
    source = torch.cat([p[0] for p in pairs]).numpy()
    target = torch.cat([p[1] for p in pairs]).numpy()
    out[f"{name}.lengths"] = np.array([len(p[1]) for p in pairs], dtype=np.int64)
    if whole:
        out[f"{name}.source"], out[f"{name}.target"] = source, target
    else:  # too large to keep: their sha256 (int64, little-endian)
        for key, array in (("source", source), ("target", target)):
            out[f"{name}.{key}_sha256"] = np.array(hashlib.sha256(array.astype("<i8").tobytes()).hexdigest())
np.savez_compressed(HERE / "token_blocks.npz", **out)
print({k: v.shape for k, v in out.items()})
