"""Where the GPU's time goes, step by step: a diagnostic for the multi-turn benchmark
(`multiturn_bench.py --step-timeline`).

The TTFT phases (kvserve/sched/phases.py) are host times: with overlapped scheduling a step's span
on the host is not its span on the GPU. This records, for every step the engine runs, CUDA events on
the compute stream around its block copies and its forward, and reads them once the run is over
(no sync inside the run). Per step: how long the GPU spent on it, how long the compute stream sat
waiting for the step's inline loads, and how long the GPU was idle before it (waiting for the host).
On a CPU the step runs synchronously and host clocks stand in for the events.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional


class _HostMark:
    """A CPU stand-in for a CUDA event: the time it was recorded."""

    def __init__(self) -> None:
        self.at = time.perf_counter()

    def elapsed_ms(self, later: "_HostMark") -> float:
        return (later.at - self.at) * 1e3


class _CudaMark:
    def __init__(self) -> None:
        import torch
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record()

    def elapsed_ms(self, later: "_CudaMark") -> float:
        return self.event.elapsed_time(later.event)


@dataclass
class StepMarks:
    tokens: int
    prefills: int
    prefill_tokens: int
    decodes: int
    copy_blocks: int
    inline_copies: int
    inline_after_inflight: int      # inline loads that must wait for the step in flight (BlockCopy.after_inflight)
    before_copies: Any = None
    before_forward: Any = None
    after_forward: Any = None


@dataclass
class StepTimeline:
    """Installs itself around one engine's copy issue and forward launch (Engine._issue_block_copies,
    ModelRunner.launch / execute) for the run; `summary()` reads the events afterwards."""
    engine: Any
    steps: list[StepMarks] = field(default_factory=list)
    _pending_copies: Optional[tuple[Any, int, int, int]] = None

    def __post_init__(self) -> None:
        self._mark = _CudaMark if self.engine.device.type == "cuda" else _HostMark
        engine, runner = self.engine, self.engine.runner
        issue, launch, execute = engine._issue_block_copies, runner.launch, runner.execute

        def issue_copies(sched_out):
            blocks = sum(len(copy.src_block_ids) for copy in sched_out.block_copies)
            inline = sum(1 for copy in sched_out.block_copies if copy.inline)
            waits = sum(1 for copy in sched_out.block_copies if copy.inline and copy.after_inflight)
            self._pending_copies = (self._mark(), blocks, inline, waits)
            return issue(sched_out)

        def wrap(forward):
            def run(sched_out, *args, **kwargs):
                marks = self._begin(sched_out)
                result = forward(sched_out, *args, **kwargs)
                marks.after_forward = self._mark()
                return result
            return run

        engine._issue_block_copies = issue_copies
        runner.launch = wrap(launch)
        runner.execute = wrap(execute)

    def _begin(self, sched_out) -> StepMarks:
        prefills = [item for item in sched_out.scheduled if item.num_new_tokens > 1
                    or item.request.num_computed_tokens < item.request.num_prompt_tokens]
        copies, self._pending_copies = self._pending_copies, None
        marks = StepMarks(tokens=sched_out.num_batched_tokens, prefills=len(prefills),
                          prefill_tokens=sum(item.num_new_tokens for item in prefills),
                          decodes=len(sched_out.scheduled) - len(prefills),
                          copy_blocks=copies[1] if copies else 0, inline_copies=copies[2] if copies else 0,
                          inline_after_inflight=copies[3] if copies else 0,
                          before_copies=copies[0] if copies else None)
        marks.before_forward = self._mark()
        self.steps.append(marks)
        return marks

    def summary(self, keep_steps: int = 400) -> dict[str, Any]:
        if self.engine.device.type == "cuda":
            import torch
            torch.cuda.synchronize()
        rows = []
        previous_end = None
        for marks in self.steps:
            first = marks.before_copies or marks.before_forward
            rows.append({
                "tokens": marks.tokens, "prefills": marks.prefills, "prefill_tokens": marks.prefill_tokens,
                "decodes": marks.decodes, "copy_blocks": marks.copy_blocks, "inline_copies": marks.inline_copies,
                "inline_after_inflight": marks.inline_after_inflight,
                "gpu_ms": round(marks.before_forward.elapsed_ms(marks.after_forward), 3),
                "load_wait_ms": round(marks.before_copies.elapsed_ms(marks.before_forward), 3)
                if marks.before_copies is not None else 0.0,
                "idle_before_ms": round(max(0.0, previous_end.elapsed_ms(first)), 3) if previous_end is not None
                else None})
            previous_end = marks.after_forward
        return {"steps": len(rows), "by_kind": _by_kind(rows), "rows": rows[:keep_steps]}


def _by_kind(rows: list[dict]) -> dict[str, Any]:
    kinds = {"with_prefill": [r for r in rows if r["prefills"]], "decode_only": [r for r in rows if not r["prefills"]]}
    out = {}
    for name, picked in kinds.items():
        if not picked:
            continue
        n = len(picked)
        idle = [r["idle_before_ms"] for r in picked if r["idle_before_ms"] is not None]
        out[name] = {"steps": n, "tokens_mean": round(sum(r["tokens"] for r in picked) / n, 1),
                     "prefills_mean": round(sum(r["prefills"] for r in picked) / n, 2),
                     "gpu_ms_mean": round(sum(r["gpu_ms"] for r in picked) / n, 3),
                     "gpu_ms_total": round(sum(r["gpu_ms"] for r in picked), 1),
                     "inline_after_inflight_total": sum(r["inline_after_inflight"] for r in picked),
                     "inline_copies_total": sum(r["inline_copies"] for r in picked),
                     "load_wait_ms_mean": round(sum(r["load_wait_ms"] for r in picked) / n, 3),
                     "load_wait_ms_total": round(sum(r["load_wait_ms"] for r in picked), 1),
                     "idle_before_ms_mean": round(sum(idle) / len(idle), 3) if idle else None,
                     "idle_before_ms_total": round(sum(idle), 1)}
    return out
