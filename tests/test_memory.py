"""One process holds no more than the plain loop (#40, item 6; #55 item 3): the peak
resident memory of three AdamW updates through ``train_samples`` is within 5% of the
hand-written loop's with ``torch.optim.AdamW(fused=True)`` on the same 210 MB model, with
1, 4 and 16 items per update (the hand loop accumulating each item's backward into
``.grad``; leantrain adding each gradient into its sums as the backward produces it).
Each in a fresh process; the figures are peaks above the memory held once the model
exists, in parameter bytes: the hand loop's is its gradients and Adam's two moments,
about 3 P, plus what its backward holds)."""

import subprocess
import sys
from pathlib import Path

import pytest

CHILD = Path(__file__).parent / "memory_child.py"


def peak(which: str, items: int) -> float:
    done = subprocess.run([sys.executable, str(CHILD), which, str(items)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.strip().splitlines()[-1].split()[0])


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status (Linux)")
@pytest.mark.parametrize("items", [1, 4, 16])
def test_a_one_process_update_peaks_no_higher_than_the_hand_written_loop(items):
    hand, ours = peak("hand", items), peak("leantrain", items)
    # gradients and two moments, plus what the backward holds: the measure itself is sound (the hand
    # loop's own peak at 16 items varies with the allocator's history: 4.53 P seen, #55 measured 4.62)
    assert 2.5 < hand < 5.0, hand
    assert ours <= hand * 1.05, (ours, hand)
