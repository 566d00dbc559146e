"""A process that ran mcore once (an in-process export: lightning-mcore export, or
export_checkpoint in a notebook) and then forks training ranks. mcore's destroy_model_parallel
leaves some of its process groups behind; forked ranks inherited them and hung creating their
own (strategy/teardown.py). Run in a subprocess so that a regression fails instead of hanging."""

import subprocess
import sys
import textwrap

from toy import ROOT

SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, "tests")
    from megatron.core import parallel_state
    from lightning_mcore.export_checkpoint import single_process_megatron
    from toy import TokenRows, fit

    with single_process_megatron():
        assert parallel_state.model_parallel_is_initialized()
    losses = fit(sys.argv[1], devices=2, steps=1, gbs=2, mbs=1, dataset=TokenRows(n=4, seq=16, vocab=200))
    print("losses", losses)
""")


def test_forked_ranks_train_after_an_in_process_mcore_run(tmp_path):
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0 and "losses [" in run.stdout, run.stdout[-2000:] + run.stderr[-3000:]
