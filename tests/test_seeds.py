"""Every random choice draws from a generator keyed by a stage id of the one table in
``seqshard.seeds``; no two stages share an id."""

from __future__ import annotations

import re
from pathlib import Path

from seqshard.seeds import USER_IDS, Seed, stage_rng

PACKAGE = Path(__file__).parent.parent / "src" / "seqshard"


def test_stage_ids_are_unique_and_below_the_users():
    values = [int(s) for s in Seed]
    assert len(values) == len(set(values))
    assert all(v < USER_IDS or s is Seed.MIX_ORDER for s, v in zip(Seed, values))


def test_no_module_makes_a_generator_of_its_own():
    makers = re.compile(
        r"default_rng\(|SeedSequence\(|np\.random\.seed\(|random\.Random\(|RandomState\(|torch\.Generator\("
    )
    found = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in PACKAGE.rglob("*.py")
        if path.name not in ("seeds.py", "demo.py")  # demo.py draws its made-up corpus, not a pipeline choice
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if makers.search(line)
    ]
    assert found == []


def test_generators_are_pure_functions_of_seed_stage_and_position():
    first = stage_rng(3, Seed.SHUFFLE, 1, 2).integers(1 << 30, size=4)
    assert (first == stage_rng(3, Seed.SHUFFLE, 1, 2).integers(1 << 30, size=4)).all()
    assert (first != stage_rng(3, Seed.BATCH_ORDER, 1, 2).integers(1 << 30, size=4)).any()
    assert (first != stage_rng(3, Seed.SHUFFLE, 2, 1).integers(1 << 30, size=4)).any()
