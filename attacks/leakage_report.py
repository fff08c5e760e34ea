"""What the curious server reports: the per-attack summary (``summary.json["leakage"]``, the sweep's
columns), the notes on what the channel let it see, and its ``report.md`` section."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .leakage_scoring import mean_of


def summary_rows(rows: Sequence[Mapping[str, Any]], names: Sequence[str], records: bool) -> list[dict[str, Any]]:
    """One entry per attack: the means over its attacked updates."""
    out = []
    for name in names:
        rs = [r for r in rows if r["attack"] == name]
        if not rs:
            continue
        conv = [r["converged_at"] + 1 for r in rs if r.get("converged_at") is not None]

        out.append({"attack": name, "attacks_run": len(rs),
                    **{k: mean_of(rs, k) for k in ("psnr", "ssim", "mse", "label_acc", "success_content",
                                                   "success_label", "iterations", "seconds")},
                    # the columns a comparison table shows (fedsim.comparison.run_row)
                    **({"columns": ["mse", "label_acc", "success_content"]} if records else {}),
                    # seed 001's "attack iterations": iterations until the gradient distance fell below the
                    # attack's threshold, over the attacks that got there (share: ``converged``)
                    "converged_iterations": float(np.mean(conv)) if conv else None,
                    # seed 001 Table 5: the spread of those iterations over the attacked updates
                    "converged_iterations_min": float(min(conv)) if conv else None,
                    "converged_iterations_max": float(max(conv)) if conv else None,
                    "converged_iterations_var": float(np.var(conv)) if conv else None,
                    "converged": len(conv) / len(rs)})
    return out


def aggregate_note(rows: Sequence[Mapping[str, Any]]) -> str:
    """Says what was attacked when the channel gave the server aggregates only ("" otherwise)."""
    agg = [r for r in rows if r.get("aggregate_of")]
    if not agg:
        return ""
    ks = sorted({r["aggregate_of"] for r in agg})
    batches = sorted({r["batch_size"] for r in agg})
    return (f"the channel gave the server only the secure aggregate: it attacked the aggregate of "
            f"{' / '.join(map(str, ks))} clients as one batch of {' / '.join(map(str, batches))} images "
            f"({len(agg)} attacks; scored against the union of the contributors' samples)")


def unreadable_note(unreadable: int) -> str:
    return (f"attacked nothing on {unreadable} intercepted replies: the channel gave the server "
            "ciphertexts only (no plaintext update, no plaintext aggregate)")


def _method(server: Any) -> str:
    """How reconstructions are matched and what counts as a success."""
    if server.records:
        return (f"assignment; the data are records (tabular): MSE over the standardised features, content success "
                f"(ASR_c) = share of records with MSE <= {server.mse_threshold:g} (fedsim.metrics.records); SSIM and "
                f"PSNR are image measures, not reported; ")
    return (f"assignment; content success (ASR_c) = share of images with SSIM >= {server.ssim_threshold}"
            f"{f' and PSNR >= {server.psnr_threshold} dB' if server.psnr_threshold is not None else ''}; ")


def report_markdown(server: Any) -> str:
    """The ``report.md`` section of an :class:`attacks.curious.CuriousServer`."""
    from fedsim.reports import md_table

    rows, names, warnings = server.rows, server.names, server.warnings
    if not rows:
        head = [f"The curious server {unreadable_note(server.unreadable)}.\n"] if server.unreadable else []
        head += [f"- {w}" for w in warnings]
        return "\n".join(["## Gradient leakage (curious server)\n", *head, ""]) if head else ""
    quality = ["mse"] if server.records else ["psnr", "ssim", "mse"]  # records: no SSIM/PSNR (image measures)
    note = aggregate_note(rows)
    malicious = sorted({r["attack"] for r in rows if r.get("threat_model") == "malicious"})
    text = ["## Gradient leakage (curious server)\n",
            f"Attacks {', '.join(names)} on {server.plan.describe()}. Reconstructions are matched to the victim's "
            "samples by optimal " + _method(server)
            + "label success (ASR_l) = share of labels recovered."
            + (f" Attacker knowledge beyond the update (threat-model ablation): "
               f"{', '.join(k.label() for k in server.knowledge)}." if server.knowledge else "") + "\n",
            *([f"Secure aggregation: {note}.\n"] if note else []),
            *(["**Threat model: a malicious server** for " + ", ".join(malicious) + ": it changed the model it "
               "sent (an imprint block, Robbing the Fed) - not the honest-but-curious server of the other "
               "attacks.\n"] if malicious else []),
            "### Per attack (mean over attacked updates)\n",
            md_table(summary_rows(rows, names, server.records),
                     ["attack", "attacks_run", *quality, "label_acc", "success_content", "success_label",
                      "iterations", "seconds"],
                     {"psnr": ".2f", "ssim": ".3f", "mse": ".4g", "label_acc": ".2f", "seconds": ".2f",
                      "iterations": ".0f", "success_content": ".2f", "success_label": ".2f"}),
            "### Per round and victim\n",
            md_table(rows, ["round", "client", *(["aggregate_of"] if note else []), "attack", "batch_size", *quality,
                            "label_acc", "iterations", "seconds", "accuracy"],
                     {"psnr": ".2f", "ssim": ".3f", "label_acc": ".2f", "seconds": ".2f", "accuracy": ".4f"}),
            "![leakage](leakage.png)\n"]
    text += [f"![{n}](reconstruction_{n}.png)\n" for n in names if any(k.startswith(n + "-") for k in server.images)]
    if warnings:
        text += ["### Warnings\n", *(f"- {w}" for w in warnings), ""]
    return "\n".join(text)
