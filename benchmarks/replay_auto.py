"""Replay ``auto``'s recorded reports through ``policy.decide`` (DESIGN §8: the choice is a pure
function of facts, run length and timings).

Every ``engine_report["auto"]`` in ``benchmarks/results`` (JSON and JSON-lines files, at any
depth) holds the run's expected length, its timings and the figures its choice rested on (the
trace estimate, the recorded functional/autograd ratio, the compile estimate). A report whose
reason is one of today's rules is replayed stage by stage: the facts it shows go into
``decide``, which must give the same engine and reason at the stage the report ended in, and the
step that leads there at the stages before. Reports of rules since removed (an older policy's
wording) and outcomes of checks (a product that failed or disagreed) are counted, not replayed.

``python -m benchmarks.replay_auto`` prints the counts and any mismatch (exit status 1 then).
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hessian_eigenthings.operators.engines.policy import (
    DEFAULT_POLICY,
    Decision,
    Facts,
    decide,
)

RESULTS = Path(__file__).parent / "results"

_SHORT = re.compile(
    r"short run: (expected products x product time under (?P<payback>[0-9.]+) x"
    r"|expected saving at the last run's functional/autograd ratio [0-9.]+ under) "
    r"the trace's expected [0-9.e+-]+ s"
)


def reports(root: Path = RESULTS) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every ``auto`` report (a dict with ``chosen`` and ``reason``) under ``root``."""
    for path in sorted(root.rglob("*.json*")):
        if path.suffix not in (".json", ".jsonl"):
            continue
        text = path.read_text()
        if '"reason"' not in text:
            continue
        lines = text.splitlines() if path.suffix == ".jsonl" else [text]
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            yield from ((path, r) for r in _walk(row))


def _walk(obj: Any) -> Iterator[dict[str, Any]]:
    if isinstance(obj, dict):
        if "chosen" in obj and "reason" in obj and "timings_ms" in obj:
            yield obj
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v)


def _facts(report: dict[str, Any], **more: Any) -> Facts:
    """The facts a report shows: the trace estimate it used (as a recorded trace time, so that
    ``decide`` estimates the same), the recorded ratio it used, its compile estimate."""
    recorded: dict[str, float] = {}
    if report.get("trace_estimate_s") is not None:
        recorded["trace_s"] = report["trace_estimate_s"]
    if report.get("functional_ratio") is not None:
        recorded["functional_ratio"] = report["functional_ratio"]
    est = report.get("compile_estimate_s")
    return Facts(
        recorded=recorded,
        compile_supported=True,
        programs=() if est is None else ((float(est), 0),),
        **more,
    )


_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?(?:e[+-]?[0-9]+)?")


def _same_reason(ours: str, theirs: str) -> bool:
    """The same words, and numbers equal up to the report's rounding (ratios are kept to three
    decimals and printed to two: 0.3451 prints 0.35, its report's 0.345 prints 0.34)."""
    if _NUMBER.sub("#", ours) != _NUMBER.sub("#", theirs):
        return False
    pairs = zip(_NUMBER.findall(ours), _NUMBER.findall(theirs), strict=True)
    return all(abs(float(a) - float(b)) <= 0.01 + 0.02 * abs(float(b)) for a, b in pairs)


def replay(report: dict[str, Any]) -> tuple[str, str]:
    """``(kind, detail)``: kind "same", "differs", or why the report is not replayed."""
    n, t, reason = report["expected_products"], report["timings_ms"], report["reason"]
    chosen = report["chosen"]

    def same(d: Decision, step: str | None = None) -> tuple[str, str]:
        if d.engine == chosen and _same_reason(d.reason, reason) and step in (None, d.step):
            return "same", ""
        return "differs", f"decide: {d.engine} / {d.reason!r} / {d.step}"

    if reason == "undecided":
        if n >= DEFAULT_POLICY.min_products:
            return "not judged yet", ""
        d = decide(Facts(), n, {})
        return ("same", "") if (d.engine, d.step) == ("autograd", "later") else same(d)
    if "decided before the first product" in reason:
        facts = _facts(report, first_look=True)
        recorded = {**facts.recorded, "autograd_ms": t["autograd_recorded"]}
        facts = Facts(**{**facts.__dict__, "recorded": recorded})
        return same(decide(facts, n, {}), "adopt")
    if reason.startswith("batches are not kept") or reason.startswith("functional engines"):
        return same(decide(Facts(refusal=reason), n, {}), "keep")
    if "autograd_first" not in t:
        return "another policy's rule", reason.split(":")[0]
    first = {"autograd_first": t["autograd_first"]}
    if reason.startswith("short run"):
        m = _SHORT.fullmatch(reason)
        payback = m and m.group("payback")
        if m is None or (payback and float(payback) != DEFAULT_POLICY.trace_payback):
            return "another policy's rule", reason
        return same(decide(_facts(report), n, first), "later")
    if reason.startswith("faster in this model's last trial"):
        return same(decide(_facts(report), n, first), "check")
    if reason.startswith("measured faster") or reason.startswith("expected saving exceeds"):
        if "trace_estimate_s" in report:  # the first product led to the trial
            d = decide(_facts(report), n, first)
            if d.step != "trial":
                return "differs", f"first product: {d.engine} / {d.reason!r} / {d.step}"
        trial = {k: t[k] for k in ("autograd", "functional", "compiled") if k in t}
        return same(decide(_facts(report), n, trial))
    if "failed" in reason or "differed" in reason:
        return "a check's outcome", ""
    return "another policy's rule", reason.split(":")[0]


def main() -> int:
    kinds: Counter[str] = Counter()
    bad = 0
    for path, report in reports():
        kind, detail = replay(report)
        kinds[kind] += 1
        if kind == "differs":
            bad += 1
            print(f"{path.relative_to(RESULTS)}: {report['reason']!r} -> {detail}")
    print(json.dumps(dict(kinds)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
