"""prompt/sized_lru.py: the count- and byte-bounded LRU behind the healing store and the
Responses store -- exact eviction order and byte totals."""
from __future__ import annotations

from mlxstack.prompt.sized_lru import SizedLRU


def test_least_recently_used_go_first_under_either_bound():
    lru: SizedLRU[str, str] = SizedLRU(max_entries=3, max_bytes=100)
    for k in "abc":
        assert lru.put(k, k.upper(), 30)
    assert lru.get("a") == "A"                    # order now b, c, a
    assert lru.put("d", "D", 30)                  # count bound: b goes -> c, a, d
    assert list(lru._items) == ["c", "a", "d"] and lru.nbytes == 90
    assert lru.put("e", "E", 50)                  # 140 bytes: c goes (count), then a (bytes) -> d, e
    assert list(lru._items) == ["d", "e"] and lru.nbytes == 80 and len(lru) == 2
    assert [lru.get(k) for k in "abcde"] == [None, None, None, "D", "E"]


def test_a_replaced_key_counts_once_and_an_oversized_value_changes_nothing():
    lru: SizedLRU[str, int] = SizedLRU(max_entries=10, max_bytes=100)
    assert lru.put("k", 1, 60) and lru.put("k", 2, 50)
    assert (lru.get("k"), lru.nbytes, len(lru)) == (2, 50, 1)
    assert lru.put("k", 3, 101) is False and (lru.get("k"), lru.nbytes) == (2, 50)
    assert lru.get("missing") is None


def test_pop_takes_one_out_and_items_lists_oldest_first():
    lru: SizedLRU[str, int] = SizedLRU(max_entries=10, max_bytes=100)
    for i, k in enumerate("abc"):
        lru.put(k, i, 10 * (i + 1))
    lru.get("a")                                   # order b, c, a
    assert lru.items() == [("b", 1), ("c", 2), ("a", 0)]
    assert lru.pop("c") == 2 and lru.nbytes == 30 and len(lru) == 2
    assert lru.pop("c") is None and lru.nbytes == 30
    assert lru.items() == [("b", 1), ("a", 0)]
