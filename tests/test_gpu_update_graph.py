"""The update recorded as a CUDA graph before the NaN/inf check and launched after it
(strategy/update_graph.py) gives the weights of the update launched after the check, bit for
bit: dense and MoE (mcore chains a dense and an expert optimizer), and across a skipped step,
whose recorded update is dropped and Adam's step count put back. Skipped without CUDA."""

import lightning as L
import pytest
import torch
from test_nonfinite import Poisoned
from toy import fit, tiny_config

from lightning_mcore import OptimizerSettings

pytestmark = [pytest.mark.gpu]

MOE = dict(num_moe_experts=4, moe_ffn_hidden_size=64, moe_router_topk=2)


class GraphUpdates(L.Callback):
    def on_train_end(self, trainer, pl_module) -> None:
        optimizer = pl_module.optimizers(use_pl_optimizer=False)
        self.launched, self.skipped = optimizer.graph_updates, optimizer.last_update_skipped


def run(tmp_path, name: str, update_graph: bool, moe: bool, poison=None) -> tuple[list, list, int]:
    counter = GraphUpdates()
    config = tiny_config(transformer_impl="transformer_engine", **(MOE if moe else {}))
    losses = fit(tmp_path, steps=5, config=config, name=name, dump_weights=True,
                 optim=OptimizerSettings(lr=1e-3, on_nonfinite="skip", update_graph=update_graph),
                 module_cls=Poisoned, module_kwargs={"poison": poison}, callbacks=[counter],
                 accelerator="gpu", precision="bf16-mixed", start_method="popen")
    return losses, torch.load(tmp_path / f"{name}.end0.pt"), counter.launched


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("poison", [None, {2: ("grad", None)}], ids=["clean", "nan-step-3"])
def test_recorded_update_gives_the_eager_weights_bit_for_bit(tmp_path, moe, poison):
    eager_losses, eager, eager_launched = run(tmp_path, "eager", False, moe, poison)
    losses, weights, launched = run(tmp_path, "graph", True, moe, poison)
    # step 1 makes Adam's state (eager); a skipped step's recording is dropped
    assert (eager_launched, launched) == (0, 4 if poison is None else 3)
    assert losses == eager_losses
    assert all(ka == kb and torch.equal(a, b) for (ka, *_, a), (kb, *_, b) in zip(weights, eager, strict=True))
    before = torch.load(tmp_path / "graph.init0.pt")
    assert any(not torch.equal(a, b) for (*_, a), (*_, b) in zip(weights, before))  # it trained
