"""The README's first fine-tune as a newcomer runs it: `fit` with configs/sft_lora.yaml, `export`
to a peft adapter and to a merged model, then the README's Python code (peft and transformers
only), all taken from README.md and run verbatim in a fresh directory with a copy of configs/.
Checked against independent references: the bundled base alone (the adapter must change its
output) and the merged export (transformers alone must give the adapted model's logits)."""

import csv
import io
import json
import os
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from readme import code_blocks, commands, run, section, user_dir, warnings_in

SECTION = "Fine-tune with LoRA, load the adapter with peft"


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory):
    """The README's commands in order, then its Python code; the code's namespace and stdout."""
    work = user_dir(tmp_path_factory.mktemp("newcomer"))
    text = section(SECTION)
    argvs = commands(text)
    assert [argv[1] for argv in argvs] == ["fit", "export", "export"], argvs
    for argv in argvs:
        proc = run(argv, work)
        assert warnings_in(proc.stderr) == [], proc.stderr  # TP=2 + SP, LoRA, exports: all quiet
    (code,) = code_blocks(text, "python")
    namespace, printed = {}, io.StringIO()
    cwd = os.getcwd()
    os.chdir(work)
    try:
        with redirect_stdout(printed):
            exec(compile(code, "README.md", "exec"), namespace)
    finally:
        os.chdir(cwd)
    return work, namespace, printed.getvalue()


def test_readme_fine_tune_trains(newcomer):
    work, _, _ = newcomer
    (metrics,) = (work / "runs" / "sft_lora" / "lightning_logs").rglob("metrics.csv")
    losses = [float(r["train/loss"]) for r in csv.DictReader(open(metrics)) if r.get("train/loss")]
    assert len(losses) >= 5 and losses[-1] < losses[0] - 0.5, losses


def test_adapter_names_the_bundled_base(newcomer):
    work, namespace, _ = newcomer
    config = json.loads((work / "runs" / "sft_lora" / "adapter" / "adapter_config.json").read_text())
    assert (work / config["base_model_name_or_path"]).resolve() == (work / namespace["base"]).resolve()
    assert config["r"] == 8 and config["lora_alpha"] == 16


def test_readme_code_generates_with_the_adapter(newcomer):
    """The README's code ran and printed its continuation; the adapter changed the base's logits;
    they are transformers' logits of the merged export, which never touches peft."""
    from transformers import AutoModelForCausalLM

    work, ns, printed = newcomer
    prompt, output, model = ns["prompt"], ns["output"], ns["model"]
    new = output[0, prompt["input_ids"].shape[1]:]
    assert len(new) >= 1 and printed.strip() == ns["tokenizer"].decode(new, skip_special_tokens=True).strip()

    ids = output[:, :-1]  # the prompt and what was generated from it
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(work / "runs" / "sft_lora" / "merged",
                                                      dtype=torch.float32)(input_ids=ids).logits
    assert (adapted - base).abs().max() > 0.1  # the trained adapter is not a no-op
    torch.testing.assert_close(adapted, merged, rtol=1e-4, atol=1e-4)
    # Greedy decoding with the merged model gives the README's tokens.
    greedy = merged.argmax(-1)[0, prompt["input_ids"].shape[1] - 1:]
    assert torch.equal(greedy, new), (greedy, new)


def test_bundled_base_is_small_and_complete():
    """The base every CPU fine-tuning config names: an HF Llama directory, well under 5 MB, whose
    tokenizer has a chat template and whose config holds the tokenizer's special ids."""
    from transformers import AutoConfig, AutoTokenizer

    base = Path(__file__).parents[1] / "configs" / "sample_data" / "tiny-llama"
    assert sum(f.stat().st_size for f in base.iterdir()) < 2.5 * 2**20
    tokenizer, config = AutoTokenizer.from_pretrained(base), AutoConfig.from_pretrained(base)
    assert config.model_type == "llama" and config.vocab_size == len(tokenizer)
    assert (config.bos_token_id, config.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert config.max_position_embeddings == 256
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
