"""engine.pacing.SlicePacer: the prompt tokens a step reads while other slots decode."""
import pytest

from flashdraft.engine.pacing import SlicePacer


def timed(pacer: SlicePacer, step_s: float, fixed: float, per_token: float, lengths: list[int]) -> SlicePacer:
    for _ in range(3):
        pacer.observe_step(step_s)
    for n in lengths:
        pacer.observe_slice(n, fixed + per_token * n)
    return pacer


def test_before_a_decode_step_is_timed_it_reads_the_most_then_the_first_size():
    """Prompts that arrive together are read as fast as they can be until a decode step tells the budget."""
    assert SlicePacer(first=32, most=512).size() == 512
    assert timed(SlicePacer(first=32), 0.02, 0, 0, []).size() == 32


def test_slices_fit_the_budget_of_a_step_from_their_fixed_and_per_token_parts():
    # a step with a slice: the decode step (20 ms) and 8 ms more, and 0.5 ms a token
    pacer = timed(SlicePacer(ratio=2.5), step_s=0.020, fixed=0.028, per_token=0.0005, lengths=[64, 128, 32])
    assert pacer.fit() == pytest.approx((0.028, 0.0005))
    assert pacer.size() == 32  # (2.5 * 20 ms - 28 ms) / 0.5 ms = 44 tokens, down to a multiple of 16
    assert timed(SlicePacer(ratio=3.0), 0.020, 0.030, 0.0001, [64, 128]).size() == 288  # 300


def test_one_length_counts_as_all_per_token():
    pacer = timed(SlicePacer(ratio=2.5), step_s=0.020, fixed=0.0, per_token=0.0002, lengths=[64])
    assert pacer.fit() == pytest.approx((0.0, 0.0002))
    assert pacer.size() == 240  # 50 ms / 0.2 ms = 250


def test_a_size_held_down_by_a_fixed_cost_it_does_not_know_yet_grows():
    """Timed at one length only, a slice counts as all per token, which a fixed part makes too short; the next
    size is then longer, and two lengths apart tell the parts apart."""
    pacer = timed(SlicePacer(ratio=2.5), step_s=0.020, fixed=0.028, per_token=0.0001, lengths=[32])
    sizes = []
    for _ in range(6):
        sizes.append(pacer.size())
        pacer.observe_slice(sizes[-1], 0.028 + 0.0001 * sizes[-1])
    assert sizes == [48, 64, 208, 208, 208, 208]  # 50 / 0.975 ms, 50 / 0.683 ms; then (50 - 28) / 0.1 = 220


def test_a_fixed_cost_past_the_budget_reads_the_most():
    """Where a slice costs a whole pass whatever its length, small slices only stretch the prompt out."""
    assert timed(SlicePacer(ratio=2.5, most=512), 0.020, 0.060, 0.0001, [16, 64, 128]).size() == 512


def test_eager_slices_of_a_whole_pass_find_their_fixed_part():
    """Eager slices costing a pass whatever their length (a recurrent target's): the first slice and the next differ
    in length, so the fit sees the fixed part and the pacer reads the most, not `least` a pass for ever."""
    pacer = SlicePacer(ratio=2.5, least=16, most=512)
    pacer.observe_step(0.013)
    sizes = []
    for _ in range(4):
        sizes.append(pacer.size())
        pacer.observe_slice(sizes[-1], 0.3 + 1e-5 * sizes[-1])
    assert sizes[0] != sizes[1] and sizes[-1] == 512, sizes


def test_graph_slices_past_the_budget_read_the_least():
    """Read in graph replays of `least` tokens (not whole passes), the first slice and a slice step over the budget
    take one replay: the most would pause the streams for dozens of replays."""
    assert timed(SlicePacer(least=16, first=32, whole_pass=False), 0.013, 0, 0, []).size() == 16  # one replay first
    pacer = timed(SlicePacer(ratio=2.5, least=16, most=512, whole_pass=False), 0.013, 0.035, 0.0001, [16, 32])
    assert pacer.fit()[0] >= 2.5 * 0.013 and pacer.size() == 16



def test_a_longer_slice_timed_faster_counts_as_all_per_token():
    """Noise (a shorter slice timed slower) must not read as no cost per token, which would read the most."""
    pacer = timed(SlicePacer(ratio=2.5), step_s=0.020, fixed=0.0, per_token=0.0, lengths=[])
    pacer.observe_slice(32, 0.030)
    pacer.observe_slice(96, 0.029)
    assert pacer.fit() == pytest.approx((0.0, 0.029 / 96))
    assert pacer.size() == 160  # 50 ms at 0.30 ms a token


def test_sizes_stay_between_least_and_most():
    assert timed(SlicePacer(least=16), 0.020, 0.049, 0.001, [16, 32]).size() == 16
    assert timed(SlicePacer(most=256), 0.020, 0.0, 1e-6, [64, 128]).size() == 256


def test_the_decode_step_is_a_moving_average():
    pacer = SlicePacer(alpha=0.5)
    pacer.observe_step(0.010)
    pacer.observe_step(0.030)
    assert pacer.step_s == pytest.approx(0.020)


def test_a_slice_step_that_compiled_is_left_out_of_the_fit():
    """A first slice of a new shape that waited on a compile (3 s beside 16 ms decode steps, 2026-12-07 H100) says
    nothing of what slices cost: it would read as a fixed cost past the budget and make every slice the largest."""
    pacer = timed(SlicePacer(ratio=2.5), step_s=0.016, fixed=0.012, per_token=0.0002, lengths=[32, 96])
    pacer.observe_slice(16, 3.0)
    assert pacer.fit() == pytest.approx((0.012, 0.0002))
    assert pacer.size() == 128  # (40 ms - 12 ms) / 0.2 ms = 140, down to a multiple of 16
