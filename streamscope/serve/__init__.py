"""streamscope over HTTP: vLLM's own OpenAI-compatible server, steered and harvested by streamscope's names.

``streamscope serve PATH [--taps ...] [vllm serve options]`` (`server`) runs
vLLM's server with streamscope's worker in the engine. A request's steers and
harvest travel as declarative JSON in its ``streamscope`` field (`protocol`),
are applied in the worker to that request's token rows (`worker`), and
harvests wait in a folder for download (`storage`). `streamscope.Client`
(`client`) speaks to it with the in-process engines' signatures and types.
"""

# anyio checks its typed-attribute classes' names when it first imports them, and the ``save`` that nnsight adds
# to every object fails that check: the server's anyio (uvicorn, FastAPI) loads its lazy modules here, before the
# server's own modules import nnsight. (In a process that imported nnsight already, only the server would need
# them, and it never runs there; the Client's HTTP is synchronous.)
try:
    import anyio._backends._asyncio  # noqa: F401
    import anyio.abc  # noqa: F401
except TypeError:
    pass
