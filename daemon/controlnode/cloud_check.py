"""The cloud check's verdicts: what ``spotvisord check`` prints, and what the daemon may buy.

The checks themselves (live, read-only calls with the control node's own credentials)
live at the edge: :mod:`daemon.controlnode.cloud_probe` runs them, the cloud parts are
:mod:`daemon.providers.aws_check` and :mod:`daemon.providers.aliyun_check`. This module
is pure: a check's outcome is a :class:`CheckResult`, and everything decided from a set of
them (the printed lines, which offers the daemon may not buy, when a failed check is
tried again) is a function of values.

One line per check::

    ok   aws: credentials resolve (arn:aws:iam::123456789012:user/ops)
    FAIL aws us-west-2: image ami-0abc: InvalidAMIID.NotFound in us-west-2; fix: providers.aws.image_id: ...

A failed check blocks the offers it concerns (:attr:`CheckResult.offers`; empty: every
offer): the daemon buys none of them until the check passes again
(:func:`blocked_offers`), and tries it again after :func:`retry_delay_s`, so a permission
granted meanwhile is picked up without a restart.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Sequence

__all__ = ["CheckResult", "passed", "failed", "render", "render_all", "merge_failures", "blocked_offers",
           "retry_delay_s", "RETRY_BASE_S", "RETRY_CAP_S", "PENDING"]

#: the daemon's retry schedule for a failed check: 60 s, doubling, at most 10 min (seconds)
RETRY_BASE_S, RETRY_CAP_S = 60.0, 600.0
#: why an offer is not bought before the first check has finished
PENDING = "the cloud check has not finished yet"


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One check's outcome.

    ``name``: what was checked, for a person (``aws us-east-1: image ami-...``).
    ``ok``: it passed. ``detail``: why it failed (the cloud's error code and message, or
    the numbers that do not add up); may say something on success too. ``fix``: what to
    change, naming the config field (``providers.aws.image_id: ...``). ``offers``: the
    indices into ``config.offers`` a failure blocks; empty: every offer. ``checked``:
    False when the cloud has nothing to check against (:func:`unchecked`): it blocks
    nothing, and is never shown as passed.
    """

    name: str
    ok: bool
    detail: str = ""
    fix: str = ""
    offers: frozenset[int] = frozenset()
    checked: bool = True


def passed(name: str, detail: str = "", offers: Iterable[int] = ()) -> CheckResult:
    return CheckResult(name, True, detail, "", frozenset(offers))


def failed(name: str, detail: str, fix: str, offers: Iterable[int] = ()) -> CheckResult:
    return CheckResult(name, False, detail, fix, frozenset(offers))


def unchecked(name: str, detail: str) -> CheckResult:
    """A check the cloud gives nothing to check against (``detail`` says what): shown as
    ``skip``, neither passed nor failed; the launch itself will tell."""
    return CheckResult(name, True, detail, "", frozenset(), checked=False)


def render(r: CheckResult) -> str:
    """``ok   <name>`` (`` (<detail>)`` when there is one), ``skip <name> (<detail>)`` for
    one not checked, or ``FAIL <name>: <detail>; fix: <fix>``: one line, whatever the
    cloud's message held."""
    if not r.checked:
        return "skip " + _one_line(f"{r.name} (not checked: {r.detail})")
    if r.ok:
        return "ok   " + _one_line(r.name + (f" ({r.detail})" if r.detail else ""))
    return "FAIL " + _one_line(f"{r.name}: {r.detail or 'failed'}; fix: {r.fix or 'see the detail'}")


def render_all(results: Sequence[CheckResult]) -> list[str]:
    """The lines ``spotvisord check`` prints: every check in order, failures merged
    (:func:`merge_failures`)."""
    return [render(r) for r in merge_failures(results)]


def merge_failures(results: Sequence[CheckResult]) -> list[CheckResult]:
    """Failures with the same detail and fix become one result (their names joined, their
    offers united), in the place of the first: four offers denied the same permission are
    one ``FAIL`` line, not four."""
    out: list[CheckResult] = []
    seen: dict[tuple[str, str], int] = {}
    for r in results:
        if r.ok:
            out.append(r)
            continue
        key = (r.detail, r.fix)
        if key not in seen:
            seen[key] = len(out)
            out.append(r)
            continue
        first = out[seen[key]]
        everyone = first.offers if not first.offers or not r.offers else first.offers | r.offers
        out[seen[key]] = replace(first, name=f"{first.name}, {r.name}", offers=everyone)
    return out


def blocked_offers(results: Sequence[CheckResult] | None, n_offers: int) -> dict[int, str]:
    """Offer index → why the daemon may not buy it (the first failed check's line); an
    offer not in the map may be bought. ``results`` None (no check has finished yet):
    every offer, fail closed.

    Example: 3 offers; the image check of us-west-2 failed for offer 2, everything else
    passed → ``{2: "FAIL aws us-west-2: image ...; fix: ..."}``: offers 0 and 1 are bought.
    """
    if results is None:
        return {i: PENDING for i in range(n_offers)}
    out: dict[int, str] = {}
    for r in merge_failures(results):
        if r.ok:
            continue
        for i in (r.offers or range(n_offers)):
            if 0 <= i < n_offers:
                out.setdefault(i, render(r))
    return out


def retry_delay_s(failures: int) -> float:
    """Seconds before a check that failed ``failures`` times in a row (1 for the first) is
    tried again: 60, 120, 240, 480, then 600 for good (any int >= 1; no overflow)."""
    exponent = min(max(0, failures - 1), 4)  # 60 x 2^4 = 960 > 600: the cap from there on
    return min(RETRY_CAP_S, RETRY_BASE_S * 2 ** exponent)


def _one_line(text: str) -> str:
    return " ".join(text.split())
