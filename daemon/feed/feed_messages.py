"""What an event says on the feed: its title, key numbers, text line (templates), the
generic webhook body, and its Slack Block Kit message or digest.

Pure functions of an :class:`~daemon.model.Event` (and the node row it names); the
delivery is :mod:`daemon.feed.sinks` (a batch to one sink), :mod:`daemon.feed.signing`
and :mod:`daemon.feed.notify` (batching, retries, the feed's thread).

**Total**: every renderer returns for any event data, whatever an older daemon stored
(``NaN``/``Infinity``, a string where a number belongs, a list, a huge integer, data
that is not an object): a value that does not fit its format is shown as it is
(``inf``, ``pwned``), never raised. The webhook body is strict JSON (RFC 8259): a
non-finite float, or an integer too long for ``str`` (over 4,300 digits), is ``null``
in ``data``; the text line still shows what was stored.
"""

from __future__ import annotations

import json
import math
import string
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Mapping, Sequence

import structlog
from slack_sdk.models.blocks import Block, ContextBlock, HeaderBlock, MarkdownTextObject, PlainTextObject, SectionBlock

from daemon.config import SLACK_MAX_BATCH
from daemon.model import Event, EventKind, Node

__all__ = [
    "EMOJI",
    "clip",
    "SlackMessage",
    "key_fields",
    "render_text",
    "slack_digest",
    "slack_escape",
    "slack_message",
    "title",
    "fallback_text",
    "jsonable",
    "webhook_batch_body",
]

log = structlog.get_logger("spotvisor.notify")

# Slack's limits (docs.slack.dev, Block Kit reference and chat.postMessage): a message
# holds at most 50 blocks; a header's plain text 150 characters; a section's text 3000,
# its fields 10 of 2000 each; a context 10 elements. ``text`` is cut past 40 000 by
# Slack; the fallback is kept far shorter (it is what a phone's notification shows).
SLACK_MAX_BLOCKS = 50
SLACK_HEADER_MAX_CHARS = 150
SLACK_SECTION_MAX_CHARS = 3000
SLACK_FIELD_MAX_CHARS = 2000
SLACK_MAX_FIELDS = 10
SLACK_TEXT_MAX_CHARS = 3000
SLACK_DIGEST_LINE_MAX_CHARS = 500  # one event's line in a digest: 24 of them stay far below 40 000

# kind → the emoji of its header (tests check every EventKind has one)
EMOJI: dict[str, str] = {
    "node_launch_requested": "🛒",
    "node_launched": "🚀",
    "node_launch_failed": "❌",
    "node_ready": "🟢",
    "interruption_notice": "⚠️",
    "rebalance_recommendation": "🔶",
    "checkpoint_requested": "📝",
    "checkpoint_committed": "✅",
    "checkpoint_flush_timed_out": "⏰",
    "node_lost": "💀",
    "node_terminated": "🔻",
    "node_admitted": "➕",
    "world_size_changed": "🔀",
    "world_size_mismatch": "🚨",
    "job_resumed": "▶️",
    "job_stalled": "🧊",
    "job_completed": "🎉",
    "pool_released": "🧹",
    "gpu_underutilized": "🐢",
    "chaos_injected": "🧪",
    "trainer_exited": "⏹️",
    "workers_failed": "🔥",
    "metadata_unreachable": "📡",
    "metadata_recovered": "📶",
    "offer_unusable": "🚫",
    "checkpoint_deadline_risk": "⏳",
    "pool_scaled": "📏",
    "job_pausing": "⏸️",
    "job_paused": "💤",
    "job_unpaused": "⏯️",
    "job_failed": "💥",
    "job_cancelling": "🛬",
    "job_cancelled": "⏏️",
    "job_relaunched": "🔁",
    "migration_started": "🧳",
    "checkpoint_replicated": "📦",
    "migration_completed": "🏁",
    "migration_failed": "🛑",
    "market_changed": "💱",
    "placement_waiting": "🏠",
    "completion_unverified": "❓",
    "code_published": "📤",
    "node_setup_failed": "🧰",
    "setup_halted": "⛔",
    "cloud_check_failed": "🔒",
    "cloud_check_passed": "🔓",
    "offer_family_backoff": "🧮",
    "rendezvous_unreachable": "🔌",
    "rendezvous_recovered": "🤝",
}
_DEFAULT_EMOJI = "🔔"



# -- what an event says ---------------------------------------------------------------------------
def title(kind: str) -> str:
    """``checkpoint_committed`` → ``Checkpoint committed``."""
    return kind.replace("_", " ").capitalize()


def _str(v: Any) -> str:
    """``str(v)`` that never raises (an int past Python's 4,300-digit limit, a broken ``__str__``)."""
    try:
        return str(v)
    except Exception:  # noqa: BLE001 - a value from the store must not stop the feed
        if isinstance(v, int):
            return f"<an integer of {v.bit_length()} bits>"
        return f"<{type(v).__name__}>"


def _real(v: Any) -> float:
    """``v`` as a float, for a formatter: a real number (not a bool) or a numeric string.

    Raises:
        ValueError, TypeError, OverflowError: anything else (the caller shows the value as it is).
    """
    if isinstance(v, bool):
        raise TypeError("a bool is not a number here")
    return float(v)


def _count(v: Any) -> str:
    if isinstance(v, bool):
        raise TypeError("a bool is not a count")
    if isinstance(v, float) and not math.isfinite(v):
        return _str(v)
    return f"{int(v):,}"  # a numeric string too; ValueError past 4,300 digits: shown as it is


def _secs(v: Any) -> str:
    v = _real(v)
    if not math.isfinite(v) or abs(v) >= 1e9:  # ~32 years: no clock reading, a number as it is
        return f"{v:.3g} s"
    if abs(v) < 60:
        return f"{v:.1f} s"
    if abs(v) < 3600:
        return f"{int(v // 60)} min {int(v % 60)} s"
    return f"{int(v // 3600)} h {int(v % 3600 // 60)} min"


def _bytes(v: Any) -> str:
    v = _real(v)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if not abs(v) >= 1024 or unit == "TiB":  # NaN stops at B
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{v:.1f} TiB"  # unreachable


def _usd(v: Any) -> str:
    return f"${_real(v):,.2f}"


def _usd_h(v: Any) -> str:
    return f"${_real(v):,.3f}/h"


def _plain(v: Any) -> str:
    return ", ".join(map(_str, v)) if isinstance(v, list) else _str(v)


# data key → (label, formatter), in the order they are shown
_KNOWN: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
    ("why", "Why", _plain),  # job_failed's, first: the one-line text keeps six fields
    ("step", "Step", _count),
    ("last_step", "Last step", _count),
    ("resumed_from", "Resumed from step", _count),
    ("last_commit_step", "Last commit", _count),
    ("world_size", "World size", _count),
    ("seconds", "Flush", _secs),
    ("bytes", "Size", _bytes),
    ("boot_s", "Boot", _secs),
    ("detection_latency_s", "Seen after", _secs),
    ("overdue_s", "Past deadline", _secs),
    ("idle_s", "No step for", _secs),
    ("lead_s", "Lead", _secs),
    ("backoff_s", "Back-off", _secs),
    ("price_usd_h", "Price", _usd_h),
    ("source", "From domain", _plain),
    ("target", "To domain", _plain),
    ("commit_step", "Committed step", _count),
    ("copy_s", "Copy", _secs),
    ("decision_to_first_step_s", "Decision to first step", _secs),
    ("egress_usd", "Egress", _usd),
    ("reason", "Reason", _plain),
    ("left", "Left because", _plain),
    ("error", "Error", _plain),
    ("message", "Message", _plain),
    ("failures", "Failures", _count),
    ("code_version", "Code", lambda v: _plain(v)[:12]),
    ("setup_s", "Setup", _secs),
    ("stage", "Failed at", _plain),
    ("exit_code", "Exit code", _plain),
    ("last_line", "Last line", _plain),
)


def _unix_s(v: Any) -> float | None:
    """A deadline as unix seconds (a number or ISO-8601), None if it is neither or not finite."""
    try:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            t = float(v)
        elif isinstance(v, str):
            d = datetime.fromisoformat(v)
            t = (d if d.tzinfo else d.replace(tzinfo=timezone.utc)).timestamp()
        else:
            return None
    except (ValueError, OverflowError, OSError):
        return None
    return t if math.isfinite(t) else None


def _data(ev: Event) -> Mapping[str, Any]:
    """The event's data as a mapping with string keys (data that is not an object: empty)."""
    d = ev.data
    if not isinstance(d, Mapping):
        return {}
    return d if all(isinstance(k, str) for k in d) else {k: v for k, v in d.items() if isinstance(k, str)}


def _iso(t: Any) -> str:
    """Unix seconds as ISO-8601 UTC; the value as it is when it is no time."""
    try:
        return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")
    except (TypeError, ValueError, OverflowError, OSError):
        return _str(t)


def key_fields(ev: Event, node: Node | None = None) -> list[tuple[str, str]]:
    """The numbers a person wants first, as ``(label, value)``: node, where it runs
    (provider, instance type, zone: from the event, else from the node's row), step,
    world size, seconds, bytes, cost (any ``*_usd`` / ``*_usd_h`` data key), reason.
    Absent or null data is left out; a value of the wrong type, or not finite, is shown
    as it is. Never raises, whatever the data."""
    d = _data(ev)
    out: list[tuple[str, str]] = []
    if ev.node:
        out.append(("Node", _str(ev.node)))
    provider = d.get("provider") or (node.provider if node else None)
    where = [provider, node.instance_type if node else None, node.zone if node else None]
    if any(where):
        out.append(("Instance", " ".join(_str(w) for w in where if w)))
    elif d.get("offer"):
        out.append(("Offer", _str(d["offer"])))
    if ev.kind == EventKind.WORLD_SIZE_CHANGED.value and ("old" in d or "new" in d):
        old = d.get("old")
        out.append(("World size", f"{_str(old) if old is not None else '–'} → {_str(d.get('new'))}"))
    deadline = _unix_s(d.get("deadline"))  # a notice's: ISO-8601 (Notice.to_dict) or unix seconds
    if deadline is not None:
        out.append(("Deadline", f"in {_secs(max(0.0, deadline - ev.time))}" if _finite(ev.time) else _iso(deadline)))
    elif d.get("deadline") not in (None, "", [], {}):
        out.append(("Deadline", _plain(d["deadline"])))
    seen = {"provider", "deadline"}
    for key, label, fmt in _KNOWN:
        seen.add(key)
        v = d.get(key)
        if v is None or (isinstance(v, (str, list, dict)) and not v):
            continue
        try:
            out.append((label, fmt(v)))
        except Exception:  # noqa: BLE001 - wrong type, not finite, too long: shown as it is
            out.append((label, _plain(v)))
    for key, v in d.items():  # costs another part adds (final cost, savings) show up without a change here
        if key in seen or v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        try:
            if key.endswith("_usd_h"):
                out.append((title(key[: -len("_usd_h")]), _usd_h(v)))
            elif key.endswith("_usd"):
                out.append((title(key[: -len("_usd")]), _usd(v)))
        except Exception:  # noqa: BLE001 - an int too large for a float
            out.append((title(key), _plain(v)))
    return out


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _fields_for_template(ev: Event, pool: str, node: Node | None) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if node is not None:
        fields.update(provider=node.provider, instance_type=node.instance_type, zone=node.zone,
                      region=node.region)
    fields.update(_data(ev))
    fields.update(
        seq=ev.seq, time=ev.time, kind=ev.kind, node=ev.node or "", pool=pool, data=ev.data,
        title=title(ev.kind), emoji=EMOJI.get(ev.kind, _DEFAULT_EMOJI), iso=_iso(ev.time),
    )
    return fields


class _Template(string.Formatter):
    """``str.format`` with a missing field shown as ``?`` and each value passed
    through ``escape`` after formatting (Slack's ``&``, ``<``, ``>``)."""

    def __init__(self, escape: Callable[[str], str]) -> None:
        self._escape = escape

    def get_value(self, key: int | str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        if isinstance(key, int):
            raise KeyError(key)
        return kwargs.get(key, "?")

    def format_field(self, value: Any, format_spec: str) -> str:
        return self._escape(super().format_field(value, format_spec))


def _no_escape(s: str) -> str:
    return s


def slack_escape(s: str) -> str:
    """Slack's control characters (``&``, ``<``, ``>``) as entities, for text from events."""
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def render_text(ev: Event, *, pool: str, node: Node | None = None, template: str | None = None,
                escape: Callable[[str], str] = _no_escape) -> str:
    """The one-line text of an event: ``template`` (``str.format`` fields: see
    :class:`daemon.config.SinkSpec`), or the default ``<emoji> <Title> · <node>: key
    numbers``. A template that does not render for this event (a format spec that
    does not fit the value, ``{failures:,d}`` of ``inf``) or renders to blank text
    falls back to the default line, with a warning. Never raises, whatever the data."""
    if template is not None:
        try:
            text = _Template(escape).vformat(template, (), _fields_for_template(ev, pool, node))
        except Exception as exc:  # noqa: BLE001 - any value meets any format spec here
            log.warning("notify_template_failed", kind=ev.kind, seq=ev.seq, error=clip(_str(exc), 200))
        else:
            if text.strip():
                return text
            log.warning("notify_template_failed", kind=ev.kind, seq=ev.seq, error="the template rendered blank")
    head = f"{EMOJI.get(ev.kind, _DEFAULT_EMOJI)} {title(ev.kind)}"
    if ev.node:
        head += f" · {escape(_str(ev.node))}"
    rest = [f"{label.lower()} {escape(value)}" for label, value in key_fields(ev, node) if label != "Node"][:6]
    return head + (": " + ", ".join(rest) if rest else "")


def fallback_text(ev: Event) -> str:
    """The line of an event whose rendering failed (a bug): its kind and ``seq`` only."""
    return f"{EMOJI.get(ev.kind, _DEFAULT_EMOJI)} {title(_str(ev.kind))} (seq {ev.seq}: its details could not be shown)"


_MAX_DEPTH = 64  # deeper data is cut (a string) in the webhook body


def jsonable(v: Any, _depth: int = 0) -> Any:
    """``v`` as strict JSON values: a non-finite float (or an integer too long for ``str``)
    becomes None, a non-string key its ``str``, a tuple a list, another object its
    ``str``; data nested deeper than 64 levels is cut to ``"…"``. Never raises."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        try:
            int.__repr__(v)  # what json.dumps does: ValueError past 4,300 digits
        except ValueError:
            return None
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if _depth >= _MAX_DEPTH:
        return "…"
    if isinstance(v, Mapping):
        return {(k if isinstance(k, str) else _str(k)): jsonable(x, _depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x, _depth + 1) for x in v]
    return _str(v)


def webhook_batch_body(events: Sequence[tuple[Event, str]], *, pool: str) -> bytes:
    """The generic webhook body for a batch of ``(event, text)``, oldest first: UTF-8 JSON
    ``{"pool": pool, "events": [{"seq", "time", "kind", "node", "data", "text"}, ...]}``.

    Strict JSON (RFC 8259) whatever the data: non-finite numbers are ``null`` (see
    :func:`jsonable`); text that cannot be UTF-8 (a lone surrogate) is ``\\u`` escaped."""
    obj = jsonable({"pool": pool, "events": [
        {"seq": ev.seq, "time": ev.time, "kind": ev.kind, "node": ev.node, "data": ev.data, "text": text}
        for ev, text in events]})
    try:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except UnicodeEncodeError:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


@dataclass(frozen=True, slots=True)
class SlackMessage:
    """An incoming-webhook message: ``text`` (notification fallback) and Block Kit ``blocks``."""

    text: str
    blocks: list[Block]

    def to_dict(self) -> dict[str, Any]:
        """The JSON body; raises ``SlackObjectFormationError`` if a block breaks a limit."""
        return {"text": self.text, "blocks": [b.to_dict() for b in self.blocks]}


def clip(s: str, n: int) -> str:
    """``s`` cut to at most ``n`` characters, an ellipsis marking the cut."""
    return s if len(s) <= n else s[: n - 1] + "…"


def slack_message(ev: Event, *, pool: str, node: Node | None = None, template: str | None = None) -> SlackMessage:
    """Block Kit for one event: a header (emoji, kind, node), the template's text if the
    sink has one, the key numbers as a field grid (two columns on a phone), and a
    context line with the pool, ``seq`` and the time in the reader's own time zone."""
    emoji = EMOJI.get(ev.kind, _DEFAULT_EMOJI)
    head = f"{emoji} {title(ev.kind)}" + (f" · {_str(ev.node)}" if ev.node else "")
    text = clip(render_text(ev, pool=pool, node=node, template=template, escape=slack_escape), SLACK_TEXT_MAX_CHARS)
    fields = [
        MarkdownTextObject(text=clip(f"*{label}*\n{slack_escape(value)}", SLACK_FIELD_MAX_CHARS))
        for label, value in key_fields(ev, node)[:SLACK_MAX_FIELDS]
    ]
    blocks: list[Block] = [HeaderBlock(text=PlainTextObject(text=clip(head, SLACK_HEADER_MAX_CHARS), emoji=True))]
    if template is not None or not fields:
        blocks.append(SectionBlock(text=MarkdownTextObject(text=clip(text, SLACK_SECTION_MAX_CHARS)),
                                   fields=fields or None))
    else:
        blocks.append(SectionBlock(fields=fields))
    tail = _log_tail(ev)
    if tail:  # job_failed: the failing node's last lines, as a person reads them first
        blocks.append(SectionBlock(text=MarkdownTextObject(text=clip(
            "*Last log lines*\n```" + slack_escape("\n".join(tail)) + "```", SLACK_SECTION_MAX_CHARS))))
    blocks.append(ContextBlock(elements=[MarkdownTextObject(
        text=f"pool *{slack_escape(pool)}* · seq {ev.seq} · {_slack_when(ev.time)}")]))
    return SlackMessage(text=text, blocks=blocks)


#: the last lines of a ``log_tail`` a Slack message shows (the webhook's data carries all of it)
SLACK_LOG_LINES = 8


def _log_tail(ev: Event) -> list[str]:
    """The event's ``log_tail`` (job_failed: masked, each line cut by the daemon), its last
    :data:`SLACK_LOG_LINES` lines of text; ``[]`` when it has none."""
    lines = _data(ev).get("log_tail")
    if not isinstance(lines, list):
        return []
    # a line's own ``` would end the code block the lines are shown in
    return [clip(ln.replace("```", "` ` `"), 240) for ln in lines if isinstance(ln, str) and ln.strip()][
        -SLACK_LOG_LINES:]


def _slack_when(t: float) -> str:
    """A time Slack shows in the reader's own time zone (UTC where it cannot); the value
    as it is when it is no time."""
    try:
        iso = datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"<!date^{int(t)}^{{date_short_pretty}} {{time_secs}}|{iso}>"
    except (TypeError, ValueError, OverflowError, OSError):
        return slack_escape(_str(t))


def slack_digest(items: Sequence[tuple[Event, Node | None, str | None]], *, pool: str) -> SlackMessage:
    """One Slack message for a batch of ``(event, node, template)``, oldest first.

    One event: :func:`slack_message` (the rich layout). More: a header with the count
    (with the kind's emoji and title when they all share one), then per event a
    section with its line (template or default, at most
    :data:`SLACK_DIGEST_LINE_MAX_CHARS`) and a context with its ``seq`` and time, and
    a closing context with the pool and the ``seq`` range: 2 + 2 per event blocks.

    Raises:
        ValueError: no events, or more than ``SLACK_MAX_BATCH`` (24: they would not
            fit in a message's 50 blocks; the sink's ``max_batch`` is validated so).
    """
    if not 1 <= len(items) <= SLACK_MAX_BATCH:
        raise ValueError(f"a Slack digest holds 1 to {SLACK_MAX_BATCH} events, got {len(items)}")
    if len(items) == 1:
        ev, node, template = items[0]
        return slack_message(ev, pool=pool, node=node, template=template)
    kinds = {ev.kind for ev, _, _ in items}
    if len(kinds) == 1:
        (kind,) = kinds
        head = f"{EMOJI.get(kind, _DEFAULT_EMOJI)} {title(kind)} × {len(items)}"
    else:
        head = f"{_DEFAULT_EMOJI} {len(items)} events"
    blocks: list[Block] = [HeaderBlock(text=PlainTextObject(text=clip(head, SLACK_HEADER_MAX_CHARS), emoji=True))]
    lines = []
    for ev, node, template in items:
        line = clip(render_text(ev, pool=pool, node=node, template=template, escape=slack_escape),
                     SLACK_DIGEST_LINE_MAX_CHARS)
        lines.append(line)
        blocks.append(SectionBlock(text=MarkdownTextObject(text=line)))
        blocks.append(ContextBlock(elements=[MarkdownTextObject(text=f"seq {ev.seq} · {_slack_when(ev.time)}")]))
    first, last = items[0][0].seq, items[-1][0].seq
    blocks.append(ContextBlock(elements=[MarkdownTextObject(
        text=f"pool *{slack_escape(pool)}* · {len(items)} events · seq {first}–{last}")]))
    text = clip(f"{len(items)} events in {slack_escape(pool)}:\n" + "\n".join(lines), SLACK_TEXT_MAX_CHARS)
    return SlackMessage(text=text, blocks=blocks)


