"""The contract between lightning_tbp and the Lightning, torch and diffusers classes it extends.

Every method of ours that replaces one of a base class from another package carries
``@override``, and every ``@override`` names a method that a base class still has. A rename
upstream then fails here, by name, instead of silently disconnecting a hook (the strategies'
``setup``/``backward``/``teardown``, the callbacks' hooks).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import lightning_tbp

_OWN = lightning_tbp.__name__


def _own_classes() -> list[type]:
    classes = {}
    for info in pkgutil.walk_packages(lightning_tbp.__path__, f"{_OWN}."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__:
                classes[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return [classes[name] for name in sorted(classes)]


def _foreign_bases(cls: type) -> list[type]:
    return [base for base in cls.__mro__[1:] if not base.__module__.startswith(_OWN) and base is not object]


def _own_methods(cls: type) -> dict[str, object]:
    methods = {}
    for name, value in vars(cls).items():
        function = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        defined_here = inspect.isfunction(function) and function.__module__.startswith(_OWN)  # not Enum's copies
        if defined_here and not (name.startswith("__") and name.endswith("__")):
            methods[name] = function
    return methods


EXTENDING = [cls for cls in _own_classes() if _foreign_bases(cls)]


def test_the_package_extends_lightning_classes() -> None:
    names = {cls.__name__ for cls in EXTENDING}
    assert {"TinyBackpropStrategy", "TinyBackpropDDPStrategy", "MemoryProfilerCallback", "DiffusionModule"} <= names


def _ours(cls: type) -> bool:
    return cls.__module__.startswith(_OWN)


@pytest.mark.parametrize("cls", EXTENDING, ids=lambda cls: cls.__qualname__)
def test_every_replaced_method_is_marked_and_every_marked_one_replaces_something(cls: type) -> None:
    mro = [base for base in cls.__mro__ if base is not object]
    for position, owner in enumerate(mro):
        if not _ours(owner):
            continue
        later = mro[position + 1 :]  # a mixin's hooks replace those of the Lightning class after it
        for name, function in _own_methods(owner).items():
            replaced = [base for base in later if name in vars(base)]
            marked = getattr(function, "__override__", False)
            foreign = [base for base in replaced if not _ours(base)]
            assert marked or not foreign, (
                f"{owner.__qualname__}.{name} replaces {foreign[0].__qualname__}.{name}: mark it @override"
            )
            assert replaced or not marked, (
                f"{owner.__qualname__}.{name} is marked @override, but no base of {cls.__qualname__} has it any more"
            )


def test_the_strategies_hooks_are_checked() -> None:
    from lightning_tbp.strategies import TinyBackpropMixin

    marked = {name for name, f in _own_methods(TinyBackpropMixin).items() if getattr(f, "__override__", False)}
    assert {"setup", "pre_backward", "teardown", "post_backward", "training_step", "optimizer_step"} <= marked
