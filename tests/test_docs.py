"""The documentation site (mkdocs.yml, docs/): it builds with `mkdocs build --strict` as the README
shows it, and a warning (a broken link or anchor, a missing API name, a missing README snippet, a
docstring mkdocstrings cannot read) fails the build; the API page lists every public name; every
command and code block of the README and of docs/ is read by a test, or is an illustration whose
names and arguments are checked here."""

from __future__ import annotations

import ast
import inspect
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from readme import DOCS, README, ROOT, code_blocks, page, section, sections

import lightning_mcore
import lightning_mcore.callbacks
import lightning_mcore.data


def mkdocs_build(root: Path, site: Path) -> subprocess.CompletedProcess:
    """The README's build command (Documentation), run in `root`, writing the site to `site`."""
    (argv,) = [shlex.split(line) for line in code_blocks(section("Documentation"), "bash")[0].splitlines()
               if line.startswith("mkdocs ")]
    assert argv == ["mkdocs", "build", "--strict"], argv
    argv = [sys.executable, "-m", "mkdocs", *argv[1:], "--site-dir", str(site)]
    return subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=300)


def test_site_builds_without_a_warning(tmp_path):
    proc = mkdocs_build(ROOT, tmp_path / "site")
    assert proc.returncode == 0 and "WARNING" not in proc.stderr, proc.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("MegatronStrategy", "SFTDataModule", "MegatronProgressBar"):
        assert f'id="lightning_mcore.' in api and name in api, name
    started = (tmp_path / "site" / "getting-started" / "index.html").read_text()
    assert "uv pip install --compile-bytecode" in started  # the README's set-up, included


BREAKAGES = {
    "broken link": ("sft.md", "\nSee [a page that does not exist](no-such-page.md).\n"),
    "broken anchor": ("sft.md", "\nSee [a section that does not exist](lora.md#no-such-section).\n"),
    "missing API name": ("api.md", "\n::: lightning_mcore.NoSuchName\n"),
    "missing README section": ("getting-started.md", '\n--8<-- "README.md:no-such-section"\n'),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """A copy of the site's sources (the package linked), which builds as the original does."""
    root = tmp_path_factory.mktemp("docs") / "repo"
    root.mkdir()
    for name in ("mkdocs.yml", "README.md"):
        shutil.copy(ROOT / name, root / name)
    shutil.copytree(DOCS, root / "docs")
    (root / "lightning_mcore").symlink_to(ROOT / "lightning_mcore")
    proc = mkdocs_build(root, root.parent / "site")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_a_broken_page_fails_the_build(breakage, sources, tmp_path):
    """The build above can fail: a copy of the site's sources with one mistake does not build."""
    root = tmp_path / "repo"
    shutil.copytree(sources, root, symlinks=True)
    name, text = BREAKAGES[breakage]
    with open(root / "docs" / name, "a") as f:
        f.write(text)
    proc = mkdocs_build(root, tmp_path / "bad")
    assert proc.returncode != 0, proc.stderr[-4000:]


def public_names() -> set[str]:
    return ({f"lightning_mcore.{n}" for n in lightning_mcore.__all__}
            | {f"lightning_mcore.data.{n}" for n in lightning_mcore.data.__all__}
            | {f"lightning_mcore.callbacks.{n}" for n in lightning_mcore.callbacks.__all__})


def test_api_page_lists_every_public_name():
    """Each name of the three packages' __all__ has its `::: name` (a callback that the top package
    exports too is listed once, under lightning_mcore), and nothing else is listed."""
    listed = re.findall(r"^::: (\S+)$", page("api.md"), re.M)
    assert len(listed) == len(set(listed)), listed
    expected = {n for n in public_names() if not (n.startswith("lightning_mcore.callbacks.")
                                                 and n.rsplit(".", 1)[1] in lightning_mcore.__all__)}
    assert set(listed) == expected, set(listed) ^ expected


# Where each shown block is read. Every (page, section) holding a bash or python block is here;
# the test file named must name the section (and the page, for docs/), so it reads it there.
READ_BY = {
    ("README.md", "Set up (fresh machine)"): "test_ci_setup.py",
    ("README.md", "The main job: quickstart"): "test_quickstart.py",
    ("README.md", "Fine-tune with LoRA, load the adapter with peft"): "test_newcomer.py",
    ("README.md", "Test command"): "test_ci_setup.py",
    ("README.md", "Documentation"): "test_docs.py",
    ("sft.md", "Supervised fine-tuning"): "test_readme_examples.py",
    ("preference.md", "Preference training (DPO, IPO)"): "test_readme_examples.py",
    ("reward-kto-distill.md", "Reward models, KTO, distillation"): "test_readme_examples.py",
    ("grpo.md", "GRPO, and generation with a KV cache"): "test_readme_examples.py",
    ("vision-language.md", "Vision-language models (Qwen2.5-VL, Qwen3-VL, Qwen3.5)"): "test_readme_examples.py",
    ("hf-families.md", "Check your own model: verify"): "test_readme_examples.py",
    ("hf-families.md", "Adding a family"): "test_readme_examples.py",
    ("pretraining.md", "Data"): "test_data_indexed.py",
    ("gpu.md", "Memory plan before launch"): "test_memory_plan.py",
    ("lora.md", "Qwen3-30B-A3B on one GPU"): "test_memory_plan.py",
    ("lora.md", "LoRA over an FP8 base"): "test_lora_fp8_base.py",
    ("lora.md", "LoRA over an NF4 (4-bit) base"): "test_lora_nf4_base.py",
    ("parallelism.md", "Several nodes: torchrun and SLURM"): "test_readme_multinode.py",
    ("testing.md", "Benchmark results"): "test_results_table.py",
}
# Python blocks with placeholders (a model path, `...`): checked by test_illustrations_call_real_api.
ILLUSTRATIONS = {
    ("lora.md", "LoRA"),
    ("hf-families.md", "Hugging Face checkpoints"),
    ("checkpoints.md", "Checkpoints"),
}


def shown_blocks() -> dict[tuple[str, str], list[str]]:
    """(page, section) -> its bash and python blocks, for README.md and every page of docs/."""
    found = {}
    for name in ["README.md", *sorted(p.name for p in DOCS.glob("*.md"))]:
        for title, text in sections(page(name)).items():
            blocks = code_blocks(text, "bash") + code_blocks(text, "python")
            if blocks:
                found[(name, title)] = blocks
    return found


def test_every_shown_block_is_read_by_a_test():
    shown = shown_blocks()
    unread = set(shown) - set(READ_BY) - ILLUSTRATIONS
    assert not unread, f"blocks that no test reads (add a test, then list it in READ_BY): {unread}"
    assert set(READ_BY) | ILLUSTRATIONS <= set(shown), (set(READ_BY) | ILLUSTRATIONS) - set(shown)
    for (name, title), test in READ_BY.items():
        source = (ROOT / "tests" / test).read_text()
        assert title in source or f'"{title}"' in source, (test, title)
        assert name == "README.md" or f'"{name}"' in source, (test, name)


def calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def test_illustrations_call_real_api():
    """The placeholder examples: valid Python; each public class they call takes the keywords
    given, a call whose arguments are all literals constructs, and each method called on a
    module exists on MegatronModule."""
    shown = shown_blocks()
    for key in ILLUSTRATIONS:
        for block in shown[key]:
            for call in calls(ast.parse(block)):
                func = call.func
                if isinstance(func, ast.Name) and func.id in lightning_mcore.__all__:
                    cls = getattr(lightning_mcore, func.id)
                    params = inspect.signature(cls).parameters
                    for keyword in call.keywords:
                        assert keyword.arg in params, (key, func.id, keyword.arg)
                    if not call.args and all(isinstance(k.value, ast.Constant) for k in call.keywords):
                        eval(compile(ast.Expression(call), "<docs>", "eval"), vars(lightning_mcore))
                elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "module":
                    method = getattr(lightning_mcore.MegatronModule, func.attr)
                    inspect.signature(method).bind(None, *[ast.literal_eval(a) for a in call.args],
                                                   **{k.arg: ast.literal_eval(k.value) for k in call.keywords})


def test_readme_feature_map_is_the_sites():
    """The README's feature map and the site's home page list the same guides in the same rows,
    and the README links every page of the site."""
    def rows(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("| ") and "](" in line]

    intro = README[: README.index("\n## ")]
    assert rows(intro) and [r.replace("](docs/", "](") for r in rows(intro)] == rows(page("index.md"))
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", README))
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    assert pages <= linked, pages - linked


def test_readme_stays_short():
    assert len(README.splitlines()) <= 250


def test_architecture_tree_matches_the_package():
    """docs/architecture.md's tree: every package of lightning_mcore has its line, and every
    package, module and file it names exists (the page is updated when the layout changes)."""
    (tree,) = [b for b in code_blocks(page("architecture.md"), "") if b.startswith("lightning_mcore/")]
    lib = Path(lightning_mcore.__file__).parent
    packages = {p.name for p in lib.iterdir() if (p / "__init__.py").is_file()}
    shown = set(re.findall(r"^  ([a-z_]+)/", tree, re.M))
    assert shown == packages, (sorted(packages - shown), sorted(shown - packages))
    current = None
    for line in tree.splitlines()[1:]:
        head = re.match(r"^  ([a-z_]+)/", line)
        if head:
            current = head.group(1)
        if re.match(r"^  [a-z_]+\.py", line):
            current = None  # a top-level module's line: its files are top-level too
        for name in re.findall(r"\b([a-z_0-9]+\.py)\b", line):
            where = [lib / name] if current is None else [lib / current / name, lib / name]
            assert any(p.is_file() for p in where), f"{name} (under {current or 'lightning_mcore'}/) is not a file"
