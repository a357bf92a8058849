"""``ClusterLayout``: parsing ``HxR`` and uneven ``R0,R1,...``, host-major rank numbering."""

from __future__ import annotations

import pytest

from netdist.netlab.layout import ClusterLayout


def test_a_grid_is_hosts_by_ranks() -> None:
    layout = ClusterLayout.parse("2x4")
    assert layout.ranks_per_host == (4, 4)
    assert (layout.hosts, layout.world_size, str(layout)) == (2, 8, "2x4")
    assert [layout.host_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.local_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert list(layout.ranks_of(1)) == [4, 5, 6, 7]


def test_an_uneven_layout_lists_ranks_per_host() -> None:
    layout = ClusterLayout.parse("1,2,3")
    assert layout.ranks_per_host == (1, 2, 3)
    assert (layout.hosts, layout.world_size, layout.uniform) == (3, 6, False)
    assert [layout.host_of(r) for r in range(6)] == [0, 1, 1, 2, 2, 2]
    assert [layout.first_rank(h) for h in range(3)] == [0, 1, 3]
    assert [layout.local_rank(r) for r in range(6)] == [0, 0, 1, 0, 1, 2]
    assert str(layout) == "1,2,3" and ClusterLayout.parse(str(layout)) == layout


@pytest.mark.parametrize("text, expected", [("4X2", (2, 2, 2, 2)), (" 2 x 1 ", (1, 1)),
                                            ("3", (3,)), ("2,2", (2, 2))])
def test_spellings(text: str, expected: tuple[int, ...]) -> None:
    assert ClusterLayout.parse(text).ranks_per_host == expected


@pytest.mark.parametrize("text", ["", "x", "2x", "0x4", "2x0", "1,0", "1,,2", "-1", "2*4",
                                  "a,b"])
def test_bad_layouts_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="layout"):
        ClusterLayout.parse(text)


def test_ranks_and_hosts_out_of_range_are_refused() -> None:
    layout = ClusterLayout((1, 2))
    for bad in (-1, 3):
        with pytest.raises(ValueError, match=f"rank {bad} is not in a world of 3"):
            layout.host_of(bad)
    with pytest.raises(ValueError, match="host 2 is not in a cluster of 2 hosts"):
        layout.ranks_of(2)
    with pytest.raises(ValueError, match="at least one"):
        ClusterLayout(())
