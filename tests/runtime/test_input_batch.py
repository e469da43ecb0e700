"""``InputBatch``: the one layout of a scheduled step, on every device.

Every step of a real workload (prefills of mixed lengths, chunked prefill beside decodes, a
prefix-cache hit, requests finishing and leaving their rows) is laid out by the engine's
``InputBatch`` and, independently, from scratch by ``_reference_layout`` (fresh tensors built from
the Python lists, as a step was once prepared on the CPU); both must agree on every token id,
position, slot, query start, context length, block-table entry a kernel reads, and sample row.
"""

from __future__ import annotations

import torch

from kiln import LLM, SamplingParams
from kiln.compiler.inputs import InputBuffers, InputLimits
from kiln.runtime.input_batch import InputBatch
from kiln.runtime.scheduler_output import SchedulerOutput


def _reference_layout(sched: SchedulerOutput, block_size: int) -> dict:
    ids, pos, slots, qsl, seq_lens, rows, tables = [], [], [], [0], [], [], []
    for s in sched.scheduled:
        start, n = s.start, s.num_new_tokens
        ids += s.request.token_ids_slice(start, start + n)
        pos += range(start, start + n)
        slots += [s.block_ids[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
        tables.append(list(s.block_ids[: -(-(start + n) // block_size)]))  # the blocks attention reads
        if s.samples:
            rows.append(len(ids) - 1)
    return dict(ids=ids, pos=pos, slots=slots, qsl=qsl, seq_lens=seq_lens, rows=rows, tables=tables)


def _laid_out(batch: InputBatch, sched: SchedulerOutput) -> dict:
    inputs, rows = batch.prepare(sched)
    buf, n, r = batch.buffers, inputs.num_tokens, inputs.num_reqs
    tables = [buf.table_np[i, : -(-inputs.seq_lens[i] // batch.block_size)].tolist() for i in range(r)]
    assert inputs.query_lens == [s.num_new_tokens for s in sched.scheduled]
    assert inputs.num_decodes == next((i for i, q in enumerate(inputs.query_lens) if q != 1), r)
    return dict(ids=buf.ids_np[:n].tolist(), pos=buf.pos_np[:n].tolist(), slots=buf.slot_np[:n].tolist(),
                qsl=buf.qsl_np[: r + 1].tolist(), seq_lens=buf.seq_lens_np[:r].tolist(), rows=rows, tables=tables)


def test_input_batch_matches_a_from_scratch_layout(kiln_cache_dir):
    llm = LLM(model="random:tiny", dtype="float32", device="cpu", max_model_len=512,
              cache={"dir": kiln_cache_dir, "block_size": 4, "num_blocks": 256},
              scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 24})
    runner = llm.engine.executor.runner
    # A second InputBatch over buffers of its own, fed the same steps, filled with stale garbage first.
    limits = InputLimits(24, 8, -(-runner.max_model_len // 4))
    mine = InputBatch(InputBuffers(limits, torch.device("cpu")), block_size=4)
    for arr in (mine.buffers.ids_np, mine.buffers.pos_np, mine.buffers.slot_np, mine.buffers.table_np):
        arr.fill(987)
    steps = []
    prepare = runner.input_batch.prepare

    def spy(sched, *args):
        steps.append((_reference_layout(sched, 4), _laid_out(mine, sched)))
        return prepare(sched, *args)

    runner.input_batch.prepare = spy
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(100, 1000, (12,), generator=gen).tolist()
    prompts = [torch.randint(100, 1000, (n,), generator=gen).tolist() for n in (3, 30, 9)] + [shared + [5, 6, 7]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm.generate([shared + [1, 2]], params, use_tqdm=False)  # leaves shared's blocks in the prefix cache
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert any(len(ref["qsl"]) > 2 and ref["qsl"][1] == 1 and ref["qsl"][-1] > len(ref["qsl"]) for ref, _ in steps)
    for ref, got in steps:
        assert got == ref
