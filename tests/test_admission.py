"""One admission rule (engine.core.admission), checked by hand against each case."""
import pytest

from engine.core.admission import AdmissionError, admit


@pytest.mark.parametrize("n,mt,refuse,expect", [
    (10, 5, True, 5), (10, 5, False, 5),            # fits: as asked
    (10, 90, True, 90), (10, 91, False, 90),        # exactly fits / truncated to the room left
    (10, None, True, 90), (10, None, False, 90),    # as many as fit
    (100, None, False, 1), (100, 7, False, 1),      # prompt == max_model_len: one token
])
def test_admitted(n, mt, refuse, expect):
    assert admit(n, mt, 100, refuse_overflow=refuse) == expect


@pytest.mark.parametrize("n,mt,refuse,field", [
    (0, 5, False, "prompt"), (0, 5, True, "prompt"),
    (101, 1, False, "prompt"), (101, None, True, "prompt"),
    (100, None, True, "prompt"),                    # the server needs room for a token
    (10, 91, True, "max_tokens"), (100, 1, True, "max_tokens"),
    (10, 0, False, "max_tokens"), (10, -3, True, "max_tokens"),
])
def test_refused_naming_the_field(n, mt, refuse, field):
    with pytest.raises(AdmissionError) as e:
        admit(n, mt, 100, refuse_overflow=refuse)
    assert e.value.field == field and str(e.value).startswith(field)
