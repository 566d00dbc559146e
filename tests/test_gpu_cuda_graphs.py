"""On GPU, CUDA graphs (GPTConfig.cuda_graphs) train what eager execution trains: 20 steps from
the same initial weights on the same data give the same losses within bf16 rounding, for whole
dense layers captured and for MoE attention + router. The graphs replay the kernels of the
capture, so a stale input buffer or an RNG state the capture froze would show as a loss that
stops following the eager run's.

Both graphed fits run in this one process, one after the other, as in a notebook: mcore keeps
its captures in process globals, and before the strategy released them at teardown the second
fit stopped in its first step ("no matching cudagraph runners"). Skipped without CUDA."""

import pytest
from toy import TokenRows, fit, tiny_config

from lightning_mcore import OptimizerSettings

pytestmark = [pytest.mark.gpu]

SHAPE = dict(num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4, seq_length=128,
             vocab_size=1024, transformer_impl="transformer_engine")
MOE = dict(num_moe_experts=8, moe_ffn_hidden_size=128, moe_router_topk=2, moe_aux_loss_coeff=0.01)
CASES = {"layer": ({}, []), "moe": (MOE, ["attn", "moe_router"])}


def test_graphs_train_as_eager_one_fit_after_another(tmp_path):
    data = TokenRows(n=16, seq=128, vocab=1024)  # 16 rows seen 10 times: memorised, the loss falls
    for case, (moe, parts) in CASES.items():
        runs = {name: fit(tmp_path, steps=20, gbs=8, mbs=2, dataset=data, name=f"{case}-{name}",
                          config=tiny_config(**SHAPE, **moe, cuda_graphs=graphs),
                          optim=OptimizerSettings(lr=3e-3), accelerator="gpu", precision="bf16-mixed",
                          start_method="popen")
                for name, graphs in (("eager", None), ("graphs", parts))}
        print(case, "losses", runs)
        eager, graphs = runs["eager"], runs["graphs"]
        assert len(eager) == len(graphs) == 20
        assert eager[-1] < eager[0] - 1.0, f"{case}: the eager run did not learn"
        for step, (a, b) in enumerate(zip(eager, graphs)):
            assert b == pytest.approx(a, rel=1e-2), f"{case} step {step}: eager {a} vs graphs {b}"
