"""The component base, written once: the lifecycle every server-side component shares (aggregation
rules, server transforms, server halves of channels (:mod:`fedsim.seams`) and observers
(:mod:`fedsim.observers`) subclass :class:`Component`), and presets (:func:`preset`: a registry entry
that is a component with other defaults). Imports nothing heavy (the config's first pass may import it)."""
from __future__ import annotations

from typing import Any, ClassVar, Mapping, Sequence

from fedsim.components import Declared, declared_params


class Component(Declared):
    """The lifecycle every server-side component shares - aggregation rules, server transforms, server
    halves of channels and observers - written once:

    * ``validate_config(cfg)``: checks against the rest of the config (raise ValueError; the config
      loader names the component's key); single parameters are checked from the signature's
      constraints (:mod:`fedsim.params`) before the component is built;
    * ``setup(param_names, cfg)``: once before round 1 (before the first exchange);
    * ``metrics()``: what it did this round (the metrics row: ``strategy.<key>``, ``<transform>.<key>``,
      ``channel.<key>``);
    * ``state()`` / ``load_state(state)``: what it carries from one round to the next, for checkpoints.

    ``state()`` fails closed: a component that carries nothing between rounds says so with
    ``stateless = True``; any other must return its state (a dict of arrays, numbers, strings, lists
    and dicts) and take it back in ``load_state``. A component that does neither cannot be
    checkpointed: the run writes no checkpoint (the summary says why) and ``--resume`` is refused
    naming it, so a user's stateful rule that forgot ``state()`` cannot resume silently wrong.
    """

    name: ClassVar[str] = ""
    #: True when the component carries nothing from one round to the next (``state()`` is then ``{}``)
    stateless: ClassVar[bool] = False

    def validate_config(self, cfg: Mapping[str, Any]) -> None:
        """Checks against the rest of the config (raise ValueError); called when the config is loaded."""

    def setup(self, param_names: Sequence[str], cfg: Mapping[str, Any]) -> None:
        """Called once before round 1 (before the first exchange)."""

    def metrics(self) -> dict[str, float]:
        """What the component did this round (logged in the round's metrics row). Default: nothing."""
        return {}

    def state(self) -> dict[str, Any]:
        """What this component carries from one round to the next (see the class doc). Default: ``{}``
        for a ``stateless`` component; otherwise it cannot report its state (NotImplementedError)."""
        if self.stateless:
            return {}
        raise NotImplementedError(
            f"{type(self).__qualname__} ({self.name!r}) neither returns its state from state() nor declares "
            "stateless = True, so it cannot be checkpointed")

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state` returned (resuming a run after ``setup``). Default: nothing to restore
        for a ``stateless`` component; a component with a state() must restore it here."""
        if state and not self.stateless:
            raise NotImplementedError(f"{type(self).__qualname__} ({self.name!r}) has no load_state() to take "
                                      "its state back")


def resume_problem(comp: Any) -> str | None:
    """Why a component cannot be checkpointed and resumed exactly - its ``state()`` fails or is no dict,
    or it reports a state it has no ``load_state()`` for - or None."""
    try:
        st = comp.state()
    except NotImplementedError as exc:
        return str(exc) or "it cannot report its state (state())"
    if not isinstance(st, dict):
        return "it cannot report its state (state())"
    if st and not getattr(comp, "stateless", False) and type(comp).load_state is Component.load_state:
        return "it reports a state() but has no load_state() to take it back"
    return None


def preset(base: type, name: str, doc: str, *, class_name: str | None = None,
           attrs: Mapping[str, Any] | None = None, **defaults: Any) -> type:
    """A component that is ``base`` with other defaults: a registry entry declared in one line instead of
    a subclass that repeats the parameters (``ig-fr`` is ``ig-bn`` with ``features = 0.1``, ...).

    The result is a class (so registries, ``isinstance`` and import references treat it as any other)
    whose declared parameters are ``base``'s - the same types and constraints - with ``defaults`` as
    their defaults; every parameter can still be set. ``attrs`` are class attributes it sets (e.g. a
    switch of ``base`` that is no parameter). ``preset_of``/``preset_defaults`` say what it is.
    """
    import inspect
    import sys

    params = declared_params(base)
    unknown = sorted(set(defaults) - set(params))
    if unknown:
        raise TypeError(f"preset {name!r}: {unknown} are not parameters of {base.__qualname__}")
    kw = inspect.Parameter.KEYWORD_ONLY
    sig = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
           *(p.replace(kind=kw, default=defaults.get(n, p.default)) for n, p in params.items())]

    def __init__(self, **kwargs: Any) -> None:
        base.__init__(self, **{**defaults, **kwargs})

    __init__.__signature__ = inspect.Signature(sig)  # type: ignore[attr-defined]
    __init__.__annotations__ = {n: p.annotation for n, p in params.items() if p.annotation is not inspect.Parameter.empty}
    cls_name = class_name or "".join(part.capitalize() for part in name.replace("_", "-").split("-"))
    module = sys._getframe(1).f_globals.get("__name__", base.__module__)
    return type(cls_name, (base,), {"name": name, "__init__": __init__, "__doc__": doc, "__module__": module,
                                    "__qualname__": cls_name, "preset_of": base, "preset_defaults": dict(defaults),
                                    **dict(attrs or {})})
