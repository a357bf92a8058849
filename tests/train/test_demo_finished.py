"""Starting a finished demo job again (issue 12, item 18): ``--resume`` on a checkpoint
that already completes the epochs asked for says so instead of silently "resuming" into
zero steps, writes nothing, and still reports the trained model's accuracy; asking for
more epochs continues from that checkpoint."""

from __future__ import annotations

import asyncio
from pathlib import Path

from netdist.checkpoint import list_checkpoints
from netdist.train.digits_job import DemoConfig, DemoResult, train_worker
from netdist.transport.inprocess import InProcessTransport


async def run_job(config: DemoConfig, lines: list[str]) -> DemoResult:
    (transport,) = InProcessTransport.create_group(1, timeout=30.0)
    return await asyncio.wait_for(train_worker(transport, config, log=lines.append), 100)


def _snapshot(root: Path) -> dict[str, int]:
    """Every file under ``root`` with its modification time in nanoseconds."""
    return {str(p.relative_to(root)): p.stat().st_mtime_ns
            for p in sorted(root.rglob("*")) if p.is_file()}


async def test_a_finished_job_started_again_says_so_and_trains_nothing(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    config = DemoConfig(epochs=1, checkpoint_dir=str(ckpt), resume=True)
    first_lines: list[str] = []
    first = await run_job(config, first_lines)
    assert first.steps == 45 and [s for s, _ in list_checkpoints(ckpt)] == [45]
    files = _snapshot(ckpt)

    lines: list[str] = []
    again = await run_job(config, lines)
    assert lines[0] == (f"nothing to train: the checkpoint in {ckpt} (step 45) is the end "
                        f"of epoch 1 of 1; raise the epochs to train longer, or use a new "
                        f"checkpoint directory to start over")
    assert not any(line.startswith(("resumed from", "epoch", "checkpoint:")) for line in lines)
    assert again.steps == 45 and again.resumed_from_step == 45
    assert again.test_accuracy == first.test_accuracy  # the trained model, reported again
    assert lines[-1] == first_lines[-1] == f"final test accuracy: {first.test_accuracy:.1%}"
    assert _snapshot(ckpt) == files  # nothing written, nothing replaced

    longer: list[str] = []
    more = await run_job(DemoConfig(epochs=2, checkpoint_dir=str(ckpt), resume=True), longer)
    assert longer[0] == f"resumed from {ckpt} at step 45 (epoch 2, batch 0)"
    assert more.steps == 90 and [s for s, _ in list_checkpoints(ckpt)] == [45, 90]
