"""``mlxterm board add|list|show|move|run|cancel|retry|approve|reject|archive|export`` (alias
``mlxterm tasks``): the Kanban task board from the command line (the TUI's board screen shows
the same store).

``board run`` is the headless dispatcher: it drains the queue with ``--concurrency N`` agent
sessions on one engine per profile, prints a summary and exits 1 if any card it ran failed.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("board", aliases=["tasks"], help="the task board: agent tasks as cards (add, run, review...)")
    tsub = p.add_subparsers(dest="board_command", metavar="ACTION", required=True)

    ap = tsub.add_parser("add", help="add a card from a task YAML or from --prompt")
    ap.add_argument("task", nargs="?", type=Path, help="task YAML (the same file as `mlxterm run`)")
    ap.add_argument("--prompt", help="the task text (instead of a YAML file)")
    ap.add_argument("--title", help="card title (default: the task name / the prompt's start)")
    ap.add_argument("--workspace", help="directory copied as the card's workspace")
    ap.add_argument("--git", metavar="REPO", help="work in a git worktree of REPO on a new branch")
    ap.add_argument("--profile", help="profile (default: the best installed agent-capable one)")
    ap.add_argument("--check", action="append", default=[], metavar="CMD",
                    help="acceptance check run with bash in the workspace (repeatable)")
    ap.add_argument("--allow", action="append", default=[], metavar="TOOL", help="tool allowed without asking")
    ap.add_argument("--priority", type=int, default=0, help="higher runs first (default 0)")
    ap.add_argument("--label", action="append", default=[], metavar="L")
    ap.add_argument("--after", action="append", default=[], type=int, metavar="ID",
                    help="run only after card ID is done (repeatable)")
    ap.add_argument("--max-retries", type=int, default=2, metavar="N",
                    help="new attempts (new sessions) after failed checks (default 2)")
    ap.add_argument("--repair-rounds", type=int, metavar="N",
                    help="failing check output sent back within an attempt (default: the task's, else the profile's)")
    ap.add_argument("--auto-accept", action="store_true", help="checks passed -> done (no review)")
    ap.add_argument("--backlog", action="store_true", help="add to the backlog instead of the queue")
    ap.add_argument("--json", action="store_true")
    ap.set_defaults(func=_add)

    lp = tsub.add_parser("list", help="cards by state")
    lp.add_argument("--state", action="append", help="only cards in STATE (repeatable)")
    lp.add_argument("--all", action="store_true", help="include archived cards")
    lp.add_argument("--json", action="store_true")
    lp.set_defaults(func=_list)

    for name, helptext in (("show", "a card with its attempts"), ("export", "a card and its attempts as JSON")):
        sp = tsub.add_parser(name, help=helptext)
        sp.add_argument("id", type=int, metavar="ID")
        sp.add_argument("--json", action="store_true")
        if name == "export":
            sp.add_argument("--output", "-o", type=Path, metavar="FILE", help="write to FILE (atomically)")
        sp.set_defaults(func=_show if name == "show" else _export)

    rep = tsub.add_parser("report", help="one standalone HTML report of the board's cards and attempts")
    rep.add_argument("ids", type=int, nargs="*", metavar="ID", help="only these cards (default: every card)")
    rep.add_argument("--all", action="store_true", help="include archived cards")
    rep.add_argument("--out", "-o", type=Path, default=Path("board-report.html"), metavar="FILE")
    rep.add_argument("--json", action="store_true")
    rep.set_defaults(func=_report)

    mp = tsub.add_parser("move", help="move a card to STATE (allowed moves only)")
    mp.add_argument("id", type=int, metavar="ID")
    mp.add_argument("state", metavar="STATE")
    mp.add_argument("--json", action="store_true")
    mp.set_defaults(func=_move)

    for name, helptext in (("cancel", "stop a queued or running card (-> backlog)"),
                           ("retry", "queue a failed / blocked card again"),
                           ("start", "queue a backlog card"),
                           ("approve", "accept a card in review (-> done)"),
                           ("archive", "archive a card")):
        sp = tsub.add_parser(name, help=helptext)
        sp.add_argument("id", type=int, metavar="ID")
        sp.add_argument("--json", action="store_true")
        sp.set_defaults(func=_action, action=name)

    rj = tsub.add_parser("reject", help="send a card in review back with a comment (same agent session)")
    rj.add_argument("id", type=int, metavar="ID")
    rj.add_argument("comment", help="what to change")
    rj.add_argument("--json", action="store_true")
    rj.set_defaults(func=_action, action="reject")

    rp = tsub.add_parser("run", help="run queued cards headless (the dispatcher)")
    rp.add_argument("--concurrency", "-j", type=int, default=1, metavar="N", help="cards at once (default 1)")
    rp.add_argument("--wip", action="append", default=[], metavar="PROFILE=N", help="per-profile limit")
    rp.add_argument("--until-empty", action="store_true",
                    help="stop when nothing is queued or running (default: keep waiting for cards)")
    rp.add_argument("--json", action="store_true", help="print the summary as JSON")
    rp.set_defaults(func=_run)


def _board():
    from agents.board.store import BoardStore

    return BoardStore()


def _out(args, data, text: str) -> None:
    print(json.dumps(data, indent=2, ensure_ascii=False) if args.json else text)


def _line(card) -> str:
    labels = f" [{', '.join(card.labels)}]" if card.labels else ""
    reason = f" — {card.reason}" if card.reason else ""
    return f"{card.id:>4}  {card.state:<9} p{card.priority:<3} {card.title}{labels}{reason}"


def _add(args) -> int:
    from agents.board.actions import card_from_task, workspace_spec
    from agents.board.model import BoardError, Card, CheckSpec
    from agents.taskfile import load_task

    if (args.task is None) == (args.prompt is None):
        raise BoardError("give a task YAML file or --prompt TEXT (one of them)")
    extra = {"priority": args.priority, "labels": args.label, "depends_on": args.after,
             "max_retries": args.max_retries, "auto_accept": args.auto_accept}
    if args.task is not None:
        card = card_from_task(load_task(args.task), title=args.title, profile=args.profile, **extra)
        if args.workspace or args.git:
            card.workspace = workspace_spec(args.workspace, args.git)
        card.checks += [CheckSpec(f"check {len(card.checks) + i + 1}", c) for i, c in enumerate(args.check)]
        card.allow = list(dict.fromkeys([*card.allow, *args.allow]))
    else:
        title = args.title or (args.prompt.strip().splitlines()[0][:60] if args.prompt.strip() else "")
        if not title:
            raise BoardError("--prompt is empty")
        card = Card(id=0, title=title, prompt=args.prompt, profile=args.profile,
                    workspace=workspace_spec(args.workspace, args.git),
                    checks=[CheckSpec(f"check {i + 1}", c) for i, c in enumerate(args.check)],
                    allow=list(args.allow), **extra)
    if args.max_retries < 0:
        raise BoardError("--max-retries must be >= 0")
    if args.repair_rounds is not None:
        if args.repair_rounds < 0:
            raise BoardError("--repair-rounds must be >= 0")
        card.repair_rounds = args.repair_rounds
    card.state = "backlog" if args.backlog else "queued"
    card = _board().add(card)
    _out(args, card.as_dict(), f"added card {card.id} ({card.state}): {card.title}")
    return 0


def _list(args) -> int:
    from agents.board.model import STATES

    board = _board()
    states = tuple(args.state) if args.state else tuple(s for s in STATES if args.all or s != "archived")
    cards = board.cards(states)
    if args.json:
        _out(args, [c.as_dict() for c in cards], "")
        return 0
    for state in states:
        group = [c for c in cards if c.state == state]
        if group:
            print(f"{state} ({len(group)})")
            for c in group:
                print(_line(c))
    if not cards:
        print("no cards; add one with: mlxterm board add TASK.yaml")
    return 0


def _show(args) -> int:
    from dataclasses import fields

    from agents.board.actions import export_card
    from agents.board.model import Attempt

    fields_ = {f.name for f in fields(Attempt)}
    data = export_card(_board(), args.id)
    if args.json:
        _out(args, data, "")
        return 0
    c = data["card"]
    print(f"card {c['id']}: {c['title']} — {c['state']}" + (f" ({c['reason']})" if c["reason"] else ""))
    print(f"profile {c['profile'] or '(best agent-capable)'} · priority {c['priority']} · "
          f"retries {c['retries_used']}/{c['max_retries']} · workspace {c['workspace_dir'] or '(not made yet)'}")
    if c["depends_on"]:
        print(f"after cards {', '.join(map(str, c['depends_on']))}")
    print(f"prompt: {c['prompt']}")
    for a in data["attempts"]:
        t = a["tokens"]
        ratio = a["first_step_cached_ratio"]
        print(f"  attempt {a['number']} ({a['kind']}): {a['status']}"
              + (f", {a['stop_reason']}" if a["stop_reason"] else "")
              + (f", {a['wall_s']:.1f} s" if a["wall_s"] is not None else "")
              + (f", {a['requests']} requests, {t['completion']} tokens" if a["requests"] else "")
              + (f", first step {ratio:.0%} cached" if ratio is not None else "")
              + f", session {a['session_id'] or '-'}")
        notes = Attempt(**{k: v for k, v in a.items() if k in fields_}).notes()
        if notes:
            print(f"    {'; '.join(notes)}")
        if a["status"] == "unchecked":
            print("    unchecked: the card has no checks; nothing verified the work")
        for ch in a["checks"]:
            print(f"    check {ch['name']}: {'passed' if ch['passed'] else 'FAILED'}")
        if a["error"]:
            print(f"    error: {a['error']}")
    return 0


def _export(args) -> int:
    from engine.atomic import atomic_write_text

    from agents.board.actions import export_card

    text = json.dumps(export_card(_board(), args.id), indent=2, ensure_ascii=False) + "\n"
    if args.output:
        atomic_write_text(args.output, text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _report(args) -> int:
    from agents.board.actions import export_card
    from app.report import write_report

    board = _board()
    ids = args.ids or [c.id for c in board.cards() if args.all or c.state != "archived"]
    out = write_report([export_card(board, i) for i in ids], args.out, title="mlxterm task board")
    _out(args, {"report": str(out), "cards": ids}, f"wrote {out} ({len(ids)} cards)")
    return 0


def _move(args) -> int:
    from agents.board.actions import move_by_hand

    card = move_by_hand(_board(), args.id, args.state)
    _out(args, card.as_dict(), _line(card))
    return 0


def _action(args) -> int:
    from agents.board import actions
    from agents.board.dispatcher import request_cancel

    board = _board()
    if args.action == "cancel":
        card = request_cancel(board, board.get(args.id))
    elif args.action == "reject":
        card = actions.reject(board, args.id, args.comment)
    else:
        card = getattr(actions, args.action)(board, args.id)
    _out(args, card.as_dict(), _line(card))
    return 0


def _parse_wip(items: list[str]) -> dict[str, int]:
    from agents.board.model import BoardError

    out = {}
    for item in items:
        name, _, n = item.partition("=")
        if not name or not n.isdigit() or int(n) < 1:
            raise BoardError(f"--wip {item}: expected PROFILE=N with N >= 1")
        out[name] = int(n)
    return out


def summary(cards, finished, wall_s: float) -> dict:
    """The JSON summary of a dispatcher run (also what the benchmark reads). ``unchecked``: cards
    in review whose last attempt had no checks to pass (nothing verified them)."""
    last = {cid: a.status for cid, a in finished}
    attempts = [{"card": cid, "number": a.number, "status": a.status, "wall_s": a.wall_s,
                 "first_step_cached_ratio": a.first_step_cached_ratio, "cached_ratio": a.cached_ratio,
                 "tokens": a.tokens, "checks_passed": sum(1 for c in a.checks if c["passed"]),
                 "checks": len(a.checks), "first_try": (a.first_try or {}).get("status"),
                 "repair_rounds": len(a.repair_rounds), "corrective_turns": a.corrective_turns,
                 "workspace_changed": a.workspace_changed} for cid, a in finished]
    return {"wall_s": round(wall_s, 3), "cards": [{"id": c.id, "title": c.title, "state": c.state,
                                                   "reason": c.reason} for c in cards],
            "attempts": attempts, "failed": [c.id for c in cards if c.state == "failed"],
            "unchecked": [c.id for c in cards if c.state == "review" and last.get(c.id) == "unchecked"]}


def _run(args) -> int:
    import threading
    import time

    from engine.sessions import SessionStore

    from agents.board.dispatcher import Dispatcher
    from agents.board.runner import AttemptRun
    from agents.choose import best_agent_profile
    from agents.headless import describe_event

    engines: dict[str, object] = {}
    lock = threading.Lock()

    def engine_for(profile: str):
        from engine.serving.remote_engine import load_engine

        with lock:
            if profile not in engines:
                engines[profile] = load_engine(profile)  # a remote profile: its server
            return engines[profile]

    default: list[str] = []

    def default_profile() -> str:
        if not default:
            default.append(best_agent_profile())
        return default[0]

    err = sys.stderr if args.json else sys.stdout

    def progress(run: AttemptRun, ev) -> None:
        line = describe_event(ev)
        if line:
            print(f"card {run.card.id}: {line}", file=err, flush=True)

    def changed(card_id: int) -> None:
        card = board.get(card_id)
        print(f"card {card.id} -> {card.state}" + (f" ({card.reason})" if card.reason else ""), file=err, flush=True)

    board = _board()
    t0 = time.monotonic()
    dispatcher = Dispatcher(board, SessionStore(), engine_for, concurrency=args.concurrency,
                            per_profile=_parse_wip(args.wip), default_profile=default_profile,
                            on_event=progress, on_change=changed)
    for cid in dispatcher.recovered:
        print(f"card {cid}: its attempt was interrupted (the process running it is gone); requeued", file=err)

    def on_sigint(signum, frame) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print("\nmlxterm: cancelling the running cards (Ctrl-C again to abort)", file=sys.stderr, flush=True)
        dispatcher.stop(cancel=True)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        cards = dispatcher.drain(until_empty=args.until_empty)
    finally:
        signal.signal(signal.SIGINT, previous)
        for eng in engines.values():
            eng.close()
    result = summary(cards, dispatcher.finished, time.monotonic() - t0)
    if args.json:
        print(json.dumps(result, indent=2, ensure_ascii=False))
    else:
        for c in cards:
            print(_line(c))
        print(f"{len(cards)} cards in {result['wall_s']:.1f} s; {len(result['failed'])} failed"
              + (f"; {len(result['unchecked'])} unchecked (no checks)" if result["unchecked"] else ""))
    return 1 if result["failed"] else 0
