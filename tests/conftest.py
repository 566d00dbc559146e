import os

# Ranks are forked from this process. An OpenMP pool with >1 thread in the parent deadlocks
# forked children (seen in torch.zeros), and Lightning raises the thread count unless
# OMP_NUM_THREADS is set; one thread per rank also suits 2 cores.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# GPU tests compare fp32 with transformers' fp32: Transformer Engine runs fp32 GEMMs in TF32
# unless this is set before CUDA starts (Gemma 3's tiny model: 8e-3 off with TF32, 4e-6 without).
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")

import datasets  # noqa: E402, F401 - see below
import pytest  # noqa: E402
import torch  # noqa: E402
from process_state import leaves_no_process_state  # noqa: E402

torch.set_num_threads(1)
# `datasets` gives its logger a handler on sys.stderr when it is imported: imported first inside a
# test, that is the test's capsys buffer, closed after it, and every later log line of datasets
# prints logging's own error with a traceback into the next test's stderr (seen in a test that
# asserts stderr holds one error line). Imported here, the handler writes to pytest's session
# capture, which lives as long as the session.
# On CPU, mcore's fused functions (jit_fuser: torch.compile) are traced and built by inductor in
# every new rank process, seconds each on 2 cores, for kernels no CPU test is about; they run
# eagerly here. The README's commands run as a user runs them (readme.clean_env drops this).
if not torch.cuda.is_available():
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _each_test_starts_clean():
    with leaves_no_process_state():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed multi-rank test (gpu, distributed) is printed at once: its ranks may still wait in
    a collective, and the teardown above (destroying the process group) then hangs until a
    timeout kills pytest before its summary, taking the failure's message with it (twice on GPU,
    benchmarks/RESULTS.md sessions 24 and 25)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and ({"gpu", "distributed"} & set(item.keywords)):
        terminal = item.config.pluginmanager.get_plugin("terminalreporter")
        if terminal is not None:
            terminal.write_line(f"\nFAILED {item.nodeid} (printed before its teardown)\n{report.longreprtext}")
            terminal.flush()
