"""A loop that counts its calls and takes a new iterator of its loader each epoch: resumed inside any epoch or at an
epoch's end it reads on as the uninterrupted run did (the iterator the replay took for the restored step's epoch is made
the restored one: before, it read that epoch from its start, silently; at an epoch's end it stopped in one line, for
no reason: baft's snapshot of a step is taken as the next begins, past the loop's iter()). Under a disk checkpoint
(``torch-save``, taken as a step ends) the same holds inside an epoch (the replayed loop's state was not put back:
silently another order), and at an epoch's end, where the checkpoint holds the spent iterator, it stops in one line.
The loader reads through two worker processes in every run but one."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from baft.cli.launch import launch_env
from baft.recovery.digests import DIGESTS_ENV, compare, redone_differ

SCRIPT = Path(__file__).parent / "scripts" / "epoch_iterators.py"


def train(tmp_path, name, faults=(), policy="baft", in_place=False, loop=(), workers=2):
    """The run ``name`` under ``tmp_path``, each rank's state digests in ``name-digests``."""
    cmd = [sys.executable, "-m", "baft.cli", "train", "--nprocs", "2", "--max-restarts", str(len(faults)),
           *(["--in-place"] if in_place else []), "--run-dir", str(tmp_path / name),
           *(a for fault in faults for a in ("--fault", fault)), "--", str(SCRIPT), policy, str(workers), *loop]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=launch_env({DIGESTS_ENV: str(tmp_path / f"{name}-digests")}))


def losses(tmp_path, name) -> dict[str, str]:
    """Each step's loss and learning rate (DeepSpeed's scheduler's) as rank 0 printed them last (a resumed run prints
    again the steps it replays: their learning rate was the restored step's, before)."""
    return dict(re.findall(r"^\[0\] step (\d+) loss (\S+ lr \S+)$", (tmp_path / name / "output.log").read_text(), re.M))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's directory."""
    directory = tmp_path_factory.mktemp("epochs")
    run = train(directory, "reference")
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(losses(directory, "reference")) == 15
    return directory


@pytest.mark.slow
def test_a_new_iterator_each_epoch_resumes_inside_any_epoch_and_at_an_epochs_end(tmp_path, reference):
    # baft's snapshot of step 3 (7, 11), copied in the bubbles of step 4 (8, 12), is not committed when a rank is
    # killed as that step computes: resumed from step 2 in the first epoch, 6 in the second, 10 at the second's end
    faults = ("rank=1,step=4,phase=backward", "rank=1,step=8,phase=backward,restart=1",
              "rank=0,step=12,phase=forward,restart=2")
    run = train(tmp_path, "baft", faults)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.findall(r"resumed from step (\d+) ", (tmp_path / "baft" / "output.log").read_text()) == ["2", "6", "10"]
    assert losses(tmp_path, "baft") == losses(reference, "reference")
    # DeepSpeed's RepeatingLoader of torch's own DataLoader, not given to baft.initialize (DeepSpeedExamples' shape:
    # before, the data went on from the first epoch's start, said at start): resumed at the second epoch's end, where
    # it takes the third's iterator, then inside the third (its iterator made again as it was, read to the position)
    run = train(tmp_path, "plain", ("rank=0,step=12,phase=forward", "rank=1,step=14,phase=backward,restart=1"),
                loop=("plain",))
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.findall(r"resumed from step (\d+) ", (tmp_path / "plain" / "output.log").read_text()) == ["10", "12"]
    assert losses(tmp_path, "plain") == losses(reference, "reference")
    assert "data position will not be restored" not in run.stderr
    # the counting loop over torch's own DataLoader, not given either: found as the loop first reads it (before, its
    # data went on from the first epoch's start, said), killed inside the first epoch and at the second's end
    run = train(tmp_path, "plain-epochs", ("rank=1,step=4,phase=backward", "rank=0,step=12,phase=forward,restart=1"),
                loop=("plain-epochs",))
    assert run.returncode == 0, run.stderr[-3000:]
    log = (tmp_path / "plain-epochs" / "output.log").read_text()
    assert re.findall(r"resumed from step (\d+) ", log) == ["2", "10"]
    assert losses(tmp_path, "plain-epochs") == losses(reference, "reference")
    assert "keeps no position" not in run.stderr and "did not find" not in run.stderr
    # a shuffled torch DataLoader made after baft.initialize (found at the first call, too late to note its first
    # iterator's making), the loop drawing from torch's generator between its steps: baft.initialize sets that as the
    # restored step's loop left it, and the resumed process made the first epoch's iterator from it (before: another
    # order, its workers' draws too, silently). Killed in the first epoch; the steps trained again are compared
    run = train(tmp_path, "plain-after", ("rank=1,step=4,phase=backward",), loop=("plain-after",))
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.findall(r"resumed from step (\d+) ", (tmp_path / "plain-after" / "output.log").read_text()) == ["2"]
    assert redone_differ(tmp_path / "plain-after-digests") == []
    # the counting loop over torchdata's StatefulDataLoader, not given to baft.initialize: found as the loop first
    # reads it (before: no position, said, and the data from the first epoch's start), killed in the first epoch and
    # inside the third
    run = train(tmp_path, "found", ("rank=1,step=4,phase=backward", "rank=0,step=14,phase=forward,restart=1"),
                loop=("found",))
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.findall(r"resumed from step (\d+) ", (tmp_path / "found" / "output.log").read_text()) == ["2", "12"]
    assert losses(tmp_path, "found") == losses(reference, "reference")
    assert "data position will not be restored" not in run.stdout + run.stderr
    # DeepSpeed's own loader that the script makes (engine.deepspeed_io, with 2 workers) and repeats, found at the
    # first call (before, no position: said there, and the data went on from its start): resumed in the first epoch
    # (its iterator, made after baft.initialize, made again as the uninterrupted run made it), at the second's end
    # and inside the third
    run = train(tmp_path, "deepspeed-io", ("rank=1,step=4,phase=backward", "rank=0,step=12,phase=forward,restart=1",
                                           "rank=1,step=14,phase=backward,restart=2"), loop=("deepspeed-io",))
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.findall(r"resumed from step (\d+) ", (tmp_path / "deepspeed-io" / "output.log").read_text()) == [
        "2", "10", "12"]
    assert losses(tmp_path, "deepspeed-io") == losses(reference, "reference")
    assert "data position will not be restored" not in run.stdout + run.stderr
    # a checkpoint at each step's end: killed in step 8's forward, resumed from step 7, inside the second epoch; in
    # step 11's, from step 10: a spent iterator, the next epoch's order not in the checkpoint
    disk = train(tmp_path, "torch-save", ("rank=0,step=8,phase=forward", "rank=0,step=11,phase=forward,restart=1"), "torch-save")
    assert disk.returncode != 0
    log = (tmp_path / "torch-save" / "output.log").read_text()
    assert re.findall(r"resumed from step (\d+) ", log) == ["7", "10"]
    resumed, uninterrupted = losses(tmp_path, "torch-save"), losses(reference, "reference")
    assert len(resumed) == 10 and resumed == {step: uninterrupted[step] for step in resumed}
    said = [line for line in (disk.stdout + disk.stderr).splitlines() if "took a new iterator" in line]
    assert said and said[0].startswith("baft: error: the loop took a new iterator of its data loader"), said
    # in the run directory, not shared memory, and the newest two kept of each rank's (every step's, before)
    kept = sorted(p.name for p in (tmp_path / "torch-save" / "checkpoints").iterdir())
    assert kept == ["step10-rank0.pt", "step10-rank1.pt", "step9-rank0.pt", "step9-rank1.pt"]


@pytest.mark.slow
def test_a_generator_of_the_scripts_over_the_loader_resumes_at_an_epochs_end(tmp_path, reference):
    """Each epoch a generator of the script's over the loader (``for batch in loader: yield batch``): its ``iter()`` is
    taken as ``train_batch`` first reads it, past baft's snapshot of the step before, which holds the spent epoch.
    Resumed there, that ``iter()`` is the next epoch's; before, it was the spent restored one (probe 10: StopIteration
    in the first resumed step)."""
    run = train(tmp_path, "generator", ("rank=0,step=12,phase=forward",), loop=("generator",))
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.findall(r"resumed from step (\d+) ", (tmp_path / "generator" / "output.log").read_text()) == ["10"]
    assert losses(tmp_path, "generator") == losses(reference, "reference")
    # one generator across epochs (while True: for batch in loader): the uninterrupted run read the spent iterator to its
    # end (torch's RandomSampler draws once more there) before its next iter(); so does the restored one (read in the
    # main process: there the sampler's generator is the one the next epoch draws from)
    run = train(tmp_path, "forever", ("rank=0,step=12,phase=forward",), loop=("forever",), workers=0)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.findall(r"resumed from step (\d+) ", (tmp_path / "forever" / "output.log").read_text()) == ["10"]
    assert losses(tmp_path, "forever") == losses(reference, "reference")
    # made after an iter() of the loader the script never reads: the restored iterator, taken by that iter(), is given
    # to the generator's (before, a new one: the epoch again from its start, or at its end the first's order)
    run = train(tmp_path, "after-iter", ("rank=0,step=8,phase=forward", "rank=0,step=12,phase=forward,restart=1"),
                loop=("forever-after-iter",), workers=0)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.findall(r"resumed from step (\d+) ", (tmp_path / "after-iter" / "output.log").read_text()) == ["6", "10"]
    assert losses(tmp_path, "after-iter") == losses(reference, "reference")


@pytest.mark.slow
def test_a_survivor_in_place_reads_on_from_the_restored_position_through_its_loaders_workers(tmp_path, reference):
    """The survivor's iterator, made the restored one, takes over the restored iterator's worker processes: they were
    shut down under it as the restored one was collected (torchdata 0.11): the survivor read nothing more
    (StopIteration, or a closed queue with persistent workers, then a relaunch), or, workers started again
    without their state, another order, silently."""
    # killed in step 6's backward, the restore goes back to step 4, inside the first epoch, and rank 0 had taken the
    # second's iterator for step 6: its call would train steps 5 and 6 from the first's (step 6 past its end), so it
    # is replaced too; rank 0 survives the second kill, at the second epoch's end (resumed from step 10)
    run = train(tmp_path, "in-place", ("rank=1,step=6,phase=backward", "rank=1,step=12,phase=backward,restart=1"),
                in_place=True)
    assert run.returncode == 0, run.stderr[-3000:]
    log = (tmp_path / "in-place" / "output.log").read_text()
    assert ("baft: rank 0 lost a peer and cannot recover in place (its loop took a new iterator of its data loader "
            "for step 6, after the newest step every rank holds (4)") in log, log[-3000:]
    records = [json.loads(line) for line in (tmp_path / "in-place" / "recovery.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["restored_step"]) for r in records] == [("in place", 4), ("in place", 10)]
    assert losses(tmp_path, "in-place") == losses(reference, "reference")
    # every part too: the survivor's snapshots said another reader came at the step it trained again (probe 19)
    assert compare(reference / "reference-digests", tmp_path / "in-place-digests") == []


@pytest.mark.slow
def test_a_survivors_next_epoch_reader_is_another_reader_in_its_snapshots_too(tmp_path, reference):
    """Probe 16: a survivor recovered in place inside its call for step 5, an epoch's last, and its loop then made
    the next epoch's generator: its new engine, which had seen no call before, took that for the first reader, and
    its snapshot of step 5 said no other reader came. A second fault restored that snapshot, where the generator's
    iter() took the spent epoch (StopIteration, every attempt: the run failed). Rank 0 is killed in step 5, then
    rank 1 in step 7, restored from step 5."""
    run = train(tmp_path, "survivor", ("rank=0,step=5,phase=backward", "rank=1,step=7,phase=forward,restart=1"),
                in_place=True, loop=("generator",))
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.findall(r"resumed from step (\d+) ", (tmp_path / "survivor" / "output.log").read_text()) == ["3", "5"]
    assert losses(tmp_path, "survivor") == losses(reference, "reference")
    # torchdata's loader not given to baft.initialize, found as the loop first read it, its first epoch's iterator
    # taken before (the order its sampler drew then unrecorded): a survivor, its sampler's generator drawn on, rebuilt
    # the restored epoch in another order (the steps it trained again differed from their first training); it is
    # replaced now
    run = train(tmp_path, "found-survivor", ("rank=1,step=4,phase=backward",), in_place=True, loop=("found",),
                workers=0)
    assert run.returncode == 0, run.stderr[-3000:]
    assert ("baft: rank 0 lost a peer and cannot recover in place (the script took an iterator of its "
            "StatefulDataLoader before baft kept the loader") in (tmp_path / "found-survivor" / "output.log").read_text()
    assert redone_differ(tmp_path / "found-survivor-digests") == []  # (the reference reads through 2 workers)
    # one shuffled by torchdata's own sampler, whose state its loader keeps: the survivor recovers in place, and its
    # new engine, which found the loader only after it had told which iterator read last, no longer says in its
    # snapshot of the step it trains again that another reader came (a state digest differed from the uninterrupted
    # run's)
    assert train(tmp_path, "shuffled-reference", loop=("found-shuffled",), workers=0).returncode == 0
    run = train(tmp_path, "found-shuffled", ("rank=1,step=3,phase=forward",), in_place=True,
                loop=("found-shuffled",), workers=0)
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "found-shuffled" / "recovery.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["in place"]
    assert compare(tmp_path / "shuffled-reference-digests", tmp_path / "found-shuffled-digests") == []
