"""``mlxterm generate``: one generation from the command line (streamed text or one JSON object)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate a reply (or a raw completion) once")
    p.add_argument("--profile", help="profile name or path (default: smollm2-135m)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user message (or raw text with --raw)")
    src.add_argument("--messages", type=Path, help="JSON file: a list of {role, content} messages")
    p.add_argument("--system", help="system prompt (overrides the profile's)")
    p.add_argument("--raw", action="store_true", help="completion mode: no chat template")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--min-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="go on past end-of-sequence tokens to --max-tokens (fixed lengths for timing)",
    )
    p.add_argument("--logprobs", type=int, default=0, help="return the top-N logprobs per token")
    p.add_argument("--session", metavar="ID", help="continue (or create) this saved session")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.set_defaults(func=run)


def _messages(args) -> list[dict]:
    from engine.errors import MlxtermError

    if args.messages is None:
        return [{"role": "user", "content": args.prompt}]
    try:
        data = json.loads(args.messages.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise MlxtermError(f"{args.messages}: cannot read messages ({e})") from None
    if not isinstance(data, list) or not all(isinstance(m, dict) and "role" in m for m in data):
        raise MlxtermError(f"{args.messages}: expected a JSON list of {{role, content}} objects")
    return data


def run(args) -> int:
    from engine.profiles import DEFAULT_PROFILE, load_profile
    from engine.runtime import Engine, GenerationRequest

    profile = load_profile(args.profile or DEFAULT_PROFILE)
    if profile.model.remote is not None:
        return _run_remote(args, profile)
    engine = Engine.load(profile)
    try:
        overrides = dict(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            stop=tuple(args.stop) if args.stop else None,
            logprobs=args.logprobs or None,
            ignore_eos=args.ignore_eos or None,
        )
        if args.session:
            turn = _session_turn(engine, args, overrides)
        else:
            turn = engine.submit(
                GenerationRequest(
                    _prompt_ids(engine, args),
                    engine.sampling(**overrides),
                    split_reasoning=engine.profile.chat.reasoning,
                )
            )
        try:
            done = _stream(turn, args.json)
        except KeyboardInterrupt:
            turn.cancel()
            done = turn.result()
        out = None
        if args.json:
            out = _result_json(engine, done)
            if args.session:
                out["session"] = turn.session_id
        return _finish(done, out)
    finally:
        engine.close()


def _run_remote(args, profile) -> int:
    """A remote profile: the turn runs on its OpenAI-compatible server (engine.serving.remote)."""
    from engine.errors import MlxtermError
    from engine.serving.remote_engine import RemoteEngine

    if args.raw or args.logprobs:
        raise MlxtermError(f"profile {profile.name} is remote: --raw and --logprobs need a local model")
    chat = RemoteEngine.load(profile)
    overrides = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                     seed=args.seed, stop=tuple(args.stop) if args.stop else None)
    with chat:
        if args.session:  # a stored chat: messages only, marked remote (engine.sessions.remote_chat)
            turn = _session_turn(chat, args, overrides)
        else:
            messages = _messages(args)
            if args.system is not None:
                messages = [m for m in messages if m.get("role") != "system"]
                messages.insert(0, {"role": "system", "content": args.system})
            turn = chat.submit_messages(messages, chat.sampling(**overrides))
        try:
            done = _stream(turn, args.json)
        except KeyboardInterrupt:
            turn.cancel()  # hangs up the stream: the server stops generating too
            done = turn.result()
    out = None
    if args.json:
        out = {"text": done.text, "reasoning": done.reasoning, "finish_reason": done.finish_reason,
               "usage": {"prompt_tokens": done.usage.prompt_tokens, "cached_tokens": done.usage.cached_tokens,
                         "completion_tokens": done.usage.completion_tokens},
               "timings": {"ttft_ms": done.timings.ttft_ms, "decode_tps": done.timings.decode_tps,
                           "total_ms": done.timings.total_ms},
               "profile": profile.name, "model": chat.model_name, "remote": profile.model.remote.base_url}
        if args.session:
            out["session"] = turn.session_id
        if done.error:
            out["error"] = done.error
    return _finish(done, out)


def _stream(events, quiet: bool):
    """Print a turn's text (stdout) and reasoning (stderr) as it streams, unless ``quiet``
    (``--json``); returns its ``Done``."""
    from engine.serving.events import Done, ReasoningDelta, TextDelta

    done = None
    for ev in events:
        if isinstance(ev, Done):
            done = ev
        elif not quiet and isinstance(ev, TextDelta):
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        elif not quiet and isinstance(ev, ReasoningDelta):
            sys.stderr.write(ev.text)
    assert done is not None
    return done


def _finish(done, out: dict | None) -> int:
    """The JSON result (``out``) or the streamed text's newline; exit code 1 on an error."""
    if out is not None:
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    if done.error:
        print(f"mlxterm: {done.error}", file=sys.stderr)
        return 1
    return 0


def _prompt_ids(engine, args) -> list[int]:
    if args.raw:
        text = args.prompt if args.prompt is not None else _raw_from_messages(_messages(args))
        return engine.raw_prompt(text)
    messages = _messages(args)
    if args.system is not None:
        messages = [m for m in messages if m.get("role") != "system"]
        messages.insert(0, {"role": "system", "content": args.system})
    return engine.chat_prompt(messages)


def _session_turn(engine, args, overrides):
    from engine.errors import MlxtermError
    from engine.sessions import SessionNotFound, SessionStore
    from engine.sessions.chat import ChatService
    from engine.sessions.remote_chat import RemoteChatService

    if args.prompt is None:
        raise MlxtermError("--session takes the new message with --prompt")
    store = SessionStore()
    try:
        session = store.get(args.session)
    except SessionNotFound:
        session = store.create(profile=engine.profile.name, session_id=args.session)
    chat = (RemoteChatService if getattr(engine, "remote", False) else ChatService)(engine, store)
    if args.system is not None and session.message_count == 0:
        chat.set_system(session.id, args.system)
    return chat.send(session.id, args.prompt, **overrides)


def _raw_from_messages(messages: list[dict]) -> str:
    return "".join(str(m.get("content", "")) for m in messages)


def _result_json(engine, done) -> dict:
    out = {
        "text": done.text,
        "reasoning": done.reasoning,
        "finish_reason": done.finish_reason,
        "usage": {
            "prompt_tokens": done.usage.prompt_tokens,
            "cached_tokens": done.usage.cached_tokens,
            "completion_tokens": done.usage.completion_tokens,
        },
        "timings": {
            "load_ms": done.timings.load_ms,
            "ttft_ms": done.timings.ttft_ms,
            "prefill_tps": done.timings.prefill_tps,
            "decode_tps": done.timings.decode_tps,
            "total_ms": done.timings.total_ms,
        },
        "peak_memory_bytes": done.peak_memory_bytes,
        "profile": engine.profile.name,
        "model": engine.model_name,
        "weight_format": engine.weight_format,
    }
    out["cache"] = {"source": done.cache_source, "restore_ms": done.timings.restore_ms}
    out["batch"] = {"lane": done.lane, "size_min": done.batch_min, "size_mean": done.batch_mean,
                    "size_max": done.batch_max}
    if done.logprobs:
        out["logprobs"] = [
            {"token": lp.token, "logprob": lp.logprob, "top": lp.top} for lp in done.logprobs
        ]
    if done.speculation is not None:
        out["speculation"] = done.speculation
    if done.error:
        out["error"] = done.error
    return out
