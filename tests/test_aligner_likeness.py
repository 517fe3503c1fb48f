"""analysis/aligner.py (LISA notes §7 #19): the head mass of an aligner's A_{n-1} block and its permutation-likeness,
on aligners constructed to permute heads by a permutation that is not its own inverse, so that a mass read in the
wrong direction (source -> output instead of output -> source) fails."""

from __future__ import annotations

import pytest
import torch

from attnslim.analysis.aligner import head_mass, permutation_likeness
from attnslim.modules.aligner import Aligner

H = 5
PI = [2, 0, 3, 4, 1]  # output head a reads source head PI[a]; a 5-cycle: PI^-1 = [1, 4, 0, 2, 3] differs everywhere
PI_INV = [PI.index(a) for a in range(H)]


def _one_hot(perm: list[int]) -> torch.Tensor:  # (h, h): row a has a 1 at column perm[a]
    return torch.eye(H)[perm]


def _permuting_aligner(hidden: int) -> Aligner:
    """Fusion aligner (c_in = 2h) whose output head a is input head PI[a]; the A_delta block is random (SL) or
    reaches no output (DL, as identity_init leaves it)."""
    torch.manual_seed(0)
    al = Aligner(2 * H, H, hidden)
    al.identity_init()
    with torch.no_grad():
        if hidden == 0:
            al.l1.weight[:, :H] = _one_hot(PI)
        else:  # relu(x) - relu(-x) = x through the first 2h hidden units, routed by the permutation
            al.l1.weight[:H, :H], al.l1.weight[H : 2 * H, :H] = _one_hot(PI), -_one_hot(PI)
    return al


@pytest.mark.parametrize("hidden", [0, 4 * H])
def test_permuting_aligner_is_concentrated_and_its_argmax_is_the_source_head_it_reads(hidden):
    al = _permuting_aligner(hidden)
    prev = torch.randn(1, H, 3, 4)  # (b, h, l, t) scores of layer n-1
    out = al(torch.cat([prev, torch.zeros_like(prev)], dim=1))  # A_delta = 0
    assert torch.allclose(out, prev[:, PI], atol=1e-6)  # the aligner really reads head PI[a] into head a
    got = permutation_likeness(head_mass(al), PI)
    assert got.argmax == PI and got.agreement == 1.0
    assert got.concentration == pytest.approx(1.0)
    assert permutation_likeness(head_mass(al), PI_INV).agreement == 0.0
    assert got.chance == pytest.approx(1 / H)


def test_concentration_falls_from_one_to_chance_as_the_rows_spread():
    torch.manual_seed(1)
    noise = torch.rand(H, H)
    values = [permutation_likeness(_one_hot(PI) + s * noise, PI).concentration for s in (0.0, 0.1, 1.0, 100.0)]
    assert values[0] == pytest.approx(1.0)
    assert all(a > b for a, b in zip(values, values[1:], strict=False))
    assert values[-1] < 1.5 / H
    assert permutation_likeness(torch.ones(H, H), PI).concentration == pytest.approx(1 / H)


def test_dl_mass_counts_paths_through_hidden_units_that_reach_an_output():
    """A hidden unit that reads a source head but that no output reads adds no mass (identity_init's random rows
    reach the outputs with zero W2 weight), so only the routed paths count."""
    al = _permuting_aligner(4 * H)
    with torch.no_grad():
        al.l1.weight[2 * H :, :H] = 10.0  # loud unused hidden units
    assert permutation_likeness(head_mass(al), PI).concentration == pytest.approx(1.0)
    with torch.no_grad():
        al.l2.weight[:, 2 * H :] = 1.0  # now they reach every output: every row spreads over all sources
    assert permutation_likeness(head_mass(al), PI).concentration < 0.5


def test_shape_errors():
    with pytest.raises(ValueError, match=r"\(h, h\)"):
        permutation_likeness(torch.ones(H, H + 1), PI)
    with pytest.raises(ValueError, match="length h"):
        permutation_likeness(torch.ones(H, H), PI[:-1])
