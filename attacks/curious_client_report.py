"""What the curious client (:class:`attacks.curious_client_observer.CuriousClient`) reports: the
per-attack summary (``summary.json["client_leakage"]``, the sweep's columns) and its ``report.md``
section."""
from __future__ import annotations

from typing import Any

from .leakage_scoring import mean_of
from .membership import AUDIT_COLUMNS, TPR_KEYS


def summary_rows(obs: Any) -> list[dict[str, Any]]:
    """One entry per attack for ``summary.json["client_leakage"]``; ``columns`` names what a sweep shows."""
    out = []
    for attack in ("cc-invert", "cc-span"):
        rs = [r for r in obs.rows if r["attack"] == attack]
        if rs:
            out.append({"attack": attack, "attacks_run": len(rs),
                        **{k: mean_of(rs, k) for k in ("exact", "psnr", "ssim", "mse", "success_content")},
                        "columns": ["exact", "psnr", "ssim"]})
    for f in obs.features:
        rs = [r for r in obs.rows if r["attack"] == "cc-mia" and r["features"] == f]
        if rs:
            prev = [r for r in rs if r["calibration"] == "previous round"]
            entry = {"attack": f"cc-mia-{f}", "asr": mean_of(prev, "asr"),
                     **{k: mean_of(prev, k) for k in AUDIT_COLUMNS}, "columns": ["asr", "auc", TPR_KEYS[1e-2]]}
            if obs.adaptive:
                entry["asr_same_round"] = mean_of([r for r in rs if r["calibration"] == "same round"], "asr")
                entry["columns"].append("asr_same_round")
            out.append(entry)
    for attack in ("cc-loss", "cc-calibrated"):
        rs = [r for r in obs.rows if r["attack"] == attack]
        if rs:
            out.append({"attack": attack, **{k: mean_of(rs, k) for k in AUDIT_COLUMNS},
                        "columns": ["auc", TPR_KEYS[1e-3], TPR_KEYS[1e-2]]})
    return out


def report_markdown(obs: Any) -> str:
    """The ``report.md`` section of a curious client."""
    from fedsim.reports import md_table

    if not obs.rows:
        return ""
    transforms = [t.get("name") for t in obs.cfg.get("transforms") or []]
    defence = "under the lossless perturbation" if "lossless-perturbation" in transforms else "without a defence"
    inv = [r for r in obs.rows if r["attack"] in ("cc-invert", "cc-span")]
    mia = [r for r in obs.rows if r["attack"] in ("cc-mia", "cc-loss", "cc-calibrated")]
    text = [f"## Curious client (client {obs.client}, {defence})\n",
            "What one honest-but-curious client can learn from what it receives (seed 002 §3, §6.4): the "
            "model sent to it every round, its own reply and data, the public partition sizes. Nothing from "
            "other clients' replies is used; the other clients' records are used only to score.\n"]
    if inv:
        text += ["### Gradient inversion of the other clients' combined gradient\n",
                 "From two consecutive models and its own gradient; `cc-invert`: analytic first-layer rows "
                 "(`rows_agreeing` > 0) or the single-example guess; `cc-span`: the adaptive span attack. "
                 f"`exact` = share of the victims' records recovered to max abs error <= {obs.exact_tol}.\n",
                 md_table(inv, ["round", "attack", "victims", "candidates", "exact", "psnr", "ssim", "mse",
                                "success_content", "seconds", "accuracy"],
                          {"exact": ".2f", "psnr": ".2f", "ssim": ".3f", "mse": ".3g", "success_content": ".2f",
                           "seconds": ".2f", "accuracy": ".4f"})]
        if obs._images:
            text.append("![client reconstruction](client_reconstruction.png)\n")
    if mia:
        text += ["### Membership inference (§6.4.1)\n",
                 "`cc-mia`: attack model on the chosen layer outputs + label, calibrated on records the client "
                 "knows (its own training records: members; test records: non-members) with the model of the "
                 "calibration round, scored on other clients' training records and unseen test records with the "
                 "model of the attacked round (`asr`: balanced accuracy, chance 0.5; its scores: the attack "
                 "model's logit). `cc-loss`: the attacked round's loss (Yeom et al.); `cc-calibrated`: its drop "
                 "from the previous round's model (Watson et al.). AUC 0.5 is chance; TPR at 0.1% / 1% FPR with "
                 "n scored non-members has resolution 1/n.\n",
                 md_table(mia, ["round", "attack", "features", "calibration", "known", "scored", "asr",
                                "calibration_asr", *AUDIT_COLUMNS, "seconds", "accuracy"],
                          {"asr": ".3f", "calibration_asr": ".3f", "auc": ".3f", TPR_KEYS[1e-3]: ".3f",
                           TPR_KEYS[1e-2]: ".3f", "seconds": ".2f", "accuracy": ".4f"})]
        if obs._curves:
            text.append("\n![membership ROC](client_membership_roc.png)\n")
    return "\n".join(text)
