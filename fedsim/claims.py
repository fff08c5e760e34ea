"""Paper claims decided over seeds: holds, does not hold, or inconclusive, with the interval that decided.

An experiment states the paper's claims as ``[[experiment.claims]]`` tables (checked by
:func:`check_claims`) and runs every variant once per seed (``seeds``, default ``[0, 1, 2]`` for
experiments). :func:`evaluate_claims` decides each claim on the per-seed numbers.

**The claim spec** (TOML):

* a comparison: ``text``, ``value = "variant:column"``, ``op`` (``>``, ``>=``, ``<``, ``<=``: the claim
  is ``value op than + margin``; or ``~=``: ``|value - than| <= margin``), ``than`` (``"variant:column"``
  or a number), ``margin`` (optional, default 0; required and >= 0 with ``~=``). A column is any
  column of the variant's row: ``accuracy``, ``<attack>.ssim``, ``final.<metric>``, ``mean.<metric>``;
* the systematic evaluation (seed 004): ``best_family = "GradPrune"`` with ``budget`` (that family's
  setting is the best defense within the utility budget at every row), or ``most_often_strongest =
  "attack"`` (that attack is the strongest in the most defended settings);
* optional ``extension = "why"``: the claim goes beyond the paper's setting (the paper's claim applied to
  a setting it did not test); the README labels it so and says why.

**The statistics** (level :data:`LEVEL` = 95%, at least :data:`MIN_SEEDS` = 3 seeds):

* Two cells: the paired difference ``d_s = value_s - than_s`` over the seeds where both were measured
  (the same seed gives both variants the same partition, initial model and client sampling, so the
  pairing removes that shared variation) and its Student-t interval ``mean(d) +- t(0.975, n - 1) *
  sd(d) / sqrt(n)``. One cell and a number: the t-interval of the cell's mean, minus the number.
* The interval decides: ``>``/``>=``: holds when the whole interval lies above ``margin``, does not
  hold when it lies at or below it (below it for ``>=``), else inconclusive; ``<``/``<=`` mirrored;
  ``~=`` (equivalence): holds when the interval lies within ``[-margin, margin]``, does not hold when it
  lies entirely outside, else inconclusive. An interval of zero width (the same difference in every
  seed) decides like a point.
* Inconclusive, whatever the interval: fewer than 3 seeds; a one-sided comparison of two cells without a
  margin that are equal in every seed (a tie, e.g. both at a ceiling of 1.0: the measurement cannot order
  them; with a margin, "costs at most 1 point", equality is evidence and the interval decides); a
  comparison of two leakage cells ``<attack>.<metric>`` whose attacks both failed in every seed (their
  ``<attack>.success_content`` is 0: no reconstruction met the attack's success line, SSIM >=
  ``ssim_threshold`` for images, MSE <= ``mse_threshold`` for records): two failures differ by noise.
* The systematic claims are decided per seed (the systematic evaluation of that seed's runs): holds
  when they hold in every seed, does not hold when in none, inconclusive when the seeds disagree.
* A cell missing in every seed: "not measured".

Each claim is tested on its own at 95%: with 50 claims a few intervals miss by chance (no correction
for multiple comparisons).
"""
from __future__ import annotations

import math
import operator
from typing import Any, Mapping, Sequence

from fedsim.config import ConfigError

LEVEL = 0.95
MIN_SEEDS = 3
OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
WITHIN = "~="  # two-sided: |value - than| <= margin
VERDICTS = ("holds", "does not hold", "inconclusive", "not measured")
_TIE = 1e-12  # float noise: differences below this (relative) are ties


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(float(v)) else None


# ------------------------------------------------------------------ the spec
def check_claims(claims: Any, labels: Sequence[str], where: str = "experiment.claims") -> list[dict[str, Any]]:
    """Validate ``[[experiment.claims]]`` (module docstring) against the variants' ``labels``."""
    if claims is None:
        return []
    if not isinstance(claims, list):
        raise ConfigError(f"{where} must be a list of tables (text, value, op, than)")
    out = []
    for i, c in enumerate(claims):
        w = f"{where}[{i}]"
        if not isinstance(c, dict) or not isinstance(c.get("text"), str):
            raise ConfigError(f"{w} must be a table with 'text'")
        if "extension" in c and (not isinstance(c["extension"], str) or not c["extension"].strip()):
            raise ConfigError(f"{w}.extension must say how the claim goes beyond the paper's setting (a string)")
        if "most_often_strongest" in c:
            if not isinstance(c["most_often_strongest"], str):
                raise ConfigError(f"{w}.most_often_strongest must be an attack name")
            _no_unknown(c, {"text", "extension", "most_often_strongest"}, w)
            out.append(dict(c))
            continue
        if "best_family" in c:  # the systematic evaluation's winner within a utility budget
            if not isinstance(c["best_family"], str) or _num(c.get("budget")) is None:
                raise ConfigError(f"{w}: best_family must be a family name and budget a number")
            _no_unknown(c, {"text", "extension", "best_family", "budget"}, w)
            out.append(dict(c))
            continue
        _no_unknown(c, {"text", "extension", "value", "op", "than", "margin"}, w)
        if c.get("op") not in (*OPS, WITHIN):
            raise ConfigError(f"{w}.op must be one of {[*OPS, WITHIN]}, got {c.get('op')!r}")
        if c["op"] == WITHIN:
            if _num(c.get("margin")) is None or c["margin"] < 0:
                raise ConfigError(f"{w}.margin must be a number >= 0 with op = '{WITHIN}' "
                                  "(the claim is: |value - than| <= margin)")
        elif "margin" in c and _num(c["margin"]) is None:
            raise ConfigError(f"{w}.margin must be a number (the claim is: value op than + margin)")
        for k in ("value", "than"):
            v = c.get(k)
            if k == "than" and _num(v) is not None:
                continue
            if not isinstance(v, str) or ":" not in v:
                raise ConfigError(f"{w}.{k} must be 'variant label:column'" + (" or a number" if k == "than" else ""))
            if v.rsplit(":", 1)[0] not in labels:
                raise ConfigError(f"{w}.{k}: no variant labelled {v.rsplit(':', 1)[0]!r}")
        out.append(dict(c))
    return out


def _no_unknown(c: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = set(c) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)} ({', '.join(sorted(allowed))})")


# ------------------------------------------------------------------ statistics
def t_interval(x: Sequence[float], level: float = LEVEL) -> tuple[float, float, float, float]:
    """(mean, sample std, low, high): the Student-t interval of the mean of ``x`` (``len(x) >= 2``;
    one value: std 0 and the interval is the value itself, which no verdict uses)."""
    n = len(x)
    mean = math.fsum(x) / n
    if n < 2:
        return mean, 0.0, mean, mean
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in x) / (n - 1))
    from scipy.stats import t

    half = float(t.ppf(0.5 + level / 2, n - 1)) * std / math.sqrt(n)
    return mean, std, mean - half, mean + half


def decide(op: str, lo: float, hi: float, margin: float) -> str:
    """The verdict of an interval ``[lo, hi]`` on ``value - than`` against ``op`` and ``margin``."""
    if op == WITHIN:
        if -margin <= lo and hi <= margin:
            return "holds"
        return "does not hold" if lo > margin or hi < -margin else "inconclusive"
    if op in (">", ">="):
        holds = lo > margin if op == ">" else lo >= margin
        fails = hi <= margin if op == ">" else hi < margin
    else:
        holds = hi < margin if op == "<" else hi <= margin
        fails = lo >= margin if op == "<" else lo > margin
    return "holds" if holds else ("does not hold" if fails else "inconclusive")


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _pm(mean: float, std: float, n: int) -> str:
    return f"{mean:.4g} ± {std:.2g}" if n > 1 else f"{mean:.4g}"


# ------------------------------------------------------------------ evaluation
def evaluate_claims(claims: Sequence[Mapping[str, Any]], runs: Sequence[Mapping[str, Any]],
                    sys_spec: Mapping[str, Any] | None = None, min_seeds: int = MIN_SEEDS) -> list[dict[str, Any]]:
    """Decide every claim on ``runs``: one row per run (``variant``, ``seed``, the variant's ``row`` /
    ``col`` / ``family`` and its columns; a row without ``seed`` counts as seed 0). Returns one record
    per claim: ``verdict`` (:data:`VERDICTS`), ``why`` (what decided it), ``holds`` (True / False / None
    for the two decided verdicts / the others), ``seeds`` (those used), the mean and sample std of each
    side, ``ci`` (the 95% interval that decided: on ``value - than``), ``per_seed``, and ``ours`` and
    ``interval``: the numbers as text."""
    by: dict[tuple[str, int], Mapping[str, Any]] = {}
    seeds: list[int] = []
    for r in runs:
        s = int(r["seed"]) if r.get("seed") is not None else 0
        by[(r["variant"], s)] = r
        if s not in seeds:
            seeds.append(s)
    seeds.sort()
    out = []
    for c in claims:
        base = {"text": c["text"], **({"extension": c["extension"]} if c.get("extension") else {})}
        if "best_family" in c or "most_often_strongest" in c:
            res = _systematic_claim(c, runs, seeds, sys_spec, min_seeds)
        else:
            res = _cell_claim(c, by, seeds, min_seeds)
        res["holds"] = {"holds": True, "does not hold": False}.get(res["verdict"])
        out.append({**base, **res})
    return out


def _cell_claim(c: Mapping[str, Any], by: Mapping[tuple[str, int], Mapping[str, Any]], seeds: Sequence[int],
                min_seeds: int) -> dict[str, Any]:
    op, m = c["op"], float(c.get("margin", 0.0))
    number = _num(c["than"])

    def at(ref: Any, s: int) -> float | None:
        if _num(ref) is not None:
            return float(ref)
        lab, k = str(ref).rsplit(":", 1)
        return _num((by.get((lab, s)) or {}).get(k))

    a = {s: at(c["value"], s) for s in seeds}
    b = {s: at(c["than"], s) for s in seeds}
    used = [s for s in seeds if a[s] is not None and b[s] is not None]
    res: dict[str, Any] = {"value": c["value"], "than": c["than"], "op": op, "margin": m, "seeds": used,
                           "n": len(used), "level": LEVEL,
                           "per_seed": [{"seed": s, "value": a[s], "than": b[s]} for s in seeds]}
    if not used:
        miss = c["value"] if all(a[s] is None for s in seeds) else c["than"]
        return {**res, "verdict": "not measured", "why": f"{miss} missing", "ours": f"{miss} missing",
                "interval": "-", "ci": None}
    xa, xb = [a[s] for s in used], [b[s] for s in used]
    ma, sa, _, _ = t_interval(xa)
    mb, sb, _, _ = t_interval(xb)
    d = [x - y for x, y in zip(xa, xb)]
    md, sd, lo, hi = t_interval(d)
    need = (f"|difference| <= {m:g}" if op == WITHIN else
            f"{'difference' if number is None else 'value - ' + _g(number)} {op} {m:g}")
    res.update(value_mean=ma, value_std=sa, than_mean=mb, than_std=sb, difference_mean=md, difference_std=sd,
               ci=[lo, hi])
    ours = f"{c['value']} {_pm(ma, sa, len(used))}"
    ours += f" vs {number:g}" if number is not None else f" vs {c['than']} {_pm(mb, sb, len(used))}"
    res["ours"] = ours
    res["interval"] = (f"difference {md:+.4g}, {LEVEL:.0%} CI [{lo:+.4g}, {hi:+.4g}] (needs {need})"
                       if len(used) > 1 else f"difference {md:+.4g} (needs {need})")
    verdict = decide(op, lo, hi, m)
    why = f"the {LEVEL:.0%} interval " + {"holds": "meets", "does not hold": "excludes",
                                           "inconclusive": "straddles"}[verdict] + " the claim's bound"
    if number is None and op != WITHIN and m == 0 and all(abs(x) <= _TIE * max(1.0, abs(y)) for x, y in zip(d, xb)):
        verdict, why = "inconclusive", "tied in every seed (e.g. both at a ceiling): the measurement cannot order them"
    elif number is None and _both_failed(c["value"], c["than"], by, used):
        verdict, why = "inconclusive", ("both attacks failed in every seed (success_content 0: no reconstruction "
                                        "met the attack's success line): their difference is noise")
    elif len(used) < min_seeds:
        verdict, why = "inconclusive", f"{len(used)} seed(s): a claim is decided over >= {min_seeds}"
    return {**res, "verdict": verdict, "why": why}


def _both_failed(value: str, than: str, by: Mapping[tuple[str, int], Mapping[str, Any]],
                 seeds: Sequence[int]) -> bool:
    """Both cells are leakage columns ``<attack>.<metric>`` of attacks whose ``success_content`` is 0 in
    every seed."""
    for ref in (value, than):
        label, col = ref.rsplit(":", 1)
        if "." not in col:
            return False
        key = col.rsplit(".", 1)[0] + ".success_content"
        for s in seeds:
            v = _num((by.get((label, s)) or {}).get(key))
            if v is None or v > 0:
                return False
    return True


def _systematic_claim(c: Mapping[str, Any], runs: Sequence[Mapping[str, Any]], seeds: Sequence[int],
                      sys_spec: Mapping[str, Any] | None, min_seeds: int) -> dict[str, Any]:
    """``best_family`` / ``most_often_strongest``: the systematic evaluation of each seed's runs."""
    from fedsim.tables import systematic

    per_seed, decided = [], []
    for s in seeds:
        rows = [r for r in runs if (int(r["seed"]) if r.get("seed") is not None else 0) == s]
        holds, ours = None, "not measured"
        if sys_spec is not None and "best_family" in c:
            got = [b["best"] for b in systematic(rows, {**sys_spec, "budgets": [c["budget"]]})["best"]
                   if b["best"] is not None]
            if got:
                holds = all(w["family"] == c["best_family"] for w in got)
                ours = f"best within utility loss <= {c['budget']:g}: " + "; ".join(
                    f"{w['variant']} ({w['strongest']} {w['error']:.4f})" for w in got)
            else:
                ours = "no setting within the budget"
        elif sys_spec is not None:
            counts = systematic(rows, sys_spec)["strongest_counts"]
            if counts:
                holds = counts.get(c["most_often_strongest"]) == max(counts.values())
                ours = "strongest attack per defended setting: " + ", ".join(
                    f"{a} {n}" for a, n in sorted(counts.items(), key=lambda x: -x[1]))
        per_seed.append({"seed": s, "holds": holds, "ours": ours})
        if holds is not None:
            decided.append(holds)
    res: dict[str, Any] = {"seeds": [p["seed"] for p in per_seed if p["holds"] is not None], "n": len(decided),
                           "per_seed": per_seed, "ci": None}
    k = sum(decided)
    res["ours"] = "; ".join(f"seed {p['seed']}: {p['ours']}" for p in per_seed) or "not measured"
    res["interval"] = f"holds in {k} of {len(decided)} seeds" if decided else "-"
    if not decided:
        return {**res, "verdict": "not measured", "why": "no seed could evaluate it"}
    if len(decided) < min_seeds:
        return {**res, "verdict": "inconclusive", "why": f"{len(decided)} seed(s): a claim is decided over >= {min_seeds}"}
    if k == len(decided):
        return {**res, "verdict": "holds", "why": "holds in every seed"}
    if k == 0:
        return {**res, "verdict": "does not hold", "why": "holds in no seed"}
    return {**res, "verdict": "inconclusive", "why": "the seeds disagree"}


def verdict_of(c: Mapping[str, Any]) -> str:
    """A claims.json record's verdict (records published before verdicts: from ``holds``)."""
    if c.get("verdict") in VERDICTS:
        return c["verdict"]
    return {True: "holds", False: "does not hold"}.get(c.get("holds"), "not measured")


def cell(text: Any) -> str:
    """Text for a markdown table cell (a '|' would end the cell)."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def claims_markdown(results: Sequence[Mapping[str, Any]]) -> str:
    if not results:
        return ""
    seeds = sorted({s for r in results for s in r.get("seeds") or []})
    lines = ["## Paper claims\n",
             f"Decided over the seeds {seeds} (a claim needs >= {MIN_SEEDS}): mean ± sample std of each side; "
             f"the {LEVEL:.0%} Student-t interval of the per-seed difference decides (fedsim/claims.py). "
             "Inconclusive: the interval straddles the claim's bound, fewer than three seeds, a tie in every seed "
             "(no margin), or two attacks that both failed.\n",
             "| claim | ours (mean ± std over seeds) | interval | verdict |", "|---|---|---|---|"]
    for r in results:
        text = r["text"] + (f" *(extension beyond the paper: {r['extension']})*" if r.get("extension") else "")
        lines.append(f"| {cell(text)} | {cell(r['ours'])} | {cell(r['interval'])} | **{verdict_of(r)}**: {cell(r['why'])} |")
    return "\n".join(lines)
