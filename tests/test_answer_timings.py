"""``tokens_per_s`` in every answer's timings: decoding speed, also when a mode emits the answer in one burst."""

from __future__ import annotations

import pytest

from ctx_integrations.engine.core.requests import decode_rate


def test_the_rate_counts_the_tokens_after_the_first_over_the_time_after_it():
    assert decode_rate(11, ttft_s=2.0, total_s=4.0) == pytest.approx(10 / 2.0)


def test_an_answer_that_arrived_in_one_burst_is_rated_over_its_whole_time():
    # RAPID accepting a whole draft in its first round: every token lands with the first one. Dividing the
    # nine later tokens by the ~0 s after it reported thousands of tokens per second (seen in an eval table).
    assert decode_rate(10, ttft_s=1.2345, total_s=1.2345 + 1e-6) == pytest.approx(10 / (1.2345 + 1e-6))
    assert decode_rate(10, ttft_s=1.0, total_s=1.0) == pytest.approx(10.0)


@pytest.mark.parametrize(("tokens", "total"), [(0, 1.0), (3, 0.0)])
def test_no_tokens_or_no_time_is_a_zero_rate(tokens, total):
    assert decode_rate(tokens, ttft_s=0.0, total_s=total) == 0.0


def test_one_token_is_rated_over_the_whole_answer():
    assert decode_rate(1, ttft_s=0.5, total_s=0.5) == pytest.approx(2.0)
