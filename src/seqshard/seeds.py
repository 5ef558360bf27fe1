"""Every stage that draws random numbers has a fixed id here; its generator is a pure function
of (seed, stage id, position), never a global RNG and never ``seed + something``.

``stage_rng(seed, Seed.SHUFFLE, epoch, rank, worker, window)`` is the same on any machine and
after any resume, so a restored stage needs no RNG state. The ids are stable numbers, never
reused (``@unique`` refuses two stages with one id when the module is imported); a user's own
stage picks an id from :data:`USER_IDS` on (``Reader.rng``).
"""

from __future__ import annotations

from enum import IntEnum, unique

import numpy as np

USER_IDS = 100  # ids of stages written by users start here


@unique
class Seed(IntEnum):
    """The stage ids of seqshard's own random choices."""

    PLAN = 1  # the epoch's shard order (pipeline/epoch_plan.py)
    SHUFFLE = 2  # the shuffle window's order
    BATCH_ORDER = 3  # the order of a sort window's batches
    SAMPLE = 4  # per-sample generators (Reader.sample_rng), followed by the stage's own id
    SPEED = 5  # speed perturbation factor, per sample
    NOISE = 6  # noise stretch and SNR, per sample
    NOISE_ORDER = 7  # the order of the noise shards in each pass
    DITHER = 8  # fbank dither, per sample
    SPEC_AUGMENT = 9  # SpecAugment masks, per sample
    TOKEN_VIRTUAL = 11  # the sentences of a mixed token epoch
    TOKEN_BATCH_ORDER = 12  # each rank's order of token batches
    TOKEN_REDEAL = 13  # the order of token batches dealt again after an elastic resume
    MIX_PASS = 14  # a mixed source's shard order in each pass (after PLAN)
    TOKEN_BLOCKS = 15  # the order of a language-model epoch's blocks (tokens/blocks.py)
    ESTIMATE = 16  # lengths drawn from the index to estimate an epoch's batches (rank/counts.py)
    PACK_BUCKET = 17  # the pack-time order of a length group's utterances in one bucket (prep/bucket_wave.py)
    BUCKET_ORDER = 18  # the length bucket of each reader's k-th batch with bucket_sync (stages/buckets.py)
    MIX_ORDER = 0x6D7578  # which source each position of a mixed stream takes (seqshard.mix)


def stage_rng(seed: int, stage: int, *position: int) -> np.random.Generator:
    """A generator keyed by (seed, stage, *position); seeds are derived, never added."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, int(stage), *position])))


def torch_generator(seed: int, device: object = "cpu") -> object:
    """A torch generator on ``device`` seeded with ``seed``, a number drawn from a
    :func:`stage_rng` (random numbers made where the data is, e.g. fbank dither on a GPU)."""
    import torch

    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed))
    return generator
