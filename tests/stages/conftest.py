"""Fixtures the stage tests share."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.channel import Channel
from pipeline.contracts.messages import Group


@pytest.fixture
def scored(monkeypatch: pytest.MonkeyPatch) -> dict[str, Group]:
    """Every scored group sent to the train stage, by group id: what a trainer's groups came from."""
    sent: dict[str, Group] = {}
    original_send = Channel.send

    async def spy(self: Channel[Any], item: Any) -> None:
        if self.name == "scored" and isinstance(item, Group):
            sent[item.group_id] = item
        await original_send(self, item)

    monkeypatch.setattr(Channel, "send", spy)
    return sent
