"""Engine bugs found while writing the unit tests. These fail until the engine is fixed.

NaN temperature: `SamplingParams._validate` checks `self.temperature < 0.0`, which is False for
NaN, so `SamplingParams(temperature=float("nan"))` is accepted (top_p and min_p use chained
range checks and do reject NaN). `greedy` is also False for NaN, so the row goes to
`Sampler._sample`, where `logits / nan` is all NaN and `argmax` returns token 0 at every step
whatever the logits are. The request silently produces garbage, although the module promises
that a bad request is refused before it reaches the scheduler.
"""

import pytest

from kvfleet.contracts.sampling_params import SamplingParams


def test_nan_temperature_is_rejected():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))
