"""Average-linkage clustering of a few dozen points and the leaf order of its dendrogram.

The allocator orders regions so that neighbours in the order are close (see
:func:`shoal.plan.allocator.region_order`). It needs this for at most a few dozen regions, once
per stage count, so plain Python and small numpy blocks do it in well under a millisecond; the
plan command therefore never imports scipy (whose clustering module costs ~0.3-0.7 s to import).

The result is the one ``scipy.cluster.hierarchy`` gives for ``linkage(method="average",
optimal_ordering=True)`` followed by ``leaves_list`` -- merges, tie-breaks and the
float32 arithmetic of its leaf-ordering pass included -- so plans made with either are the same
(``tests/test_plan_cluster.py`` compares them on random and tied inputs and on every built-in
scenario).

Linkage rows are ``(a, b, distance, size)`` as in scipy: the ``i``-th merge creates cluster
``n + i`` from clusters ``a < b`` (ids below ``n`` are the points).
"""

from __future__ import annotations

import math

import numpy as np

# The leaf-ordering pass keeps its path costs in float32 and starts every minimum at 2**30
# (scipy's convention); costs are seconds here, far below it.
_CAP = np.float32(2.0 ** 30)


def average_linkage(dist: np.ndarray) -> list[tuple[int, int, float, int]]:
    """Average-linkage (UPGMA) merges of the points of the square distance matrix ``dist``.

    Nearest-neighbour chain: follow each cluster's nearest neighbour (preferring the chain's
    previous element on a tie, lowest index otherwise) until two clusters are each other's
    nearest, merge them into the slot of the larger index, update distances as size-weighted
    means. The merges are then sorted by distance (stably) and relabelled so that each merge
    names the current clusters of its two points."""
    n = len(dist)
    if n < 2:
        return []
    d = [[float(v) for v in row] for row in dist]
    for row in d:
        if not all(math.isfinite(v) for v in row):
            raise ValueError("average_linkage needs finite distances")
    size = [1] * n
    chain: list[int] = []
    raw: list[tuple[int, int, float, int]] = []
    for _ in range(n - 1):
        if not chain:
            chain.append(next(i for i in range(n) if size[i] > 0))
        while True:
            x = chain[-1]
            if len(chain) > 1:
                y = chain[-2]
                best = d[x][y]
            else:
                y, best = -1, math.inf
            row = d[x]
            for i in range(n):
                if size[i] and i != x and row[i] < best:
                    best, y = row[i], i
            if len(chain) > 1 and y == chain[-2]:
                break
            chain.append(y)
        del chain[-2:]
        x, y = min(x, y), max(x, y)
        nx, ny = size[x], size[y]
        raw.append((x, y, best, nx + ny))
        size[x], size[y] = 0, nx + ny
        for i in range(n):
            if size[i] and i != y:
                v = (nx * d[i][x] + ny * d[i][y]) / (nx + ny)
                d[i][y] = d[y][i] = v
    raw.sort(key=lambda r: r[2])  # stable, like a merge sort
    return _relabel(raw, n)


def _relabel(raw: list[tuple[int, int, float, int]], n: int) -> list[tuple[int, int, float, int]]:
    """Merges recorded by point slots -> merges of cluster ids (union-find, new ids from ``n``)."""
    parent = list(range(2 * n - 1))
    size = [1] * (2 * n - 1)

    def find(x: int) -> int:
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return root

    out = []
    for k, (x, y, dist, _) in enumerate(raw):
        rx, ry = find(x), find(y)
        new = n + k
        parent[rx] = parent[ry] = new
        size[new] = size[rx] + size[ry]
        out.append((min(rx, ry), max(rx, ry), dist, size[new]))
    return out


def leaves(z: list[tuple], n: int) -> list[int]:
    """The points of the dendrogram ``z`` left to right (pre-order, first child first)."""
    if n == 1:
        return [0]
    out: list[int] = []
    stack = [2 * n - 2]
    while stack:
        v = stack.pop()
        if v < n:
            out.append(v)
        else:
            a, b = z[v - n][0], z[v - n][1]
            stack.append(int(b))
            stack.append(int(a))
    return out


def optimal_order(z: list[tuple], dist: np.ndarray) -> list[tuple[int, int, float, int]]:
    """``z`` with children swapped so that the leaf order has a short path through ``dist``
    (Bar-Joseph, Gifford and Jaakkola's optimal leaf ordering, as scipy applies it).

    Points are renumbered by their position in ``z``'s current leaf order, so every cluster is
    a range of positions. Bottom-up, ``cost[u, w]`` is the shortest path through a cluster's
    points that starts at ``u`` and ends at ``w``: for a cluster with children ``L`` and ``R``,
    ``cost[u, w] = min over m, k of cost[u, m] + dist[m, k] + cost[k, w]`` with ``u, m`` in
    different children of ``L`` (or both ``L`` itself, a point) and ``k, w`` likewise in ``R``.
    Each cluster picks its cheapest ``(u, w)`` (first in position order on a tie) and that choice
    decides whether each child is mirrored; a node is finally mirrored when an odd number of its
    ancestors (itself included) asked for it."""
    n = len(z) + 1
    if n <= 2:
        return list(z)
    order = leaves(z, n)
    pos = {p: i for i, p in enumerate(order)}
    kids = [(pos[int(a)] if a < n else int(a), pos[int(b)] if b < n else int(b)) for a, b, *_ in z]
    d = np.asarray(dist, dtype=float)[np.ix_(order, order)]
    span = [(i, i + 1) for i in range(n)] + [(0, 0)] * (n - 1)
    for k, (a, b) in enumerate(kids):
        span[n + k] = (span[a][0], span[b][1])
    cost = np.zeros((n, n), dtype=np.float32)
    swap_l = np.zeros((n, n), dtype=np.int8)  # for (u, w): u came from the left child's right half
    swap_r = np.zeros((n, n), dtype=np.int8)  # for (u, w): w came from the right child's left half
    mirror = [0] * (n - 1)
    for vl, vr in kids:
        # (cluster of u, cluster of m) on the left and (cluster of w, cluster of k) on the right;
        # index 1 of each list means "this child mirrored"
        lefts = [(vl, vl)] if vl < n else [kids[vl - n], kids[vl - n][::-1]]
        rights = [(vr, vr)] if vr < n else [kids[vr - n][::-1], kids[vr - n]]
        for sl, (uc, mc) in enumerate(lefts):
            u0, u1 = span[uc]
            m0, m1 = span[mc]
            for sr, (wc, kc) in enumerate(rights):
                w0, w1 = span[wc]
                k0, k1 = span[kc]
                # float32 sum of the two inner paths, the float64 hop between them, rounded to float32
                inner = cost[u0:u1, m0:m1][:, None, :, None] + cost[w0:w1, k0:k1][None, :, None, :]
                total = (inner.astype(np.float64) + d[m0:m1, k0:k1][None, None, :, :]).astype(np.float32)
                best = np.minimum(total.min(axis=(2, 3)), _CAP)
                cost[u0:u1, w0:w1] = best
                cost[w0:w1, u0:u1] = best.T
                swap_l[u0:u1, w0:w1] = swap_l[w0:w1, u0:u1] = sl
                swap_r[u0:u1, w0:w1] = swap_r[w0:w1, u0:u1] = sr
        l0, l1 = span[vl]
        r0, r1 = span[vr]
        j = int(np.argmin(cost[l0:l1, r0:r1]))  # row-major: the first (u, w) on a tie
        bu, bw = l0 + j // (r1 - r0), r0 + j % (r1 - r0)
        if vl >= n:
            mirror[vl - n] = int(swap_l[bu, bw])
        if vr >= n:
            mirror[vr - n] = int(swap_r[bu, bw])
    flip = [0] * (n - 1)
    for k in range(n - 2, -1, -1):  # parents come after their children in z
        flip[k] ^= mirror[k]  # its parent's parity (set below, parent first) and its own request
        for c in kids[k]:
            if c >= n:
                flip[c - n] = flip[k]
    out = []
    for k, (a, b, h, s) in enumerate(z):
        out.append((b, a, h, s) if flip[k] else (a, b, h, s))
    return out


def leaf_order(dist: np.ndarray) -> list[int]:
    """Indices of the points of ``dist`` in the optimal leaf order of their average-linkage
    dendrogram: neighbours in the order are close (what ``scipy.cluster.hierarchy`` gives for
    ``leaves_list(linkage(squareform(dist), "average", optimal_ordering=True))``)."""
    n = len(dist)
    if n <= 1:
        return list(range(n))
    z = average_linkage(dist)
    return leaves(optimal_order(z, dist), n)
