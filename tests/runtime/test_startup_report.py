"""What start-up tells the user: the start line, the ready line, progress bars only on a terminal,
and KV numbers that agree between the log and /metrics."""

from __future__ import annotations

import io
import logging
import re
import socket
import threading
import time

import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kiln import LLM
from kiln.clock import process_age_s
from kiln.compiler.piece import PieceCompiler
from kiln.entrypoints.openai.api_server import _DrainingServer, api_url
from kiln.entrypoints.openai.metrics import ServerMetrics
from kiln.passes.manager import PassManager
from kiln.progress import progress_bar
from kiln.runtime.engine import StartupReport

NUM_BLOCKS = 64
BLOCK_SIZE = 16
NUM_USABLE = NUM_BLOCKS - 1  # block 0 is the pool's null block


@pytest.fixture(scope="module")
def started():
    """An LLM on random:tiny and the kiln log records of its construction."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    kiln_logger = logging.getLogger("kiln")
    old_level = kiln_logger.level
    kiln_logger.addHandler(handler)
    kiln_logger.setLevel(logging.INFO)
    try:
        llm = LLM("random:tiny", device="cpu", cache={"num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE})
    finally:
        kiln_logger.removeHandler(handler)
        kiln_logger.setLevel(old_level)
    return llm, [r.getMessage() for r in records]


def test_start_line_names_model_dtype_device_and_compile_modes(started):
    _, lines = started
    # compile and scheduler defaults are `auto`: the line shows what they resolved to on this device
    assert lines[0] == ("kiln: model random:tiny, float32 on cpu, compile.mode=eager, compile.cudagraph=none, "
                        "max_num_seqs=128, max_num_batched_tokens=2048")
    assert llm_config(started).compile.mode == "eager" and llm_config(started).scheduler.max_num_seqs == 128


def llm_config(started):
    return started[0].engine.config


def test_ready_line_counts_usable_blocks(started):
    llm, lines = started
    ready = [line for line in lines if line.startswith("kiln: ready")]
    assert len(ready) == 1 and lines[-1] == ready[0]
    pattern = (rf"kiln: ready — KV cache {NUM_USABLE * BLOCK_SIZE} tokens \({NUM_USABLE} blocks of {BLOCK_SIZE}\), "
               r"\d+\.\d s from launch \(interpreter \d+\.\d s, imports and config \d+\.\d s[^()]*\)$")
    assert re.match(pattern, ready[0]), ready[0]
    report = llm.engine.startup
    # Every second from the process's launch is in one phase: they add up to its age when ready.
    assert report.since_launch_s == pytest.approx(sum(s for _, s in report.timeline))
    assert [name for name, _ in report.timeline[:3]] == ["interpreter", "imports and config", "load weights"]
    assert all(s >= 0 for _, s in report.timeline) and report.timeline[-1][0] == "other"
    assert report.since_launch_s <= process_age_s() + 0.01  # the process's age counts in 10 ms ticks
    assert report.timeline[-1][1] <= report.startup_s
    assert report.num_usable_blocks == NUM_USABLE == llm.engine.kv_manager.num_usable_blocks
    assert report.num_kv_tokens == NUM_USABLE * BLOCK_SIZE
    kv = [line for line in lines if line.startswith("KV cache:")]
    assert kv and kv[0].startswith(f"KV cache: {NUM_USABLE} usable blocks of {BLOCK_SIZE} tokens "
                                   f"({NUM_USABLE * BLOCK_SIZE} tokens of context; 1 more block is reserved)")


def test_kv_numbers_in_log_and_metrics_agree(started):
    llm, _ = started
    text = ServerMetrics(llm.engine.stats, lambda: True).render().decode()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["kiln_kv_blocks_total"] == llm.engine.startup.num_usable_blocks == NUM_USABLE
    assert values["kiln_kv_blocks_in_use"] == 0


def test_ready_line_format():
    phases = {"load_weights_s": 3.0, "load_call_s": 0.64, "weights_wait_s": 0.4, "dynamo_s": 2.0, "inductor_s": 5.0, "cache_load_s": 0.0, "cudagraph_s": 0.5,
              "kv_alloc_s": 0.26, "ready_s": 9.0}
    report = StartupReport.measured(1455, 16, 9.04, phases, False, age_at_import=0.3, age_at_engine=2.5)
    assert report.ready_line("http://127.0.0.1:8000/v1") == (
        "kiln: ready at http://127.0.0.1:8000/v1 — KV cache 23280 tokens (1455 blocks of 16), 11.5 s from launch "
        "(interpreter 0.3 s, imports and config 2.2 s, load weights 1.0 s, Dynamo 2.0 s, Inductor 5.0 s, "
        "CUDA graphs 0.5 s, KV cache 0.3 s, other 0.2 s)")
    assert report.since_launch_s == pytest.approx(2.5 + 9.04)
    # Ranks in other processes: what the engine measured itself, as one phase.
    elsewhere = StartupReport.measured(1455, 16, 12.0, {}, True, age_at_import=0.3, age_at_engine=2.5)
    assert elsewhere.ready_line() == (
        "kiln: ready — KV cache 23280 tokens (1455 blocks of 16), 14.5 s from launch (interpreter 0.3 s, "
        "imports and config 2.2 s, engine 12.0 s); kiln's forward is built in the background")
    # The server's frontend: its own start, the engine core's phases, the hand-over.
    seen = report.seen_from(age_at_spawn=1.5, age_now=13.4)
    assert [name for name, _ in seen.timeline][:3] == ["frontend start", "engine core: interpreter",
                                                       "engine core: imports and config"]
    assert seen.timeline[-1] == ("hand-over", pytest.approx(13.4 - 1.5 - 11.54))
    assert seen.since_launch_s == pytest.approx(13.4)


def test_api_url():
    assert api_url("127.0.0.1", 8000) == "http://127.0.0.1:8000/v1"
    assert api_url("::1", 8001) == "http://[::1]:8001/v1"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_is_quiet_off_a_terminal(monkeypatch):
    pipe = io.StringIO()
    monkeypatch.setattr("sys.stderr", pipe)
    bar = progress_bar(range(3), desc="loading", unit="tensor")
    assert bar.disable and list(bar) == [0, 1, 2]
    bar.close()
    assert pipe.getvalue() == ""

    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    bar = progress_bar(range(3), desc="loading", total=3, unit="tensor")
    assert not bar.disable and list(bar) == [0, 1, 2]
    bar.close()
    assert "loading" in terminal.getvalue() and "3/3" in terminal.getvalue()


def test_compile_bar_counts_inductor_builds(monkeypatch):
    """One tick per build; the total arrives with the static builds (none here: the bar ends full)."""
    monkeypatch.setattr("torch._inductor.standalone_compile", lambda gm, args, **kw: gm)  # imported per build
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    compiler = PieceCompiler(PassManager([]), {})
    with compiler.progress():
        bar = compiler._bar
        assert not bar.disable
        for key in ("a1", "b2"):
            compiler._build(key, "dynamic", None, [], "from_tracing_context")
        assert bar.n == 2 and bar.total is None
        compiler.compile_sizes(set())
        assert bar.total == 2
    assert compiler._bar is None
    assert "0 built [" in terminal.getvalue() and "2/2" in terminal.getvalue()  # no total, then one


class _IdleEngine:
    def shutdown(self) -> None:
        pass


async def _no_app(scope, receive, send) -> None:
    raise AssertionError("no request is made")


def test_server_logs_ready_line_once_listening(caplog):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(_no_app, lifespan="off", log_level="warning")
    server = _DrainingServer(config, _IdleEngine(), drain_s=0.0, ready_line="kiln: ready at URL")
    with caplog.at_level(logging.INFO, logger="kiln"):
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        server.should_exit = True
        thread.join(30)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("kiln")] == ["kiln: ready at URL"]
