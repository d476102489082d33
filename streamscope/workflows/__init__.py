"""The research tools, written against the public names and `model.engine` only, so they run on both engines.

`cache` (`model.cache`, TransformerLens's names), `logit_lens` (`streamscope.lens`), `patching`
(`streamscope.patch`), `plot` (the PNG figures), `check` (`streamscope check`), `cli` (the `streamscope`
command) and `demo` (`python -m streamscope.demo`).
"""
