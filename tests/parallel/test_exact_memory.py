"""The exact reduction in bounded memory (#40, item 2): with 16 items per update, a rank's
peak resident memory under ``exact_reduction`` on 2 gloo processes is at most one item's
gradient (1 P) above one process's peak for the same updates (plus a stated slack of
0.25 P for measuring noise): one process adds each item's gradient into its sums as the
backward produces it (#55), where an exact rank still holds one item's whole gradient
while it sends its ranges (measured 1.92 P per rank against one process's 1.22 P; 2.09 P
before one process's hooks); gathering every item on every rank, as before, peaked at 48 P
per rank here. Peaks are
above the memory held once the model exists, in units of the parameter bytes P, each
process fresh, with glibc's mmap threshold fixed at 64 KiB: its default threshold grows
as large blocks are freed, after which freed mid-size blocks stay in the heap and the
resident size measures the allocator's fragmentation rather than the live tensors."""

import sys

import pytest
import torch
import torch.multiprocessing as mp

import exact_memory_cases as cases

pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed"),
              pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status (Linux)"),
              pytest.mark.slow]


def test_an_exact_ranks_peak_is_one_item_at_most_above_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # read by each spawned interpreter's allocator
    mp.spawn(cases.measure, args=(1, str(tmp_path / "init1"), str(tmp_path)), nprocs=1, join=True)
    mp.spawn(cases.measure, args=(2, str(tmp_path / "init2"), str(tmp_path)), nprocs=2, join=True)
    one = float((tmp_path / "peak0-of-1.txt").read_text())
    ranks = [float((tmp_path / f"peak{r}-of-2.txt").read_text()) for r in (0, 1)]
    assert 1.0 < one < 6.0, one  # the measure is sound: a gradient sum, an item's gradients, scratch
    assert max(ranks) <= one + 1.0 + 0.25, (ranks, one)


def sharded_peaks(tmp_path, mode: str, world: int) -> tuple[float, float]:
    """(the largest rank's peak, the most a rank holds once a gradient is reduced), in P."""
    mp.spawn(cases.measure_sharded, args=(world, str(tmp_path / f"init-{mode}-{world}"), str(tmp_path), mode),
             nprocs=world, join=True)
    rows = [[float(x) for x in (tmp_path / f"peak{r}-{mode}-of-{world}.txt").read_text().split()]
            for r in range(world)]
    return max(r[0] for r in rows), max(r[1] for r in rows)


def test_gradient_sharding_holds_less_than_optimizer_sharding_and_falls_with_the_world(tmp_path, monkeypatch):
    """#40, item 1, with AdamW and clipping by norm. Once an update's gradient is reduced,
    a rank under ``"optimizer"`` holds the whole of it (for ``clip_grad_norm_``'s bits),
    under ``"gradients"`` its ranges only (the block norm): on 2 ranks about P/2 less.
    (The peak itself comes earlier, in the last backward, where both modes hold the
    rank's own item sum and the buckets in flight, so the two peaks are alike.) And a
    rank's peak falls with the world: on 2 ranks it holds half of the AdamW state
    (2 P in one process)."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    one, _ = sharded_peaks(tmp_path, "gradients", 1)
    gradients, gradients_held = sharded_peaks(tmp_path, "gradients", 2)
    optimizer, optimizer_held = sharded_peaks(tmp_path, "optimizer", 2)
    assert 3.0 < one < 8.0, one  # sound: a gradient sum, an item's gradients, 2 P of state
    assert 1.2 < gradients_held <= optimizer_held - 0.35, (gradients_held, optimizer_held)
    # one process adds each item's gradient into its sums as the backward produces it (#55),
    # so its peak fell: the fall with the world measured 0.73 P (3.15 against 3.88), under
    # the 0.75 this bound had; 0.6 keeps the claim (it falls) with room for noise
    assert gradients <= one - 0.6, (gradients, one)
    assert optimizer <= one - 0.5, (optimizer, one)


def whole_peak(tmp_path, mode: str, world: int) -> float:
    """The largest rank's peak in P, the parameters included, with 4 MiB buckets."""
    mp.spawn(cases.measure_whole, args=(world, str(tmp_path / f"whole-{mode}-{world}"), str(tmp_path), mode, 4 << 20),
             nprocs=world, join=True)
    return max(float((tmp_path / f"whole{r}-{mode}-of-{world}.txt").read_text()) for r in range(world))


def test_parameter_sharding_holds_a_share_of_everything_and_falls_with_the_world(tmp_path, monkeypatch):
    """#40, item 3: under ``"parameters"`` a rank's peak is about (parameters + gradients +
    AdamW state) / W = 4 P / W, plus what does not fall with the world: the units gathered
    at once (two of 1/8 P), the reduce-scatter's buckets in flight (its bound, set to 4 MiB
    here, plus the newest bucket, both ways: one layer's weight is 1/8 P), the gradient
    being cut, the activations and what the process itself grows by; about 1 P on this
    model, hence 4 / W + 1.25 (as shipped the buffers are DDP's 25 MiB and 50 MiB, about 1 P
    more of this model and nothing of a large one). Measured (largest rank): 4.38, 2.89-3.02, 1.86-1.93 P
    on 1, 2 and 4 ranks; ``"gradients"``, which keeps the parameters whole, 3.64 P on 2
    (2.44 P on 4). The fall with the world is the test's point (the last two lines)."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    one, two, four = (whole_peak(tmp_path, "parameters", w) for w in (1, 2, 4))
    assert 4.0 < one < 5.0, one  # sound: the parameters, gradient sums and AdamW state, whole
    assert two <= 4 / 2 + 1.25 and four <= 4 / 4 + 1.25, (two, four)
    assert two <= one - 1.2 and four <= two - 0.6, (one, two, four)  # 4 P / W: a drop of 2 P, then of 1 P
    gradients_two = whole_peak(tmp_path, "gradients", 2)
    assert two <= gradients_two - 0.5, (two, gradients_two)


def test_parameter_sharding_ends_a_run_without_a_second_copy_of_its_ranges(tmp_path, monkeypatch):
    """When a ``"parameters"`` run ends, the module is gathered whole a chunk of slots
    (16 MiB) at a time and a rank lets its own ranges of each chunk go once it is whole:
    its memory rises by about P - P/W, not by P (measured 0.56 P on 2 ranks; 1.00 P when
    the ranges were kept to the end)."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    mp.spawn(cases.measure_finish, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    rises = [float((tmp_path / f"finish{r}-of-2.txt").read_text()) for r in (0, 1)]
    assert all(0.4 < x <= 1 - 1 / 2 + 0.2 for x in rises), rises

