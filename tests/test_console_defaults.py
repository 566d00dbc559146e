"""A Python run's console (objectives/console.py): Lightning's own bar and summary give way to ours,
and a bar or summary the user configured keeps its settings in ours."""

from lightning.pytorch.callbacks import Callback, ModelSummary, RichModelSummary, TQDMProgressBar

from lightning_mcore.objectives.console import (MegatronModelSummary, MegatronProgressBar,
                                                MegatronRichModelSummary, replacing_defaults)


def test_users_bar_and_summary_keep_their_settings():
    bar, summary, rich, other = TQDMProgressBar(refresh_rate=7, leave=True), ModelSummary(max_depth=3), \
        RichModelSummary(max_depth=2), Callback()
    got = replacing_defaults([bar, summary, rich, other])
    assert [type(c) for c in got] == [MegatronProgressBar, MegatronModelSummary, MegatronRichModelSummary]
    assert got[0].refresh_rate == 7 and vars(got[0]) == vars(bar)
    assert vars(got[1]) == vars(summary) and vars(got[2]) == vars(rich)
    assert got[0] is not bar  # a new instance: Lightning swaps it in for the Trainer's own


def test_ours_and_other_subclasses_stay():
    class MyBar(TQDMProgressBar):
        pass

    assert replacing_defaults([MegatronProgressBar(), MyBar(), MegatronModelSummary()]) == []
