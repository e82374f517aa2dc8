"""spotctl: supervisorctl-style control of a running spotvisord, over its unix socket.

    spotctl                                    interactive shell (history, tab completion)
    spotctl status [--json]                    job line (durations, recoveries) + nodes table
    spotctl nodes [--json]                     nodes table only
    spotctl events [-f] [--since SEQ] [--kind K ...] [--json]
    spotctl tail NODE [-n N] [-f] [--json]     the node's trainer log (as the daemon holds it)
    spotctl cost [--json]                      spot USD so far, on-demand equivalent, savings
    spotctl checkpoint                         commit a checkpoint now; training goes on
    spotctl drain NODE                         the node commits, then leaves the job cleanly
    spotctl scale N                            the pool's target size (min..max; kept across restarts)
    spotctl pause                              commit, then release every node; the job is kept
    spotctl resume                             relaunch to the target (a paused, failed or cancelled
                                               job); resume from the last commit
    spotctl down                               commit, release every instance, end the job cancelled
    spotctl simulate-preemption NODE [--lead-s S]   local provider only: an interruption notice

Every verb takes ``--json`` (machine-readable output) and works in the shell too.
The socket is ``--socket PATH``, else ``$SPOTVISOR_SOCKET``, else the daemon
socket of ``--config FILE``, else ``.spotvisor/spotvisord.sock`` (the local
default) if it exists, else ``/run/spotvisor/spotvisord.sock`` (systemd).

With no daemon answering, ``events`` prints what the newest ``spotvisord demo`` run
under ``.spotvisor/`` recorded, if any (the socket not named otherwise), saying so on
stderr: the demo has ended by the time one asks what it did.

Exit codes: 0 ok, 1 daemon unreachable or its answer unreadable (one line naming the
socket), 2 usage error (one line: a bad argument, or a request the daemon refused, e.g.
an unknown node). A node id goes into the URL percent-quoted, and only in the form
:data:`daemon.model.NODE_ID_RE` allows (no '/', '?', '..'): it names one node, never
another route.
"""

from __future__ import annotations

import argparse
import asyncio
import cmd
import json
import os
import shlex
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable, NoReturn

from daemon.model import MAX_EVENT_SEQ, MAX_NOTICE_LEAD_S, is_node_id
from daemon.interfaces.ctl_render import (_clock, _placement, render_cost, render_event,  # noqa: F401 - spotctl's API
                                          render_nodes, render_status)
from daemon.interfaces.pipes import quiet_broken_pipe

# aiohttp is imported by the first request, not here: it is most of spotctl's start-up
# (about 0.2 of 0.3 CPU seconds), and the shell's prompt, `-h` and a usage error need none of it.

__all__ = ["main", "render_status", "render_nodes", "render_cost", "SpotShell"]

_LOCAL_SOCKET = Path(".spotvisor/spotvisord.sock")
_SYSTEMD_SOCKET = Path("/run/spotvisor/spotvisord.sock")
HISTORY_FILE = "~/.spotctl_history"
_NODE_VERBS = ("tail", "drain", "simulate-preemption")


class Unreachable(Exception):
    """The daemon cannot be reached (exit 1)."""


class Refused(Exception):
    """The daemon answered with a 4xx: a usage problem (exit 2)."""


class UsageError(Exception):
    """A bad command line (exit 2)."""


class BadAnswer(Exception):
    """The daemon answered 200 with something this spotctl cannot read (exit 1)."""


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistake reported as one line (and no exit: the shell goes on)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} -h`)")


def _socket_path(args: argparse.Namespace) -> Path:
    if args.socket:
        return Path(args.socket)
    if os.environ.get("SPOTVISOR_SOCKET"):
        return Path(os.environ["SPOTVISOR_SOCKET"])
    if args.config:
        from daemon.config import ConfigError, load_config

        try:
            return load_config(args.config).daemon.socket_path()
        except ConfigError as exc:
            raise UsageError(f"--config {args.config}: {exc.problems[0]}") from None
    return _LOCAL_SOCKET if _LOCAL_SOCKET.exists() else _SYSTEMD_SOCKET


# -- transport ---------------------------------------------------------------------------------
async def _request(sock: Path, path: str, *, stream: bool = False, out: Callable[[Any], None] | None = None,
                   method: str = "GET", body: dict[str, Any] | None = None, timeout_s: float = 10.0) -> Any:
    import aiohttp

    conn = aiohttp.UnixConnector(path=str(sock))
    timeout = aiohttp.ClientTimeout(total=None if stream else timeout_s, sock_connect=5)
    try:
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
            async with s.request(method, f"http://spotvisord{path}", json=body) as r:
                if 400 <= r.status < 500:
                    try:
                        raise Refused((await r.json())["error"])
                    except (ValueError, KeyError, TypeError, aiohttp.ContentTypeError):
                        raise Refused(f"spotvisord answered {r.status}") from None
                if r.status != 200:
                    raise Unreachable(f"spotvisord answered {r.status}: {(await r.text()).strip()}")
                if not stream:
                    try:
                        return await r.json()
                    except (ValueError, aiohttp.ContentTypeError):
                        raise BadAnswer(f"{path.split('?')[0]}: the answer is not JSON") from None
                assert out is not None
                async for raw in r.content:
                    if raw.strip():
                        try:
                            item = json.loads(raw)
                        except ValueError:
                            raise BadAnswer(f"{path.split('?')[0]}: a line of the answer is not JSON") from None
                        out(item)
    except (aiohttp.ClientConnectionError, FileNotFoundError, ConnectionRefusedError) as exc:
        raise Unreachable(
            f"cannot reach spotvisord at {sock} ({exc.__class__.__name__}); is it running? "
            "(start it with `spotvisord run --config FILE`, or pass --socket PATH)"
        ) from None


# -- verbs -------------------------------------------------------------------------------------
def _common(*, suppress: bool) -> argparse.ArgumentParser:
    # The subcommands repeat these options with SUPPRESS defaults: a subparser's own
    # default would otherwise overwrite a value given before the subcommand
    # (``spotctl --socket PATH status`` would lose PATH).
    d = {"default": argparse.SUPPRESS} if suppress else {}
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--socket", help="daemon control socket", **d)
    common.add_argument("--config", help="read the socket path from this config", **d)
    common.add_argument("--json", action="store_true", help="machine-readable output", **d)
    return common


def _node_path(node: str, *rest: str) -> str:
    """``/v1/nodes/<node>/<rest...>``, each segment percent-quoted (nothing is safe: a '/',
    '?' or '..' in a node id can never reach another route)."""
    return "/".join(["/v1/nodes", *(urllib.parse.quote(part, safe="") for part in (node, *rest))])


def _node_id(text: str) -> str:
    if not is_node_id(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a node id (letters, digits, '.', '_', '-', as `spotctl nodes` shows them, "
            f"e.g. default-1)")
    return text


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:30]!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def _seq(text: str) -> int:
    value = _nonneg_int(text)
    if value > MAX_EVENT_SEQ:
        raise argparse.ArgumentTypeError(f"{text[:30]} is past the largest event seq (2^63-1)")
    return value


def _lead_s(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= MAX_NOTICE_LEAD_S:  # nan, inf and 1e308 too
        raise argparse.ArgumentTypeError(f"{text} is not within (0, {MAX_NOTICE_LEAD_S:g}] seconds")
    return value


HELP = {
    "status": "job line (durations, recoveries) and nodes table",
    "nodes": "nodes table",
    "events": "the event log",
    "tail": "the node's trainer log (the daemon's copy: its last 256 KiB, shipped with heartbeats)",
    "cost": "spot USD so far, the on-demand equivalent, savings",
    "checkpoint": "commit a checkpoint now (the job keeps training)",
    "drain": "make a node leave the job cleanly (commit, then leave)",
    "scale": "set the pool's target size (within pool min..max; kept across daemon restarts)",
    "pause": "commit a checkpoint, then release every node (the job and its checkpoints are kept)",
    "resume": "relaunch a paused, failed or cancelled job to its target size; it resumes from the last commit",
    "down": "commit a checkpoint, release every instance and end the job cancelled (stops the bill)",
    "simulate-preemption": "local provider only: publish an interruption notice on the node's metadata endpoint",
}
VERBS = tuple(HELP)


def _parser() -> _Parser:
    common = _common(suppress=True)
    p = _Parser(prog="spotctl", description="talk to spotvisord (no command: an interactive shell)",
                parents=[_common(suppress=False)])
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    v = {verb: sub.add_parser(verb, parents=[common], help=text, description=text) for verb, text in HELP.items()}
    e = v["events"]
    e.add_argument("-f", "--follow", action="store_true", help="keep printing new events")
    e.add_argument("--since", type=_seq, default=0, metavar="SEQ", help="only events after SEQ")
    e.add_argument("--kind", action="append", default=[], help="only this kind (repeatable)")
    t = v["tail"]
    t.add_argument("node", type=_node_id, help="node id, as `spotctl nodes` shows it")
    t.add_argument("-n", "--lines", type=_nonneg_int, default=10, metavar="N", help="the last N lines (default 10)")
    t.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    v["drain"].add_argument("node", type=_node_id, help="node id, as `spotctl nodes` shows it")
    v["scale"].add_argument("nodes", type=_nonneg_int, metavar="N", help="target number of nodes")
    s = v["simulate-preemption"]
    s.add_argument("node", type=_node_id, help="node id, as `spotctl nodes` shows it")
    s.add_argument("--lead-s", type=_lead_s, default=30.0, metavar="S",
                   help=f"seconds between the notice and the reclaim, in (0, {MAX_NOTICE_LEAD_S:g}] (default 30)")
    return p


def _emit(as_json: bool, obj: Any, text: Callable[[], str]) -> None:
    """Print the daemon's answer: as JSON with ``--json``, else as ``text()`` renders it."""
    print(json.dumps(obj, indent=2) if as_json else text(), flush=True)


async def _amain(args: argparse.Namespace, sock: Path) -> int:
    c, as_json = args.cmd, args.json
    if c in ("status", "nodes"):
        status = await _request(sock, "/v1/status")
        _emit(as_json, status, lambda: render_status(status) if c == "status" else render_nodes(status))
    elif c == "cost":
        cost = await _request(sock, "/v1/cost")
        _emit(as_json, cost, lambda: render_cost(cost))
    elif c == "events":
        query = (f"?since={args.since}" + "".join(f"&kind={k}" for k in args.kind)
                 + ("&follow=1" if args.follow else ""))
        await _request(sock, "/v1/events" + query, stream=True,
                       out=lambda ev: print(json.dumps(ev) if as_json else render_event(ev), flush=True))
    elif c == "tail":
        seen = 0

        def line(ln: dict[str, Any]) -> None:
            nonlocal seen
            seen += 1
            print(json.dumps({"node": args.node, **ln}) if as_json else ln["line"], flush=True)

        query = f"?lines={args.lines}" + ("&follow=1" if args.follow else "")
        await _request(sock, _node_path(args.node, "log") + query, stream=True, out=line)
        if not seen and not args.follow and not as_json:
            print(f"spotctl: no trainer log from {args.node} yet", file=sys.stderr)
        elif args.follow and not as_json:  # the daemon ends a follow when the node has terminated
            print(f"spotctl: {args.node}: the daemon ended the log (the node has terminated)", file=sys.stderr)
    elif c == "checkpoint":
        reply = await _request(sock, "/v1/checkpoint", method="POST")
        said = ("the job commits at its next step boundary" if reply.get("trainer_reports", True) else
                "the job's script (job.command) has reported no step, so a commit may not follow: only a script "
                "with spotvisor's HF callback or trainer library commits on request; a plain one keeps its own "
                "schedule")
        _emit(as_json, reply, lambda: f"checkpoint requested ({reply['request_id']}): {said}")
    elif c == "drain":
        reply = await _request(sock, _node_path(args.node, "drain"), method="POST")
        _emit(as_json, reply, lambda: f"{reply['node']}: {reply['state']} "
                                      "(its trainer commits, then the node leaves the job)")
    elif c == "scale":
        r = await _request(sock, "/v1/scale", method="POST", body={"nodes": args.nodes})
        drain = f"; draining {', '.join(r['draining'])} (each commits, then leaves)" if r["draining"] else ""
        paused = " (applies at resume: the job is paused)" if r["paused"] else ""
        _emit(as_json, r, lambda: f"target {r['target_nodes']} nodes (was {r['old']}){paused}{drain}")
    elif c == "pause":
        r = await _request(sock, "/v1/pause", method="POST")
        who = (f"the job commits a checkpoint ({', '.join(r['committing'])})" if r["committing"]
               else "no trainer runs: nothing to commit")
        _emit(as_json, r, lambda: f"pausing: {who}, then every node is released "
                                  "(job_paused when done; spotctl resume relaunches)")
    elif c == "resume":
        r = await _request(sock, "/v1/resume", method="POST")
        frm = "the start" if r["resume_from_step"] is None else f"step {r['resume_from_step']}"
        was = f" the {r['was']} job" if r.get("was") else ""
        frm = (f"the job resumes from its last commit ({frm})" if r.get("trainer_reports", True) else
               "the job's script (job.command) resumes from what it saved itself (it reported no commit)")
        _emit(as_json, r, lambda: f"resuming{was}: launching {r['target_nodes']} nodes; {frm}")
    elif c == "down":
        r = await _request(sock, "/v1/down", method="POST")
        who = (f"the job commits a checkpoint ({', '.join(r['committing'])})" if r["committing"]
               else "no trainer runs: nothing to commit")
        _emit(as_json, r, lambda: f"cancelling: {who}, then every instance is released (a node whose "
                                  f"commit has not come in {r['wait_s']:g} s is released anyway; "
                                  "job_cancelled when done; spotctl resume starts it again)")
    elif c == "simulate-preemption":
        r = await _request(sock, _node_path(args.node, "simulate-preemption"), method="POST",
                           body={"lead_s": args.lead_s})
        at = _clock(r["deadline"], "%H:%M:%S")
        _emit(as_json, r, lambda: f"{r['node']}: interruption notice published; the local provider "
                                  f"reclaims it at {at} (in {r['lead_s']:g} s)")
    else:  # pragma: no cover - argparse only lets the verbs above through
        raise UsageError(f"spotctl: unknown command {c!r}")
    return 0


def _last_demo_db(args: argparse.Namespace) -> Path | None:
    """The event database of the newest ``spotvisord demo`` run (``<state_dir>/demo-<time>/
    spotvisord.db``) under ``--config``'s state directory, or the local default's
    (``.spotvisor``) when no config is named; None when a socket is named (``--socket``,
    ``$SPOTVISOR_SOCKET``: that daemon is the one asked about)."""
    if getattr(args, "socket", None) or os.environ.get("SPOTVISOR_SOCKET"):
        return None
    root = _LOCAL_SOCKET.parent
    if getattr(args, "config", None):
        from daemon.config import ConfigError, load_config

        try:
            root = load_config(args.config).daemon.state_path()
        except ConfigError:  # _socket_path said so already
            return None
    runs = sorted(root.glob("demo-*/spotvisord.db"))  # named by their start time
    return runs[-1] if runs else None


#: where an ended demo run keeps what ``tail`` and ``cost`` show while it runs
_AFTER_THE_RUN = {"tail": "node logs are files now: {run}/nodes/<node>/trainer.log (unmasked: the daemon's "
                          "copy masked the job's secrets)",
                  "cost": "spot cost is in its summary (spot_cost_usd) and in `spotctl events --kind pool_released` "
                          "(cost_usd, node_hours)",
                  "status": "figures are in its summary (`make demo`: demo-summary.json) and its record in "
                            "`spotctl events` (resumes: --kind job_resumed)"}


def _recorded_events(args: argparse.Namespace, sock: Path, db: Path) -> int:
    """``spotctl events`` with no daemon answering and a demo run recorded here: that
    run's events, read-only, as the daemon would have sent them (``--since``, ``--kind``,
    ``--json``); a follow ends at the last one. Exit 0."""
    from daemon.interfaces.demo_runner import read_events

    print(f"spotctl: no spotvisord answers at {sock}; the events the last demo run recorded ({db.parent}):",
          file=sys.stderr, flush=True)
    for ev in read_events(db, args.since):
        if not args.kind or ev.kind in args.kind:
            print(json.dumps(ev.to_dict()) if args.json else render_event(ev.to_dict()), flush=True)
    if args.follow:
        print("spotctl: that run has ended: nothing more to follow", file=sys.stderr)
    return 0


def run_verb(args: argparse.Namespace, sock: Path) -> int:
    """Run one parsed verb; the exit code (errors printed as one line on stderr). With no
    daemon answering, ``events`` shows the last local demo run's record if there is one
    (:func:`_recorded_events`): ``make demo`` has ended by the time one asks what it did."""
    try:
        return asyncio.run(_amain(args, sock))
    except Unreachable as exc:
        db = _last_demo_db(args) if args.cmd in ("events", *_AFTER_THE_RUN) else None
        if db is not None and args.cmd == "events":
            return _recorded_events(args, sock, db)
        # an ended demo run: where what the verb would have shown lies now
        after = "" if db is None else f"; the last demo run's {_AFTER_THE_RUN[args.cmd].format(run=db.parent)}"
        print(f"spotctl: {exc}{after}", file=sys.stderr)
        return 1
    except Refused as exc:
        print(f"spotctl: {exc}", file=sys.stderr)
        return 2
    except BadAnswer as exc:
        print(f"spotctl: unexpected answer from spotvisord at {sock}: {exc} "
              "(are spotctl and spotvisord the same version?)", file=sys.stderr)
        return 1
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:  # a reply of another shape
        what = f"no {exc.args[0]!r} in it" if isinstance(exc, KeyError) and exc.args else type(exc).__name__
        print(f"spotctl: unexpected answer from spotvisord at {sock}: {what} "
              "(are spotctl and spotvisord the same version?)", file=sys.stderr)
        return 1


# -- interactive shell -------------------------------------------------------------------------
class SpotShell(cmd.Cmd):
    """``spotctl`` with no command: every verb, with readline history (``~/.spotctl_history``)
    and tab completion of verbs and node ids. Ctrl-C stops a following verb (``events -f``,
    ``tail -f``) and returns to the prompt; ``quit``, ``exit`` or Ctrl-D leave."""

    prompt = "spotctl> "
    intro = "spotctl shell: type help, or a command (status, nodes, events, tail NODE, ...); Ctrl-D leaves"

    def __init__(self, sock: Path, *, history: str = HISTORY_FILE) -> None:
        super().__init__()
        self.sock = sock
        self.history = os.path.expanduser(history)
        self.parser = _parser()
        self.last_rc = 0
        self._node_ids: tuple[float, list[str]] = (0.0, [])
        self._history_loaded = False
        try:  # only the shell needs it (and a one-shot verb's output stays free of terminal codes)
            import readline
        except ImportError:  # no GNU readline / libedit here: a shell without history or completion
            readline = None
        self.readline = readline

    # cmd's own parsing takes a verb up to the first non-identifier character; ours has hyphens
    def parseline(self, line: str) -> tuple[str | None, str | None, str]:
        line = line.strip()
        if not line:
            return None, None, line
        if line[0] == "?":
            line = "help " + line[1:]
        verb, _, rest = line.partition(" ")
        return verb.replace("-", "_"), rest.strip(), line

    def preloop(self) -> None:
        rl = self.readline
        if rl is None or self._history_loaded:  # cmdloop runs again after a Ctrl-C at the prompt
            return
        self._history_loaded = True
        rl.set_completer_delims(" \t\n")  # node ids and verbs have hyphens
        rl.set_history_length(1000)
        try:
            rl.read_history_file(self.history)
        except OSError:  # none yet
            pass

    def postcmd(self, stop: bool, line: str) -> bool:
        if self.readline is not None and line.strip():
            try:
                self.readline.write_history_file(self.history)
            except OSError as exc:
                print(f"spotctl: cannot write the history to {self.history} ({exc.strerror})", file=sys.stderr)
        return stop

    def emptyline(self) -> bool:
        return False  # not cmd's default (repeat the last command)

    def default(self, line: str) -> bool:
        print(f"spotctl: unknown command {line.split()[0]!r} (commands: {', '.join(VERBS)}; help, quit)",
              file=sys.stderr)
        self.last_rc = 2
        return False

    def do_help(self, arg: str) -> bool:
        """help [COMMAND]: the commands, or one command's options"""
        verb = arg.strip()
        if verb in HELP:
            self.run(verb, "-h")
        elif verb:
            self.default(verb)
        else:
            for v in VERBS:
                print(f"  {v:<20} {HELP[v]}")
            print(f"  {'help [COMMAND]':<20} a command's options\n  {'quit':<20} leave (or Ctrl-D)")
        return False

    def do_quit(self, arg: str) -> bool:
        """leave the shell"""
        return True

    do_exit = do_quit

    def do_EOF(self, arg: str) -> bool:
        print()
        return True

    def run(self, verb: str, arg: str) -> None:
        try:
            args = self.parser.parse_args([verb, *shlex.split(arg)])
        except UsageError as exc:
            print(exc, file=sys.stderr)
            self.last_rc = 2
            return
        except ValueError as exc:  # shlex: an unclosed quote
            print(f"spotctl: {exc}", file=sys.stderr)
            self.last_rc = 2
            return
        except SystemExit as exc:  # -h printed the help
            self.last_rc = int(exc.code or 0)
            return
        try:
            self.last_rc = run_verb(args, self.sock)
        except KeyboardInterrupt:  # Ctrl-C ends a follow; the shell goes on
            print()
            self.last_rc = 130

    def completenames(self, text: str, *ignored: Any) -> list[str]:
        return [v + " " for v in (*VERBS, "help", "quit") if v.startswith(text)]

    def completedefault(self, text: str, line: str, begidx: int, endidx: int) -> list[str]:
        words = line[:begidx].split()
        if len(words) == 1 and words[0] in _NODE_VERBS:
            return [i + " " for i in self.node_ids() if i.startswith(text)]
        return []

    def complete_help(self, text: str, *ignored: Any) -> list[str]:
        return self.completenames(text)

    def node_ids(self) -> list[str]:
        """Live node ids from the daemon (cached for 2 s; none if it cannot be asked)."""
        at, ids = self._node_ids
        if time.monotonic() - at > 2.0:
            try:
                status = asyncio.run(_request(self.sock, "/v1/status", timeout_s=2.0))
                ids = [n["id"] for n in status["nodes"] if n["state"] not in ("terminated", "lost", "failed")]
            except (Unreachable, Refused, BadAnswer, asyncio.TimeoutError, KeyError, TypeError):
                ids = []
            self._node_ids = (time.monotonic(), ids)
        return ids

    def cmdloop(self, intro: Any = None) -> None:
        while True:
            try:
                super().cmdloop(intro)
                return
            except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt, like a shell
                print("^C")
                intro = ""


for _verb in VERBS:
    def _do(self: SpotShell, arg: str, _verb: str = _verb) -> bool:
        self.run(_verb, arg)
        return False

    _do.__doc__ = f"{_verb}: {HELP[_verb]} (`{_verb} -h` for its options)"
    setattr(SpotShell, "do_" + _verb.replace("-", "_"), _do)


@quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        sock = _socket_path(args)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        if args.cmd is None:
            SpotShell(sock).cmdloop()
            return 0
        return run_verb(args, sock)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `spotctl events -f | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
