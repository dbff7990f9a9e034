"""Marks on mlx-lm cache layers live beside them (cache/marks.py), never on them."""
from __future__ import annotations

import gc

from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from mlxstack.cache import marks
from mlxstack.cache.layer_kinds import mark_layer, restore_layer
from mlxstack.cache.marks import mark, marked, marks_of


def test_a_mark_is_held_beside_the_layer_not_on_it():
    layer = QuantizedKVCache()
    before = dict(vars(layer))
    mark(layer, "fp_head", ("k", "v"))
    assert marked(layer, "fp_head") == ("k", "v") and marked(layer, "cut") is None
    assert marked(layer, "cut", False) is False
    assert vars(layer) == before                          # nothing written onto mlx-lm's object
    assert marked(KVCache(), "fp_head") is None           # another layer has no marks


def test_a_mark_goes_with_its_layer():
    layer = RotatingKVCache(max_size=4)
    mark(layer, "cut", True)
    ident = id(layer)
    assert ident in marks._marks
    del layer
    gc.collect()
    # its own entry is gone (other tests' freed models may leave at the same collection, so the
    # table's size says nothing)
    assert ident not in marks._marks


def test_restoring_a_layer_puts_its_marks_back_too():
    layer = RotatingKVCache(max_size=4)
    mark(layer, "cut", False)
    saved = mark_layer(layer)
    mark(layer, "cut", True)
    layer.offset = 7
    restore_layer(layer, saved)
    assert layer.offset == 0 and marks_of(layer) == {"cut": False}


def test_a_freed_objects_callback_never_drops_a_newer_objects_marks():
    layer = RotatingKVCache(max_size=4)
    mark(layer, "cut", True)
    stale = __import__("weakref").ref(KVCache())           # another, already dead, object's ref
    marks._drop(id(layer), stale)
    assert marked(layer, "cut") is True
