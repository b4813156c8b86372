"""Plan, then work through it: parsing the plan, ticking items, the planned run, and the
per-file context policy (older file versions replaced by a reference, the KV prefix kept)."""

import textwrap

from engine.sessions import SessionStore

import pytest

from agents import compaction
from agents.events import Compacted, StepDone, StepStart
from agents.headless import HeadlessRun, describe_event
from agents.plan import Plan, PlanItem, parse_plan, plan_from_task
from agents.scripted import Reply, ScriptedEngine, scripted_profile
from agents.session import AgentOptions, AgentSession
from agents.taskfile import load_task
from agents.transcript import read_transcript, replay_messages


@pytest.mark.parametrize("text, paths, features", [
    ("1. index.html: the board markup\n2. app.js - cards, drag and drop\n3. style.css (themes)",
     ["index.html", "app.js", "style.css"], ["the board markup", "cards, drag and drop", "themes"]),
    ("Here is my plan:\n- **`index.html`** \u2014 markup\n  - the new card form\n  - the archive\n* src/app.js: logic\n",
     ["index.html", "src/app.js"], ["markup; the new card form; the archive", "logic"]),
    ("### index.html\n- columns\n- cards\n### app.js\n- storage\n", ["index.html", "app.js"],
     ["columns; cards", "storage"]),
    ("1) ./index.html\n2) index.html again: the dialog\n3. ../secret.txt\n4. /etc/passwd.txt",
     ["index.html"], ["again: the dialog"]),
    ("I will write the files.\n```\n1. fake.js: in a code block\n```\nNo list here.", [], []),
    ("1. set document.title\n2. console.log the click\n3. app.js: the click", ["app.js"], ["the click"]),
])
def test_parse_plan(text, paths, features):
    plan = parse_plan(text)
    assert [i.path for i in plan.items] == paths
    assert [i.features for i in plan.items] == features


def test_parse_plan_keeps_to_allowed_paths_and_caps_items():
    plan = parse_plan("1. index.html uses data.json\n2. README.md\n3. app.js", allowed=["index.html", "app.js"])
    assert [i.path for i in plan.items] == ["index.html", "app.js"]
    many = "\n".join(f"{n}. f{n}.js" for n in range(30))
    assert len(parse_plan(many).items) == 12


def test_tick_render_and_round_trip():
    plan = Plan([PlanItem("index.html", "markup"), PlanItem("app.js")])
    assert plan.next_item().path == "index.html"
    assert [i.path for i in plan.tick(["./index.html", "other.txt"])] == ["index.html"]
    assert plan.tick(["index.html"]) == []  # already done
    assert plan.render() == "[x] 1. index.html: markup\n[ ] 2. app.js"
    assert not plan.finished and plan.next_item().path == "app.js"
    again = Plan.from_dict(plan.to_dict())
    assert again == plan
    plan.items[1].given_up = True
    assert plan.next_item() is None and "[-] 2. app.js" in plan.render()


def test_plan_from_task_names_the_missing_files(tmp_path):
    (tmp_path / "style.css").write_text("x")
    plan = plan_from_task("Write index.html, app.js and style.css; see ../x.md", lambda p: (tmp_path / p).exists())
    assert [i.path for i in plan.items] == ["index.html", "app.js"] and plan.source == "task"


TASK = """
prompt: "Build a page: index.html, app.js and style.css."
limits: {steps: 6, wall_s: 60}
checks:
  - name: all
    run: test -s index.html && test -s app.js && test -s style.css
"""


def headless(tmp_path, replies, task=TASK, **profile):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "task.yaml"
    path.write_text(textwrap.dedent(task))
    engine = ScriptedEngine(replies, profile=scripted_profile(edit_format="whole", **profile))
    lines = []
    run = HeadlessRun(load_task(path), engine=engine, workspace=tmp_path / "ws", run_dir=tmp_path / "run",
                      store=SessionStore(tmp_path / "s.db"), allow=("bash",),
                      on_event=lambda ev: lines.append(describe_event(ev, run.progress)))
    return run, engine, lines


def test_planned_run_plans_then_writes_one_file_per_item(tmp_path):
    replies = ["`index.html`: the markup\n2. **app.js** - the logic\n   - add cards\n3. style.css (colours)"
               "\n4. README.md: how to use it",  # not a file the task names: left out
               "<p>hi</p>\n```\n", "console.log(1);\n```\n", "body { color: red }\n```\n"]
    run, engine, lines = headless(tmp_path, replies)
    result = run.run()
    assert result["status"] == "passed", result
    assert [i["path"] for i in result["plan"]["items"]] == ["index.html", "app.js", "style.css"]
    assert all(i["done"] and i["attempts"] == 1 for i in result["plan"]["items"])
    assert result["steps"] == 4 and result["progress"]["steps"] == 4
    # the planning turn starts the list for the model; each item's turn opens its file
    prompts = [engine.tokenizer.decode(r.prompt_ids) for r in engine.requests]
    assert prompts[0].endswith("<|im_start|>assistant\nPlan:\n1. ") and "short plan only" in prompts[0]
    assert prompts[2].endswith("Only this file.<|im_end|>\n<|im_start|>assistant\napp.js\n```javascript\n")
    assert "[x] 1. index.html: the markup\n[ ] 2. app.js: the logic; add cards" in prompts[2]
    assert (tmp_path / "ws" / "app.js").read_text() == "console.log(1);\n"
    # every follow-up request extends the previous one: the session cache covers it
    for before, after in zip(engine.requests, engine.requests[1:], strict=False):
        assert after.prompt_ids[: len(before.prompt_ids)] == before.prompt_ids
    records = read_transcript(tmp_path / "run" / "transcript.jsonl")
    assert [r["type"] for r in records if r["type"].startswith("plan")] == ["plan"] + ["plan_tick"] * 3
    assert records[[r["type"] for r in records].index("plan")]["text"].startswith("[ ] 1. index.html")
    text = "\n".join(line for line in lines if line)
    assert "[step 3] app.js: " in text and "tokens (" in text and "done: style.css" in text
    assert "    [x] 3. style.css: colours" in text
    from app.report import build_report

    page = build_report([tmp_path / "run" / "result.json"])
    assert "<h4>plan</h4>" in page and "<span class='ok'>done</span> <code>app.js</code>: the logic; add cards" in page


def test_no_plan_in_the_reply_falls_back_to_the_task_files_and_gives_up_on_silence(tmp_path):
    # app.js: two runs write nothing (each step reopens the file; the block is cut off, then the
    # same cut-off block again stops the run as repeated)
    replies = ["Sure, I will build it.", "<p>hi</p>\n```\n", *[Reply("no file")] * 4, "body {}\n```\n"]
    run, engine, lines = headless(tmp_path, replies, task=TASK.replace("wall_s: 60", "wall_s: 60}\nrepair_rounds: 0\nsampling: {seed: 0}\n#"),
                                  repair_temperature=0.7)
    result = run.run()
    items = result["plan"]["items"]
    assert result["plan"]["source"] == "task" and [i["path"] for i in items] == ["index.html", "app.js", "style.css"]
    assert items[1]["given_up"] and items[1]["attempts"] == 2 and not items[1]["done"]
    assert items[2]["done"] and items[2]["attempts"] == 1 and result["status"] == "failed"
    opened = [engine.tokenizer.decode(r.prompt_ids).endswith("assistant\napp.js\n```javascript\n")
              for r in engine.requests]
    assert opened == [False, False, True, True, True, True, False]
    # the second run of an item samples at the profile's repair temperature
    temps = [r.params.temperature for r in engine.requests]
    assert temps[2:4] == [0.0, 0.0] and temps[4:6] == [0.7, 0.7] and temps[6] == 0.0
    seeds = [r.params.seed for r in engine.requests]
    assert seeds[2:4] == [1, 2] and seeds[4:6] == [1001, 1002] and seeds[6] == 1
    assert any(isinstance(line, str) and "given up: app.js" in line for line in lines)


def test_a_planning_reply_stops_where_it_starts_writing_a_file(tmp_path):
    """The 0.5B followed its plan ("1. 1. Create ...") with the files themselves, in the same
    reply, and rushed them: the planning reply is stopped where its first file block opens (kept
    in the context as generated, not a call), and each file gets its own turn."""
    replies = [Reply("1. Create index.html with the page.\n2. 2. app.js: the click.\n\n"
                     "index.html\n```html\n<p>hi</p>\n```\napp.js\n```js\nlet a = document.title;\n```\n",
                     delay_s=0.002),
               "<p>hi</p>\n<script src=app.js></script>\n```\n", "let a = 1;\n```\n", "body {}\n```\n"]
    run, engine, lines = headless(tmp_path, replies)
    result = run.run()
    items = result["plan"]["items"]
    # style.css, named by the task and left out of the model's plan, comes after its items
    assert result["plan"]["source"] == "model" and result["status"] == "passed"
    assert [(i["path"], i["features"]) for i in items] == [("index.html", "Create  with the page."),
                                                          ("app.js", "the click."), ("style.css", "")]
    assert [i["attempts"] for i in items] == [1, 1, 1] and len(engine.requests) == 4
    assert (tmp_path / "ws" / "app.js").read_text() == "let a = 1;\n"
    msgs = SessionStore(tmp_path / "s.db").messages(result["session_id"])
    plan_reply = next(m for m in msgs if m.role == "assistant" and not m.meta.get("example"))
    raw = plan_reply.meta["raw_text"]
    assert "index.html\n```html\n" in raw and "let a" not in raw and not plan_reply.tool_calls
    assert msgs[plan_reply.index + 1].role == "user"  # no tool result: the block was no call
    assert not any(line and "malformed" in line for line in lines)


def test_single_file_task_is_not_planned(tmp_path):
    task = 'prompt: "create hello.txt containing hi"\nchecks: [{name: c, run: test -s hello.txt}]\n'
    run, engine, _ = headless(tmp_path, ["hello.txt\n```\nhi\n```\n", "done"], task=task)
    result = run.run()
    assert result["plan"] is None and result["status"] == "passed"
    task = 'prompt: "create a.txt and b.txt"\nplan: false\n'
    run, engine, _ = headless(tmp_path / "2", ["done"], task=task)
    assert run.run()["plan"] is None


# -- the per-file context policy -------------------------------------------------------------

def test_compaction_keeps_the_latest_version_of_each_file_and_the_prefix(tmp_path):
    """index.html written three times: once the context is short, the two older versions become
    a one-line reference, the latest stays whole, and the prefix before the first changed
    message keeps its tokens (the next request reuses it from the cache)."""
    def page(n):
        return "".join(f"<p>version {n} line {i}</p>\n" for i in range(40))

    replies = [f"index.html\n```html\n{page(n)}```" for n in range(3)] + ["All done."]
    engine = ScriptedEngine(replies, profile=scripted_profile(max_context=6000, max_tokens=1200,
                                                              edit_format="whole"))
    store = SessionStore(tmp_path / "s.db")
    agent = AgentSession.create(engine, store, tmp_path, options=AgentOptions(system_prompt="t", examples=False))
    snapshots, events = [], []
    for ev in agent.run("write index.html three times"):
        events.append(ev)
        if isinstance(ev, StepStart):
            snapshots.append(store.messages(agent.session_id))
    assert events[-1].reason == "answered"
    compactions = [e for e in events if isinstance(e, Compacted)]
    assert compactions, "the context never got compacted"
    msgs = store.messages(agent.session_id)
    writers = [m for m in msgs if m.role == "assistant" and m.tool_calls]
    ref = compaction.reference("index.html")
    assert [ref in m.meta["raw_text"] for m in writers] == [True, True, False]
    assert page(2) in writers[2].meta["raw_text"] and page(0) not in writers[0].meta["raw_text"]
    assert writers[0].meta["compacted"]["superseded"] is True
    assert writers[0].meta["raw_text"].startswith("index.html\n```html\n" + ref)
    # the prefix up to the first changed message is unchanged, and the cache serves it
    first = compactions[0].messages[0]
    before = next(s for s in snapshots if len(s) > first)
    assert [m.token_ids for m in before[:first]] == [m.token_ids for m in msgs[:first]]
    after_request = engine.requests[-1]
    prefix = sum(len(m.token_ids) for m in msgs[:first])
    assert after_request.prompt_ids[:prefix] == [t for m in msgs[:first] for t in m.token_ids]
    step_after = [e for e in events if isinstance(e, StepDone)][-1]
    assert prefix <= step_after.cached_tokens < step_after.prompt_tokens
    assert store.context_tokens(agent.session_id) == [t for m in msgs for t in m.token_ids]
    # the transcript records the rewrite and replays to the session
    rec = next(r for r in agent.transcript.records if r["type"] == "compaction")
    assert [s["path"] for s in rec["superseded"]] == ["index.html", "index.html"]
    assert [m["content"] for m in replay_messages(agent.transcript.records)] == [m.content for m in msgs]


def test_old_versions_include_reads_and_skip_the_latest():
    from engine.sessions import Message

    def msg(i, role, content="", **kw):
        fields = {"reasoning": None, "tool_calls": None, "tool_call_id": None, "name": None, "token_ids": [],
                  "token_count": 0, "context_start": 0, "profile": "", "updated": 0.0, "meta": {}, **kw}
        return Message(id=i, session_id="s", index=i, role=role, content=content, created=0.0, **fields)

    body = "x" * 300
    call = {"id": "c1", "type": "function", "function": {"name": "write_file",
                                                          "arguments": {"path": "a.js", "content": body}}}
    messages = [
        msg(0, "assistant", "a.js", tool_calls=[call], meta={"raw_text": f"a.js\n```js\n{body}```"}),
        msg(1, "tool", "Created a.js", tool_call_id="c1", name="write_file", meta={"ok": True, "path": "a.js"}),
        msg(2, "tool", "a.js:\n" + body, tool_call_id="c2", name="read_file", meta={"ok": True, "path": "a.js"}),
        msg(3, "tool", "b.js:\n" + body, tool_call_id="c3", name="read_file", meta={"ok": True, "path": "b.js"}),
    ]
    versions = compaction.old_versions(messages)
    assert [(v.index, v.path) for v in versions] == [(0, "a.js")]
    assert compaction.drop_version(messages[0], versions[0]) == f"a.js\n```js\n{compaction.reference('a.js')}```"


def test_a_real_engine_reuses_the_prefix_after_an_old_version_is_dropped(tmp_path, tiny_llama_dir):
    """On the real engine (a tiny random model, its own KV checkpoints): the request after a
    compaction that dropped an older file version is served from the cache up to the first
    changed message."""
    from engine.runtime import Engine, GenerationRequest

    from tests.tiny_models import write_profile

    profile = write_profile(tmp_path / "tiny-agent.yaml", tiny_llama_dir, context={"max_context": 4096},
                            sampling={"max_tokens": 4})
    engine = Engine.load(str(profile))
    try:
        store = SessionStore(tmp_path / "s.db")
        ws = tmp_path / "ws"
        ws.mkdir()
        agent = AgentSession.create(engine, store, ws, options=AgentOptions(system_prompt="t", examples=False))
        sid, tok = agent.session_id, engine.tokenizer
        agent.context.append([{"role": "user", "content": "write index.html"}], generation_prompt=True, metas=[{}])
        for n in range(2):
            content = "".join(f"<p>version {n} line {i}</p>\n" for i in range(12))
            raw = f"index.html\n```html\n{content}```"
            call = {"id": f"c{n}", "type": "function",
                    "function": {"name": "write_file", "arguments": {"path": "index.html", "content": content}}}
            store.add_message(sid, "assistant", "", tool_calls=[call], token_ids=tok.encode(raw) + [min(tok.eos_ids)],
                              meta={"raw_text": raw, "step": n + 1})
            agent.context.append([{"role": "tool", "content": "Wrote index.html.", "tool_call_id": f"c{n}",
                            "name": "write_file"}], generation_prompt=True,
                          metas=[{"ok": True, "path": "index.html", "step": n + 1}])

        def ask() -> tuple[int, int]:
            prompt = store.context_tokens(sid)
            done = engine.submit(GenerationRequest(prompt, engine.sampling(max_tokens=4), session_id=sid)).result()
            assert done.error is None, done.error
            return done.usage.prompt_tokens, done.usage.cached_tokens

        ask()  # the engine checkpoints this context
        event = agent.context.compact(3, 1, 100_000)
        assert event is not None
        msgs = store.messages(sid)
        first = event.messages[0]
        assert compaction.reference("index.html") in msgs[first].meta["raw_text"]
        prefix = sum(m.token_count for m in msgs[:first])
        prompt_tokens, cached = ask()
        assert prefix <= cached < prompt_tokens
    finally:
        engine.close()


def test_task_plan_key_and_resume_flag_are_checked(tmp_path):
    from agents.taskfile import TaskError

    bad = tmp_path / "bad.yaml"
    bad.write_text('prompt: "x"\nplan: yes please\n')
    with pytest.raises(TaskError, match="plan: expected true or false"):
        load_task(bad)
    good = tmp_path / "good.yaml"
    good.write_text('prompt: "x"\nplan: true\n')
    assert load_task(good).plan is True
    from pathlib import Path

    # the Kanban task is planned by default: its prompt names three new files (and a URL, no file)
    kanban = load_task(Path(__file__).resolve().parents[1] / "assets" / "tasks" / "kanban-app.yaml")
    assert kanban.plan is None
    assert [i.path for i in plan_from_task(kanban.prompt, lambda p: False).items] == ["index.html", "app.js",
                                                                                       "style.css"]
