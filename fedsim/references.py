"""Import references: how a config names a user's own component (``"package.module:attribute"`` or
``"path/to/file.py:attribute"``), where its code comes from, and the one place such code is imported.

A config is data: a reference may name the user's own code (a file, or a module that is neither in the
standard library nor an installed package) or a registered component class; anything else (``os:system``)
is refused before it is imported.
"""
from __future__ import annotations

import importlib
import os
import re
import sys
import sysconfig
import types
from typing import Any

from fedsim.params import ConfigError

STDLIB = "Python's standard library"
INSTALLED = "an installed package"


def _library_file(path: str) -> str | None:
    """:data:`STDLIB` or :data:`INSTALLED` when ``path`` lies in Python's standard library or in a
    ``site-packages`` / ``dist-packages`` folder (an installed distribution); None for the user's own
    files (a checkout, a ``PYTHONPATH`` folder, an editable install's sources)."""
    real = os.path.realpath(path)
    parts = real.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        return INSTALLED
    if any(a.lower() in ("lib", "lib64") and re.fullmatch(r"python\d+(\.\d+)?t?", b)
           for a, b in zip(parts, parts[1:])):
        return STDLIB  # <prefix>/lib/pythonX.Y/ of any Python installation, not only this one's
    for key in ("stdlib", "platstdlib"):
        for paths in (sysconfig.get_paths(), sysconfig.get_paths(vars={"installed_base": sys.base_prefix,
                                                                       "installed_platbase": sys.base_exec_prefix,
                                                                       "base": sys.base_prefix,
                                                                       "platbase": sys.base_exec_prefix})):
            lib = paths.get(key)
            if lib and (real + os.sep).startswith(os.path.realpath(lib) + os.sep):
                return STDLIB
    return None


def _stdlib_module(name: str) -> bool:
    top = name.split(".")[0]
    return top in sys.stdlib_module_names or top in sys.builtin_module_names or top == "__main__"


def code_origin(obj: type | types.FunctionType) -> tuple[str | None, str]:
    """Where a class's or function's code is defined: (:data:`STDLIB`, :data:`INSTALLED`, or None for
    the user's own code; its qualified name). A module that cannot be located counts as the standard
    library."""
    module = getattr(obj, "__module__", None)
    qual = f"{module}.{getattr(obj, '__qualname__', '?')}"
    if not isinstance(module, str) or _stdlib_module(module):
        return STDLIB, qual
    file = getattr(sys.modules.get(module), "__file__", None)
    return (_library_file(file) if file else STDLIB), qual


def _load_file_module(path: str, what: str) -> types.ModuleType:
    """Import a Python file by path once per process (a stable module name derived from its absolute
    path, so every lookup - and every process that reads the same config - gets the same classes).
    A file of Python's standard library or of an installed package is refused before it runs."""
    import hashlib
    import importlib.util

    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise ConfigError(f"{what}: {_no_file(path)}")
    library = _library_file(full)
    if library:
        raise ConfigError(f"{what}: plugin file {path!r} is part of {library}: a file reference must name "
                          "your own code (an installed package's class: 'package.module:Class')")
    stem = "".join(c if c.isalnum() else "_" for c in os.path.splitext(os.path.basename(full))[0])
    name = f"fedsim_plugin_{stem}_{hashlib.sha1(full.encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{what}: cannot import plugin file {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def reference_file(ref: Any) -> str | None:
    """The file an import reference names (``"path/file.py:attribute"``), or None (a module reference or
    a registered name)."""
    if not is_reference(ref):
        return None
    mod = ref.rpartition(":")[0]
    return mod if mod and (mod.endswith(".py") or "/" in mod or "\\" in mod) else None


def _no_file(path: str) -> str:
    return f"plugin file {path!r} does not exist"


def missing_plugin_file(ref: Any) -> str | None:
    """Why an import reference's file cannot be imported (it does not exist), or None. Imports nothing."""
    import os

    path = reference_file(ref)
    if path is None or os.path.isfile(os.path.abspath(os.path.expanduser(path))):
        return None
    return _no_file(path)


def is_reference(name: Any) -> bool:
    """Whether a component name is an import reference (``"module:attr"`` or ``"path/file.py:attr"``)."""
    return isinstance(name, str) and ":" in name


def resolve_reference(ref: str, what: str) -> Any:
    """An import reference -> the object it names (a user's own plugin).

    ``"package.module:attribute"`` imports a module (it must be importable: installed, or on
    ``PYTHONPATH``); ``"path/to/file.py:attribute"`` imports a file (a relative path is taken from
    the working directory; :func:`absolute_reference` makes it absolute for processes elsewhere).
    A module of Python's standard library is refused before it is imported, a file of the standard
    library or of an installed package before it runs; what the object may be is the registry's
    decision (:meth:`Registry.lookup`). Any error while importing - the plugin's own code raising
    included - is a :class:`ConfigError` naming ``what`` and the reference.
    """
    mod, _, attr = ref.rpartition(":")
    try:
        if not mod or not attr:
            raise ValueError("expected 'module:attribute' or 'path/file.py:attribute'")
        if reference_file(ref) is not None:
            obj: Any = _load_file_module(mod, what)
        elif _stdlib_module(mod):
            raise ConfigError(f"{what}: {ref!r} names {STDLIB}; a reference must name your own code or a "
                              "component class (docs/plugins.md)")
        else:
            obj = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except ConfigError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the plugin's import failed: one line naming it
        msg = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{what}: cannot import {ref!r} ({msg})") from None
    return obj


def absolute_reference(ref: Any, base: str | None = None) -> Any:
    """A file reference with its path made absolute (relative to ``base``, default the working
    directory); anything else unchanged. Configs carry absolute paths so that Ray workers and the
    ServerApp of ``flwr run``, which run in other directories, import the same file."""
    import os

    if not is_reference(ref):
        return ref
    mod, _, attr = ref.rpartition(":")
    if reference_file(ref) is None or os.path.isabs(os.path.expanduser(mod)):
        return ref
    return f"{os.path.abspath(os.path.join(base or os.getcwd(), os.path.expanduser(mod)))}:{attr}"
