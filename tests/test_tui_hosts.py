"""The main screen's mixins and their hosts (``app.tui.hosts``): the screen provides every member a
protocol lists, and each mixin uses nothing of its host that its protocol does not list."""

from __future__ import annotations

import ast
import inspect

import pytest
from textual.screen import Screen

from app.tui.agent_mode import AgentActions
from app.tui.dictation import DictationActions
from app.tui.hosts import HOSTS, AgentHost, ChatHost, DictationHost, members
from app.tui.screens.chat_actions import ChatActions
from app.tui.screens.main import MainScreen

MIXINS = [(ChatActions, ChatHost), (AgentActions, AgentHost), (DictationActions, DictationHost)]


def _used_and_own(cls) -> tuple[set[str], set[str]]:
    """(names the class's methods read as ``self.X``, names it defines or assigns itself)."""
    tree = ast.parse(inspect.getsource(cls))
    used, own = set(), set(vars(cls))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            (own if isinstance(node.ctx, ast.Store) else used).add(node.attr)
    return used, own


@pytest.mark.parametrize("mixin, host", MIXINS, ids=lambda x: x.__name__)
def test_the_main_screen_provides_what_each_mixin_needs(mixin, host):
    assert HOSTS[mixin.__name__] is host
    assert issubclass(MainScreen, mixin)
    missing = [name for name in members(host) if not hasattr(MainScreen, name)
               and name not in MainScreen.__init__.__code__.co_names]
    assert missing == []


@pytest.mark.parametrize("mixin, host", MIXINS, ids=lambda x: x.__name__)
def test_each_mixin_uses_only_what_its_host_declares(mixin, host):
    used, own = _used_and_own(mixin)
    textual = set(dir(Screen))
    undeclared = sorted(used - own - textual - set(members(host)))
    assert undeclared == [], f"{mixin.__name__} uses {undeclared} of its host: declare them in app.tui.hosts"
