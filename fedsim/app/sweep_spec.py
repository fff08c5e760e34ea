"""A sweep or experiment file, read and checked (:mod:`fedsim.app.sweep` runs it): the base config,
every variant resolved and validated, the seeds, and an experiment's ``[experiment]``, ``[report]``,
claims and ``[quick]`` variant."""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from fedsim.app import validate
from fedsim.claims import check_claims
from fedsim.config import (
    ConfigError,
    _merge,
    absolute_references,
    apply_overrides,
    defaults,
    precheck,
    read_toml,
)
from fedsim.tables import check_report


def variant_slug(label: str) -> str:
    """A variant's label as a folder and config name (``gaussian 1e-2`` -> ``gaussian-1e-2``)."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", label).strip("-").lower() or "variant"


def check_seeds(seeds: Any, where: str = "seeds") -> list[int]:
    ok = isinstance(seeds, list) and seeds and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                   for x in seeds) and len(set(seeds)) == len(seeds)
    if not ok:
        raise ConfigError(f"{where} must be a non-empty list of distinct integers >= 0, got {seeds!r}")
    return list(seeds)


# an experiment's seeds unless its file names them (``seeds = [...]``) or ``--seeds`` does: its claims
# are decided over at least three (fedsim.claims); ``--quick`` runs one seed unless ``[quick] seeds``
EXPERIMENT_SEEDS = (0, 1, 2)
VARIANT_META = ("label", "row", "col", "family")  # variant keys that describe it rather than configure it


@dataclass
class SweepSpec:
    """A sweep or experiment file, resolved: the base config, the variants' labels and configs, the
    seeds, and (experiments) the ``[experiment]`` description, the ``[report]`` tables, the claims and
    each variant's ``row`` / ``col`` / ``family`` labels."""

    base: dict[str, Any]
    variants: list[tuple[str, dict]]
    seeds: list[int] | None = None
    experiment: dict[str, Any] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=lambda: {"tables": [], "systematic": None})
    claims: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, dict[str, str]] = field(default_factory=dict)  # label -> {row, col, family}
    quick: bool = False
    # (label, seed) -> the components validating that run's config built (load_spec(runs=True)), for the run
    built: dict[tuple[str, int | None], dict[str, Any]] = field(default_factory=dict)


def run_config(cfg: dict[str, Any], seed: int | None) -> dict[str, Any]:
    """The config of a variant's run with ``seed`` (seed replaced, name suffixed), or the variant's own."""
    if seed is None:
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg["seed"] = seed
    cfg["name"] = f"{cfg['name']}-seed{seed}"
    return cfg


def load_sweep(path: str | Path, overrides: Sequence[str] = (),
               only: Sequence[str] = ()) -> tuple[dict[str, Any], list[tuple[str, dict]]]:
    """(base config, [(label, resolved config), ...]); raises ConfigError naming the variant and key.

    ``only`` keeps just the variants with these labels; the overrides are applied to those alone (so
    ``--set defenses.0.sigma=...`` works with ``--only`` a variant that has a defense)."""
    spec = load_spec(path, overrides, only)
    return spec.base, spec.variants


def _check_quick(quick: Any, p: Path, labels: Sequence[str]) -> dict[str, Any]:
    if not isinstance(quick, dict):
        raise ConfigError(f"{p}: [quick] must be a table (set = [...], variants = [...], seeds = [...])")
    unknown = set(quick) - {"set", "variants", "seeds", "variant_set"}
    if unknown:
        raise ConfigError(f"{p}: quick: unknown keys {sorted(unknown)} (set, variants, seeds, variant_set)")
    if not isinstance(quick.get("set", []), list) or not all(isinstance(x, str) for x in quick.get("set", [])):
        raise ConfigError(f"{p}: quick.set must be a list of 'section.key=value' strings")
    per = quick.get("variant_set", {})
    if not isinstance(per, dict) or not all(isinstance(v, list) and all(isinstance(x, str) for x in v)
                                            for v in per.values()):
        raise ConfigError(f"{p}: quick.variant_set must be a table from variant label to a list of "
                          "'section.key=value' strings")
    if any(k not in labels for k in per):
        raise ConfigError(f"{p}: quick.variant_set: no variant labelled {[k for k in per if k not in labels]}")
    vs = quick.get("variants", [])
    if not isinstance(vs, list) or any(v not in labels for v in vs):
        raise ConfigError(f"{p}: quick.variants must list variant labels; unknown: "
                          f"{[v for v in vs if v not in labels] if isinstance(vs, list) else vs!r}")
    return quick


def _labels(variants: list[dict[str, Any]]) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The variants' labels (non-empty, distinct) and their ``row`` / ``col`` / ``family``."""
    labels: list[str] = []
    meta: dict[str, dict[str, str]] = {}
    for i, v in enumerate(variants):
        label = v.get("label")
        if not isinstance(label, str) or not label:
            raise ConfigError(f"variants[{i}].label must be a non-empty string")
        if label in labels:
            raise ConfigError(f"variants[{i}].label {label!r} is used twice")
        for k in VARIANT_META[1:]:
            if k in v and not isinstance(v[k], str):
                raise ConfigError(f"variants[{i}].{k} must be a string, got {v[k]!r}")
        labels.append(label)
        meta[label] = {"row": v.get("row", label), "col": v.get("col"), "family": v.get("family")}
    return labels, meta


def _override_base(base: dict[str, Any], overrides: Sequence[str]) -> None:
    """The base names the output folder and heads the report; every override was checked against every
    selected variant, and one that only a variant can take (defenses.<i>.<param>) skips the base."""
    for o in overrides:
        try:
            apply_overrides(base, [o])
        except ConfigError:
            pass


def load_spec(path: str | Path, overrides: Sequence[str] = (), only: Sequence[str] = (),
              quick: bool = False, checked: Callable[[list[dict[str, Any]]], None] | None = None,
              seeds: Sequence[int] | None = None, runs: bool = False) -> SweepSpec:
    """Read and validate a sweep/experiment file (every variant's config, the report specs and claims).
    ``quick`` applies the file's ``[quick]`` table: its ``set`` overrides come before ``overrides`` (then
    ``variant_set``: a variant's own quick overrides, for keys the other variants do not have, such as
    the parameters of an attack only it runs) and its ``variants`` choose the variants unless ``only``
    does. Every variant passes the first pass (:func:`fedsim.config.precheck`, no heavy import) before
    any is validated in full; ``checked`` is then called with their configs (``run_sweep`` starts Ray
    there). ``seeds`` (``--seeds``) replaces the file's. ``runs``: validate the config of every run (each
    variant with each seed, :func:`run_config`) instead of each variant, and keep the components that
    built in ``built``, so that each run is built once (``run_sweep`` hands them to the run)."""
    p = Path(path)
    data = read_toml(p, "sweep file")
    given = check_seeds(list(seeds), "--seeds") if seeds is not None else None
    seeds = check_seeds(data.pop("seeds")) if "seeds" in data else None
    if seeds is None and "experiment" in data:  # an experiment decides its claims over seeds
        seeds = list(EXPERIMENT_SEEDS)
    variants = data.pop("variants", None)
    experiment = data.pop("experiment", {})
    report = data.pop("report", None)
    quick_spec = data.pop("quick", None)
    if not isinstance(variants, list) or not variants or not all(isinstance(v, dict) for v in variants):
        raise ConfigError(f"{p}: a sweep needs [[variants]] tables (each with a label)")
    _check_experiment(experiment, p)
    base = defaults()
    _merge(base, data)
    out = []
    labels, meta = _labels(variants)
    report_spec = check_report(report, f"{p}: report", base=str(p.parent))
    claims = check_claims(experiment.get("claims"), labels, f"{p}: experiment.claims")
    pre: list[str] = []
    per_variant: dict[str, list[str]] = {}
    if quick:
        if quick_spec is None:
            raise ConfigError(f"{p}: --quick: this file has no [quick] table")
        q = _check_quick(quick_spec, p, labels)
        pre = list(q.get("set", []))
        per_variant = {k: list(v) for k, v in q.get("variant_set", {}).items()}
        if not only and q.get("variants"):
            only = list(q["variants"])
        # a smoke test: one run per variant at the file's seed unless [quick] names seeds
        seeds = check_seeds(q["seeds"], f"{p}: quick.seeds") if "seeds" in q else None
    elif quick_spec is not None:
        _check_quick(quick_spec, p, labels)
    unknown = [o for o in only if o not in labels]
    if unknown:
        raise ConfigError(f"--only {unknown}: no such variant; variants: {labels}")
    overrides = [*pre, *overrides]
    index = {}
    for i, v in enumerate(variants):
        v = {k: x for k, x in v.items() if k not in VARIANT_META}
        label = labels[i]
        if only and label not in only:
            continue
        cfg = copy.deepcopy(base)
        _merge(cfg, v)
        cfg["name"] = f"{base.get('name', 'sweep')}-{variant_slug(label)}"
        try:
            apply_overrides(cfg, [*pre, *per_variant.get(label, []), *overrides[len(pre):]])
            absolute_references(cfg)
            precheck(cfg)
        except ConfigError as exc:
            raise ConfigError(f"variants[{i}] ({label}): {exc}") from exc
        index[label] = i
        out.append((label, cfg))
    if given is not None:
        seeds = given
    if checked is not None:
        checked([cfg for _, cfg in out])
    built = _validate_runs(out, seeds if runs else None, index)
    _override_base(base, overrides)
    return SweepSpec(base, out, seeds, experiment, report_spec, claims, meta, quick, built if runs else {})


def _check_experiment(experiment: Any, p: Path) -> None:
    if not isinstance(experiment, dict):
        raise ConfigError(f"{p}: [experiment] must be a table (title, paper, scale, notes, claims)")
    unknown = set(experiment) - {"title", "paper", "scale", "notes", "claims"}
    if unknown:
        raise ConfigError(f"{p}: experiment: unknown keys {sorted(unknown)} (title, paper, scale, notes, claims)")


def _validate_runs(out: list[tuple[str, dict[str, Any]]], seeds: Sequence[int] | None,
                   index: Mapping[str, int]) -> dict[tuple[str, int | None], Any]:
    """Every variant validated in full (with ``seeds``: every run, each variant with each seed), keyed by
    (label, seed): the components each built."""
    built = {}
    for label, cfg in out:
        for seed in seeds or [None]:
            try:
                built[(label, seed)] = validate(run_config(cfg, seed))
            except ConfigError as exc:
                raise ConfigError(f"variants[{index[label]}] ({label}): {exc}") from exc
    return built
