"""engine.pacing.SlicePacer: the prompt tokens a step reads while other slots decode."""
import pytest

from flashdraft.engine.pacing import SlicePacer


def timed(pacer: SlicePacer, step_s: float, fixed: float, per_token: float, lengths: list[int]) -> SlicePacer:
    for _ in range(3):
        pacer.observe_step(step_s)
    for n in lengths:
        pacer.observe_slice(n, fixed + per_token * n)
    return pacer


def test_before_anything_is_timed_it_reads_the_first_size():
    assert SlicePacer(first=64).size() == 64
    assert SlicePacer(first=64).size() == timed(SlicePacer(first=64), 0.02, 0, 0, []).size()


def test_slices_fit_the_budget_of_a_step_from_their_fixed_and_per_token_parts():
    pacer = timed(SlicePacer(ratio=2.5), step_s=0.020, fixed=0.008, per_token=0.0005, lengths=[64, 128, 32])
    assert pacer.fit() == pytest.approx((0.008, 0.0005))
    assert pacer.size() == 48  # (1.5 * 20 ms - 8 ms) / 0.5 ms = 44 tokens, the nearest multiple of 16
    assert timed(SlicePacer(ratio=3.0), 0.020, 0.010, 0.0001, [64, 128]).size() == 304  # 300


def test_one_length_counts_as_all_per_token():
    pacer = timed(SlicePacer(ratio=2.5), step_s=0.020, fixed=0.0, per_token=0.0002, lengths=[64])
    assert pacer.fit() == pytest.approx((0.0, 0.0002))
    assert pacer.size() == 144  # 30 ms / 0.2 ms = 150


def test_a_size_held_down_by_a_fixed_cost_it_does_not_know_yet_grows():
    """Timed at one length only, a slice counts as all per token, which a fixed part makes too short; the next
    size is then longer, and two lengths apart tell the parts apart."""
    pacer = timed(SlicePacer(ratio=2.5), step_s=0.020, fixed=0.008, per_token=0.0001, lengths=[32])
    sizes = []
    for _ in range(6):
        sizes.append(pacer.size())
        pacer.observe_slice(sizes[-1], 0.008 + 0.0001 * sizes[-1])
    assert sizes == [80, 224, 224, 224, 224, 224]  # 30 ms / 0.35 ms a token at 32; then (30 - 8) / 0.1 = 220


def test_a_fixed_cost_past_the_budget_reads_the_most():
    """Where a slice costs a whole pass whatever its length, small slices only stretch the prompt out."""
    assert timed(SlicePacer(ratio=2.5, most=512), 0.020, 0.050, 0.0001, [16, 64, 128]).size() == 512
    assert timed(SlicePacer(ratio=2.5, most=512), 0.020, 0.040, 0.0, [16, 64]).size() == 512


def test_sizes_stay_between_least_and_most():
    assert timed(SlicePacer(least=16), 0.020, 0.029, 0.001, [16, 32]).size() == 16
    assert timed(SlicePacer(most=256), 0.020, 0.0, 1e-6, [64, 128]).size() == 256


def test_the_decode_step_is_a_moving_average():
    pacer = SlicePacer(alpha=0.5)
    pacer.observe_step(0.010)
    pacer.observe_step(0.030)
    assert pacer.step_s == pytest.approx(0.020)
