"""The step keeps the engine's log-probs only while something reads them: the policy's
update under a rollout correction; otherwise they are dropped after the scoring pass's
``rollout/logprob_gap`` (4 bytes a response token of host memory, the whole step's on a DP1
policy)."""

from pathlib import Path

import pytest

from tests.launcher import run_workers

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "rollout_logprobs_worker.py"


@pytest.mark.parametrize("correction", ["off", "token"])
def test_engine_logprobs_kept_only_for_the_correction(correction):
    (out,) = run_workers(WORKER, 1, correction, timeout=180)
    line = next(x for x in out.splitlines() if x.startswith("correction="))
    fields = dict(part.split("=") for part in line.split())
    assert fields["kept"] == str(correction != "off")
    assert (int(fields["weight_calls"]) > 0) == (correction != "off")
    # The bench's engine and stub scorer differ (-0.5 against -1e-6 * token): a real gap.
    assert float(fields["gap"]) > 0.1
