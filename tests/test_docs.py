"""The documentation site (mkdocs.yml, docs/) builds with MkDocs in strict mode, and the README's links lead somewhere.

Strict mode turns every warning into a failure: a link to a page or an anchor that does not exist, a page of
docs/ that the navigation leaves out, a navigation entry without its page, a docstring the API reference cannot
read, a README section the home page includes that is gone. The second test plants a broken link and a page left
out of the navigation in a copy of docs/, so a configuration that stopped checking would fail here. The code
blocks of the pages run in tests/test_readme.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
#: The API reference reads the whole public surface; the build took 4 s on this machine's two cores (2026-12-05).
BUILD_LIMIT = 120


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of `config` into `site`, from the repository's root (the snippets' base)."""
    environment = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=ROOT, env=environment, capture_output=True, text=True, timeout=BUILD_LIMIT)


def test_the_site_builds_in_strict_mode(tmp_path):
    result = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    site = tmp_path / "site"
    # The home page holds the README's tour (included, not copied), and the reference its generated entries.
    home = (site / "index.html").read_text()
    assert "The API on one page" in home and "Load a checkpoint and read or edit any value" in home
    reference = "".join(page.read_text() for page in (site / "reference").rglob("index.html"))
    documented = set(re.findall(r'id="(streamscope\.[\w.]+)"', reference))
    missing = [name for name in PUBLIC if not any(entry == name or entry.endswith("." + name) for entry in documented)]
    assert not missing, f"the API reference lost these public names: {missing}"


#: Names of the public surface (design.md's) the API reference must document, by the end of their full path.
PUBLIC = ["streamscope.load", "Layer.layer_input", "Layer.layer_mid", "Layer.layer_output", "Layer.skip",
          "Attention.attention_output", "Attention.head_results", "Mlp.mlp_output", "Mlp.neurons",
          "Standardized.token_embeddings", "Standardized.final_norm_output", "Standardized.support", "Unavailable",
          "Steer", "Condition", "apply_steers", "Harvest", "Generation", "load_harvest", "Cache", "lens", "Lens",
          "patch", "Patching", "directions.find", "directions.Direction", "directions.Sweep", "directions.export_gguf",
          "sae.SAE", "sae.from_sae_lens", "sae.train", "Client", "scale.harvest", "testing.build_checkpoint"]


def test_a_broken_link_or_a_page_left_out_fails_the_build(tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    page = docs / "tutorials" / "first-hour.md"
    page.write_text(page.read_text() + "\nSee [nowhere](no-such-page.md) and [no anchor](../guide/map.md#nowhere).\n")
    (docs / "orphan.md").write_text("# A page no navigation lists\n")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["docs_dir"] = str(docs)
    # The checks under test are MkDocs' own (the validation settings): the reference's generator is left out, so
    # its pages' `::: name` lines stay text and this build takes a second or two.
    config["plugins"] = [plugin for plugin in config["plugins"] if not (isinstance(plugin, dict) and "mkdocstrings" in plugin)]
    planted = tmp_path / "mkdocs.yml"
    planted.write_text(yaml.safe_dump(config))
    result = build(planted, tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-page.md" in result.stderr and "#nowhere" in result.stderr and "orphan.md" in result.stderr, \
        result.stderr


def test_the_readme_links_lead_to_files():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [target for target in targets if "://" not in target]
    assert local, "the README links to no page of the site"
    missing = [target for target in local if not (ROOT / target).is_file()]
    assert not missing, f"README links to files that do not exist: {missing}"


@pytest.mark.parametrize("package", ["mkdocs", "mkdocs-material", "mkdocstrings-python"])
def test_the_doc_tools_are_in_the_test_extra(package):
    """`make test` on a fresh clone installs the test extra (scripts/setup.sh): the site's tools must be in it."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert any(re.match(rf"{re.escape(package)}\s*[=<>~]", requirement) for requirement in extra), extra


def _command_lines() -> list[tuple[str, str]]:
    """Every `streamscope COMMAND ...` line of a shell or output block in the README and docs/ (continuations joined,
    comments dropped), with where it is."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        language = None  # None outside a fenced block
        for line in re.sub(r"\\\n\s*", " ", page.read_text()).splitlines():
            if line.startswith("```"):
                language = line[3:].strip() if language is None else None
            elif language in ("", "bash", "text", "console"):
                line = line.strip().removeprefix("$ ")
                if re.match(r"streamscope [a-z]", line):
                    found.append((f"{page.relative_to(ROOT)}", line.split(" #")[0].strip()))
    return found


def test_the_pages_command_lines_parse():
    """The command lines the pages show are ones the `streamscope` command takes (its own parser; `serve` takes
    vLLM's options, which vLLM's parser checks when the server starts, so only its PATH is read here)."""
    import shlex

    from streamscope.cli import parser

    lines = _command_lines()
    assert any(page == "README.md" for page, _ in lines), lines
    refused = []
    for page, line in lines:
        words = shlex.split(line)[1:]
        if words[0] == "serve":
            continue
        try:
            parser().parse_args(words)
        except SystemExit:
            refused.append((page, line))
    assert not refused, refused
