"""The main screen's controllers and their hosts (``app.tui.hosts``): the screen owns each
controller and passes itself as the host, it provides every member the host protocol lists,
and each controller uses nothing of its host that the protocol does not list."""

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

OWNED = [(ChatActions, ChatHost), (AgentActions, AgentHost), (DictationActions, DictationHost)]


def _host_uses(cls) -> set[str]:
    """The names the class's methods read as ``self.host.X``."""
    tree = ast.parse(inspect.getsource(cls))
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "host" and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "self"}


def _self_uses(cls) -> set[str]:
    """The names the class's methods read as ``self.X``."""
    tree = ast.parse(inspect.getsource(cls))
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "self"}


def _missing_on_screen(host) -> list[str]:
    return [name for name in members(host) if not hasattr(MainScreen, name)
            and name not in MainScreen.__init__.__code__.co_names]


@pytest.mark.parametrize("controller, host", OWNED, ids=lambda x: x.__name__)
def test_the_main_screen_owns_each_controller_as_its_host(controller, host):
    assert HOSTS[controller.__name__] is host
    assert not issubclass(MainScreen, controller)  # composition, not a mixin
    assert controller.__name__ in MainScreen.__init__.__code__.co_names
    assert inspect.signature(controller.__init__).parameters["host"].annotation == host.__name__
    assert _missing_on_screen(host) == []


@pytest.mark.parametrize("controller, host", OWNED, ids=lambda x: x.__name__)
def test_each_controller_uses_only_what_its_host_declares(controller, host):
    used = _host_uses(controller)
    assert used, f"{controller.__name__} never reaches its host through self.host"
    undeclared = sorted(used - set(dir(Screen)) - set(members(host)))
    assert undeclared == [], f"{controller.__name__} uses {undeclared} of its host: declare them in app.tui.hosts"
    # a widget controller could reach the screen around its protocol: only through ``host``
    assert not _self_uses(controller) & {"screen", "parent", "ancestors"}
