"""mcore caches rotary embeddings (functools.lru_cache on RotaryEmbedding.forward, 32 entries) keyed
on the module and its context-parallel process group, so a finished run's groups stay referenced
there. In a CI run (session 28) a rank forked afterwards evicted such an inherited entry, dropped the
last reference to a group of the launching process, and hung for good in its destructor, which
joins threads that do not come across a fork. A run's teardown and the fork launcher now empty
those caches (strategy/teardown.py, strategy/launcher.py)."""

import json

import lightning as L
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from toy import fit

from lightning_mcore.export_checkpoint import single_process_megatron
from lightning_mcore.strategy import teardown


class CachedAtStart(L.Callback):
    """Writes the rotary cache's size as the forked rank starts fitting, before any forward."""

    def __init__(self, path) -> None:
        self.path = path

    def on_fit_start(self, *args) -> None:
        self.path.write_text(json.dumps(RotaryEmbedding.forward.cache_info().currsize))


def populated() -> None:
    """A run in this process (a notebook's export, a test) that leaves an entry holding a group."""
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)
    rope(16, cp_group=parallel_state.get_context_parallel_group())
    assert RotaryEmbedding.forward.cache_info().currsize == 1


def test_a_forked_rank_inherits_no_cached_rotary_group(tmp_path, monkeypatch):
    with single_process_megatron():
        populated()
    assert RotaryEmbedding.forward.cache_info().currsize == 0  # the run's teardown emptied the cache

    monkeypatch.setattr(teardown, "clear_rotary_caches", lambda: None)  # a teardown that did not
    with single_process_megatron():
        populated()
    assert RotaryEmbedding.forward.cache_info().currsize == 1
    fit(tmp_path, devices=1, steps=1, gbs=2, mbs=2, callbacks=(CachedAtStart(tmp_path / "cached.json"),))
    assert json.loads((tmp_path / "cached.json").read_text()) == 0  # the launcher emptied it before forking
    monkeypatch.undo()
    teardown.clear_rotary_caches()  # this process keeps no entry of the test's either
    assert RotaryEmbedding.forward.cache_info().currsize == 0
