"""A stand-in for the humming kernel package, written by streamscope's scripts/humming_stub.py (see there)."""


class _Placeholder(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"humming.{cls.__name__} was called, but humming here is streamscope's stand-in "
                           f"(scripts/humming_stub.py): this run needs the real humming package.")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(name, (), {})
