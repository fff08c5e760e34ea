"""Registries of pluggable components and the one mechanism that validates and builds them.

Every configurable component - aggregation rules, channels, server transforms, client defenses,
Flower mods, attacks, observers - declares its parameters once, as the keyword parameters of its
``__init__`` (with defaults and type annotations). :meth:`Registry.build` checks a config entry
against that declaration and constructs the component; every error is a :class:`ConfigError`
naming the key (``defenses[0].ratio``, ``strategy.mu``, ``attack.victims``, ...).

The core never imports a plugin package: plugins register themselves here when they are imported,
and the composition root (``fedsim.app``) imports the built-in plugin packages. A name may also be
an import reference ``"package.module:attribute"`` or ``"path/file.py:attribute"`` to a user's own
code. A config is data, so a reference loads only what the user clearly asked for
(:meth:`Registry.lookup`, docs/plugins.md "What a reference may name"): a subclass of the registry's
base class, or a function (or a class of a registry without a base) that a plugin registered or that
is defined in the user's own code - never something of Python's standard library or of an installed
package (``"os:system"``, ``"subprocess:call"``, ``"builtins:eval"``, ``"shutil:rmtree"``), which
could be handed any arguments the config names.
"""
from __future__ import annotations

import functools
import inspect
import math
import types
import typing
from typing import Any, Callable, Mapping, Sequence

from fedsim.params import ConfigError, check_constraints, split
from fedsim.references import code_origin, is_reference, resolve_reference

_EMPTY = inspect.Parameter.empty


def _hints(func: Callable) -> dict[str, Any]:
    try:
        return typing.get_type_hints(func, include_extras=True)  # keeps Annotated constraints
    except Exception:  # noqa: BLE001 - an unresolvable annotation only disables type checks
        return {}


def declared_params(cls: type, hidden: Sequence[str] = ()) -> dict[str, inspect.Parameter]:
    """Keyword parameters a class accepts, following ``**kwargs`` up its bases (first declaration wins).

    The returned parameters carry resolved annotations (``Parameter.annotation``) where they resolve.
    A plain function (a model or dataset builder) declares its keyword parameters the same way.
    """
    out: dict[str, inspect.Parameter] = {}
    if not isinstance(cls, type):
        hints = _hints(cls)
        for p in inspect.signature(cls).parameters.values():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in hidden:
                out[p.name] = p.replace(annotation=hints.get(p.name, _EMPTY))
        return out
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if init is object.__init__:
            break
        hints = _hints(init)
        more = False
        for p in list(inspect.signature(init).parameters.values())[1:]:
            if p.kind is p.VAR_KEYWORD:
                more = True
            elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in out \
                    and p.name not in hidden:
                out[p.name] = p.replace(annotation=hints.get(p.name, _EMPTY))
        if not more:
            break
    return out


def _scalar_types(annotation: Any) -> tuple[set[type], bool] | None:
    """(allowed scalar types, None allowed) for annotations built from int/float/bool/str/None only."""
    if annotation is _EMPTY or annotation is Any:
        return None
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or \
        typing.get_origin(annotation) is typing.Union else (annotation,)
    allowed, nullable = set(), False
    for a in args:
        if a is type(None):
            nullable = True
        elif a in (int, float, bool, str):
            allowed.add(a)
        else:
            return None  # a collection or another type: the component checks it
    return allowed, nullable


_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def check_value(key: str, value: Any, annotation: Any) -> None:
    """The one check of a parameter's value against its declaration: the type (scalar annotations;
    numbers must be finite), then the constraints of ``Annotated[T, Range(...), OneOf(...), ...]``
    (:mod:`fedsim.params`). Every error is a one-line :class:`ConfigError` naming ``key``."""
    annotation, constraints = split(annotation)
    _check_type(key, value, annotation)
    check_constraints(key, value, constraints)


def _check_type(key: str, value: Any, annotation: Any) -> None:
    spec = _scalar_types(annotation)
    if spec is None:
        bad = _non_finite(value)
        if bad is not None:
            raise ConfigError(f"{key}{bad[0]} must be a finite number, got {bad[1]!r}")
        return
    allowed, nullable = spec
    if value is None:
        if not nullable:
            raise ConfigError(f"{key} must be set")
        return
    if isinstance(value, bool):
        ok = bool in allowed
    elif isinstance(value, int):
        ok = int in allowed or float in allowed
    elif isinstance(value, float):
        ok = float in allowed
    else:
        ok = type(value) in allowed
    if not ok:
        names = " or ".join(_NAMES[t] for t in (int, float, bool, str) if t in allowed)
        if allowed == {int, float}:
            names = "a number"
        raise ConfigError(f"{key} must be {names}{' or unset' if nullable else ''}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")


def _non_finite(value: Any, where: str = "") -> tuple[str, float] | None:
    """The first NaN or infinity inside a (nested) list or table parameter: (its position, the value)."""
    if isinstance(value, float) and not math.isfinite(value):
        return where, value
    if isinstance(value, Mapping):
        items = ((f".{k}", v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for pos, v in items:
        bad = _non_finite(v, where + pos)
        if bad is not None:
            return bad
    return None




class Declared:
    """Base of every component kind (rules, transforms, server channels and observers through
    :class:`fedsim.lifecycle.Component`, defenses, attacks, attacker knowledge): a component built
    directly in Python checks its parameters as the config loader does - the declaration is its
    ``__init__`` signature, checked by :func:`check_value` - so ``DLG(iterations=0)`` raises the same
    one-line :class:`ConfigError`, naming the parameter as ``<name>.<parameter>`` (``dlg.iterations must
    be >= 1, got 0``). Only the arguments given are checked (defaults are the author's), and only once, by
    the constructor called (not again by a base's ``__init__`` reached through ``super()``).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None and not hasattr(init, "__checked_init__"):
            cls.__init__ = _checked_init(init)  # type: ignore[method-assign]


def check_arguments(cls: type, init: Callable, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Check the arguments of a direct ``cls(*args, **kwargs)`` call (``init`` is the ``__init__`` that
    receives them) against ``cls``'s declared parameters; the run config (``cfg``) is context, not a
    parameter. Arguments that do not bind are left to Python's own TypeError."""
    try:
        bound = inspect.signature(init).bind(None, *args, **kwargs)
    except TypeError:
        return
    given: dict[str, Any] = {}
    for i, (name, value) in enumerate(bound.arguments.items()):
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            given.update(value)
        elif i and kind is not inspect.Parameter.VAR_POSITIONAL:
            given[name] = value
    declared = _declared_cached(cls)
    label = getattr(cls, "name", "") or cls.__qualname__
    for name, value in given.items():
        if name in declared and name != "cfg":
            check_value(f"{label}.{name}", value, declared[name].annotation)


@functools.lru_cache(maxsize=None)
def _declared_cached(cls: type) -> dict[str, inspect.Parameter]:
    return declared_params(cls)


def _checked_init(init: Callable) -> Callable:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if type(self).__init__ is __init__:  # the constructor called, not a base's reached through super()
            check_arguments(type(self), init, args, kwargs)
        init(self, *args, **kwargs)

    __init__.__checked_init__ = True  # type: ignore[attr-defined]
    return __init__


class Registry:
    """Named component classes of one kind (``kind`` is how errors call them: 'defense', 'strategy', ...).

    ``hidden`` parameters are supplied by the code that builds the component, never by a config.
    """

    def __init__(self, kind: str, base: type | None = None, hidden: Sequence[str] = (), functions: bool = False):
        self.kind, self.base, self.hidden, self.functions = kind, base, tuple(hidden), functions
        self._classes: dict[str, type] = {}

    # ---- registration --------------------------------------------------------------------------
    def register(self, cls: type | None = None, *, name: str | None = None):
        """Class decorator (``@REG.register`` uses ``cls.name``; ``@REG.register(name="x")``)."""

        def add(c: type) -> type:
            key = name or getattr(c, "name", "")
            if not key:
                raise TypeError(f"{c.__name__} needs a non-empty `name` to be registered as a {self.kind}")
            self._classes[key] = c
            return c

        return add(cls) if cls is not None else add

    def add(self, name: str, cls: type) -> type:
        self._classes[name] = cls
        return cls

    def remove(self, name: str) -> None:
        self._classes.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._classes)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._classes or ":" in name)

    def __iter__(self):
        return iter(self.names())

    def __getitem__(self, name: str) -> type:
        return self._classes[name]

    def __setitem__(self, name: str, cls: type) -> None:  # tests plug test-only components in
        self._classes[name] = cls

    def __delitem__(self, name: str) -> None:
        del self._classes[name]

    def items(self):
        return self._classes.items()

    # ---- lookup, validation, construction ---------------------------------------------------------
    def get(self, name: str, default: Any = None) -> Any:  # dict-like
        return self._classes.get(name, default)

    def lookup(self, name: Any, where: str) -> type:
        """The class registered as ``name`` (or imported from ``"module:attr"``); errors name ``where``.

        What a reference may name (a config is data: loading it must not run arbitrary code):

        * anything this registry holds (a plugin registered it: a decorator, an entry point);
        * a subclass of the registry's ``base`` (from the user's code or an installed package);
        * a function (registries with ``functions``), or a class of a registry without a base, only when
          it is defined in the user's own code: a file reference, or a module that is neither part of
          Python's standard library nor of an installed package (``site-packages``), since fedsim calls
          it with whatever keyword arguments the config names.
        """
        if isinstance(name, str) and name in self._classes:
            return self._classes[name]
        if is_reference(name):
            obj = resolve_reference(name, where)
            self._check_reference(obj, name, where)
            return obj
        if not self._classes and not self.functions:
            raise ConfigError(f"{where}: no {self.kind} is registered (load fedsim's plugins through fedsim.app)")
        raise ConfigError(f"{where} must be one of {self.names()} or an import reference "
                          f"('module:attribute' or 'path/file.py:attribute'), got {name!r}")

    def _expected(self) -> str:
        mod = "torch.nn" if self.base is not None and self.base.__module__.startswith("torch.nn.") else \
            getattr(self.base, "__module__", "")
        base = f"a subclass of {mod}.{self.base.__qualname__}" if self.base else "a class"
        return base + (" or a function" if self.functions else "")

    def _check_reference(self, obj: Any, ref: str, where: str) -> None:
        if any(obj is c for c in self._classes.values()):
            return  # registered by a plugin
        if isinstance(obj, type) and self.base is not None:
            if issubclass(obj, self.base):
                return
            raise ConfigError(f"{where}: {ref!r} must name {self._expected()}")
        if not isinstance(obj, type) and not (self.functions and inspect.isfunction(obj)):
            got = "" if isinstance(obj, type) else f" (got {type(obj).__name__})"
            raise ConfigError(f"{where}: {ref!r} must name {self._expected()}{got}")
        library, qual = code_origin(obj)
        if library:
            what = "a class" if isinstance(obj, type) else "a function"
            raise ConfigError(f"{where}: {ref!r} is {what} of {library} ({qual}); a {self.kind} reference may "
                              f"name {self._expected()} defined in your own code (a file 'path/file.py:name' or "
                              f"a module of yours) or registered by a plugin (docs/plugins.md)")

    def params(self, cls: type) -> dict[str, inspect.Parameter]:
        return declared_params(cls, self.hidden)

    def check(self, entry: Mapping[str, Any], where: str, name_key: str = "name") -> tuple[type, dict[str, Any]]:
        """Validate an entry's name and parameter names/types; returns (class, parameters)."""
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where} must be a table with a {name_key}")
        name = entry.get(name_key)
        cls = self.lookup(name, f"{where}.{name_key}")
        params = {k: v for k, v in entry.items() if k != name_key}
        self.check_params(cls, name, params, where)
        return cls, params

    def check_params(self, cls: type, name: Any, params: Mapping[str, Any], where: str) -> None:
        allowed = self.params(cls)
        for k, v in params.items():
            if k not in allowed:
                raise ConfigError(f"{where}.{k} is not a parameter of {self.kind} {name!r}; "
                                  f"allowed: {sorted(allowed) or 'none'}")
            check_value(f"{where}.{k}", v, allowed[k].annotation)
        missing = [k for k, p in allowed.items() if p.default is _EMPTY and k not in params]
        if missing:
            raise ConfigError(f"{where} ({name}) needs {missing}")

    def build(self, entry: Mapping[str, Any], where: str, name_key: str = "name", **context: Any) -> Any:
        """Validate and construct an entry ``{name_key: name, **parameters}``."""
        cls, params = self.check(entry, where, name_key)
        return self._construct(cls, entry.get(name_key), params, where, context)

    def build_named(self, name: str, params: Mapping[str, Any], where: str, *, name_where: str | None = None,
                    **context: Any) -> Any:
        """Validate and construct ``name`` with ``params`` (a section whose keys are all parameters).
        ``name_where`` is the key errors about the name itself cite (default ``where``)."""
        if not isinstance(params, Mapping):
            raise ConfigError(f"{where} must be a table")
        cls = self.lookup(name, name_where or where)
        self.check_params(cls, name, params, where)
        return self._construct(cls, name, dict(params), where, context)

    def _construct(self, cls: type, name: Any, params: dict[str, Any], where: str, context: Mapping[str, Any]) -> Any:
        """Construct; context items are passed when the class declares them. A ``ValueError`` or
        ``TypeError`` from the constructor becomes a ConfigError naming ``where``."""
        accepted = declared_params(cls)
        try:
            return cls(**params, **{k: v for k, v in context.items() if k in accepted})
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            msg = str(exc)
            head = where.split("[")[0].split(".")[0]
            raise ConfigError(msg if msg.startswith((head + ".", where)) else f"{where} ({name}): {msg}") from exc
        except Exception as exc:  # noqa: BLE001 - a plugin's constructor failed otherwise: one line naming it
            msg = f"{type(exc).__name__}: {exc}".splitlines()[0]
            raise ConfigError(f"{where} ({name}): building it raised {msg}") from exc

    def build_list(self, entries: Any, where: str, **context: Any) -> list[Any]:
        """``[[section]]`` entries in order (names may also be given as plain strings)."""
        if not isinstance(entries, list):
            raise ConfigError(f"{where} must be a list of tables ([[{where}]] with name = ...)")
        out = []
        for i, e in enumerate(entries):
            e = {"name": e} if isinstance(e, str) else e
            if not isinstance(e, Mapping):
                raise ConfigError(f"{where} must be a list of tables ([[{where}]] with name = ...)")
            out.append(self.build(e, f"{where}[{i}]", **context))
        return out


# ---- the registries (the seams plugins plug into) ----------------------------------------------------
STRATEGIES = Registry("strategy")  # aggregation rules (strategies/)
CHANNELS = Registry("channel")  # channels (channels/): each server half names its client half
TRANSFORMS = Registry("server transform")  # server transforms (strategies/)
DEFENSES = Registry("defense", hidden=("cfg",))  # client defenses (clients/); given the run config if they declare cfg
FLOWER_MODS = Registry("Flower mod")  # Flower client mods (clients/)
ATTACKS = Registry("attack")  # gradient-leakage attacks (attacks/)
OBSERVERS = Registry("observer", hidden=("cfg",))  # observers at the interception point (core and attacks/)
# models and datasets: the built-in ones (fedsim.models.BuiltinModel, fedsim.data.registry.DatasetEntry,
# registered when fedsim.models / fedsim.data are imported) and a user's own: a class or a function,
# registered by name or given as an import reference; its keyword parameters come from [model] params /
# [data] params
MODELS = Registry("model", hidden=("in_shape", "num_classes"), functions=True)
DATASETS = Registry("dataset", hidden=("data_dir", "download", "root_size"), functions=True)
KNOWLEDGE = Registry("attacker knowledge", hidden=("cfg",))  # threat-model ablations of the curious server (attacks/)
# ``[[report.figures]] draw``: functions ``draw(out_dir, configs)`` of experiment reports (experiments/)
FIGURES = Registry("report figure", functions=True)
