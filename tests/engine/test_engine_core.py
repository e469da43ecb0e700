"""The engine core in its own process (kiln.engine): what the frontend gets back equals the
in-process engine's, aborts free blocks there, and a dead process fails every pending request at once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from kiln import LLM, SamplingParams
from kiln.config import CacheConfig, CompileConfig, EngineConfig, ModelConfig
from kiln.engine.core_client import EngineCoreClient
from kiln.engine.launch import EngineCoreProcess
from kiln.engine.messages import AddRequest, encoder, to_engine_decoder
from kiln.engine.streams import EngineDeadError, RequestStream, Sink
from kiln.outputs import RequestDelta, RequestOutput, SampleDelta
from kiln.runtime.worker import free_port
from tests.helpers.server import server_log, start_server_process
from kiln.sampling_params import StructuredOutputsParams

TINY = "random:tiny"
NUM_BLOCKS = 256
CONFIG = EngineConfig(model=ModelConfig(TINY), cache=CacheConfig(num_blocks=NUM_BLOCKS),
                      compile=CompileConfig(mode="eager"))
PROMPTS = ["Once upon a time", "The capital of France is", [5, 6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def client():
    c = EngineCoreClient(CONFIG)
    c.wait_ready(timeout=300)
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY, cache={"num_blocks": NUM_BLOCKS}, compile={"mode": "eager"})


async def _finals(client, tag: str, params: SamplingParams) -> list[RequestOutput]:
    """One request at a time: random weights make near-ties that a different batch can flip."""
    finals = []
    for i, prompt in enumerate(PROMPTS):
        async for out in await client.add_request(f"{tag}-{i}", prompt, params):
            final = out
        finals.append(final)
    return finals


def _summary(out: RequestOutput) -> list:
    return [out.prompt_token_ids, [(c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs)
                                   for c in out.outputs]]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.0, n=2, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.0, stop=["e"], include_stop_str_in_output=True),
], ids=["greedy-logprobs", "seeded-n2", "stop-string"])
def test_outputs_equal_the_in_process_engine(client, llm, params):
    """The engine-core process sends deltas; merged, they are the outputs LLM.generate returns."""
    got = asyncio.run(_finals(client, f"eq{id(params)}", params))
    want = [llm.generate([p], params, use_tqdm=False)[0] for p in PROMPTS]
    assert [_summary(o) for o in got] == [_summary(o) for o in want]
    assert all(o.finished for o in got)


def test_the_launcher_imports_nothing_heavy():
    """`kiln serve` spawns the engine core before its own heavy imports: what it needs for that
    (the CLI, the launcher, the socket) must not pull in torch, or the two would not overlap."""
    code = ("import sys, kiln.entrypoints.cli, kiln.engine.launch, kiln.entrypoints.listen\n"
            "print(sorted(m for m in ('torch', 'transformers', 'fastapi', 'kiln.engine.core') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_an_engine_core_spawned_early_is_its_clients(llm):
    """A process spawned before its client (as `kiln serve` does) serves that client alike, and
    the client's shutdown stops it and removes its sockets."""
    core = EngineCoreProcess(CONFIG)
    client = EngineCoreClient(CONFIG, started=core)
    try:
        client.wait_ready(timeout=300)
        assert client.pid == core.process.pid
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        got = asyncio.run(_finals(client, "early", params))
        want = [llm.generate([p], params, use_tqdm=False)[0] for p in PROMPTS]
        assert [_summary(o) for o in got] == [_summary(o) for o in want]
    finally:
        client.shutdown()
    assert not core.process.is_alive() and core.process.exitcode == 0
    assert not os.path.exists(core.ipc_dir)


def test_a_server_that_fails_before_its_client_stops_the_engine_core_it_was_given():
    """run_server's own failures (here: the port is taken) stop an engine core spawned for it."""
    import dataclasses
    import socket

    from kiln.config import ServerConfig
    from kiln.entrypoints.openai import run_server

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        config = dataclasses.replace(CONFIG, server=ServerConfig(port=held.getsockname()[1]))
        core = EngineCoreProcess(config)
        with pytest.raises(ValueError, match="cannot listen"):
            run_server(config, engine_core=core)
    assert not core.process.is_alive()
    assert not os.path.exists(core.ipc_dir)


def test_a_lagging_stream_loses_nothing():
    """Deltas waiting in a stream's queue are merged, none dropped, however far the reader is behind."""

    async def run() -> RequestOutput:
        sink = Sink(asyncio.get_running_loop(), prompt="p", prompt_token_ids=[1])
        for k, (text, ids, done) in enumerate([("a", [1], False), ("b", [2], False), ("c", [3, 4], True)]):
            delta = RequestDelta("r", [SampleDelta(0, text, ids, "length" if done else None,
                                                   logprobs=[{i: -1.0} for i in ids])], done)
            sink.queue.put_nowait(delta)
        stream = RequestStream(lambda _: None, "r", sink, deltas=True)
        return await stream.__anext__()

    out = asyncio.run(run())
    c = out.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason, len(c.logprobs)) == ("abc", [1, 2, 3, 4], "length", 4)
    assert out.finished and out.prompt_token_ids == [1]


def test_messages_round_trip():
    params = SamplingParams(max_tokens=5, stop="x", logit_bias={3: 1.5}, seed=-3,
                            structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    message = AddRequest("r", "hi", [1, 2], params, priority=2, pooling=None)
    assert to_engine_decoder().decode(encoder().encode(message)) == message


def test_abort_frees_blocks_and_ids_are_checked(client):
    async def run() -> None:
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        stream = await client.add_request("held", "hello", params)
        await stream.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await client.add_request("held", "hello", params)
        stream.close()

    asyncio.run(run())
    deadline = time.monotonic() + 10
    while client.stats()["num_free_blocks"] != NUM_BLOCKS - 1 or client.stats()["num_running"]:
        assert time.monotonic() < deadline, client.stats()
        time.sleep(0.02)
    assert client.stats()["num_queued_seqs"] == 0


def test_a_bad_model_is_its_value_error():
    bad = EngineCoreClient(EngineConfig(model=ModelConfig("random:nope")))
    try:
        with pytest.raises(ValueError, match="random:"):
            bad.wait_ready(timeout=120)
    finally:
        bad.shutdown()


def test_a_dead_engine_fails_every_pending_request_at_once():
    died = []
    c = EngineCoreClient(CONFIG, on_dead=lambda: died.append(time.monotonic()))
    c.wait_ready(timeout=300)

    async def run() -> float:
        streams = [await c.add_request(f"d{i}", "hello", SamplingParams(max_tokens=2000, ignore_eos=True))
                   for i in range(3)]
        await streams[0].__anext__()
        os.kill(c.pid, signal.SIGKILL)
        t0 = time.monotonic()
        for s in streams:
            with pytest.raises(EngineDeadError):
                async for _ in s:
                    pass
        return time.monotonic() - t0

    try:
        assert asyncio.run(run()) < 5
        assert not c.is_healthy()
        deadline = time.monotonic() + 5  # on_dead runs on the reader thread, after the streams fail
        while not died:
            assert time.monotonic() < deadline, "on_dead was not called"
            time.sleep(0.01)
        with pytest.raises(EngineDeadError):
            asyncio.run(c.add_request("late", "hello", SamplingParams(max_tokens=2)))
    finally:
        c.shutdown()


_DROPPED_CLIENTS = textwrap.dedent("""
    import gc, os, signal, time
    from kiln.config import CacheConfig, CompileConfig, EngineConfig, ModelConfig
    from kiln.engine.core_client import EngineCoreClient

    config = EngineConfig(model=ModelConfig("random:tiny"), cache=CacheConfig(num_blocks=64),
                          compile=CompileConfig(mode="eager"))
    kept, dropped = EngineCoreClient(config), EngineCoreClient(config)
    kept.wait_ready(timeout=300)
    dropped.wait_ready(timeout=300)
    os.kill(dropped.pid, signal.SIGKILL)
    while dropped.is_healthy():
        time.sleep(0.05)
    dropped.cycle = dropped  # collected by gc, its sockets with it
    del dropped
    gc.collect()
    print("collected", flush=True)
    # kept is never shut down: the script must still exit
""")


def test_clients_never_shut_down_are_collected_and_the_script_exits():
    """A client dropped without shutdown (its engine dead) is garbage collected without waiting on
    its sockets, and a script that never calls shutdown() exits, its engine core with it."""
    done = subprocess.run([sys.executable, "-c", _DROPPED_CLIENTS], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["collected"]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers signals; its state says it has exited
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1].startswith("Z")


def test_the_engine_core_leaves_with_its_frontend(tmp_path):
    """A killed frontend leaves no engine process holding memory or the device."""
    script = textwrap.dedent(f"""
        import os, signal
        from kiln.config import CacheConfig, CompileConfig, EngineConfig, ModelConfig
        from kiln.engine.core_client import EngineCoreClient
        if __name__ == "__main__":
            c = EngineCoreClient(EngineConfig(model=ModelConfig({TINY!r}), cache=CacheConfig(num_blocks=64),
                                              compile=CompileConfig(mode="eager")))
            c.wait_ready(timeout=300)
            print(c.pid, c.ipc_dir, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    path = tmp_path / "frontend.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    pid = int(proc.stdout.split()[0])
    socket_dir = proc.stdout.split()[1]
    deadline = time.monotonic() + 15
    while not _gone(pid):
        assert time.monotonic() < deadline, "the engine core outlived its frontend"
        time.sleep(0.1)
    assert not os.path.exists(socket_dir)  # nor its sockets


def _engine_core_pid(server_pid: int) -> int:
    with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
        for pid in map(int, f.read().split()):
            with open(f"/proc/{pid}/cmdline", "rb") as c:
                cmdline = c.read()
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                return pid
    raise AssertionError("the server has no engine-core process")


def test_the_server_exits_non_zero_when_its_engine_dies():
    proc = _start_server(free_port())
    try:
        os.kill(_engine_core_pid(proc.pid), signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
        assert "the engine core died" in server_log(proc)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_frontends_sharing_an_engine_core_get_their_own_outputs():
    """Two attached clients (server.api_server_count=2): each hears only its requests; one detaching
    frees its requests' blocks while the other keeps serving; the engine core leaves after the last."""
    shared = EngineCoreProcess(CONFIG, 2)
    clients = [EngineCoreClient(CONFIG, shared=shared.address(i)) for i in range(2)]
    try:
        for c in clients:
            c.wait_ready(timeout=300)
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

        async def both() -> list[list[RequestOutput]]:
            return list(await asyncio.gather(*(_finals(c, f"s{i}", params) for i, c in enumerate(clients))))

        got = asyncio.run(both())
        want = asyncio.run(_finals(clients[0], "alone", params))
        assert [[_summary(o) for o in g] for g in got] == [[_summary(o) for o in want]] * 2

        async def hold() -> None:
            stream = await clients[0].add_request("held", "hello", SamplingParams(max_tokens=900, ignore_eos=True))
            await stream.__anext__()

        asyncio.run(hold())
        clients[0].shutdown()  # detaches with "held" unfinished
        deadline = time.monotonic() + 10
        while clients[1].stats().get("num_free_blocks") != NUM_BLOCKS - 1 or clients[1].stats()["num_running"]:
            assert time.monotonic() < deadline, clients[1].stats()
            time.sleep(0.02)
        assert shared.process.is_alive() and clients[1].is_healthy()
        assert [_summary(o) for o in asyncio.run(_finals(clients[1], "after", params))] == [_summary(o) for o in want]
        clients[1].shutdown()
        shared.process.join(30)
        assert shared.process.exitcode == 0
    finally:
        for c in clients:
            c.shutdown()
        shared.stop()


def _start_server(port: int, **server) -> subprocess.Popen:
    return start_server_process(port, TINY, 64, **server)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _frontend_pids(server_pid: int) -> list[int]:
    """The server's frontend processes: its spawned children that hold the listening socket's port."""
    engine = _engine_core_pid(server_pid)
    pids = []
    for pid in _children(server_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as c:
            if pid != engine and b"spawn_main" in c.read():
                pids.append(pid)
    return pids


def _established(pid: int, port: int) -> int:
    """TCP connections to ``port`` that process ``pid`` holds open."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01" and fields[9] in inodes:
                    count += 1
    return count


def test_two_frontends_serve_one_engine_core_and_add_up_their_metrics():
    """server.api_server_count=2: two frontend processes accept on the one port in front of one
    engine core, answer alike, /metrics sums both, and SIGTERM stops everything with status 0."""
    port = free_port()
    proc = _start_server(port, api_server_count=2)
    url = f"http://127.0.0.1:{port}"
    clients: list[httpx.Client] = []
    try:
        frontends = _frontend_pids(proc.pid)
        assert len(frontends) == 2
        # Keep connections open until each frontend holds one; ask every connection the same thing.
        while not all(_established(pid, port) for pid in frontends):
            assert len(clients) < 200, "one frontend never accepted a connection"
            clients.append(httpx.Client(base_url=url, timeout=60))
            clients[-1].get("/health")
        body = {"model": TINY, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        answers = [c.post("/v1/completions", json=body).json() for c in clients]
        assert {a["choices"][0]["text"] for a in answers} == {answers[0]["choices"][0]["text"]}
        tokens = sum(a["usage"]["completion_tokens"] for a in answers)
        for c in clients:  # every frontend's scrape shows the sum over both
            metrics = c.get("/metrics").text
            assert f"kiln_generation_tokens_total {float(tokens)}" in metrics
        engine = _engine_core_pid(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, server_log(proc)[-3000:]
        for pid in [engine, *frontends]:
            assert _gone(pid)
    finally:
        for c in clients:
            c.close()
        if proc.poll() is None:
            proc.kill()


def test_a_dead_frontend_stops_the_whole_server():
    port = free_port()
    proc = _start_server(port, api_server_count=2)
    try:
        engine = _engine_core_pid(proc.pid)
        frontends = _frontend_pids(proc.pid)
        os.kill(frontends[1], signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        assert "stopping the server" in server_log(proc)
        deadline = time.monotonic() + 15
        while not (_gone(engine) and _gone(frontends[0])):
            assert time.monotonic() < deadline, "a process outlived the server"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
