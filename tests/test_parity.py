"""Every step of 60 recorded vLLM 0.33 scheduler traces must match exactly."""
import pytest

from tests.parity_replay import first_mismatch, load_fixtures, replay

FIXTURES = load_fixtures()


def test_fixture_file_is_complete():
    assert len(FIXTURES) == 60
    assert sum(len(f["steps"]) for f in FIXTURES) > 10_000


@pytest.mark.parametrize("idx", range(len(FIXTURES)))
def test_vllm_trace_replay(idx):
    fx = FIXTURES[idx]
    records = replay(fx, check_invariants=True)
    assert len(records) == len(fx["steps"])
    mismatch = first_mismatch(fx, records)
    assert mismatch is None, f"fixture {idx} config={fx['config']}\n{mismatch}"
