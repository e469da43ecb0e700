"""The engine the reasoning, Responses and tool-call files share: one engine-core process per test
worker (an engine start is seconds on two cores) and the apps the files serve over it."""

import pytest

from kiln.config import ServerConfig
from kiln.entrypoints.openai import build_app
from tests.helpers.chat_models import QWEN3_TEMPLATE, tiny_chat_checkpoint
from tests.helpers.server import ServerThread, engine_core


@pytest.fixture(scope="session")
def qwen3_chat_server(tmp_path_factory):
    """(checkpoint path, engine core, ``server(**config)``) over a tiny random model with the
    Qwen3-style template and its ``<think>`` tokens: ``server`` gives the one ServerThread of
    ``ServerConfig(**config)`` over the engine. The servers stop when the session ends, since
    stopping one shuts its engine down. The files only send requests whose text a regex forces;
    none reads the engine's counters or blocks, which the other files' requests also use."""
    path = tiny_chat_checkpoint(str(tmp_path_factory.mktemp("qwen3ish")), QWEN3_TEMPLATE, tokens=("<think>", "</think>"))
    started: dict[tuple, ServerThread] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("KILN_API_KEY", raising=False)  # no key unless a config names one
        engine = engine_core(path)

        def server(**config) -> ServerThread:
            key = tuple(sorted(config.items()))
            if key not in started:
                started[key] = ServerThread(build_app(engine, ServerConfig(**config)))
            return started[key]

        yield path, engine, server
    for s in started.values():
        s.stop()
    engine.shutdown()
