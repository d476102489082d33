"""Every Python block of the README and of the documentation site's pages (docs/) runs, as written, on each engine
it names.

How a block runs is said by an HTML comment on the line before its fence (tests/doc_blocks.py reads them):
`<!-- readme-test: transformers, vllm -->` (or one engine), `<!-- readme-test: server -->` (run against a running
`streamscope serve` server by tests/vllm/test_serve.py), or `<!-- readme-test: skip: the reason -->`. A Python block
without such a comment fails `test_every_block_says_how_it_runs`, so a new example cannot go untested by accident;
the blocks not run anywhere are counted (`NOT_RUN`), so a new skip is a deliberate change of this file.

The pages run in the order a reader meets them (the README, then the site's navigation), one test per engine, so
that order holds under pytest-xdist too. Each page runs in a namespace of its own, as a reader following that page
alone would have, holding what the examples take as given (`prompt`, `prompts`, `steering_vector`/`vector`/`v`
of the model's width, `clean`, `corrupted`, `my_metric`, `paris_id`, `i`, `path`, `torch`, `streamscope`; the
site's home page lists them) and the `model` the previous page left, which a page may replace by loading its own:
one vLLM engine serves the pages that do not start another. The model is the tiny Llama `build_checkpoint`
writes, with a tokenizer trained on the examples' own strings, so that " Paris" is one token as in a real
model's vocabulary; paths under /tmp/ in a block are moved to the test's temporary folder, and the blocks run
there (files they write land in it). A vLLM engine a block replaces is closed.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from doc_blocks import ENGINES, Block, all_blocks, blocks, pages

ROOT = Path(__file__).resolve().parent.parent
ALL = all_blocks()

#: The blocks that run nowhere, each deliberately, with its reason in its directive: TransformerLens's own side of a
#: comparison (docs/transformerlens.md), a release downloaded from the hub (docs/sae.md), and three calls that need
#: 8 GPUs, a 70B checkpoint on a cluster or a finished run's folder (docs/scale.md), each run on a tiny checkpoint
#: by the test its reason names.
NOT_RUN = 5


def test_every_block_says_how_it_runs():
    assert ALL, "no Python blocks found in the README"
    missing = [block.name for block in ALL if block.directive is None]
    assert not missing, (f"Python blocks without a `<!-- readme-test: ENGINES -->`, `<!-- readme-test: server -->` or "
                         f"`<!-- readme-test: skip: why -->` comment on the line before the fence: {missing}")
    broken = [(block.name, block.problems) for block in ALL if block.problems]
    assert not broken, broken


def test_the_blocks_not_run_are_counted():
    skipped = [f"{block.name}: {block.skip}" for block in ALL if block.skip is not None]
    assert len(skipped) == NOT_RUN, ("the blocks that run nowhere changed; run the new one (or update NOT_RUN and its "
                                     "comment, with the reason):\n" + "\n".join(skipped))


def test_the_pages_run_in_the_readers_order():
    order = [page.relative_to(ROOT).as_posix() for page in pages()]
    assert order[:3] == ["README.md", "docs/index.md", "docs/tutorials/first-hour.md"], order
    assert len(order) == len(set(order))


def test_the_runner_reads_directives(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n<!-- readme-test: transformers, vllm -->\n```python\nx = 1\n```\n\n"
                    "## Serving\n\n<!-- readme-test: server -->\n```python\nclient = 1\n```\n\n"
                    "<!-- readme-test: skip: needs a GPU -->\n```python\nz = 3\n```\n\n```python\nw = 4\n```\n\n"
                    "<!-- readme-test: server, vllm -->\n```python\nv = 5\n```\n")
    first, served, skipped, bare, mixed = blocks(page)
    assert first.engines == ENGINES and first.skip is None and first.code == "x = 1" and first.headings == ["Top"]
    assert served.server and served.engines == ("server",) and served.headings == ["Top", "Serving"]
    assert skipped.skip == "needs a GPU" and skipped.engines == ()
    assert bare.directive is None and bare.skip is None
    assert mixed.problems and not mixed.server


# Running the blocks.

#: The strings the examples' prompts and answers are made of: the tiny tokenizer learns them as tokens.
def _corpus() -> list[str]:
    strings = []
    for block in ALL:
        try:
            tree = ast.parse(block.code)
        except SyntaxError:
            continue
        strings += [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    return strings + ["The Eiffel Tower is in Paris, the capital of France.", "Rome is the capital of Italy."]


class Session:
    """One engine's run of the pages: a namespace per page, the model carried from page to page; its engines closed
    at the end."""

    def __init__(self, folder: Path, engine: str):
        import torch

        import streamscope
        from streamscope.testing import build_checkpoint
        from streamscope.testing.tokenizer import save_tokenizer

        self.folder, self.engine = folder, engine
        path = build_checkpoint("llama", folder / "tiny-llama")
        tokenizer = save_tokenizer(path, corpus=_corpus())
        torch.manual_seed(0)
        vector = torch.randn(64) * 0.1  # the tiny Llama's width
        paris, rome = (tokenizer(word, add_special_tokens=False)["input_ids"] for word in (" Paris", " Rome"))
        assert len(paris) == len(rome) == 1, "the examples' answers should be one token each"
        self.given = {"torch": torch, "streamscope": streamscope, "path": path, "prompt": "The Eiffel Tower is in",
                      "prompts": ["The Eiffel Tower is in", "The capital of France is", "Rome is the capital of"],
                      "steering_vector": vector, "vector": vector, "v": vector, "i": 0,
                      "clean": "The capital of France is", "corrupted": "The capital of Italy is",
                      "paris_id": paris[0], "my_metric": lambda logits: logits[paris[0]] - logits[rome[0]]}
        self.page: Path | None = None
        self.space: dict = dict(self.given)

    def run(self, block: Block) -> None:
        if block.page != self.page:  # a new page: what the examples take as given, and the model so far
            model = self.space.get("model")
            self.page, self.space = block.page, dict(self.given)
            if model is not None:
                self.space["model"] = model
        space = self.space
        if self.engine == "vllm" and "model" not in space and "streamscope.load(" not in block.code:
            import streamscope

            space["model"] = streamscope.load(space["path"], engine="vllm")
        before = space.get("model")
        code = block.code.replace("/tmp/", f"{self.folder}/")
        # nnsight reads a trace's body back from its source file: the block runs from a file of its own.
        page = block.page.relative_to(ROOT).with_suffix("").as_posix().replace("/", "_")
        source = self.folder / f"{page}_{block.line}_{self.engine}.py"
        source.write_text(code + "\n")
        os.chdir(self.folder)  # files the blocks write (acts/, lens.png) land in the session's folder
        exec(compile(code, str(source), "exec"), space)  # noqa: S102 - the pages' own code
        after = space.get("model")
        if before is not None and after is not before and hasattr(before, "close"):
            before.close()

    def close(self) -> None:
        model = self.space.get("model")
        if hasattr(model, "close"):
            model.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_the_blocks_run_as_written_in_order(engine: str, tmp_path, monkeypatch):
    """One test per engine, so the blocks run in the pages' order in one session (also under pytest-xdist)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    monkeypatch.chdir(tmp_path)
    runs = [block for block in ALL if block.skip is None and engine in block.engines]
    assert runs, f"no block of the README or the docs runs on {engine}"
    session = Session(tmp_path, engine)
    try:
        for block in runs:
            try:
                session.run(block)
            except Exception as error:
                raise AssertionError(f"{block.name} (under {' > '.join(block.headings)!r}) failed on {engine}: "
                                     f"{type(error).__name__}: {error}") from error
    finally:
        session.close()


@pytest.mark.parametrize("block", [block for block in ALL if block.skip is not None], ids=lambda block: block.name)
def test_skipped_blocks_say_why(block: Block):
    pytest.skip(block.skip)
