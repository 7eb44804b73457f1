"""Loading user code named as ``package.module:attribute``.

The name is checked before anything is imported, the attribute's kind before anything of it is called,
and whatever the user's code raises becomes a one-line :class:`BNProbeError`.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from bnprobe.core.errors import BNProbeError

__all__ = ["load_callable", "resolve", "binds", "kind_of", "raised", "first_line"]


def first_line(exc: BaseException) -> str:
    """``TypeName: the first line of its message``."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def raised(where: str, exc: BaseException) -> str:
    """The one-line message for an exception ``exc`` raised by the user's code ``where``."""
    return f"{where} raised {first_line(exc)}"


def kind_of(obj: object) -> str:
    """What ``obj`` is, for an error message ("a built-in function", "the class Foo", "an int")."""
    if isinstance(obj, type):
        return f"the class {obj.__name__}"
    if inspect.isbuiltin(obj):
        return "a built-in function"
    if inspect.isfunction(obj):
        return f"a function of module {obj.__module__}"
    name = type(obj).__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def binds(obj: Any, *args: Any, **kwargs: Any) -> bool:
    """Whether ``obj`` can be called with these arguments (judged from its signature, without calling it)."""
    try:
        inspect.signature(obj).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return False
    return True


def _path_hint(module: str, exc: BaseException) -> str:
    """What to do when a module in the current folder is not found: the ``bnprobe`` command does not search it."""
    top = module.partition(".")[0]
    if not isinstance(exc, ModuleNotFoundError) or exc.name not in (top, module):
        return ""
    if Path(top).is_dir() or Path(f"{top}.py").is_file():
        return f" (./{top} is here, but the bnprobe command does not search this folder: run it with PYTHONPATH=.)"
    return " (a module of your own must be importable: install it, or put its folder on PYTHONPATH)"


def resolve(spec: str, what: str) -> tuple[ModuleType, Any]:
    """The module and the attribute named by ``spec`` (``package.module:name``), the module imported;
    ``what`` names it in errors."""
    module, sep, attr = spec.partition(":")
    if not sep or not all(p.isidentifier() for p in module.split(".")) or not attr.isidentifier():
        raise BNProbeError(f"{what} {spec!r} is not package.module:name (a module importable from here, a name in it)")
    if module.partition(".")[0] in sys.stdlib_module_names:
        raise BNProbeError(f"{what} {spec!r} is in the standard library ({module}): a {what} is code of your own "
                           "module")
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - ImportError, SyntaxError, or whatever the module raises as it runs
        raise BNProbeError(f"cannot import {what} module {module!r}: {first_line(exc)}{_path_hint(module, exc)}") \
            from None
    try:
        return mod, getattr(mod, attr)
    except AttributeError:
        raise BNProbeError(f"{what} module {module!r} has no {attr!r}") from None
    except Exception as exc:  # noqa: BLE001 - a module __getattr__ may raise anything
        raise BNProbeError(raised(f"{what} {spec!r}", exc)) from None


def load_callable(spec: str, what: str, args: tuple[str, ...], kwargs: tuple[str, ...] = ()) -> Any:
    """The Python function named by ``spec`` (``module:function``), checked to accept the positional
    arguments named ``args`` and the keywords ``kwargs`` before it is ever called; ``what`` names it in
    errors."""
    _, fn = resolve(spec, what)
    signature = f"f({', '.join(args + tuple(f'{k}=...' for k in kwargs))})"
    if not inspect.isfunction(fn):
        raise BNProbeError(f"{what} {spec!r} is {kind_of(fn)}, not a Python function {signature}")
    if not binds(fn, *args, **dict.fromkeys(kwargs)):
        raise BNProbeError(f"{what} {spec!r} takes ({_parameters(fn)}): it is called as {signature}")
    return fn


def _parameters(fn: Any) -> str:
    return str(inspect.signature(fn).replace(return_annotation=inspect.Signature.empty))[1:-1]
