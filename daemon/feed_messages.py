"""What an event says on the feed: its title, key numbers, text line (templates), the
generic webhook body, and its Slack Block Kit message or digest.

Pure functions of an :class:`~daemon.model.Event` (and the node row it names); the
delivery (signing, batching, retries, the feed's thread) is :mod:`daemon.notify`, which
re-exports these names.
"""

from __future__ import annotations

import json
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
    "job_resumed": "▶️",
    "job_completed": "🎉",
    "pool_released": "🧹",
    "gpu_underutilized": "🐢",
    "chaos_injected": "🧪",
    "trainer_exited": "⏹️",
    "metadata_unreachable": "📡",
    "metadata_recovered": "📶",
    "offer_unusable": "🚫",
    "checkpoint_deadline_risk": "⏳",
    "pool_scaled": "📏",
    "job_pausing": "⏸️",
    "job_paused": "💤",
    "job_unpaused": "⏯️",
}
_DEFAULT_EMOJI = "🔔"



# -- what an event says ---------------------------------------------------------------------------
def title(kind: str) -> str:
    """``checkpoint_committed`` → ``Checkpoint committed``."""
    return kind.replace("_", " ").capitalize()


def _count(v: Any) -> str:
    return f"{int(v):,}"


def _secs(v: Any) -> str:
    v = float(v)
    if abs(v) < 60:
        return f"{v:.1f} s"
    if abs(v) < 3600:
        return f"{int(v // 60)} min {int(v % 60)} s"
    return f"{int(v // 3600)} h {int(v % 3600 // 60)} min"


def _bytes(v: Any) -> str:
    v = float(v)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{v:.1f} TiB"  # unreachable


def _usd(v: Any) -> str:
    return f"${float(v):,.2f}"


def _usd_h(v: Any) -> str:
    return f"${float(v):,.3f}/h"


def _plain(v: Any) -> str:
    return ", ".join(map(str, v)) if isinstance(v, list) else str(v)


# data key → (label, formatter), in the order they are shown
_KNOWN: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
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
    ("lead_s", "Lead", _secs),
    ("backoff_s", "Back-off", _secs),
    ("price_usd_h", "Price", _usd_h),
    ("reason", "Reason", _plain),
    ("error", "Error", _plain),
    ("message", "Message", _plain),
    ("failures", "Failures", _count),
)


def _unix_s(v: Any) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str):
        try:
            t = datetime.fromisoformat(v)
        except ValueError:
            return None
        return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()
    return None


def key_fields(ev: Event, node: Node | None = None) -> list[tuple[str, str]]:
    """The numbers a person wants first, as ``(label, value)``: node, where it runs
    (provider, instance type, zone: from the event, else from the node's row), step,
    world size, seconds, bytes, cost (any ``*_usd`` / ``*_usd_h`` data key), reason.
    Absent or null data is left out; a value of the wrong type is shown as it is."""
    d = ev.data
    out: list[tuple[str, str]] = []
    if ev.node:
        out.append(("Node", ev.node))
    provider = d.get("provider") or (node.provider if node else None)
    where = [provider, node.instance_type if node else None, node.zone if node else None]
    if any(where):
        out.append(("Instance", " ".join(str(w) for w in where if w)))
    elif d.get("offer"):
        out.append(("Offer", str(d["offer"])))
    if ev.kind == EventKind.WORLD_SIZE_CHANGED.value and ("old" in d or "new" in d):
        out.append(("World size", f"{d.get('old') if d.get('old') is not None else '–'} → {d.get('new')}"))
    deadline = _unix_s(d.get("deadline"))  # a notice's: ISO-8601 (Notice.to_dict) or unix seconds
    if deadline is not None:
        out.append(("Deadline", f"in {_secs(max(0.0, deadline - ev.time))}"))
    elif d.get("deadline"):
        out.append(("Deadline", str(d["deadline"])))
    seen = {"provider", "deadline"}
    for key, label, fmt in _KNOWN:
        seen.add(key)
        v = d.get(key)
        if v is None or v == "" or v == []:
            continue
        try:
            out.append((label, fmt(v)))
        except (TypeError, ValueError):
            out.append((label, _plain(v)))
    for key, v in d.items():  # costs another part adds (final cost, savings) show up without a change here
        if key in seen or v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if key.endswith("_usd_h"):
            out.append((title(key[: -len("_usd_h")]), _usd_h(v)))
        elif key.endswith("_usd"):
            out.append((title(key[: -len("_usd")]), _usd(v)))
    return out


def _fields_for_template(ev: Event, pool: str, node: Node | None) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if node is not None:
        fields.update(provider=node.provider, instance_type=node.instance_type, zone=node.zone,
                      region=node.region)
    fields.update(ev.data)
    fields.update(
        seq=ev.seq, time=ev.time, kind=ev.kind, node=ev.node or "", pool=pool, data=ev.data,
        title=title(ev.kind), emoji=EMOJI.get(ev.kind, _DEFAULT_EMOJI),
        iso=datetime.fromtimestamp(ev.time, timezone.utc).isoformat(timespec="seconds"),
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
    does not fit the value) falls back to the default line, with a warning."""
    if template is not None:
        try:
            return _Template(escape).vformat(template, (), _fields_for_template(ev, pool, node))
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            log.warning("notify_template_failed", kind=ev.kind, seq=ev.seq, error=str(exc))
    head = f"{EMOJI.get(ev.kind, _DEFAULT_EMOJI)} {title(ev.kind)}"
    if ev.node:
        head += f" · {escape(ev.node)}"
    rest = [f"{label.lower()} {escape(value)}" for label, value in key_fields(ev, node) if label != "Node"][:6]
    return head + (": " + ", ".join(rest) if rest else "")


def webhook_batch_body(events: Sequence[tuple[Event, str]], *, pool: str) -> bytes:
    """The generic webhook body for a batch of ``(event, text)``, oldest first: UTF-8 JSON
    ``{"pool": pool, "events": [{"seq", "time", "kind", "node", "data", "text"}, ...]}``."""
    return json.dumps({"pool": pool, "events": [
        {"seq": ev.seq, "time": ev.time, "kind": ev.kind, "node": ev.node, "data": ev.data, "text": text}
        for ev, text in events]}, separators=(",", ":"), ensure_ascii=False, default=str).encode()


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
    head = f"{emoji} {title(ev.kind)}" + (f" · {ev.node}" if ev.node else "")
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
    blocks.append(ContextBlock(elements=[MarkdownTextObject(
        text=f"pool *{slack_escape(pool)}* · seq {ev.seq} · {_slack_when(ev.time)}")]))
    return SlackMessage(text=text, blocks=blocks)


def _slack_when(t: float) -> str:
    """A time Slack shows in the reader's own time zone (UTC where it cannot)."""
    iso = datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"<!date^{int(t)}^{{date_short_pretty}} {{time_secs}}|{iso}>"


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


