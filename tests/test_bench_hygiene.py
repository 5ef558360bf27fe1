"""The benchmarks depend on nothing of the test suite ([bench] installs no pytest) (issue 19,
item 6). Their measuring helpers check the host, not seqshard: ``python bench/selfcheck.py``."""

import ast
from pathlib import Path

import pytest

BENCH = Path(__file__).parent.parent / "bench"

TEST_ONLY = {"conftest", "pytest", "hypothesis", "gloo_ranks"}  # modules of tests/ and what only [test] installs


@pytest.mark.parametrize("script", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_benches_import_nothing_from_the_test_suite(script):
    tree = ast.parse(script.read_text())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {
        node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not imported & TEST_ONLY
