"""Where does the main thread spend a start-up? A sampling profiler that does not slow it down.

cProfile charges each Python call a fixed cost and misattributes time across C++ calls back into
Python (custom ops, Dynamo frames), so start-up profiles of many small calls mislead. This samples
the main thread's stack from a second thread every ``interval_s`` and counts, per function, the
samples it is on the stack (inclusive) and on top (self). Sampling needs the GIL, so time the main
thread spends holding it without yielding is seen late, never missed.

    sampler = StackSampler(); sampler.start(); ...; sampler.stop(); print(sampler.report())
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from typing import Optional


class StackSampler:
    def __init__(self, interval_s: float = 0.002, thread_id: Optional[int] = None) -> None:
        self.interval_s = interval_s
        self.thread_id = thread_id or threading.main_thread().ident
        self.inclusive: collections.Counter = collections.Counter()
        self.self_: collections.Counter = collections.Counter()
        self.num_samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self.seconds = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self._t0

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self.thread_id)
            if frame is None:
                continue
            self.num_samples += 1
            seen = set()
            top = True
            while frame is not None:
                code = frame.f_code
                key = f"{code.co_filename.rsplit('site-packages/', 1)[-1]}:{code.co_firstlineno}({code.co_name})"
                if top:
                    self.self_[key] += 1
                    top = False
                if key not in seen:
                    seen.add(key)
                    self.inclusive[key] += 1
                frame = frame.f_back

    def report(self, top: int = 60) -> str:
        """The ``top`` functions by inclusive share, then by self share, in seconds of the run."""
        scale = self.seconds / max(1, self.num_samples)
        lines = [f"{self.num_samples} samples over {self.seconds:.2f} s", "inclusive s  self s  function"]
        for key, n in self.inclusive.most_common(top):
            lines.append(f"{n * scale:10.2f} {self.self_[key] * scale:7.2f}  {key}")
        lines.append("-- by self time")
        for key, n in self.self_.most_common(top // 2):
            lines.append(f"{self.inclusive[key] * scale:10.2f} {n * scale:7.2f}  {key}")
        return "\n".join(lines)
