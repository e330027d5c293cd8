"""The planner's own average-linkage clustering and leaf order (``shoal.plan.cluster``) give what
``scipy.cluster.hierarchy`` gives -- merges, tie-breaks and leaf order -- on random inputs, on
inputs full of ties and on the region matrices of every built-in scenario, so plans are the same
as with scipy while ``shoal plan`` never imports it."""

import numpy as np
import pytest
from scipy.cluster.hierarchy import leaves_list, linkage
from scipy.spatial.distance import squareform

from shoal.plan import BUILTIN_SCENARIOS, load_scenario
from shoal.plan.allocator import region_matrices
from shoal.plan.cluster import average_linkage, leaf_order, leaves, optimal_order
from shoal.plan.cost import scenario_profile


def scipy_order(dist: np.ndarray) -> list[int]:
    z = linkage(squareform(dist, checks=False), method="average", optimal_ordering=True)
    return [int(i) for i in leaves_list(z)]


def symmetric(rng: np.random.Generator, n: int, values=None) -> np.ndarray:
    a = rng.random((n, n)) if values is None else rng.choice(values, size=(n, n)).astype(float)
    d = np.triu(a, 1)
    return d + d.T


def test_linkage_rows_equal_scipys():
    rng = np.random.default_rng(1)
    for n in range(2, 25):
        d = symmetric(rng, n)
        want = linkage(squareform(d, checks=False), method="average")
        got = np.array(average_linkage(d), dtype=float)
        np.testing.assert_array_equal(got, want)


def test_leaf_order_equals_scipys_on_random_distances():
    rng = np.random.default_rng(2)
    for n in range(2, 33):
        for _ in range(3):
            d = symmetric(rng, n)
            assert leaf_order(d) == scipy_order(d), n


@pytest.mark.parametrize("values", [[1.0], [1.0, 2.0], [1.0, 2.0, 3.0, 5.0], [0.04, 0.12, 0.2]])
def test_leaf_order_equals_scipys_with_ties(values):
    rng = np.random.default_rng(3)
    for n in range(2, 21):
        for _ in range(4):
            d = symmetric(rng, n, values)
            assert leaf_order(d) == scipy_order(d), (n, d.tolist())


def test_leaf_order_is_a_short_path():
    """Points on a line in shuffled order come back in line order (either direction)."""
    rng = np.random.default_rng(4)
    x = rng.permutation(np.arange(12) * 1.0 + rng.random(12) * 0.1)
    d = np.abs(x[:, None] - x[None, :])
    got = [float(x[i]) for i in leaf_order(d)]
    assert got in (sorted(got), sorted(got, reverse=True))


def test_optimal_order_only_swaps_children():
    rng = np.random.default_rng(5)
    d = symmetric(rng, 9)
    z = average_linkage(d)
    z2 = optimal_order(z, d)
    assert [(min(a, b), max(a, b), h, s) for a, b, h, s in z2] == z
    assert sorted(leaves(z2, 9)) == list(range(9))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [n for n in BUILTIN_SCENARIOS if n not in ("scale-1024", "scale-4096")])
def test_region_order_of_every_builtin_scenario_equals_scipys(name):
    s = load_scenario(name)
    prof = scenario_profile(s)
    n_layers = len(prof.layers)
    _, lat, bw = region_matrices(s)
    for stages in range(1, min(n_layers, len(s.workers)) + 1):
        d = lat + prof.param_bytes(0, n_layers) / stages / bw
        np.fill_diagonal(d, 0.0)
        assert leaf_order(d) == scipy_order(d), stages
