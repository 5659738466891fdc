"""The demo kernel check's bound (bnb_mps.demo.check), as pure functions on synthetic figures: the
error allowed per 4-bit product (docs/semantics.md section 4, float32: 5 units of 2^-24 * sum |a*w| of
the exact product up to K = 4096 terms, growing like sqrt(K) beyond), the perturbation that moves
every product by that much with random signs, the allowed logit difference over the sign draws, and
the two verdicts. Faults DC1, DC2, DC4 and DC5 of the audit (docs/tests.md). The demo's whole run is
tests/test_demo.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bnb_mps.demo import check


@pytest.mark.parametrize("K,units", [(64, 5.0), (384, 5.0), (1408, 5.0), (4096, 5.0), (8192, 5.0 * math.sqrt(2)),
                                     (16384, 10.0), (14336, 5.0 * math.sqrt(3.5))])  # fmt: skip
def test_the_error_allowed_per_product_grows_like_sqrt_K_beyond_4096_terms(K, units):
    """Fault DC1: the sqrt(K / 4096) growth dropped or changed; the demo's own products (K = 384) never
    reach it, a 7B model's down projection (K = 14336) does; K = 1408 and 4096 lie below it."""
    assert check.product_units(K) == pytest.approx(units, rel=1e-12)


def logits(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_the_allowed_difference_is_the_largest_of_every_draw_not_the_last():
    """Fault DC2: the allowed difference taken from the last sign draw instead of the largest. Three
    draws whose largest absolute change is the second's, and largest relative change the first's."""
    stock = logits([1.0, -2.0, 4.0], [8.0, 0.5, -1.0])
    draws = [
        [(logits([1.375, -2.0, 4.0], [8.0, 0.5, -1.0]), stock)],  # abs 0.375, rel 0.375 / 4 = 0.09375
        [(logits([1.0, -2.0, 4.0], [8.0, 0.5, -1.5]), stock)],  # abs 0.5, rel 0.5 / 8 = 0.0625
        [(logits([1.125, -2.0, 4.0], [8.0, 0.5, -1.0]), stock)],  # abs 0.125, rel 0.125 / 4 = 0.03125
    ]
    assert check.allowed_difference(draws) == (0.5, 0.09375)
    # a draw compares two pairs (the evaluation batch, the sample's tokens): either one counts
    two = [[(logits([0.0, 1.0]), logits([0.0, 1.0])), (logits([0.0, 3.0]), logits([0.0, 2.0]))]]
    assert check.allowed_difference(two) == (1.0, 0.5)


@pytest.mark.parametrize("gap_over_allowed,could", [(0.5, True), (1.0, True), (1.5, True), (1.99, True), (2.0, True),
                                                    (2.01, False), (3.0, False)])  # fmt: skip
def test_a_token_could_change_where_the_top_two_lie_within_twice_the_allowed_difference(gap_over_allowed, could):
    """Fault DC5: the gap compared with the allowed difference once (or any other factor but two):
    each of the top two logits may move by the allowed difference, towards the other, so a gap between
    1x and 2x the allowed difference can swap them."""
    allowed = 0.375
    assert check.could_change_a_token(gap_over_allowed * allowed, allowed, moved_a_token=False) is could
    assert check.could_change_a_token(gap_over_allowed * allowed, allowed, moved_a_token=True) is True


def test_logits_are_within_only_if_both_differences_are():
    assert check.logits_within(0.1, 0.01, 0.1, 0.01)
    assert not check.logits_within(0.1000001, 0.01, 0.1, 0.01)
    assert not check.logits_within(0.1, 0.0100001, 0.1, 0.01)


def test_the_perturbation_moves_each_product_by_its_allowed_error_with_random_signs():
    """Fault DC4: no random signs (every product moved the same way) or another size. A 4-bit layer of
    K = 8192 (where the allowed error has grown to 5 * sqrt(2) units): each output moves by that many
    units of 2^-24 * its sum |a*w| (+ |bias|), computed here in float64 from bitsandbytes' dequantized
    weight, up to the rounding of the moved result to float32; about half of them up, half down."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    torch.manual_seed(0)
    K, N = 8192, 64
    layer = bnb.nn.Linear4bit(K, N, bias=True, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(N, K), requires_grad=False, quant_type="nf4")
    layer.bias = torch.nn.Parameter(torch.randn(N))
    model = torch.nn.Sequential(layer).to("cpu")
    x = torch.randn(3, K)
    with torch.no_grad():
        stock = model(x)
        products = check.Products(model)
        with products.perturb(torch.Generator().manual_seed(5)):
            moved = model(x)
    W = F.dequantize_4bit(layer.weight.data, layer.weight.quant_state).double().numpy()
    S = np.abs(x.double().numpy()) @ np.abs(W).T + np.abs(layer.bias.detach().double().numpy())
    allowed = 5.0 * math.sqrt(2) * S * 2.0**-24
    delta = moved.double().numpy() - stock.double().numpy()
    rounding = np.spacing(np.abs(moved.numpy())).astype(np.float64)
    assert np.all(np.abs(np.abs(delta) - allowed) <= rounding), np.abs(np.abs(delta) - allowed).max()
    up = float((delta > 0).mean())
    assert 0.35 < up < 0.65, up


def test_logit_differences_are_the_largest_and_the_largest_relative_to_each_position():
    got = logits([1.0, 2.0, -4.0], [10.0, 0.0, 1.0])
    want = logits([1.5, 2.0, -4.0], [10.0, 0.0, 0.0])
    assert check.logit_diff(got, want) == (1.0, 0.125)  # (0.5 at a position whose largest is 4; 1 of 10)
    assert check.logit_diff(logits(), logits()) == (0.0, 0.0)


def test_the_greedy_margin_is_the_gap_between_the_top_two_tokens_that_may_be_chosen():
    steps = logits([3.0, 9.0, 2.5, 1.0], [0.0, 9.0, -1.0, 0.5])
    assert check.margins(steps, suppress=[1]).tolist() == [0.5, 0.5]
    assert check.margins(steps, suppress=[]).tolist() == [6.0, 8.5]


@pytest.mark.parametrize("got,want,n", [([1, 2, 3, 4], [1, 2, 3, 4], 4), ([1, 2, 9, 4], [1, 2, 3, 4], 3),
                                        ([7, 2, 3], [1, 2, 3, 4], 1), ([1, 2], [1, 2, 3], 2)])  # fmt: skip
def test_compared_steps_end_at_the_first_different_token_which_counts(got, want, n):
    """The logits of the first differing token still came from the same prefix; those after did not."""
    assert check.compared_steps(torch.tensor(got), torch.tensor(want)) == n
