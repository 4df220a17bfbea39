"""A verdict in the operator's words: the flags to set, the headline, its reasons and where it
was measured (`ranking.choose` decides; this only says it)."""
from __future__ import annotations

from kvengine.entrypoints.flags import flag_name

from .ranking import BETTER, INCONCLUSIVE, INFEASIBLE, KEEP_DEFAULT, SMALLEST_CHANGE, Verdict


def changed_flags(params: dict, default: dict | None) -> str:
    """The server flags that turn `default` into `params`, as an operator types them."""
    out = []
    for key, value in params.items():
        if default is not None and default.get(key) == value:
            continue
        if isinstance(value, bool):
            out.append(flag_name(key) if value else "--no-" + flag_name(key)[2:])
        else:
            out.append(f"{flag_name(key)} {value:g}" if isinstance(value, float) else f"{flag_name(key)} {value}")
    return " ".join(out)


def headline(verdict: Verdict) -> str:
    """The verdict in one sentence (no reasons), naming the flags to set."""
    place, rec = where(verdict), verdict.recommended
    if verdict.kind in (BETTER, SMALLEST_CHANGE):
        flags = changed_flags(rec.params, verdict.default_params)
        return (f"Verdict ({place}): set `{flags}`, everything else as {verdict.reference} ({rec.label})." if flags
                else f"Verdict ({place}): change to {rec.label}.")
    if verdict.kind == KEEP_DEFAULT:
        return f"Verdict ({place}): no significant difference: keep {verdict.reference}."
    if verdict.kind == INCONCLUSIVE:
        lead = f" ({in_flags(verdict.leader, verdict)} measured best)" if verdict.leader else ""
        return f"Verdict ({place}): inconclusive{lead}: keep what you run."
    if verdict.kind == INFEASIBLE:
        closest = in_flags(verdict.closest, verdict) if verdict.closest else "none"
        return f"Verdict ({place}): no config met every SLO; the closest is {closest}."
    return f"Verdict: nothing could be measured ({place})."


def in_flags(config, verdict: Verdict) -> str:
    """A config as the flags that turn the reference into it, with its label: "`--kv-cache-dtype fp8`
    (trial 50)"; the reference by its name."""
    flags = changed_flags(config.params, verdict.default_params) if not config.is_default else ""
    return f"`{flags}` ({config.label})" if flags else config.label


def describe(verdict: Verdict) -> str:
    """The verdict and its reasons, as the terminal, the report and the UI print it."""
    reasons = "; ".join(verdict.reasons)
    if verdict.kind == INCONCLUSIVE:
        reasons = f"These runs cannot carry a change of flags: {reasons}"
    return headline(verdict) + (f" {reasons[0].upper()}{reasons[1:]}." if reasons else "")


def where(verdict: Verdict) -> str:
    if verdict.stage == "sim":
        return "on the simulator only, not confirmed on a server"
    head = verdict.recommended or verdict.leader or verdict.closest
    m = head.live if head is not None else None
    if m is None:
        return "live stage"
    runs = m.repeat
    return f"measured on {m.measured_on or m.target}, {runs} run{'s' if runs != 1 else ''} of each config"
