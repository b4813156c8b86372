"""Agent sessions: tool-call protocol, constrained decoding, the agent loop, headless runs.

The entry point is ``agents.session.AgentSession`` (events in ``agents.events``); see
docs/agents.md. ``agents.scripted.ScriptedEngine`` stands in for the engine in tests.
"""
