"""`python -m streamscope.demo`: the demo's entry point; the demo is `streamscope.workflows.demo`."""

from .workflows.demo import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
