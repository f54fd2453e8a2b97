"""The MMA-fragment K order (``perm``) the Triton ``perm`` tiles and the Gluon kernel share, on CPU.

The wgmma A fragment gives lane l of a warp the logical columns 16 b + 8 h + 2 (l % 4) + t of its
rows. The permutation must hand that lane whole scale groups (so it decodes only its own codes) in
adjacent pairs (one 16-byte load of a blocked row), with the decoded register pair (element i of
word 0, of word 1) landing on (t = 0, t = 1). The kernels themselves: interpreter and GPU tests.
"""

import pytest
import torch


def _perm_x_torch(x: torch.Tensor, bkw: int) -> torch.Tensor:
    # The same reshape / permute as decode.perm_x and gemm_gluon._permute_x (BKW = 16).
    r, g = x.shape[0], bkw // 2
    return x.reshape(r, g // 8, 4, 2, 2, 2, 2, 2).permute(0, 1, 3, 5, 6, 7, 2, 4).reshape(r, 8 * bkw)


@pytest.mark.parametrize("bkw", [16, 32])
def test_each_lane_owns_adjacent_whole_groups(bkw):
    k = 8 * bkw
    phys = _perm_x_torch(torch.arange(k).view(1, k), bkw)[0]  # physical K element of each logical column
    assert sorted(phys.tolist()) == list(range(k))  # a permutation
    for c in range(4):  # lane % 4
        cols = [16 * b + 8 * h + 2 * c + t for b in range(k // 16) for h in range(2) for t in range(2)]
        groups = sorted({int(phys[j]) // 16 for j in cols})
        assert len(groups) * 16 == len(cols)  # whole groups only
        assert all(groups[i] + 1 == groups[i + 1] for i in range(0, len(groups), 2))  # in adjacent pairs
        for j in cols[::2]:  # t = 0 and t = 1: element i of word 0 and of word 1 of one group
            e0, e1 = int(phys[j]), int(phys[j + 1])
            assert e1 == e0 + 8 and (e0 % 16) < 8


def test_weights_and_activations_share_the_order():
    # perm_weights reorders the decoded tiles (tile i, word w = element 8 w + i) into the order
    # perm_x gives X: emulate both on a weight whose value is its physical K index.
    from qerl_kernels.decode import perm_weights, perm_x  # noqa: F401  (the jit functions exist)

    bkw, r = 16, 2
    w = torch.arange(8 * bkw, dtype=torch.float64).repeat(r, 1)
    tiles = [w[:, i::8] for i in range(8)]  # decode order: tile i, column w = element 8 w + i
    g = bkw // 2
    parts = [t.reshape(r, g, 2) for t in tiles]  # (group, t) = word 2 group + t
    s = torch.stack([torch.stack([torch.stack([parts[4 * bb1 + 2 * bb0 + h] for h in range(2)], -1)
                                  for bb0 in range(2)], -1) for bb1 in range(2)], -1)  # [r, G, t, h, bb0, bb1]
    s = s.reshape(r, g // 8, 4, 2, 2, 2, 2, 2).permute(0, 1, 3, 7, 6, 5, 2, 4).reshape(r, 8 * bkw)
    assert torch.equal(s, _perm_x_torch(w, bkw))
