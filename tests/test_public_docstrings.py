"""Every name users may import (lightning_mcore.__all__, lightning_mcore.data.__all__,
lightning_mcore.callbacks.__all__) has a docstring of its own that opens by saying what it is:
not a dataclass's generated signature, an inherited docstring, or a list of its arguments."""

import inspect

import pytest

import lightning_mcore
import lightning_mcore.callbacks
import lightning_mcore.data

PUBLIC = [(module, name) for module in (lightning_mcore, lightning_mcore.data, lightning_mcore.callbacks)
          for name in module.__all__]


def what_it_is(obj) -> str:
    """Why `obj`'s docstring does not say what it is; "" where it does."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    doc = (doc or "").strip()
    if not doc:
        return "no docstring of its own"
    if doc.startswith(f"{obj.__name__}("):
        return "only the signature @dataclass generates"
    if doc.startswith("`"):
        return f"opens with an argument, not what it is: {doc.splitlines()[0]!r}"
    return ""


@pytest.mark.parametrize("module,name", PUBLIC, ids=[f"{m.__name__}.{n}" for m, n in PUBLIC])
def test_public_name_says_what_it_is(module, name):
    obj = getattr(module, name)
    assert inspect.isclass(obj) or inspect.isfunction(obj), f"{name}: neither a class nor a function"
    why = what_it_is(obj)
    assert not why, f"{module.__name__}.{name}: {why}"


def test_the_check_fails_where_it_should():
    from dataclasses import dataclass

    @dataclass
    class Generated:
        x: int = 0

    class Inherits(Generated):
        pass

    class Arguments:
        """`x`: a number."""

    def undocumented():
        pass

    class Documented:
        """A stand-in that says what it is."""

    assert all(what_it_is(obj) for obj in (Generated, Inherits, Arguments, undocumented))
    assert what_it_is(Documented) == ""
