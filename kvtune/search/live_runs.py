"""A study's live runs as the ranking reads them: stage 2 reads them to resume where it stopped,
the report and the UI (`report_data.load_report_data`) to show them. One reader for both, so a
resumed stage 2 counts exactly the runs the report shows."""
from __future__ import annotations

from ..results import RunResult
from ..store import Store
from .measurement import SUMMARY_MEANS, Measurement
from .slo import score
from .validity import measured_on

LIVE_LABEL = "live"  # stage-2 runs are labelled "live <config> #<repeat>"


def live_runs(store: Store, study: str, slos, rows=None, load=None) -> list[Measurement]:
    """Every live run of `study`, oldest first, as stage 2 scored it: a failed or interrupted one as
    a FAIL measurement (it is no repeat); one stored before stage 2 kept its scores is scored here,
    as stage 1 would. `rows`: the study's run rows where the caller has them; `load(run_id)`: how to
    read a run (the store's, by default)."""
    trials = {row.number: row for row in store.list_trials(study, stage="live")}
    rows = rows if rows is not None else store.list_runs(limit=1_000_000, study=study)
    load = load or store.load_run
    out = []
    for row in sorted(rows, key=lambda r: r.id):
        if not (row.label or "").startswith(LIVE_LABEL + " ") or row.trial_number not in trials:
            continue
        number, params = row.trial_number, dict(trials[row.trial_number].params)
        repeat = sum(m.number == number and m.ok for m in out) + 1
        result = load(row.id) if row.status == "ok" else None
        if result is None:
            out.append(Measurement("live", number, params, "FAIL", run_id=row.id,
                                   reason=row.error or "the run did not complete", repeat=repeat))
            continue
        if "score" not in result.summary:
            sc = score(result, slos)
            result.summary["score"] = sc.as_dict() | {"values": trials[number].values or [sc.goodput_rps]}
        m = live_measurement(number, params, row.id, result)
        m.repeat = repeat
        out.append(m)
    return out


def live_measurement(number: int, params: dict, run_id: int, result: RunResult) -> Measurement:
    """One stored live run as the ranking reads it (what stage 2 scored, not scored again)."""
    sc, summary = result.summary.get("score") or {}, result.summary
    return Measurement(
        stage="live", number=number, params=dict(params), state="COMPLETE", values=sc.get("values"),
        constraints=dict(sc.get("violations") or {}), run_id=run_id, goodput_rps=sc.get("goodput_rps"),
        throughput_rps=sc.get("throughput_rps"), observed=dict(sc.get("observed") or {}),
        summary={k: summary.get(k) for k in SUMMARY_MEANS},
        target=result.target, measured_on=measured_on(result.target, result.device, result.config),
        repeat=int(summary.get("repeat") or 1), doubts=list(summary.get("doubts") or []),
        slot=summary.get("slot"))
