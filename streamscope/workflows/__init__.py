"""The research tools, written against the public names and `model.engine` only, so they run on both engines.

`cache` (`model.cache`, TransformerLens's names), `logit_lens` (`streamscope.lens`), `patching`
(`streamscope.patch`), `plot` (the PNG figures), `views` (interactive pages). The commands built on them sit above
the engines: `streamscope.check` (`streamscope check`), `streamscope.cli` (the `streamscope` command) and
`streamscope.demo` (`python -m streamscope.demo`).
"""
